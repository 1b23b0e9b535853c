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
std::vector<std::pair<std::string, int64_t>> SplitDims(
    const model::ModelConfig& config) {
  const model::TextConfig& t = config.text;
  return {
      {"linear_attn_config.num_heads", t.linear_attn_config.num_heads},
      {"num_attention_heads", t.num_attention_heads},
      {"intermediate_size", t.intermediate_size},
      {"moe_intermediate_size * num_shared_experts",
       t.moe_intermediate_size * t.num_shared_experts},
      {"num_experts", t.num_experts},
      {"vocab_size", t.vocab_size},
  };
}

}  // namespace

Range EvenBlock(int64_t total, TpShard shard) {
  return Range{total * shard.rank / shard.size, total * (shard.rank + 1) / shard.size};
}

absl::Status CheckTpSize(const model::ModelConfig& config, int size) {
  if (size < 1) {
    return InvalidArgument("tensor-parallel size must be >= 1, got ", size);
  }
  std::vector<std::string> bad;
  for (const auto& [name, total] : SplitDims(config)) {
    if (total % size != 0) bad.push_back(absl::StrCat(name, " = ", total));
  }
  if (!bad.empty()) {
    return InvalidArgument("tensor-parallel size ", size,
                           " does not divide: ", absl::StrJoin(bad, ", "));
  }
  return absl::OkStatus();
}

absl::StatusOr<RankLayout> LayoutForRank(const model::ModelConfig& config,
                                         TpShard shard) {
  TANDEM_RETURN_IF_ERROR(CheckTpSize(config, shard.size));
  if (shard.rank < 0 || shard.rank >= shard.size) {
    return InvalidArgument("tensor-parallel rank ", shard.rank, " is outside [0, ",
                           shard.size, ")");
  }
  const model::TextConfig& t = config.text;
  RankLayout layout;
  layout.shard = shard;
  layout.kda_heads = EvenBlock(t.linear_attn_config.num_heads, shard);
  layout.kda_channels = Range{layout.kda_heads.begin * t.linear_attn_config.head_dim,
                              layout.kda_heads.end * t.linear_attn_config.head_dim};
  layout.mla_heads = EvenBlock(t.num_attention_heads, shard);
  layout.dense_rows = EvenBlock(t.intermediate_size, shard);
  layout.shared_rows = EvenBlock(t.moe_intermediate_size * t.num_shared_experts, shard);
  layout.vocab = EvenBlock(t.vocab_size, shard);
  for (int64_t e = shard.rank; e < t.num_experts; e += shard.size) {
    layout.experts.push_back(e);
  }
  return layout;
}

absl::StatusOr<std::vector<KdaStateMove>> PlanKdaStateRelayout(
    const model::ModelConfig& config, int prefill_tp, int decode_tp) {
  TANDEM_RETURN_IF_ERROR(Annotate(CheckTpSize(config, prefill_tp), "prefill"));
  TANDEM_RETURN_IF_ERROR(Annotate(CheckTpSize(config, decode_tp), "decode"));
  const int64_t heads = config.text.linear_attn_config.num_heads;
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
