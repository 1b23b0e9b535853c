#include "router/placement_ledger.h"

#include <algorithm>

namespace tandem::router {

void PlacementLedger::Place(const WorkerRecord& worker, const std::string& request_id,
                            int64_t tokens) {
  absl::MutexLock l(&mu_);
  entries_[worker.registration.worker_id()].push_back(
      Entry{request_id, worker.reports, tokens});
}

void PlacementLedger::Unplace(const std::string& worker_id,
                              const std::string& request_id) {
  absl::MutexLock l(&mu_);
  auto it = entries_.find(worker_id);
  if (it == entries_.end()) return;
  auto& v = it->second;
  auto e = std::find_if(v.begin(), v.end(), [&](const Entry& x) {
    return !x.credit && x.request_id == request_id;
  });
  if (e != v.end()) v.erase(e);
  if (v.empty()) entries_.erase(it);
}

void PlacementLedger::Finished(const WorkerRecord& worker,
                               const std::string& request_id, int64_t tokens,
                               uint64_t reports_at_start) {
  absl::MutexLock l(&mu_);
  const std::string& id = worker.registration.worker_id();
  auto& v = entries_[id];
  auto e = std::find_if(v.begin(), v.end(), [&](const Entry& x) {
    return !x.credit && x.request_id == request_id;
  });
  if (e != v.end()) v.erase(e);
  // No report since it started: none counted it, so forgetting its placement
  // is the whole correction.
  if (worker.reports > reports_at_start) {
    v.push_back(Entry{request_id, worker.reports, tokens, /*credit=*/true});
  }
  if (v.empty()) entries_.erase(id);
}

InFlightMap PlacementLedger::Snapshot(const std::vector<WorkerRecord>& live) {
  absl::MutexLock l(&mu_);
  InFlightMap out;
  for (const WorkerRecord& w : live) {
    auto it = entries_.find(w.registration.worker_id());
    if (it == entries_.end()) continue;
    auto& v = it->second;
    v.erase(std::remove_if(
                v.begin(), v.end(),
                [&](const Entry& e) { return e.reports_at_placement < w.reports; }),
            v.end());
    if (v.empty()) {
      entries_.erase(it);
      continue;
    }
    InFlight f;
    for (const Entry& e : v) {
      f.requests += e.credit ? -1 : 1;
      f.tokens += e.credit ? -e.tokens : e.tokens;
    }
    out[w.registration.worker_id()] = f;
  }
  return out;
}

}  // namespace tandem::router
