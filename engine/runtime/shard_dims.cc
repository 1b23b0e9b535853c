#include "engine/runtime/shard_dims.h"

namespace tandem::engine {

parallel::ShardDims ShardDimsOf(const model::ModelConfig& config) {
  const model::TextConfig& t = config.text;
  parallel::ShardDims d;
  d.kda_heads = t.linear_attn_config.num_heads;
  d.kda_head_dim = t.linear_attn_config.head_dim;
  d.mla_heads = t.num_attention_heads;
  d.dense_rows = t.intermediate_size;
  d.shared_rows = t.moe_intermediate_size * t.num_shared_experts;
  d.num_experts = t.num_experts;
  d.vocab_size = t.vocab_size;
  return d;
}

}  // namespace tandem::engine
