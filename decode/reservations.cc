#include "decode/reservations.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace tandem::decode {

const char* ReservationStateName(ReservationState s) {
  switch (s) {
    case ReservationState::kReserved:
      return "RESERVED";
    case ReservationState::kLanding:
      return "LANDING";
    case ReservationState::kLanded:
      return "LANDED";
    case ReservationState::kAdmitted:
      return "ADMITTED";
    case ReservationState::kQuarantined:
      return "QUARANTINED";
  }
  return "?";
}

Reservations::Reservations(Clock* clock, ReservationsOptions options)
    : clock_(clock), options_(options) {}

absl::StatusOr<ReservationInfo> Reservations::Add(ReservationInfo info,
                                                  absl::Duration lease) {
  absl::MutexLock l(&mu_);
  if (table_.contains(info.request_id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("request ", info.request_id, " already has a reservation"));
  }
  info.lease_expiry = clock_->Now() + lease;
  Entry e;
  e.info = info;
  table_.emplace(info.request_id, std::move(e));
  return info;
}

Handoff Reservations::AdmitLocked(Entry* e) {
  e->state = ReservationState::kAdmitted;
  Handoff h;
  h.info = e->info;
  h.waiter = std::move(e->waiter);
  h.decode_started = e->decode_started;
  return h;
}

absl::StatusOr<std::optional<Handoff>> Reservations::Decode(
    const std::string& id, std::unique_ptr<Waiter> waiter, absl::Time wait_deadline,
    int64_t* engine_id) {
  absl::MutexLock l(&mu_);
  auto it = table_.find(id);
  if (it == table_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no reservation for request '", id,
                     "' (never reserved, released, or its lease expired)"));
  }
  Entry& e = it->second;
  *engine_id = e.info.engine_id;
  if (e.state != ReservationState::kReserved && e.state != ReservationState::kLanded) {
    return absl::FailedPreconditionError(
        absl::StrCat("request '", id, "' is already decoding"));
  }
  e.waiter = std::move(waiter);
  e.wait_deadline = wait_deadline;
  e.decode_started = clock_->Now();
  if (e.state == ReservationState::kLanded) return AdmitLocked(&e);
  e.state = ReservationState::kLanding;
  return std::nullopt;
}

absl::StatusOr<std::optional<Handoff>> Reservations::Landed(
    const std::string& id, std::optional<int64_t> engine_id, bool on_device) {
  absl::MutexLock l(&mu_);
  auto it = table_.find(id);
  if (it == table_.end()) {
    return absl::NotFoundError(
        absl::StrCat("state arrived for request '", id, "', which has no reservation"));
  }
  Entry& e = it->second;
  if (engine_id.has_value() && *engine_id != e.info.engine_id) {
    return absl::FailedPreconditionError(absl::StrCat(
        "state arrived for an earlier reservation of request '", id, "' (token ",
        *engine_id, ", this reservation's is ", e.info.engine_id, "): ignored"));
  }
  switch (e.state) {
    case ReservationState::kReserved:
      e.state = ReservationState::kLanded;
      e.info.landed_on_device = on_device;
      return std::nullopt;
    case ReservationState::kLanding:
      e.info.landed_on_device = on_device;
      return AdmitLocked(&e);
    default:
      return absl::FailedPreconditionError(
          absl::StrCat("request '", id, "' was notified twice (",
                       ReservationStateName(e.state), ")"));
  }
}

Removal Reservations::RemoveLocked(
    absl::flat_hash_map<std::string, Entry>::iterator it) {
  Entry& e = it->second;
  Removal r;
  r.found = true;
  r.was = e.state;
  r.info = e.info;
  r.waiter = std::move(e.waiter);
  const bool landed = e.state == ReservationState::kLanded;
  table_.erase(it);
  if (landed || options_.quarantine <= absl::ZeroDuration()) {
    r.free_now = true;
  } else {
    // The writer may still be putting into this memory: keep it out of use.
    quarantine_.push_back({r.info, clock_->Now() + options_.quarantine});
  }
  return r;
}

