#include "parallel/sharding.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace tandem::parallel {
namespace {

// (name, total) of every dimension a TP group splits.
std::vector<std::pair<std::string, int64_t>> SplitDims(const ShardDims& dims) {
  return {
      {"linear_attn_config.num_heads", dims.kda_heads},
      {"num_attention_heads", dims.mla_heads},
      {"intermediate_size", dims.dense_rows},
      {"moe_intermediate_size * num_shared_experts", dims.shared_rows},
      {"num_experts", dims.num_experts},
      {"vocab_size", dims.vocab_size},
  };
}

}  // namespace

Range EvenBlock(int64_t total, TpShard shard) {
  return Range{total * shard.rank / shard.size, total * (shard.rank + 1) / shard.size};
}

absl::Status CheckTpSize(const ShardDims& dims, int size) {
  if (size < 1) {
    return InvalidArgument("tensor-parallel size must be >= 1, got ", size);
  }
  std::vector<std::string> bad;
  for (const auto& [name, total] : SplitDims(dims)) {
    if (total % size != 0) bad.push_back(absl::StrCat(name, " = ", total));
  }
  if (!bad.empty()) {
    return InvalidArgument("tensor-parallel size ", size,
                           " does not divide: ", absl::StrJoin(bad, ", "));
  }
  return absl::OkStatus();
}

absl::StatusOr<RankShard> ShardForRank(const ShardDims& dims, TpShard shard) {
  TANDEM_RETURN_IF_ERROR(CheckTpSize(dims, shard.size));
  if (shard.rank < 0 || shard.rank >= shard.size) {
    return InvalidArgument("tensor-parallel rank ", shard.rank, " is outside [0, ",
                           shard.size, ")");
  }
  RankShard owned;
  owned.shard = shard;
  owned.kda_heads = EvenBlock(dims.kda_heads, shard);
  owned.kda_channels = Range{owned.kda_heads.begin * dims.kda_head_dim,
                             owned.kda_heads.end * dims.kda_head_dim};
  owned.mla_heads = EvenBlock(dims.mla_heads, shard);
  owned.dense_rows = EvenBlock(dims.dense_rows, shard);
  owned.shared_rows = EvenBlock(dims.shared_rows, shard);
  owned.vocab = EvenBlock(dims.vocab_size, shard);
  for (int64_t e = shard.rank; e < dims.num_experts; e += shard.size) {
    owned.experts.push_back(e);
  }
  return owned;
}

absl::StatusOr<std::vector<KdaStateMove>> PlanKdaStateRelayout(const ShardDims& dims,
                                                               int prefill_tp,
                                                               int decode_tp) {
  TANDEM_RETURN_IF_ERROR(Annotate(CheckTpSize(dims, prefill_tp), "prefill"));
  TANDEM_RETURN_IF_ERROR(Annotate(CheckTpSize(dims, decode_tp), "decode"));
  const int64_t heads = dims.kda_heads;
  std::vector<KdaStateMove> moves;
  for (int d = 0; d < decode_tp; ++d) {
    const Range want = EvenBlock(heads, TpShard{d, decode_tp});
    int64_t h = want.begin;
    while (h < want.end) {
      // The prefill rank that owns head h, and the end of its block.
      const int src = static_cast<int>(h * prefill_tp / heads);
      const Range have = EvenBlock(heads, TpShard{src, prefill_tp});
      const int64_t end = std::min(want.end, have.end);
      moves.push_back(KdaStateMove{src, d, Range{h, end}});
      h = end;
    }
  }
  return moves;
}

std::vector<int> MlaLatentSources(int prefill_tp, int decode_tp) {
  if (prefill_tp < 1 || decode_tp < 1) return {};
  std::vector<int> sources(decode_tp);
  for (int d = 0; d < decode_tp; ++d) sources[d] = d % prefill_tp;
  return sources;
}

}  // namespace tandem::parallel
