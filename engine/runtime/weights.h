// Typed, per-layer views of a K3 checkpoint for the forward pass.
//
//   Checkpoint (mmap) → LoadModelWeights(checkpoint, shard) → ModelWeights
//     every matrix: a BF16 bit pointer into the mapping (no copy), checked for
//     dtype and shape against the config;
//     routed experts: one kernels::Mxfp4Expert (packed + scale pointers) each;
//     small vectors only (norm gains, residual-mixer queries: H or fewer values
//     each) are converted to fp32 copies, because the kernels take fp32 gains.
//
// Tensor parallelism (ShardSpec{rank r, size N}; parallel::ShardForRank gives
// the ranges, sizes it refuses are refused here with its error). No weight is
// ever copied to shard it: a row slice is a pointer offset into the mapping, a
// column slice (o_proj, down) is a pointer offset plus the full tensor's leading
// dimension (o_proj_ld / down_ld, passed to GemmBf16 as ldw).
//   KDA:   heads [r*h/N, (r+1)*h/N): rows of q/k/v/g_proj, f_b_proj, b_proj,
//          conv, dt_bias, A_log slices; o_proj columns; all-reduce after o_proj.
//          f_a_proj and o_norm are replicated.
//   MLA:   heads likewise: q_b_proj / kv_b_proj / g_proj rows, o_proj columns;
//          q_a / kv_a (and the latent cache) are replicated.
//   Dense MLP and shared experts: intermediate rows [r*I/N, (r+1)*I/N) of
//          gate/up, the same columns of down; all-reduce after down.
//   Routed experts: expert e lives on rank e % N (others: null pointers, which
//          MoeMxfp4 skips); the router, latent down/up and norm are replicated;
//          all-reduce of u before routed_expert_norm.
//   Vocab: embedding and lm_head rows [r*V/N, (r+1)*V/N); the embedding gathers
//          the rank's rows (zeros for the others) and all-reduces, the logits
//          are all-gathered and re-ordered to [rows, V].
// Everything else (norms, residual mixers, router) is replicated.
#ifndef TANDEM_ENGINE_RUNTIME_WEIGHTS_H_
#define TANDEM_ENGINE_RUNTIME_WEIGHTS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model/checkpoint.h"
#include "engine/model/config.h"
#include "kernels/backend.h"
#include "kernels/device.h"

namespace tandem::engine {

// A small fp32 vector (norm gain, residual-mixer query): its host values, and
// the copy the kernels read once the weights are placed on a device
// (PlaceModelWeights). data() is what to hand to a backend op.
class F32Vec {
 public:
  F32Vec() = default;
  F32Vec(std::vector<float> v) : host_(std::move(v)) {}  // NOLINT: implicit
  F32Vec& operator=(std::vector<float> v) {
    host_ = std::move(v);
    device_ = nullptr;
    return *this;
  }
  const float* data() const { return device_ != nullptr ? device_ : host_.data(); }
  size_t size() const { return host_.size(); }
  bool empty() const { return host_.empty(); }
  float operator[](size_t i) const { return host_[i]; }
  const std::vector<float>& host() const { return host_; }
  void set_device(const float* p) { device_ = p; }

 private:
  std::vector<float> host_;
  const float* device_ = nullptr;
};

// Which part of the model this rank holds (the same pair as parallel::TpShard).
struct ShardSpec {
  int rank = 0;
  int size = 1;

  // [begin, end) of `total` units (heads, intermediate rows, vocab rows) owned by
  // this rank under an even split.
  int64_t Begin(int64_t total) const { return total * rank / size; }
  int64_t End(int64_t total) const { return total * (rank + 1) / size; }
  // Routed experts are dealt round-robin.
  bool OwnsExpert(int64_t expert) const { return expert % size == rank; }
};

struct KdaWeights {
  const uint16_t* q_proj = nullptr;  // [P, H]
  const uint16_t* k_proj = nullptr;
  const uint16_t* v_proj = nullptr;
  const float* q_conv = nullptr;  // [P, K]
  const float* k_conv = nullptr;
  const float* v_conv = nullptr;
  const float* a_log = nullptr;        // first h of the padded tensor
  const uint16_t* f_a_proj = nullptr;  // [d, H]
  const uint16_t* f_b_proj = nullptr;  // [P, d]
  const float* dt_bias = nullptr;      // [P]
  const uint16_t* b_proj = nullptr;    // [h, H]
  const uint16_t* g_proj = nullptr;    // [P, H]
  const float* o_norm = nullptr;       // [d]
  const uint16_t* o_proj = nullptr;    // [H, P] columns of this rank
  int64_t heads = 0;                   // this rank's heads (h / N); P = heads * d
  int64_t o_proj_ld = 0;               // the full tensor's row length (h * d)
};

struct MlaWeights {
  const uint16_t* q_a_proj = nullptr;   // [q_lora, H]
  F32Vec q_a_norm;                      // [q_lora]
  const uint16_t* q_b_proj = nullptr;   // [n * (nope + rope), q_lora]
  const uint16_t* kv_a_proj = nullptr;  // [lora + rope, H]
  F32Vec kv_a_norm;                     // [lora]
  const uint16_t* kv_b_proj = nullptr;  // [n * (nope + v), lora]
  const uint16_t* o_proj = nullptr;     // [H, n * v]
  const uint16_t* g_proj = nullptr;     // [n * v, H]
  int64_t heads = 0;                    // this rank's heads n (of all N_h)
  int64_t o_proj_ld = 0;                // the full tensor's row length (N_h * v)
};

struct DenseMlpWeights {
  const uint16_t* gate = nullptr;  // [I, H]
  const uint16_t* up = nullptr;    // [I, H]
  const uint16_t* down = nullptr;  // [H, I] columns of this rank
  int64_t inter = 0;               // this rank's rows I
  int64_t down_ld = 0;             // the full tensor's row length
};

struct MoeWeights {
  const uint16_t* router = nullptr;           // [E, H]
  const float* router_bias = nullptr;         // [E]
  const uint16_t* latent_down = nullptr;      // [L, H]
  const uint16_t* latent_up = nullptr;        // [H, L]
  F32Vec latent_norm;                         // [L]
  std::vector<kernels::Mxfp4Expert> experts;  // [E]; null pointers: not owned here
  // The same table in device memory once placed (MoeArgs::experts is device
  // memory); null: the weights are on the host.
  const kernels::Mxfp4Expert* device_experts = nullptr;
  DenseMlpWeights shared;  // width moe_inter * num_shared

