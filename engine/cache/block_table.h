// The blocks of one sequence in the paged KV cache: token position t lives in
// blocks()[t / block_size] at offset t % block_size. The table tracks how many
// token positions are reserved and grows or shrinks its block list to fit.
#ifndef TANDEM_ENGINE_CACHE_BLOCK_TABLE_H_
#define TANDEM_ENGINE_CACHE_BLOCK_TABLE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/cache/block_allocator.h"

namespace tandem::engine {

// Blocks needed to hold `num_tokens` positions.
inline int64_t BlocksForTokens(int64_t num_tokens, int32_t block_size) {
  return num_tokens <= 0 ? 0 : (num_tokens + block_size - 1) / block_size;
}

class BlockTable {
 public:
  explicit BlockTable(int32_t block_size) : block_size_(block_size) {}

  int32_t block_size() const { return block_size_; }
  int64_t num_tokens() const { return num_tokens_; }
  const std::vector<BlockId>& blocks() const { return blocks_; }

  // New blocks that Append(n) would allocate.
  int64_t BlocksNeededToAppend(int64_t n) const {
    return BlocksForTokens(num_tokens_ + n, block_size_) -
           static_cast<int64_t>(blocks_.size());
  }

  // Reserves n more positions, allocating blocks as needed; all or nothing
  // (ResourceExhausted leaves the table unchanged).
  absl::Status Append(int64_t n, BlockAllocator* allocator);

  // Keeps the first n positions (speculative rollback) and frees the blocks
  // no longer needed. n greater than num_tokens() is an error.
  absl::Status Truncate(int64_t n, BlockAllocator* allocator);

  // Frees every block; the table is empty afterwards.
  absl::Status Release(BlockAllocator* allocator);

  // Starts an empty table on blocks another sequence already holds (a shared
  // prefix): takes a reference on each. num_tokens must fit in the blocks.
  // Writing into a shared partial last block needs copy-on-write by the
  // caller (check allocator->ref_count(blocks().back()) > 1).
  absl::Status AdoptShared(absl::Span<const BlockId> blocks, int64_t num_tokens,
                           BlockAllocator* allocator);

 private:
  int32_t block_size_;
  int64_t num_tokens_ = 0;
  std::vector<BlockId> blocks_;
};

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_CACHE_BLOCK_TABLE_H_
