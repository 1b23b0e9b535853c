#include "router/worker_registry.h"

#include <algorithm>

#include "common/ids.h"
#include "common/status.h"

namespace tandem::router {

WorkerRegistry::WorkerRegistry(Clock* clock, absl::Duration timeout)
    : clock_(clock), timeout_(timeout) {}

absl::Status WorkerRegistry::Register(const tandem::v1::RegisterRequest& r) {
  if (!IsValidId(r.worker_id())) {
    return InvalidArgument(
        "worker_id must be 1-128 characters of [A-Za-z0-9._:-], got '", r.worker_id(),
        "'");
  }
  if (r.role() != tandem::v1::WORKER_ROLE_PREFILL &&
      r.role() != tandem::v1::WORKER_ROLE_DECODE) {
    return InvalidArgument("worker ", r.worker_id(),
                           ": role must be PREFILL or DECODE");
  }
  if (r.grpc_address().empty()) {
    return InvalidArgument("worker ", r.worker_id(), ": grpc_address is empty");
  }
  if (r.tp_size() < 0 || r.tp_size() > 64) {
    return InvalidArgument("worker ", r.worker_id(),
                           ": tp_size must be in [0, 64], got ", r.tp_size());
  }
  absl::MutexLock lock(&mu_);
  ExpireLocked();
  for (const auto& [id, w] : workers_) {
    if (id == r.worker_id()) continue;
    if (w.registration.model_fingerprint() != r.model_fingerprint()) {
      return FailedPrecondition(
          "worker ", r.worker_id(), " serves model fingerprint '",
          r.model_fingerprint(), "' but worker ", id, " serves '",
          w.registration.model_fingerprint(),
          "': all workers of one router must serve the same weights");
    }
    // Prefill and decode exchange state rank to rank: their TP sizes must be
    // equal (re-layout across sizes is not implemented). 0 means 1.
    const int32_t tp = std::max(r.tp_size(), 1);
    const int32_t other_tp = std::max(w.registration.tp_size(), 1);
    if (w.registration.role() != r.role() && tp != other_tp) {
      const bool prefill = r.role() == tandem::v1::WORKER_ROLE_PREFILL;
      return FailedPrecondition(
          "worker ", r.worker_id(), " (", prefill ? "prefill" : "decode", ", TP ", tp,
          ") cannot be paired with ", prefill ? "decode" : "prefill", " worker ", id,
          " (TP ", other_tp,
          "): prefill and decode workers must use the same tensor-parallel size "
          "(--tp); transfer across TP sizes is not supported");
    }
  }
  WorkerRecord& rec = workers_[r.worker_id()];
  rec.reports += 1;
  rec.registration = r;
  // The prefix snapshot is the router's index's (prefix_routing.h), not the
  // record's: every Live() copies records.
  rec.registration.clear_prefix_snapshot();
  rec.load = r.load();
  rec.registered_at = clock_->Now();
  rec.last_seen = rec.registered_at;
  return absl::OkStatus();
}

bool WorkerRegistry::Heartbeat(const std::string& worker_id,
                               const tandem::v1::WorkerLoad& load) {
  absl::MutexLock lock(&mu_);
  ExpireLocked();
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return false;
  it->second.load = load;
  it->second.last_seen = clock_->Now();
  it->second.reports += 1;
  return true;
}

bool WorkerRegistry::Remove(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  return workers_.erase(worker_id) > 0;
}

std::vector<WorkerRecord> WorkerRegistry::Live(tandem::v1::WorkerRole role) {
  absl::MutexLock lock(&mu_);
  ExpireLocked();
  std::vector<WorkerRecord> out;
  for (const auto& [id, w] : workers_) {
    if (w.registration.role() == role) out.push_back(w);
  }
  std::sort(out.begin(), out.end(), [](const WorkerRecord& a, const WorkerRecord& b) {
    return a.registration.worker_id() < b.registration.worker_id();
  });
  return out;
}

std::vector<WorkerRecord> WorkerRegistry::Available(tandem::v1::WorkerRole role) {
  std::vector<WorkerRecord> out = Live(role);
  out.erase(std::remove_if(out.begin(), out.end(),
                           [](const WorkerRecord& w) { return w.load.draining(); }),
            out.end());
  return out;
}

size_t WorkerRegistry::size() {
  absl::MutexLock lock(&mu_);
  ExpireLocked();
  return workers_.size();
}

void WorkerRegistry::ExpireLocked() {
  const absl::Time cutoff = clock_->Now() - timeout_;
  absl::erase_if(workers_,
                 [cutoff](const auto& kv) { return kv.second.last_seen < cutoff; });
}

}  // namespace tandem::router