  const kernels::Mxfp4Expert* expert_table() const {
    return device_experts != nullptr ? device_experts : experts.data();
  }
};

struct LayerWeights {
  model::LayerSpec spec;
  int kda_index = -1;  // index among KDA layers (state pool), or -1
  int mla_index = -1;  // index among MLA layers (latent cache), or -1
  F32Vec input_norm, post_attention_norm;
  F32Vec attn_res_norm, attn_res_proj;
  F32Vec mlp_res_norm, mlp_res_proj;
  KdaWeights kda;
  MlaWeights mla;
  DenseMlpWeights dense;
  MoeWeights moe;
};

struct ModelWeights {
  model::ModelConfig config;
  ShardSpec shard;
  // This rank's vocabulary rows [vocab_begin, vocab_begin + vocab_rows).
  int64_t vocab_begin = 0;
  int64_t vocab_rows = 0;
  const uint16_t* embed = nullptr;    // [vocab_rows, H] (row vocab_begin)
  const uint16_t* lm_head = nullptr;  // [vocab_rows, H]
  F32Vec final_norm;
  F32Vec output_res_norm, output_res_proj;
  std::vector<LayerWeights> layers;
  // Where the pointers above point: null = host memory (the checkpoint's
  // mapping and the F32Vec host values); else the device PlaceModelWeights
  // uploaded to, which owns `device_memory`.
  kernels::Device* device = nullptr;
  std::vector<kernels::DeviceBuffer> device_memory;
  uint64_t device_bytes = 0;  // uploaded
  // Bytes of the mapped weights (this rank's slices) one decode token reads at least
  // (every dense matrix + top_k experts per MoE layer + lm_head + its embedding row):
  // the numerator of the decode roofline.
  uint64_t dense_bytes = 0;          // all BF16/F32 weights except routed experts
  uint64_t expert_bytes_each = 0;    // one routed expert (w1+w2+w3, packed + scales)
  uint64_t routed_expert_bytes = 0;  // every routed expert this rank owns, all layers
  // Everything this rank holds: its vocabulary rows of the embedding and
  // lm_head, its slices of the dense and attention weights, the replicated
  // tensors and its routed experts (the checkpoint's formats: BF16, FP32,
  // MXFP4 packed + scales).
  uint64_t rank_bytes = 0;
};

// Builds the views of `shard`'s part; `checkpoint` must outlive the result.
// Errors name the tensor; CheckTpSize's error for a size the config refuses.
absl::StatusOr<std::unique_ptr<ModelWeights>> LoadModelWeights(
    const model::Checkpoint& checkpoint, ShardSpec shard = {});

// The same walk without a checkpoint: the byte figures above (dense_bytes,
// expert_bytes_each, routed_expert_bytes, rank_bytes) for `config` and `shard`,
// every pointer null and every small vector zeros. What a rank of a model too
// large to generate here would hold and read (engine/runtime/projection.h).
absl::StatusOr<std::unique_ptr<ModelWeights>> SizeModelWeights(
    const model::ModelConfig& config, ShardSpec shard = {});

// Uploads the weights once to `device`, in their checkpoint formats (BF16
// matrices, MXFP4 packed nibbles + E8M0 scales, fp32 small tensors), into a few
// large allocations; column slices of a TP shard (o_proj, down) are packed to
// their own width (the *_ld fields then equal the slice width). The host
// device ("host") needs no copy: `weights` is returned unchanged. On a device the
// result no longer points into the checkpoint. ResourceExhausted names what did
// not fit.
absl::StatusOr<std::unique_ptr<ModelWeights>> PlaceModelWeights(
    std::unique_ptr<ModelWeights> weights, kernels::Device& device);

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_RUNTIME_WEIGHTS_H_
