// Which part of the model each tensor-parallel rank owns: pure functions of
// the model's split dimensions (ShardDims) and (rank, size), so they are
// table-tested and every rank, the loader and the transfer planner compute the
// same answer. This package does not know the engine's model config: the
// engine fills ShardDims from it (engine/runtime/shard_dims.h, ShardDimsOf).
//
// Splits (the ones engine/runtime/weights.h documents for ShardSpec):
//   KDA heads, MLA heads, dense-MLP rows (intermediate_size), shared-expert rows
//   (moe_intermediate_size * num_shared_experts), vocab rows (lm_head and the
//   embedding table: vocabulary-parallel embedding): contiguous even
//   blocks [r*T/N, (r+1)*T/N). Contiguous keeps each rank's rows one slice of
//   the mapped tensor (no copy) and makes the logits all-gather rank-ordered.
//   Routed experts: round-robin, expert e on rank e % N (expert parallel inside
//   the TP group). Round-robin rather than contiguous because it matches
//   ShardSpec::OwnsExpert and spreads experts that were trained next to each
//   other; either is balanced only on average, per token it depends on routing.
//   Replicated on every rank: norms, residual mixers, KDA f_a_proj,
//   MLA q_a / kv_a projections (so the MLA latent cache is the same on every
//   rank), the MoE router and latent down/up projections.
// Sizes that do not divide every split are refused (CheckTpSize), naming the
// dimensions: an uneven split would unbalance the ranks and break the
// equal-chunk all-gather.
//
// Prefill TP != decode TP: the router refuses it today (a worker whose TP size
// differs from a live worker of the other role fails registration,
// router/worker_registry.cc), and the decode worker refuses such a Reserve.
// The planner for a future re-layout is here (PlanKdaStateRelayout,
// MlaLatentSources) but the hand-off does not use it yet: KDA state is split by
// heads, so each decode rank would assemble its heads from the prefill ranks
// that own them; the MLA latent cache is replicated, so each decode rank would
// copy it whole from one prefill rank.
#ifndef TANDEM_PARALLEL_SHARDING_H_
#define TANDEM_PARALLEL_SHARDING_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::parallel {

// Rank `rank` of a TP group of `size`; the same pair as engine::ShardSpec.
struct TpShard {
  int rank = 0;
  int size = 1;
};

// Half-open [begin, end).
struct Range {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const Range&) const = default;
};

// Rank r's block of `total` units under an even split (size must divide total).
Range EvenBlock(int64_t total, TpShard shard);
// The rank that owns routed expert `expert` in a group of `size`.
inline int ExpertOwner(int64_t expert, int size) {
  return static_cast<int>(expert % size);
}

// The model dimensions a TP group splits; each names the model-config field it
// comes from (the errors below use those names).
struct ShardDims {
  int64_t kda_heads = 0;     // linear_attn_config.num_heads
  int64_t kda_head_dim = 0;  // linear_attn_config.head_dim
  int64_t mla_heads = 0;     // num_attention_heads
  int64_t dense_rows = 0;    // intermediate_size
  int64_t shared_rows = 0;   // moe_intermediate_size * num_shared_experts
  int64_t num_experts = 0;   // num_experts (routed)
  int64_t vocab_size = 0;    // vocab_size
  bool operator==(const ShardDims&) const = default;
};

// What one rank owns. (Not kvtransfer::RankLayout, which is where a rank's
// cache bytes are.)
struct RankShard {
  TpShard shard;
  Range kda_heads;               // of linear_attn_config.num_heads
  Range kda_channels;            // kda_heads * head_dim: q/k/v/g_proj, f_b_proj, conv,
                                 // dt_bias rows; o_proj columns
  Range mla_heads;               // of num_attention_heads: q_b/kv_b/g_proj rows (per
                                 // head), o_proj columns
  Range dense_rows;              // of intermediate_size: gate/up rows, down columns
  Range shared_rows;             // of moe_intermediate_size * num_shared_experts
  Range vocab;                   // of vocab_size: lm_head and embedding rows,
                                 // logits slice
  std::vector<int64_t> experts;  // owned routed experts, ascending
};

// OK when `size` divides every split of `dims`; else INVALID_ARGUMENT naming
// each dimension that does not divide, with its value.
absl::Status CheckTpSize(const ShardDims& dims, int size);

// What `shard` owns; CheckTpSize's errors, or INVALID_ARGUMENT for a rank
// outside [0, size).
absl::StatusOr<RankShard> ShardForRank(const ShardDims& dims, TpShard shard);

// One copy of a sequence's KDA state (recurrent state and conv tails, every
// KDA layer) for heads [heads.begin, heads.end): from prefill rank `src` to
// decode rank `dst`. Head indices are global.
struct KdaStateMove {
  int src = 0;
  int dst = 0;
  Range heads;
  bool operator==(const KdaStateMove&) const = default;
};

// The moves that give every decode rank exactly its heads, ordered by dst then
// head; each move's heads lie inside one prefill rank's block. Equal sizes give
// one move per rank (src == dst). Errors: either size fails CheckTpSize.
absl::StatusOr<std::vector<KdaStateMove>> PlanKdaStateRelayout(const ShardDims& dims,
                                                               int prefill_tp,
                                                               int decode_tp);

// The MLA latent cache is replicated: decode rank d copies it from prefill rank
// d % prefill_tp (spreads the reads). Result[d] is that prefill rank; empty
// when either size is < 1.
std::vector<int> MlaLatentSources(int prefill_tp, int decode_tp);

}  // namespace tandem::parallel

#endif  // TANDEM_PARALLEL_SHARDING_H_
