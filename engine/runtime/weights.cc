#include "engine/runtime/weights.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/model/bf16.h"
#include "engine/runtime/shard_dims.h"
#include "parallel/sharding.h"

namespace tandem::engine {
namespace {

using model::DType;

class Loader {
 public:
  explicit Loader(const model::Checkpoint& ckpt) : ckpt_(ckpt) {}

  absl::StatusOr<const uint16_t*> Bf16(const std::string& name,
                                       std::vector<int64_t> shape) {
    TANDEM_ASSIGN_OR_RETURN(model::TensorView v,
                            ckpt_.GetChecked(name, DType::kBF16, shape));
    TANDEM_ASSIGN_OR_RETURN(auto span, v.BF16Bits());
    bytes_ += v.nbytes;
    return span.data();
  }
  // Rows [begin, begin + count) of a row-major tensor of `shape` (dimension 0
  // is the row): a pointer offset, no copy. Counts only the slice's bytes.
  absl::StatusOr<const uint16_t*> Bf16Rows(const std::string& name,
                                           std::vector<int64_t> shape, int64_t begin,
                                           int64_t count) {
    TANDEM_ASSIGN_OR_RETURN(model::TensorView v,
                            ckpt_.GetChecked(name, DType::kBF16, shape));
    TANDEM_ASSIGN_OR_RETURN(auto span, v.BF16Bits());
    const int64_t row = RowElements(shape);
    bytes_ += count * row * 2;
    return span.data() + begin * row;
  }
  // Columns [begin, begin + count) of a [rows, cols] tensor: the pointer to
  // column `begin` of row 0; the caller passes cols as the leading dimension.
  absl::StatusOr<const uint16_t*> Bf16Cols(const std::string& name,
                                           std::vector<int64_t> shape, int64_t begin,
                                           int64_t count) {
    TANDEM_ASSIGN_OR_RETURN(model::TensorView v,
                            ckpt_.GetChecked(name, DType::kBF16, shape));
    TANDEM_ASSIGN_OR_RETURN(auto span, v.BF16Bits());
    bytes_ += shape[0] * count * 2;
    return span.data() + begin;
  }
  absl::StatusOr<const float*> F32Rows(const std::string& name,
                                       std::vector<int64_t> shape, int64_t begin,
                                       int64_t count) {
    TANDEM_ASSIGN_OR_RETURN(model::TensorView v,
                            ckpt_.GetChecked(name, DType::kF32, shape));
    TANDEM_ASSIGN_OR_RETURN(auto span, v.F32());
    const int64_t row = RowElements(shape);
    bytes_ += count * row * 4;
    return span.data() + begin * row;
  }
  absl::StatusOr<const float*> F32(const std::string& name,
                                   std::vector<int64_t> shape) {
    TANDEM_ASSIGN_OR_RETURN(model::TensorView v,
                            ckpt_.GetChecked(name, DType::kF32, shape));
    TANDEM_ASSIGN_OR_RETURN(auto span, v.F32());
    bytes_ += v.nbytes;
    return span.data();
  }
  absl::StatusOr<const uint8_t*> U8(const std::string& name, std::vector<int64_t> shape,
                                    uint64_t* bytes) {
    TANDEM_ASSIGN_OR_RETURN(model::TensorView v,
                            ckpt_.GetChecked(name, DType::kU8, shape));
    *bytes += v.nbytes;
    return v.data;
  }
  // A small BF16 vector (norm gain, residual query) as fp32.
  absl::StatusOr<std::vector<float>> SmallBf16(const std::string& name,
                                               std::vector<int64_t> shape) {
    TANDEM_ASSIGN_OR_RETURN(const uint16_t* p, Bf16(name, shape));
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> out(n);
    for (int64_t i = 0; i < n; ++i) out[i] = model::Bf16ToFloat(p[i]);
    return out;
  }
  uint64_t bytes() const { return bytes_; }

