#include "engine/cache/slot_pool.h"

#include "common/status.h"

namespace tandem::engine {

SlotPool::SlotPool(int32_t num_slots) : in_use_(num_slots > 0 ? num_slots : 0, false) {
  for (int32_t i = num_slots - 1; i >= 0; --i) free_.push_back(i);
}

absl::StatusOr<SlotId> SlotPool::Acquire() {
  if (free_.empty()) {
    return ResourceExhausted("no free KDA state slot (", num_slots(), " in use)");
  }
  const SlotId id = free_.back();
  free_.pop_back();
  in_use_[id] = true;
  return id;
}

absl::Status SlotPool::Release(SlotId id) {
  if (id < 0 || id >= num_slots()) {
    return InvalidArgument("slot id ", id, " outside [0, ", num_slots(), ")");
  }
  if (!in_use_[id]) return FailedPrecondition("slot ", id, " is already free");
  in_use_[id] = false;
  free_.push_back(id);
  return absl::OkStatus();
}

absl::Status SlotPool::CheckInvariants() const {
  std::vector<bool> seen(in_use_.size(), false);
  for (SlotId id : free_) {
    if (id < 0 || id >= num_slots()) return Internal("bad free slot ", id);
    if (seen[id]) return Internal("slot ", id, " is on the free list twice");
    if (in_use_[id]) return Internal("slot ", id, " is free and in use");
    seen[id] = true;
  }
  int32_t used = 0;
  for (size_t i = 0; i < in_use_.size(); ++i) {
    if (in_use_[i]) ++used;
    if (!in_use_[i] && !seen[i]) return Internal("slot ", i, " was lost");
  }
  if (used + num_free() != num_slots()) {
    return Internal("used ", used, " + free ", num_free(), " != ", num_slots());
  }
  return absl::OkStatus();
}

}  // namespace tandem::engine
