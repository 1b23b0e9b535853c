// Sizing the paged MLA cache and the KDA state pool from a memory budget.
//
// MLA (per token, per MLA layer): the compressed latent plus the shared rope
// key, (kv_lora_rank + qk_rope_head_dim) values; K3: 24 layers * 576 * 2 bytes
// (BF16) = 27,648 bytes per token. KDA (per sequence, per KDA layer): the
// recurrent state S, heads * d_k * d_v values (fp32), plus the short-conv tails
// of q, k and v, 3 * (kernel - 1) * heads * d values. The figures follow the
// "Memory" section of the published Kimi K3 architecture notes (in the project's
// reference set, not in this repository); docs/model_format.md has the config
// fields they read.
#ifndef TANDEM_ENGINE_CACHE_MEMORY_ACCOUNTING_H_
#define TANDEM_ENGINE_CACHE_MEMORY_ACCOUNTING_H_

#include <cstdint>

#include "absl/status/statusor.h"

namespace tandem::engine {

struct MlaCacheLayout {
  int32_t num_mla_layers = 0;
  int32_t block_size = 0;        // tokens per block
  int32_t values_per_token = 0;  // kv_lora_rank + qk_rope_head_dim
  int32_t bytes_per_value = 2;   // BF16
};

struct KdaStateLayout {
  int32_t num_kda_layers = 0;
  int32_t num_heads = 0;
  int32_t head_dim = 0;               // d_k = d_v
  int32_t conv_kernel = 4;            // short convolution width
  int32_t state_bytes_per_value = 4;  // fp32 state
  int32_t conv_bytes_per_value = 4;   // conv tails
};

// One token across all MLA layers.
int64_t MlaBytesPerToken(const MlaCacheLayout& layout);
// num_mla_layers * block_size * bytes per token-layer.
int64_t BytesPerBlock(const MlaCacheLayout& layout);
// Whole blocks that fit in `budget_bytes` (0 for a non-positive budget).
int64_t BlocksForBudget(int64_t budget_bytes, const MlaCacheLayout& layout);

// One sequence's KDA state across all KDA layers.
int64_t BytesPerSlot(const KdaStateLayout& layout);
int64_t SlotsForBudget(int64_t budget_bytes, const KdaStateLayout& layout);

struct CachePlan {
  int32_t num_slots = 0;
  int64_t num_blocks = 0;
  int64_t slot_bytes = 0;   // total for all slots
  int64_t block_bytes = 0;  // total for all blocks
};

// Reserves `num_slots` KDA slots first and gives the rest of `budget_bytes` to
// KV blocks. InvalidArgument on a bad layout; ResourceExhausted when the slots
// alone do not fit or no block is left (the message names the numbers).
absl::StatusOr<CachePlan> PlanCache(int64_t budget_bytes, const MlaCacheLayout& mla,
                                    const KdaStateLayout& kda, int32_t num_slots);

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_CACHE_MEMORY_ACCOUNTING_H_
