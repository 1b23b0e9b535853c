#include "engine/cache/memory_accounting.h"

#include "common/status.h"

namespace tandem::engine {

int64_t MlaBytesPerToken(const MlaCacheLayout& l) {
  return static_cast<int64_t>(l.num_mla_layers) * l.values_per_token *
         l.bytes_per_value;
}

int64_t BytesPerBlock(const MlaCacheLayout& l) {
  return MlaBytesPerToken(l) * l.block_size;
}

int64_t BlocksForBudget(int64_t budget_bytes, const MlaCacheLayout& l) {
  const int64_t per_block = BytesPerBlock(l);
  if (budget_bytes <= 0 || per_block <= 0) return 0;
  return budget_bytes / per_block;
}

int64_t BytesPerSlot(const KdaStateLayout& l) {
  const int64_t channels = static_cast<int64_t>(l.num_heads) * l.head_dim;
  const int64_t state = channels * l.head_dim * l.state_bytes_per_value;
  const int64_t conv =
      3 * static_cast<int64_t>(l.conv_kernel - 1) * channels * l.conv_bytes_per_value;
  return static_cast<int64_t>(l.num_kda_layers) * (state + conv);
}

int64_t SlotsForBudget(int64_t budget_bytes, const KdaStateLayout& l) {
  const int64_t per_slot = BytesPerSlot(l);
  if (budget_bytes <= 0 || per_slot <= 0) return 0;
  return budget_bytes / per_slot;
}

absl::StatusOr<CachePlan> PlanCache(int64_t budget_bytes, const MlaCacheLayout& mla,
                                    const KdaStateLayout& kda, int32_t num_slots) {
  if (mla.num_mla_layers <= 0 || mla.block_size <= 0 || mla.values_per_token <= 0 ||
      mla.bytes_per_value <= 0) {
    return InvalidArgument("MLA cache layout needs positive layers (",
                           mla.num_mla_layers, "), block size (", mla.block_size,
                           "), values per token (", mla.values_per_token,
                           ") and bytes per value (", mla.bytes_per_value, ")");
  }
  if (num_slots <= 0) {
    return InvalidArgument("need at least one KDA state slot, got ", num_slots);
  }
  if (kda.num_kda_layers < 0 || kda.num_heads < 0 || kda.head_dim < 0 ||
      kda.conv_kernel < 1) {
    return InvalidArgument("bad KDA state layout");
  }
  CachePlan plan;
  plan.num_slots = num_slots;
  plan.slot_bytes = BytesPerSlot(kda) * num_slots;
  if (plan.slot_bytes > budget_bytes) {
    return ResourceExhausted(num_slots, " KDA state slots need ", plan.slot_bytes,
                             " bytes, the budget is ", budget_bytes);
  }
  plan.num_blocks = BlocksForBudget(budget_bytes - plan.slot_bytes, mla);
  if (plan.num_blocks == 0) {
    return ResourceExhausted("no KV block of ", BytesPerBlock(mla),
                             " bytes fits beside the state slots (",
                             budget_bytes - plan.slot_bytes, " bytes left)");
  }
  plan.block_bytes = plan.num_blocks * BytesPerBlock(mla);
  return plan;
}

}  // namespace tandem::engine