Removal Reservations::Release(const std::string& id) {
  absl::MutexLock l(&mu_);
  auto it = table_.find(id);
  if (it == table_.end()) return {};
  if (it->second.state == ReservationState::kAdmitted) {
    Removal r;
    r.found = true;
    r.was = ReservationState::kAdmitted;
    r.info = it->second.info;
    return r;
  }
  return RemoveLocked(it);
}

Removal Reservations::Cancel(const std::string& id, int64_t engine_id) {
  absl::MutexLock l(&mu_);
  auto it = table_.find(id);
  if (it == table_.end() || it->second.info.engine_id != engine_id) return {};
  switch (it->second.state) {
    case ReservationState::kLanding:
      return RemoveLocked(it);
    case ReservationState::kAdmitted: {
      Removal r;
      r.found = true;
      r.was = ReservationState::kAdmitted;
      r.info = it->second.info;
      return r;
    }
    default:
      return {};  // no Decode of this reservation to cancel
  }
}

bool Reservations::Finish(const std::string& id, int64_t engine_id) {
  absl::MutexLock l(&mu_);
  auto it = table_.find(id);
  if (it == table_.end() || it->second.info.engine_id != engine_id ||
      it->second.state != ReservationState::kAdmitted) {
    return false;
  }
  table_.erase(it);
  return true;
}

Removal Reservations::Refuse(const std::string& id, int64_t engine_id) {
  absl::MutexLock l(&mu_);
  auto it = table_.find(id);
  if (it == table_.end() || it->second.info.engine_id != engine_id ||
      it->second.state != ReservationState::kAdmitted) {
    return {};
  }
  Removal r;
  r.found = true;
  r.was = ReservationState::kAdmitted;
  r.info = it->second.info;
  r.free_now = true;  // the state had landed: nobody writes into it any more
  table_.erase(it);
  return r;
}

TickResult Reservations::Tick(absl::Time now) {
  absl::MutexLock l(&mu_);
  TickResult out;
  for (auto q = quarantine_.begin(); q != quarantine_.end();) {
    if (now >= q->until) {
      out.unquarantined.push_back(std::move(q->info));
      q = quarantine_.erase(q);
    } else {
      ++q;
    }
  }
  std::vector<std::string> over;
  for (const auto& [id, e] : table_) {
    switch (e.state) {
      case ReservationState::kReserved:
      case ReservationState::kLanded:
        if (now > e.info.lease_expiry) over.push_back(id);
        break;
      case ReservationState::kLanding:
        if (now > e.wait_deadline) over.push_back(id);
        break;
      default:
        break;
    }
  }
  for (const std::string& id : over) {
    out.expired.push_back(RemoveLocked(table_.find(id)));
  }
  return out;
}

std::optional<ReservationState> Reservations::State(const std::string& id) const {
  absl::MutexLock l(&mu_);
  auto it = table_.find(id);
  if (it == table_.end()) return std::nullopt;
  return it->second.state;
}

int64_t Reservations::size() const {
  absl::MutexLock l(&mu_);
  return table_.size();
}

int64_t Reservations::num_admitted() const {
  absl::MutexLock l(&mu_);
  int64_t n = 0;
  for (const auto& [id, e] : table_) n += e.state == ReservationState::kAdmitted;
  return n;
}

int64_t Reservations::num_quarantined() const {
  absl::MutexLock l(&mu_);
  return quarantine_.size();
}

int64_t Reservations::held_blocks() const {
  absl::MutexLock l(&mu_);
  int64_t n = 0;
  for (const auto& [id, e] : table_) {
    if (e.state != ReservationState::kAdmitted) n += e.info.blocks.size();
  }
  for (const Quarantined& q : quarantine_) n += q.info.blocks.size();
  return n;
}

int64_t Reservations::held_slots() const {
  absl::MutexLock l(&mu_);
  int64_t n = 0;
  for (const auto& [id, e] : table_) {
    if (e.state != ReservationState::kAdmitted && e.info.slot >= 0) ++n;
  }
  for (const Quarantined& q : quarantine_) n += q.info.slot >= 0 ? 1 : 0;
  return n;
}

}  // namespace tandem::decode
