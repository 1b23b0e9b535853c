#include "engine/cache/block_allocator.h"

#include "common/status.h"

namespace tandem::engine {

BlockAllocator::BlockAllocator(int32_t num_blocks)
    : ref_(num_blocks > 0 ? num_blocks : 0, 0) {
  free_.reserve(ref_.size());
  // Stack: block 0 is handed out first.
  for (int32_t i = num_blocks - 1; i >= 0; --i) free_.push_back(i);
}

absl::StatusOr<BlockId> BlockAllocator::Allocate() {
  if (free_.empty()) {
    return ResourceExhausted("no free KV block (", num_blocks(), " in use)");
  }
  const BlockId id = free_.back();
  free_.pop_back();
  ref_[id] = 1;
  return id;
}

absl::Status BlockAllocator::AllocateN(int64_t n, std::vector<BlockId>* out) {
  if (n < 0) return InvalidArgument("cannot allocate ", n, " blocks");
  if (n > static_cast<int64_t>(free_.size())) {
    return ResourceExhausted("need ", n, " KV blocks, ", free_.size(), " free of ",
                             num_blocks());
  }
  for (int64_t i = 0; i < n; ++i) {
    const BlockId id = free_.back();
    free_.pop_back();
    ref_[id] = 1;
    out->push_back(id);
  }
  return absl::OkStatus();
}

absl::Status BlockAllocator::IncRef(BlockId id) {
  if (id < 0 || id >= num_blocks()) {
    return InvalidArgument("block id ", id, " outside [0, ", num_blocks(), ")");
  }
  if (ref_[id] == 0) return FailedPrecondition("block ", id, " is free");
  ++ref_[id];
  return absl::OkStatus();
}

absl::Status BlockAllocator::Free(BlockId id) {
  if (id < 0 || id >= num_blocks()) {
    return InvalidArgument("block id ", id, " outside [0, ", num_blocks(), ")");
  }
  if (ref_[id] == 0) {
    return FailedPrecondition("block ", id, " is already free");
  }
  if (--ref_[id] == 0) free_.push_back(id);
  return absl::OkStatus();
}

int32_t BlockAllocator::ref_count(BlockId id) const {
  if (id < 0 || id >= num_blocks()) return 0;
  return ref_[id];
}

absl::Status BlockAllocator::CheckInvariants() const {
  std::vector<bool> seen(ref_.size(), false);
  for (BlockId id : free_) {
    if (id < 0 || id >= num_blocks()) {
      return Internal("free list holds bad id ", id);
    }
    if (seen[id]) return Internal("block ", id, " is on the free list twice");
    seen[id] = true;
    if (ref_[id] != 0) {
      return Internal("free block ", id, " has ref count ", ref_[id]);
    }
  }
  int32_t used = 0;
  for (size_t i = 0; i < ref_.size(); ++i) {
    if (ref_[i] < 0) return Internal("block ", i, " has negative ref count");
    if (ref_[i] > 0) ++used;
    if (ref_[i] == 0 && !seen[i]) {
      return Internal("block ", i, " has ref count 0 but is not free");
    }
  }
  if (used + num_free() != num_blocks()) {
    return Internal("used ", used, " + free ", num_free(), " != ", num_blocks());
  }
  return absl::OkStatus();
}

}  // namespace tandem::engine
