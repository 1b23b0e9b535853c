// A fixed pool of KDA recurrent-state slots, one per running sequence (the
// state itself, ~430 MB per sequence at full size, is owned by the forward
// pass). Acquire/release with the same guarantees as BlockAllocator: LIFO,
// deterministic, misuse is an error status.
#ifndef TANDEM_ENGINE_CACHE_SLOT_POOL_H_
#define TANDEM_ENGINE_CACHE_SLOT_POOL_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::engine {

using SlotId = int32_t;

class SlotPool {
 public:
  explicit SlotPool(int32_t num_slots);

  SlotPool(const SlotPool&) = delete;
  SlotPool& operator=(const SlotPool&) = delete;

  // ResourceExhausted when every slot is taken.
  absl::StatusOr<SlotId> Acquire();
  absl::Status Release(SlotId id);

  int32_t num_slots() const { return static_cast<int32_t>(in_use_.size()); }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  int32_t num_used() const { return num_slots() - num_free(); }
  bool in_use(SlotId id) const { return id >= 0 && id < num_slots() && in_use_[id]; }

  absl::Status CheckInvariants() const;

 private:
  std::vector<bool> in_use_;
  std::vector<SlotId> free_;  // stack
};

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_CACHE_SLOT_POOL_H_
