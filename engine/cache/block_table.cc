#include "engine/cache/block_table.h"

#include "common/status.h"

namespace tandem::engine {

absl::Status BlockTable::Append(int64_t n, BlockAllocator* allocator) {
  if (n < 0) return InvalidArgument("cannot append ", n, " tokens");
  TANDEM_RETURN_IF_ERROR(allocator->AllocateN(BlocksNeededToAppend(n), &blocks_));
  num_tokens_ += n;
  return absl::OkStatus();
}

absl::Status BlockTable::Truncate(int64_t n, BlockAllocator* allocator) {
  if (n < 0 || n > num_tokens_) {
    return InvalidArgument("cannot truncate a table of ", num_tokens_, " tokens to ",
                           n);
  }
  const int64_t keep = BlocksForTokens(n, block_size_);
  while (static_cast<int64_t>(blocks_.size()) > keep) {
    TANDEM_RETURN_IF_ERROR(allocator->Free(blocks_.back()));
    blocks_.pop_back();
  }
  num_tokens_ = n;
  return absl::OkStatus();
}

absl::Status BlockTable::Release(BlockAllocator* allocator) {
  return Truncate(0, allocator);
}

absl::Status BlockTable::AdoptShared(absl::Span<const BlockId> blocks,
                                     int64_t num_tokens, BlockAllocator* allocator) {
  if (!blocks_.empty() || num_tokens_ != 0) {
    return FailedPrecondition("can only adopt a prefix into an empty table");
  }
  if (num_tokens < 0 ||
      BlocksForTokens(num_tokens, block_size_) != static_cast<int64_t>(blocks.size())) {
    return InvalidArgument(num_tokens, " tokens do not fill ", blocks.size(),
                           " blocks of ", block_size_);
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    absl::Status s = allocator->IncRef(blocks[i]);
    if (!s.ok()) {
      for (size_t j = 0; j < i; ++j) allocator->Free(blocks[j]).IgnoreError();
      return s;
    }
  }
  blocks_.assign(blocks.begin(), blocks.end());
  num_tokens_ = num_tokens;
  return absl::OkStatus();
}

}  // namespace tandem::engine