 private:
  static int64_t RowElements(const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
    return n;
  }
  const model::Checkpoint& ckpt_;
  uint64_t bytes_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ModelWeights>> LoadModelWeights(
    const model::Checkpoint& checkpoint, ShardSpec shard) {
  TANDEM_ASSIGN_OR_RETURN(const parallel::RankShard lay,
                          parallel::ShardForRank(ShardDimsOf(checkpoint.config()),
                                                 {shard.rank, shard.size}));
  auto w = std::make_unique<ModelWeights>();
  w->config = checkpoint.config();
  w->shard = shard;
  const model::ModelConfig& c = w->config;
  const model::TextConfig& t = c.text;
  const auto& la = t.linear_attn_config;
  const int64_t H = t.hidden_size, V = t.vocab_size, P = c.KdaProjectionSize();
  const int64_t d = la.head_dim, K = la.short_conv_kernel_size,
                nh = t.num_attention_heads;
  const int64_t L = t.routed_expert_hidden_size, M = t.moe_intermediate_size;
  const int64_t S = t.num_shared_experts * M, E = t.num_experts;
  if (t.hidden_act != "situ") {
    return InvalidArgument("hidden_act \"", t.hidden_act,
                           "\" is not supported (situ only)");
  }
  Loader ld(checkpoint);

  const int64_t v0 = lay.vocab.begin, Vr = lay.vocab.size();
  w->vocab_begin = v0;
  w->vocab_rows = Vr;
  TANDEM_ASSIGN_OR_RETURN(w->embed,
                          ld.Bf16Rows("model.embed_tokens.weight", {V, H}, v0, Vr));
  TANDEM_ASSIGN_OR_RETURN(w->lm_head, ld.Bf16Rows("lm_head.weight", {V, H}, v0, Vr));
  TANDEM_ASSIGN_OR_RETURN(w->final_norm, ld.SmallBf16("model.norm.weight", {H}));
  TANDEM_ASSIGN_OR_RETURN(w->output_res_norm,
                          ld.SmallBf16("model.output_attn_res_norm.weight", {H}));
  TANDEM_ASSIGN_OR_RETURN(w->output_res_proj,
                          ld.SmallBf16("model.output_attn_res_proj.weight", {1, H}));

  int kda_index = 0, mla_index = 0;
  uint64_t expert_bytes_total = 0;
  for (const model::LayerSpec& spec : c.Layers()) {
    LayerWeights lw;
    lw.spec = spec;
    const std::string p = absl::StrCat("model.layers.", spec.index, ".");
    TANDEM_ASSIGN_OR_RETURN(lw.input_norm,
                            ld.SmallBf16(p + "input_layernorm.weight", {H}));
    TANDEM_ASSIGN_OR_RETURN(lw.post_attention_norm,
                            ld.SmallBf16(p + "post_attention_layernorm.weight", {H}));
    TANDEM_ASSIGN_OR_RETURN(lw.attn_res_norm,
                            ld.SmallBf16(p + "self_attention_res_norm.weight", {H}));
    TANDEM_ASSIGN_OR_RETURN(lw.attn_res_proj,
                            ld.SmallBf16(p + "self_attention_res_proj.weight", {1, H}));
    TANDEM_ASSIGN_OR_RETURN(lw.mlp_res_norm,
                            ld.SmallBf16(p + "mlp_res_norm.weight", {H}));
    TANDEM_ASSIGN_OR_RETURN(lw.mlp_res_proj,
                            ld.SmallBf16(p + "mlp_res_proj.weight", {1, H}));
    const std::string a = p + "self_attn.";
    if (spec.attention == model::AttentionKind::kKda) {
      lw.kda_index = kda_index++;
      KdaWeights& k = lw.kda;
      // This rank's heads [h0, h0 + hr) and channels [c0, c0 + cr).
      const int64_t h0 = lay.kda_heads.begin, hr = lay.kda_heads.size();
      const int64_t c0 = lay.kda_channels.begin, cr = lay.kda_channels.size();
      k.heads = hr;
      k.o_proj_ld = P;
      TANDEM_ASSIGN_OR_RETURN(k.q_proj,
                              ld.Bf16Rows(a + "q_proj.weight", {P, H}, c0, cr));
      TANDEM_ASSIGN_OR_RETURN(k.k_proj,
                              ld.Bf16Rows(a + "k_proj.weight", {P, H}, c0, cr));
      TANDEM_ASSIGN_OR_RETURN(k.v_proj,
                              ld.Bf16Rows(a + "v_proj.weight", {P, H}, c0, cr));
      TANDEM_ASSIGN_OR_RETURN(k.q_conv,
                              ld.F32Rows(a + "q_conv1d.weight", {P, 1, K}, c0, cr));
      TANDEM_ASSIGN_OR_RETURN(k.k_conv,
                              ld.F32Rows(a + "k_conv1d.weight", {P, 1, K}, c0, cr));
      TANDEM_ASSIGN_OR_RETURN(k.v_conv,
                              ld.F32Rows(a + "v_conv1d.weight", {P, 1, K}, c0, cr));
      TANDEM_ASSIGN_OR_RETURN(k.a_log,
                              ld.F32Rows(a + "A_log", {c.ALogPaddedLength()}, h0, hr));
      TANDEM_ASSIGN_OR_RETURN(k.f_a_proj, ld.Bf16(a + "f_a_proj.weight", {d, H}));
      TANDEM_ASSIGN_OR_RETURN(k.f_b_proj,
                              ld.Bf16Rows(a + "f_b_proj.weight", {P, d}, c0, cr));
      TANDEM_ASSIGN_OR_RETURN(k.dt_bias, ld.F32Rows(a + "dt_bias", {P}, c0, cr));
      TANDEM_ASSIGN_OR_RETURN(
          k.b_proj, ld.Bf16Rows(a + "b_proj.weight", {la.num_heads, H}, h0, hr));
      TANDEM_ASSIGN_OR_RETURN(k.g_proj,
                              ld.Bf16Rows(a + "g_proj.weight", {P, H}, c0, cr));
      TANDEM_ASSIGN_OR_RETURN(k.o_norm, ld.F32(a + "o_norm.weight", {d}));
      TANDEM_ASSIGN_OR_RETURN(k.o_proj,
                              ld.Bf16Cols(a + "o_proj.weight", {H, P}, c0, cr));
    } else {
      lw.mla_index = mla_index++;
      MlaWeights& m = lw.mla;
      const int64_t h0 = lay.mla_heads.begin, hr = lay.mla_heads.size();
      const int64_t vd = t.v_head_dim, kvb = t.qk_nope_head_dim + t.v_head_dim;
      m.heads = hr;
      m.o_proj_ld = nh * vd;
      TANDEM_ASSIGN_OR_RETURN(m.q_a_proj,
                              ld.Bf16(a + "q_a_proj.weight", {t.q_lora_rank, H}));
      TANDEM_ASSIGN_OR_RETURN(
          m.q_a_norm, ld.SmallBf16(a + "q_a_layernorm.weight", {t.q_lora_rank}));
      TANDEM_ASSIGN_OR_RETURN(
          m.q_b_proj,
          ld.Bf16Rows(a + "q_b_proj.weight", {nh * c.QHeadDim(), t.q_lora_rank},
                      h0 * c.QHeadDim(), hr * c.QHeadDim()));
      TANDEM_ASSIGN_OR_RETURN(m.kv_a_proj,
                              ld.Bf16(a + "kv_a_proj_with_mqa.weight",
                                      {t.kv_lora_rank + t.qk_rope_head_dim, H}));
      TANDEM_ASSIGN_OR_RETURN(
          m.kv_a_norm, ld.SmallBf16(a + "kv_a_layernorm.weight", {t.kv_lora_rank}));
      TANDEM_ASSIGN_OR_RETURN(
          m.kv_b_proj, ld.Bf16Rows(a + "kv_b_proj.weight", {nh * kvb, t.kv_lora_rank},
                                   h0 * kvb, hr * kvb));
      TANDEM_ASSIGN_OR_RETURN(
          m.o_proj, ld.Bf16Cols(a + "o_proj.weight", {H, nh * vd}, h0 * vd, hr * vd));
      TANDEM_ASSIGN_OR_RETURN(
          m.g_proj, ld.Bf16Rows(a + "g_proj.weight", {nh * vd, H}, h0 * vd, hr * vd));
    }
    if (spec.ffn == model::FfnKind::kDense) {
      const int64_t I = t.intermediate_size;
      const int64_t i0 = lay.dense_rows.begin, ir = lay.dense_rows.size();
      lw.dense.inter = ir;
      lw.dense.down_ld = I;
      TANDEM_ASSIGN_OR_RETURN(lw.dense.gate,
                              ld.Bf16Rows(p + "mlp.gate_proj.weight", {I, H}, i0, ir));
      TANDEM_ASSIGN_OR_RETURN(lw.dense.up,
                              ld.Bf16Rows(p + "mlp.up_proj.weight", {I, H}, i0, ir));
      TANDEM_ASSIGN_OR_RETURN(lw.dense.down,
                              ld.Bf16Cols(p + "mlp.down_proj.weight", {H, I}, i0, ir));
    } else {
      const std::string m = p + "block_sparse_moe.";
      MoeWeights& moe = lw.moe;
      TANDEM_ASSIGN_OR_RETURN(moe.router, ld.Bf16(m + "gate.weight", {E, H}));
      TANDEM_ASSIGN_OR_RETURN(moe.router_bias,
                              ld.F32(m + "gate.e_score_correction_bias", {E}));
      TANDEM_ASSIGN_OR_RETURN(moe.latent_down,
                              ld.Bf16(m + "routed_expert_down_proj.weight", {L, H}));
      TANDEM_ASSIGN_OR_RETURN(moe.latent_up,
                              ld.Bf16(m + "routed_expert_up_proj.weight", {H, L}));
      TANDEM_ASSIGN_OR_RETURN(moe.latent_norm,
                              ld.SmallBf16(m + "routed_expert_norm.weight", {L}));
      const int64_t s0 = lay.shared_rows.begin, sr = lay.shared_rows.size();
      moe.shared.inter = sr;
      moe.shared.down_ld = S;
      TANDEM_ASSIGN_OR_RETURN(
          moe.shared.gate,
          ld.Bf16Rows(m + "shared_experts.gate_proj.weight", {S, H}, s0, sr));
      TANDEM_ASSIGN_OR_RETURN(
          moe.shared.up,
          ld.Bf16Rows(m + "shared_experts.up_proj.weight", {S, H}, s0, sr));
      TANDEM_ASSIGN_OR_RETURN(
          moe.shared.down,
          ld.Bf16Cols(m + "shared_experts.down_proj.weight", {H, S}, s0, sr));
      moe.experts.resize(E);
      for (int64_t e = 0; e < E; ++e) {
        if (!shard.OwnsExpert(e)) continue;
        const std::string x = absl::StrCat(m, "experts.", e, ".");
        kernels::Mxfp4Expert& ex = moe.experts[e];
        uint64_t eb = 0;
        TANDEM_ASSIGN_OR_RETURN(ex.w1_packed,
                                ld.U8(x + "w1.weight_packed", {M, L / 2}, &eb));
        TANDEM_ASSIGN_OR_RETURN(ex.w1_scale,
                                ld.U8(x + "w1.weight_scale", {M, L / 32}, &eb));
        TANDEM_ASSIGN_OR_RETURN(ex.w3_packed,
                                ld.U8(x + "w3.weight_packed", {M, L / 2}, &eb));
        TANDEM_ASSIGN_OR_RETURN(ex.w3_scale,
                                ld.U8(x + "w3.weight_scale", {M, L / 32}, &eb));
        TANDEM_ASSIGN_OR_RETURN(ex.w2_packed,
                                ld.U8(x + "w2.weight_packed", {L, M / 2}, &eb));
        TANDEM_ASSIGN_OR_RETURN(ex.w2_scale,
                                ld.U8(x + "w2.weight_scale", {L, M / 32}, &eb));
        w->expert_bytes_each = eb;
        expert_bytes_total += eb;
      }
    }
    w->layers.push_back(std::move(lw));
  }
  // Embedding rows are gathered, not streamed: count lm_head once, not the table.
  w->dense_bytes = ld.bytes() - static_cast<uint64_t>(Vr) * H * 2;
  (void)expert_bytes_total;
  return w;
}

}  // namespace tandem::engine
