// A fixed pool of KV-cache blocks with reference counts.
//
// Blocks are ids 0..N-1 into the paged MLA latent cache (the memory itself is
// owned by the forward pass). A block is free (ref count 0) or used by one or
// more holders (ref count >= 1; > 1 when a prefix is shared). Free blocks are
// handed out LIFO, so allocation order is deterministic. Misuse (freeing a free
// block, a bad id) is an error status, never a crash or a silent corruption.
#ifndef TANDEM_ENGINE_CACHE_BLOCK_ALLOCATOR_H_
#define TANDEM_ENGINE_CACHE_BLOCK_ALLOCATOR_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::engine {

using BlockId = int32_t;

class BlockAllocator {
 public:
  explicit BlockAllocator(int32_t num_blocks);

  BlockAllocator(const BlockAllocator&) = delete;
  BlockAllocator& operator=(const BlockAllocator&) = delete;

  // One block with ref count 1; ResourceExhausted when none is free.
  absl::StatusOr<BlockId> Allocate();
  // `n` blocks appended to *out, all or nothing.
  absl::Status AllocateN(int64_t n, std::vector<BlockId>* out);
  // Adds a holder to a used block (prefix sharing).
  absl::Status IncRef(BlockId id);
  // Drops one holder; the block becomes free when none is left.
  absl::Status Free(BlockId id);

  int32_t num_blocks() const { return static_cast<int32_t>(ref_.size()); }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  int32_t num_used() const { return num_blocks() - num_free(); }
  // 0 for a free block (and for an id out of range).
  int32_t ref_count(BlockId id) const;

  // Checks free + used == N, that the free list holds exactly the blocks with
  // ref count 0, once each. For tests and debug checks.
  absl::Status CheckInvariants() const;

 private:
  std::vector<int32_t> ref_;
  std::vector<BlockId> free_;  // stack
};

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_CACHE_BLOCK_ALLOCATOR_H_
