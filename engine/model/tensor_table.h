// The complete list of text tensors a K3 checkpoint holds for a given config:
// name, dtype and exact shape. ValidateAgainstConfig, the generator and the docs
// all use this one table.
#ifndef TANDEM_ENGINE_MODEL_TENSOR_TABLE_H_
#define TANDEM_ENGINE_MODEL_TENSOR_TABLE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "engine/model/config.h"
#include "engine/model/safetensors_header.h"

namespace tandem::model {

// Every K3 text tensor name starts with this; Kimi-Linear checkpoints have none.
inline constexpr absl::string_view kTextPrefix = "language_model.";

// What a tensor is, for initialisation and statistics.
enum class TensorKind {
  kEmbedding,    // embed_tokens [V, H]
  kLmHead,       // lm_head [V, H]
  kMatrix,       // BF16 [out, in] projection
  kNorm,         // RMSNorm gain (BF16 or F32)
  kResProj,      // attention-residual query vector [1, H]
  kConv,         // KDA depthwise conv [P, 1, K] (F32)
  kALog,         // KDA A_log, zero-padded (F32)
  kDtBias,       // KDA dt_bias (F32)
  kRouterBias,   // gate.e_score_correction_bias (F32)
  kMxfp4Packed,  // routed expert weight_packed (U8) [out, in/2]
  kMxfp4Scale,   // routed expert weight_scale (U8) [out, in/32]
};

struct ExpectedTensor {
  std::string name;  // full checkpoint name, with kTextPrefix
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  TensorKind kind = TensorKind::kMatrix;
  int layer = -1;  // -1 for model-level tensors
  uint64_t nbytes() const;
};

// In order: embed_tokens, every layer (attention, norms, residual mixers, FFN),
// norm, output_attn_res_*, lm_head.
std::vector<ExpectedTensor> ExpectedTensors(const ModelConfig& config);

// "model.layers.3.mlp_res_norm.weight" for "language_model.model.layers.3..." and
// for the unprefixed name alike.
absl::string_view StripTextPrefix(absl::string_view name);
// True for vision tower / projector tensors (ignored by the text engine).
bool IsVisionTensor(absl::string_view name);

}  // namespace tandem::model

#endif  // TANDEM_ENGINE_MODEL_TENSOR_TABLE_H_
