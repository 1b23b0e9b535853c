#include "engine/runtime/weights.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/cache/memory_budget.h"
#include "engine/model/bf16.h"
#include "engine/runtime/shard_dims.h"
#include "parallel/sharding.h"

namespace tandem::engine {
namespace {

using model::DType;

// Views into a checkpoint, counting the bytes each rank reads. Without a
// checkpoint (SizeModelWeights) it only counts: every pointer is null and the
// small vectors are zeros of their size, so the byte figures come from this one
// walk of the model whether a checkpoint is there or not.
class Loader {
 public:
  explicit Loader(const model::Checkpoint* ckpt) : ckpt_(ckpt) {}

  absl::StatusOr<const uint16_t*> Bf16(const std::string& name,
                                       std::vector<int64_t> shape) {
    bytes_ += Elements(shape) * 2;
    if (ckpt_ == nullptr) return static_cast<const uint16_t*>(nullptr);
    TANDEM_ASSIGN_OR_RETURN(model::TensorView v,
                            ckpt_->GetChecked(name, DType::kBF16, shape));
    TANDEM_ASSIGN_OR_RETURN(auto span, v.BF16Bits());
    return span.data();
  }
  // Rows [begin, begin + count) of a row-major tensor of `shape` (dimension 0
  // is the row): a pointer offset, no copy. Counts only the slice's bytes.
  absl::StatusOr<const uint16_t*> Bf16Rows(const std::string& name,
                                           std::vector<int64_t> shape, int64_t begin,
                                           int64_t count) {
    const int64_t row = RowElements(shape);
    bytes_ += count * row * 2;
    if (ckpt_ == nullptr) return static_cast<const uint16_t*>(nullptr);
    TANDEM_ASSIGN_OR_RETURN(model::TensorView v,
                            ckpt_->GetChecked(name, DType::kBF16, shape));
    TANDEM_ASSIGN_OR_RETURN(auto span, v.BF16Bits());
    return span.data() + begin * row;
  }
  // Columns [begin, begin + count) of a [rows, cols] tensor: the pointer to
  // column `begin` of row 0; the caller passes cols as the leading dimension.
  absl::StatusOr<const uint16_t*> Bf16Cols(const std::string& name,
                                           std::vector<int64_t> shape, int64_t begin,
                                           int64_t count) {
    bytes_ += shape[0] * count * 2;
    if (ckpt_ == nullptr) return static_cast<const uint16_t*>(nullptr);
    TANDEM_ASSIGN_OR_RETURN(model::TensorView v,
                            ckpt_->GetChecked(name, DType::kBF16, shape));
    TANDEM_ASSIGN_OR_RETURN(auto span, v.BF16Bits());
    return span.data() + begin;
  }
  absl::StatusOr<const float*> F32Rows(const std::string& name,
                                       std::vector<int64_t> shape, int64_t begin,
                                       int64_t count) {
    const int64_t row = RowElements(shape);
    bytes_ += count * row * 4;
    if (ckpt_ == nullptr) return static_cast<const float*>(nullptr);
    TANDEM_ASSIGN_OR_RETURN(model::TensorView v,
                            ckpt_->GetChecked(name, DType::kF32, shape));
    TANDEM_ASSIGN_OR_RETURN(auto span, v.F32());
    return span.data() + begin * row;
  }
  absl::StatusOr<const float*> F32(const std::string& name,
                                   std::vector<int64_t> shape) {
    bytes_ += Elements(shape) * 4;
    if (ckpt_ == nullptr) return static_cast<const float*>(nullptr);
    TANDEM_ASSIGN_OR_RETURN(model::TensorView v,
                            ckpt_->GetChecked(name, DType::kF32, shape));
    TANDEM_ASSIGN_OR_RETURN(auto span, v.F32());
    return span.data();
  }
  absl::StatusOr<const uint8_t*> U8(const std::string& name, std::vector<int64_t> shape,
                                    uint64_t* bytes) {
    *bytes += Elements(shape);
    if (ckpt_ == nullptr) return static_cast<const uint8_t*>(nullptr);
    TANDEM_ASSIGN_OR_RETURN(model::TensorView v,
                            ckpt_->GetChecked(name, DType::kU8, shape));
    return v.data;
  }
  // A small BF16 vector (norm gain, residual query) as fp32.
  absl::StatusOr<std::vector<float>> SmallBf16(const std::string& name,
                                               std::vector<int64_t> shape) {
    TANDEM_ASSIGN_OR_RETURN(const uint16_t* p, Bf16(name, shape));
    const int64_t n = Elements(shape);
    std::vector<float> out(n);
    if (p == nullptr) return out;
    for (int64_t i = 0; i < n; ++i) out[i] = model::Bf16ToFloat(p[i]);
    return out;
  }
  uint64_t bytes() const { return bytes_; }

