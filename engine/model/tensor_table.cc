#include "engine/model/tensor_table.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace tandem::model {

uint64_t ExpectedTensor::nbytes() const {
  uint64_t n = DTypeSize(dtype);
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

std::vector<ExpectedTensor> ExpectedTensors(const ModelConfig& config) {
  const TextConfig& t = config.text;
  const LinearAttnConfig& la = t.linear_attn_config;
  const int64_t H = t.hidden_size;
  const int64_t V = t.vocab_size;
  const int64_t P = config.KdaProjectionSize();
  const int64_t d = la.head_dim;
  const int64_t nh = t.num_attention_heads;
  const int64_t L = t.routed_expert_hidden_size;
  const int64_t M = t.moe_intermediate_size;
  const int64_t S = t.num_shared_experts * M;
  const int64_t G = 32;  // MXFP4 group (validated)

  std::vector<ExpectedTensor> out;
  auto add = [&](std::string name, DType dtype, std::vector<int64_t> shape,
                 TensorKind kind, int layer) {
    out.push_back(ExpectedTensor{absl::StrCat(kTextPrefix, name), dtype,
                                 std::move(shape), kind, layer});
  };
  const DType bf16 = DType::kBF16, f32 = DType::kF32, u8 = DType::kU8;

  add("model.embed_tokens.weight", bf16, {V, H}, TensorKind::kEmbedding, -1);
  for (const LayerSpec& spec : config.Layers()) {
    const int i = spec.index;
    const std::string p = absl::StrCat("model.layers.", i, ".");
    add(p + "input_layernorm.weight", bf16, {H}, TensorKind::kNorm, i);
    add(p + "post_attention_layernorm.weight", bf16, {H}, TensorKind::kNorm, i);
    add(p + "self_attention_res_norm.weight", bf16, {H}, TensorKind::kNorm, i);
    add(p + "self_attention_res_proj.weight", bf16, {1, H}, TensorKind::kResProj, i);
    add(p + "mlp_res_norm.weight", bf16, {H}, TensorKind::kNorm, i);
    add(p + "mlp_res_proj.weight", bf16, {1, H}, TensorKind::kResProj, i);
    const std::string a = p + "self_attn.";
    if (spec.attention == AttentionKind::kKda) {
      add(a + "q_proj.weight", bf16, {P, H}, TensorKind::kMatrix, i);
      add(a + "k_proj.weight", bf16, {P, H}, TensorKind::kMatrix, i);
      add(a + "v_proj.weight", bf16, {P, H}, TensorKind::kMatrix, i);
      add(a + "q_conv1d.weight", f32, {P, 1, la.short_conv_kernel_size},
          TensorKind::kConv, i);
      add(a + "k_conv1d.weight", f32, {P, 1, la.short_conv_kernel_size},
          TensorKind::kConv, i);
      add(a + "v_conv1d.weight", f32, {P, 1, la.short_conv_kernel_size},
          TensorKind::kConv, i);
      add(a + "A_log", f32, {config.ALogPaddedLength()}, TensorKind::kALog, i);
      add(a + "f_a_proj.weight", bf16, {d, H}, TensorKind::kMatrix, i);
      add(a + "f_b_proj.weight", bf16, {P, d}, TensorKind::kMatrix, i);
      add(a + "dt_bias", f32, {P}, TensorKind::kDtBias, i);
      add(a + "b_proj.weight", bf16, {la.num_heads, H}, TensorKind::kMatrix, i);
      add(a + "g_proj.weight", bf16, {P, H}, TensorKind::kMatrix, i);
      add(a + "o_norm.weight", f32, {d}, TensorKind::kNorm, i);
      add(a + "o_proj.weight", bf16, {H, P}, TensorKind::kMatrix, i);
    } else {
      add(a + "q_a_proj.weight", bf16, {t.q_lora_rank, H}, TensorKind::kMatrix, i);
      add(a + "q_a_layernorm.weight", bf16, {t.q_lora_rank}, TensorKind::kNorm, i);
      add(a + "q_b_proj.weight", bf16, {nh * config.QHeadDim(), t.q_lora_rank},
          TensorKind::kMatrix, i);
      add(a + "kv_a_proj_with_mqa.weight", bf16,
          {t.kv_lora_rank + t.qk_rope_head_dim, H}, TensorKind::kMatrix, i);
      add(a + "kv_a_layernorm.weight", bf16, {t.kv_lora_rank}, TensorKind::kNorm, i);
      add(a + "kv_b_proj.weight", bf16,
          {nh * (t.qk_nope_head_dim + t.v_head_dim), t.kv_lora_rank},
          TensorKind::kMatrix, i);
      add(a + "o_proj.weight", bf16, {H, nh * t.v_head_dim}, TensorKind::kMatrix, i);
      add(a + "g_proj.weight", bf16, {nh * t.v_head_dim, H}, TensorKind::kMatrix, i);
    }
    if (spec.ffn == FfnKind::kDense) {
      const int64_t I = t.intermediate_size;
      add(p + "mlp.gate_proj.weight", bf16, {I, H}, TensorKind::kMatrix, i);
      add(p + "mlp.up_proj.weight", bf16, {I, H}, TensorKind::kMatrix, i);
      add(p + "mlp.down_proj.weight", bf16, {H, I}, TensorKind::kMatrix, i);
    } else {
      const std::string m = p + "block_sparse_moe.";
      const int64_t E = t.num_experts;
      add(m + "gate.weight", bf16, {E, H}, TensorKind::kMatrix, i);
      add(m + "gate.e_score_correction_bias", f32, {E}, TensorKind::kRouterBias, i);
      add(m + "routed_expert_down_proj.weight", bf16, {L, H}, TensorKind::kMatrix, i);
      add(m + "routed_expert_up_proj.weight", bf16, {H, L}, TensorKind::kMatrix, i);
      add(m + "routed_expert_norm.weight", bf16, {L}, TensorKind::kNorm, i);
      add(m + "shared_experts.gate_proj.weight", bf16, {S, H}, TensorKind::kMatrix, i);
      add(m + "shared_experts.up_proj.weight", bf16, {S, H}, TensorKind::kMatrix, i);
      add(m + "shared_experts.down_proj.weight", bf16, {H, S}, TensorKind::kMatrix, i);
      for (int64_t e = 0; e < E; ++e) {
        const std::string x = absl::StrCat(m, "experts.", e, ".");
        add(x + "w1.weight_packed", u8, {M, L / 2}, TensorKind::kMxfp4Packed, i);
        add(x + "w1.weight_scale", u8, {M, L / G}, TensorKind::kMxfp4Scale, i);
        add(x + "w2.weight_packed", u8, {L, M / 2}, TensorKind::kMxfp4Packed, i);
        add(x + "w2.weight_scale", u8, {L, M / G}, TensorKind::kMxfp4Scale, i);
        add(x + "w3.weight_packed", u8, {M, L / 2}, TensorKind::kMxfp4Packed, i);
        add(x + "w3.weight_scale", u8, {M, L / G}, TensorKind::kMxfp4Scale, i);
      }
    }
  }
  add("model.norm.weight", bf16, {H}, TensorKind::kNorm, -1);
  add("model.output_attn_res_norm.weight", bf16, {H}, TensorKind::kNorm, -1);
  add("model.output_attn_res_proj.weight", bf16, {1, H}, TensorKind::kResProj, -1);
  add("lm_head.weight", bf16, {V, H}, TensorKind::kLmHead, -1);
  return out;
}

absl::string_view StripTextPrefix(absl::string_view name) {
  if (absl::StartsWith(name, kTextPrefix)) name.remove_prefix(kTextPrefix.size());
  return name;
}

bool IsVisionTensor(absl::string_view name) {
  return absl::StartsWith(name, "vision_tower.") ||
         absl::StartsWith(name, "mm_projector.");
}

}  // namespace tandem::model
