#include "engine/cache/cache_sizing.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/cache/memory_budget.h"

namespace tandem::engine {

std::string CacheSizing::Summary() const {
  return absl::StrCat(
      num_blocks, " MLA blocks (", cache_tokens, " tokens, ", FormatBytes(block_bytes),
      "), ", num_slots, " KDA slots (", FormatBytes(slot_bytes), ", ", num_snapshots,
      " of them prefix snapshots), max_model_len ", max_model_len, " tokens; ",
      FormatBytes(total_bytes()), " of a ", FormatBytes(budget_bytes), " budget");
}

absl::StatusOr<CacheSizing> SizeCache(const CacheSizingInput& in) {
  if (in.budget_bytes <= 0) {
    return InvalidArgument("the KV cache memory budget must be > 0 bytes, got ",
                           in.budget_bytes);
  }
  if (in.token_bytes <= 0 || in.slot_bytes < 0 || in.block_size <= 0) {
    return InvalidArgument("cache sizing needs positive bytes per token (",
                           in.token_bytes, "), bytes per slot >= 0 (", in.slot_bytes,
                           ") and a positive block size (", in.block_size, ")");
  }
  if (in.max_num_seqs <= 0) {
    return InvalidArgument("--max_num_seqs must be >= 1, got ", in.max_num_seqs);
  }
  if (in.model_max_len <= 1) {
    return InvalidArgument(
        "the model's context (max_position_embeddings) must be "
        ">= 2 tokens, got ",
        in.model_max_len);
  }
  if (in.max_model_len < 0 || in.max_model_len == 1) {
    return InvalidArgument("--max_model_len must be >= 2 (0: the model's ",
                           in.model_max_len, "), got ", in.max_model_len);
  }
  if (in.max_model_len > in.model_max_len) {
    return InvalidArgument("--max_model_len ", in.max_model_len,
                           " exceeds the model's context of ", in.model_max_len,
                           " tokens (max_position_embeddings)");
  }
  if (in.num_blocks_override < 0) {
    return InvalidArgument("--num_blocks must be >= 0, got ", in.num_blocks_override);
  }
  if (!(in.snapshot_fraction >= 0.0 && in.snapshot_fraction <= 0.9)) {
    return InvalidArgument("the prefix snapshot share must be in [0, 0.9], got ",
                           in.snapshot_fraction);
  }
  CacheSizing s;
  s.budget_bytes = in.budget_bytes;
  int64_t snapshots = 0;
  if (in.slot_bytes > 0 && in.snapshot_fraction > 0) {
    snapshots =
        static_cast<int64_t>(in.budget_bytes * in.snapshot_fraction) / in.slot_bytes;
    snapshots = std::min<int64_t>(snapshots, 1 << 20);
  }
  s.num_snapshots = static_cast<int32_t>(snapshots);
  const int64_t snapshot_bytes = snapshots * in.slot_bytes;
  // KDA state first, up to half the budget.
  int64_t slots = in.max_num_seqs;
  if (in.slot_bytes > 0 && slots * in.slot_bytes > in.budget_bytes / 2) {
    slots = (in.budget_bytes / 2) / in.slot_bytes;
    s.slots_limited_by_memory = true;
    if (slots == 0) {
      return ResourceExhausted("a KV cache budget of ", FormatBytes(in.budget_bytes),
                               " holds no sequence's KDA state (", in.slot_bytes,
                               " bytes; at most half the budget goes to it): raise "
                               "--kv_cache_memory");
    }
  }
  s.num_slots = static_cast<int32_t>(slots);
  s.slot_bytes = slots * in.slot_bytes + snapshot_bytes;
  const int64_t block_cost = in.token_bytes * in.block_size;
  if (in.num_blocks_override > 0) {
    s.num_blocks = in.num_blocks_override;
  } else {
    s.num_blocks = (in.budget_bytes - s.slot_bytes) / block_cost;
  }
  s.num_blocks = std::min<int64_t>(s.num_blocks, std::numeric_limits<int32_t>::max());
  if (s.num_blocks <= 0) {
    return ResourceExhausted("a KV cache budget of ", FormatBytes(in.budget_bytes),
                             " leaves no ", FormatBytes(block_cost),
                             " MLA block beside ", s.num_slots, " KDA slots (",
                             FormatBytes(s.slot_bytes),
                             "): raise --kv_cache_memory or lower --max_num_seqs");
  }
  s.block_bytes = s.num_blocks * block_cost;
  s.cache_tokens = s.num_blocks * in.block_size;
  const int64_t wanted = in.max_model_len > 0 ? in.max_model_len : in.model_max_len;
  s.max_model_len = wanted;
  if (wanted > s.cache_tokens) {
    if (in.max_model_len > 0) {
      const int64_t need_blocks = (wanted + in.block_size - 1) / in.block_size;
      return InvalidArgument(
          "--max_model_len ", wanted, " needs ", FormatBytes(need_blocks * block_cost),
          " of MLA cache for one sequence, but the cache holds ", s.cache_tokens,
          " tokens (", s.Summary(),
          "): raise --kv_cache_memory, lower --max_num_seqs or lower --max_model_len");
    }
    s.max_model_len = s.cache_tokens;
    s.max_model_len_limited_by_memory = true;
  }
  if (s.max_model_len < 2) {
    return ResourceExhausted("the KV cache holds ", s.cache_tokens,
                             " tokens, too few for a request: raise --kv_cache_memory");
  }
  return s;
}

}  // namespace tandem::engine