 private:
  static int64_t Elements(const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  static int64_t RowElements(const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
    return n;
  }
  const model::Checkpoint* ckpt_;  // null: count only
  uint64_t bytes_ = 0;
};

}  // namespace

namespace {

// LoadModelWeights with a checkpoint; SizeModelWeights (counting only) without.
absl::StatusOr<std::unique_ptr<ModelWeights>> WalkModelWeights(
    const model::ModelConfig& config, const model::Checkpoint* checkpoint,
    ShardSpec shard) {
  TANDEM_ASSIGN_OR_RETURN(
      const parallel::RankShard lay,
      parallel::ShardForRank(ShardDimsOf(config), {shard.rank, shard.size}));
  auto w = std::make_unique<ModelWeights>();
  w->config = config;
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
  w->routed_expert_bytes = expert_bytes_total;
  w->rank_bytes = ld.bytes() + expert_bytes_total;
  return w;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelWeights>> LoadModelWeights(
    const model::Checkpoint& checkpoint, ShardSpec shard) {
  return WalkModelWeights(checkpoint.config(), &checkpoint, shard);
}

absl::StatusOr<std::unique_ptr<ModelWeights>> SizeModelWeights(
    const model::ModelConfig& config, ShardSpec shard) {
  return WalkModelWeights(config, nullptr, shard);
}

namespace {

// Bump allocation of uploaded tensors from few device allocations: chunks that
// double from 4 MiB up to 256 MiB (a small model does not take 256 MiB), a
// tensor as large as the next chunk in an allocation of its own, and one of
// exactly the tensor's size when a chunk no longer fits (the last tensors fill
// what is left). Out of memory names the tensor, its size, what was placed and
// what the device has free.
class Uploader {
 public:
  Uploader(kernels::Device& device, ModelWeights* w) : device_(device), w_(w) {}

  // Names the tensors that follow ("layers.3." + their own name).
  void set_prefix(std::string prefix) { prefix_ = std::move(prefix); }

  template <typename T>
  absl::StatusOr<const T*> Put(absl::string_view name, const T* src, int64_t count) {
    if (src == nullptr || count == 0) return static_cast<const T*>(nullptr);
    const size_t bytes = static_cast<size_t>(count) * sizeof(T);
    TANDEM_ASSIGN_OR_RETURN(void* dst, Reserve(name, bytes));
    TANDEM_RETURN_IF_ERROR(device_.CopyToDevice(dst, src, bytes));
    w_->device_bytes += bytes;
    ++tensors_;
    return static_cast<const T*>(dst);
  }
  // A [rows, cols] BF16 matrix with row stride *ld: packed to stride cols.
  absl::Status Matrix(absl::string_view name, const uint16_t** p, int64_t rows,
                      int64_t cols, int64_t* ld) {
    if (*p == nullptr) return absl::OkStatus();
    const int64_t stride = ld != nullptr ? *ld : cols;
    if (stride == cols) {
      TANDEM_ASSIGN_OR_RETURN(*p, Put(name, *p, rows * cols));
      return absl::OkStatus();
    }
    std::vector<uint16_t> packed(static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(packed.data() + r * cols, *p + r * stride, cols * sizeof(uint16_t));
    }
    TANDEM_ASSIGN_OR_RETURN(*p, Put(name, packed.data(), rows * cols));
    *ld = cols;
    return absl::OkStatus();
  }
  template <typename T>
  absl::Status Array(absl::string_view name, const T** p, int64_t count) {
    TANDEM_ASSIGN_OR_RETURN(*p, Put(name, *p, count));
    return absl::OkStatus();
  }
  absl::Status Vec(absl::string_view name, F32Vec* v) {
    TANDEM_ASSIGN_OR_RETURN(
        const float* d, Put(name, v->host().data(), static_cast<int64_t>(v->size())));
    v->set_device(d);
    return absl::OkStatus();
  }

 private:
  static constexpr size_t kFirstChunk = size_t{4} << 20;
  static constexpr size_t kMaxChunk = size_t{256} << 20;
  static constexpr size_t kAlign = 256;
  absl::StatusOr<void*> Reserve(absl::string_view name, size_t bytes) {
    const size_t need = (bytes + kAlign - 1) / kAlign * kAlign;
    if (need <= left_) {
      void* out = cur_;
      cur_ += need;
      left_ -= need;
      return out;
    }
    const size_t next = std::min(kMaxChunk, std::max(kFirstChunk, next_chunk_ * 2));
    // A tensor as large as the next chunk gets an allocation of its own (the
    // current chunk keeps taking the small ones).
    const bool own = need >= next;
    absl::StatusOr<kernels::DeviceBuffer> b =
        kernels::DeviceBuffer::Allocate(&device_, own ? need : next);
    if (!b.ok() && !own) b = kernels::DeviceBuffer::Allocate(&device_, need);
    if (!b.ok()) {
      const kernels::DeviceMemoryInfo info = device_.MemoryInfo();
      return ResourceExhausted(
          "placing the model on ", device_.name(), ": tensor ", prefix_, name, " (",
          FormatBytes(static_cast<int64_t>(bytes)), ") does not fit; ",
          FormatBytes(static_cast<int64_t>(w_->device_bytes)), " of weights in ",
          tensors_, " tensors placed so far, ", FormatBytes(info.free_bytes),
          " of the device's ", FormatBytes(info.total_bytes),
          " free (the model needs a larger device or more TP ranks): ",
          b.status().message());
    }
    char* base = b->as<char>();
    const size_t size = b->bytes();
    w_->device_memory.push_back(std::move(b).value());
    if (!own) {
      next_chunk_ = next;
      cur_ = base + need;
      left_ = size - need;
    }
    return base;
  }
  kernels::Device& device_;
  ModelWeights* w_;
  std::string prefix_;
  int64_t tensors_ = 0;
  size_t next_chunk_ = 0;
  char* cur_ = nullptr;
  size_t left_ = 0;
};

absl::Status PlaceDense(Uploader& up, absl::string_view name, DenseMlpWeights* m,
                        int64_t H) {
  TANDEM_RETURN_IF_ERROR(
      up.Matrix(absl::StrCat(name, "gate_proj"), &m->gate, m->inter, H, nullptr));
  TANDEM_RETURN_IF_ERROR(
      up.Matrix(absl::StrCat(name, "up_proj"), &m->up, m->inter, H, nullptr));
  return up.Matrix(absl::StrCat(name, "down_proj"), &m->down, H, m->inter, &m->down_ld);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelWeights>> PlaceModelWeights(
    std::unique_ptr<ModelWeights> w, kernels::Device& device) {
  if (w == nullptr) return InvalidArgument("PlaceModelWeights: no weights");
  if (device.name() == "host") return w;
  if (w->device != nullptr) {
    return FailedPrecondition("PlaceModelWeights: the weights are already on ",
                              w->device->name());
  }
  const model::ModelConfig& c = w->config;
  const model::TextConfig& t = c.text;
  const auto& la = t.linear_attn_config;
  const int64_t H = t.hidden_size, d = la.head_dim, K = la.short_conv_kernel_size;
  const int64_t ql = t.q_lora_rank, lora = t.kv_lora_rank, rope = t.qk_rope_head_dim;
  const int64_t qd = c.QHeadDim(), vd = t.v_head_dim, nope = t.qk_nope_head_dim;
  const int64_t L = t.routed_expert_hidden_size, M = t.moe_intermediate_size;
  const int64_t E = t.num_experts;
  Uploader up(device, w.get());
  TANDEM_RETURN_IF_ERROR(
      up.Matrix("model.embed_tokens", &w->embed, w->vocab_rows, H, nullptr));
  TANDEM_RETURN_IF_ERROR(up.Matrix("lm_head", &w->lm_head, w->vocab_rows, H, nullptr));
  TANDEM_RETURN_IF_ERROR(up.Vec("model.norm", &w->final_norm));
  TANDEM_RETURN_IF_ERROR(up.Vec("model.output_attn_res_norm", &w->output_res_norm));
  TANDEM_RETURN_IF_ERROR(up.Vec("model.output_attn_res_proj", &w->output_res_proj));
  for (LayerWeights& lw : w->layers) {
    up.set_prefix(absl::StrCat("model.layers.", lw.spec.index, "."));
    const std::pair<const char*, F32Vec*> vecs[] = {
        {"input_layernorm", &lw.input_norm},
        {"post_attention_layernorm", &lw.post_attention_norm},
        {"attn_res_norm", &lw.attn_res_norm},
        {"attn_res_proj", &lw.attn_res_proj},
        {"mlp_res_norm", &lw.mlp_res_norm},
        {"mlp_res_proj", &lw.mlp_res_proj}};
    for (const auto& [name, v] : vecs) TANDEM_RETURN_IF_ERROR(up.Vec(name, v));
    if (lw.spec.attention == model::AttentionKind::kKda) {
      KdaWeights& k = lw.kda;
      const int64_t P = k.heads * d;
      const std::pair<const char*, const uint16_t**> projs[] = {
          {"self_attn.q_proj", &k.q_proj},
          {"self_attn.k_proj", &k.k_proj},
          {"self_attn.v_proj", &k.v_proj},
          {"self_attn.g_proj", &k.g_proj}};
      for (const auto& [name, m] : projs) {
        TANDEM_RETURN_IF_ERROR(up.Matrix(name, m, P, H, nullptr));
      }
      const std::pair<const char*, const float**> convs[] = {
          {"self_attn.q_conv1d", &k.q_conv},
          {"self_attn.k_conv1d", &k.k_conv},
          {"self_attn.v_conv1d", &k.v_conv}};
      for (const auto& [name, cv] : convs) {
        TANDEM_RETURN_IF_ERROR(up.Array(name, cv, P * K));
      }
      TANDEM_RETURN_IF_ERROR(up.Array("self_attn.A_log", &k.a_log, k.heads));
      TANDEM_RETURN_IF_ERROR(
          up.Matrix("self_attn.f_a_proj", &k.f_a_proj, d, H, nullptr));
      TANDEM_RETURN_IF_ERROR(
          up.Matrix("self_attn.f_b_proj", &k.f_b_proj, P, d, nullptr));
      TANDEM_RETURN_IF_ERROR(up.Array("self_attn.dt_bias", &k.dt_bias, P));
      TANDEM_RETURN_IF_ERROR(
          up.Matrix("self_attn.b_proj", &k.b_proj, k.heads, H, nullptr));
      TANDEM_RETURN_IF_ERROR(up.Array("self_attn.o_norm", &k.o_norm, d));
      TANDEM_RETURN_IF_ERROR(
          up.Matrix("self_attn.o_proj", &k.o_proj, H, P, &k.o_proj_ld));
    } else {
      MlaWeights& m = lw.mla;
      TANDEM_RETURN_IF_ERROR(
          up.Matrix("self_attn.q_a_proj", &m.q_a_proj, ql, H, nullptr));
      TANDEM_RETURN_IF_ERROR(up.Vec("self_attn.q_a_layernorm", &m.q_a_norm));
      TANDEM_RETURN_IF_ERROR(
          up.Matrix("self_attn.q_b_proj", &m.q_b_proj, m.heads * qd, ql, nullptr));
      TANDEM_RETURN_IF_ERROR(up.Matrix("self_attn.kv_a_proj_with_mqa", &m.kv_a_proj,
                                       lora + rope, H, nullptr));
      TANDEM_RETURN_IF_ERROR(up.Vec("self_attn.kv_a_layernorm", &m.kv_a_norm));
      TANDEM_RETURN_IF_ERROR(up.Matrix("self_attn.kv_b_proj", &m.kv_b_proj,
                                       m.heads * (nope + vd), lora, nullptr));
      TANDEM_RETURN_IF_ERROR(
          up.Matrix("self_attn.o_proj", &m.o_proj, H, m.heads * vd, &m.o_proj_ld));
      TANDEM_RETURN_IF_ERROR(
          up.Matrix("self_attn.g_proj", &m.g_proj, m.heads * vd, H, nullptr));
    }
    if (lw.spec.ffn == model::FfnKind::kDense) {
      TANDEM_RETURN_IF_ERROR(PlaceDense(up, "mlp.", &lw.dense, H));
    } else {
      MoeWeights& moe = lw.moe;
      TANDEM_RETURN_IF_ERROR(
          up.Matrix("block_sparse_moe.gate", &moe.router, E, H, nullptr));
      TANDEM_RETURN_IF_ERROR(up.Array("block_sparse_moe.gate.e_score_correction_bias",
                                      &moe.router_bias, E));
      TANDEM_RETURN_IF_ERROR(up.Matrix("block_sparse_moe.routed_expert_down_proj",
                                       &moe.latent_down, L, H, nullptr));
      TANDEM_RETURN_IF_ERROR(up.Matrix("block_sparse_moe.routed_expert_up_proj",
                                       &moe.latent_up, H, L, nullptr));
      TANDEM_RETURN_IF_ERROR(
          up.Vec("block_sparse_moe.routed_expert_norm", &moe.latent_norm));
      TANDEM_RETURN_IF_ERROR(
          PlaceDense(up, "block_sparse_moe.shared_experts.", &moe.shared, H));
      std::vector<kernels::Mxfp4Expert> table = moe.experts;
      for (size_t e = 0; e < table.size(); ++e) {
        kernels::Mxfp4Expert& ex = table[e];
        if (ex.w1_packed == nullptr) continue;  // another rank's
        const std::string x = absl::StrCat("block_sparse_moe.experts.", e, ".");
        TANDEM_RETURN_IF_ERROR(
            up.Array(x + "w1.weight_packed", &ex.w1_packed, M * L / 2));
        TANDEM_RETURN_IF_ERROR(
            up.Array(x + "w1.weight_scale", &ex.w1_scale, M * L / 32));
        TANDEM_RETURN_IF_ERROR(
            up.Array(x + "w3.weight_packed", &ex.w3_packed, M * L / 2));
        TANDEM_RETURN_IF_ERROR(
            up.Array(x + "w3.weight_scale", &ex.w3_scale, M * L / 32));
        TANDEM_RETURN_IF_ERROR(
            up.Array(x + "w2.weight_packed", &ex.w2_packed, L * M / 2));
        TANDEM_RETURN_IF_ERROR(
            up.Array(x + "w2.weight_scale", &ex.w2_scale, L * M / 32));
      }
      moe.experts = table;  // host copy of the device pointers
      TANDEM_ASSIGN_OR_RETURN(moe.device_experts,
                              up.Put("block_sparse_moe (device expert table)",
                                     table.data(), static_cast<int64_t>(table.size())));
    }
  }
  TANDEM_RETURN_IF_ERROR(device.Synchronize());
  w->device = &device;
  return w;
}

}  // namespace tandem::engine
