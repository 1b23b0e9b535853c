// Deterministic generator of K3-architecture checkpoints with random weights:
// the exact K3 tensor names, dtypes and layout (tensor_table.h), shrunk.
//
//   MakeCheckpoint(options) → config.json (ModelConfig::ToJson)
//                           → generation_config.json
//                           → model-0000i-of-0000n.safetensors (+ index JSON)
//                           → tokenizer files copied from options.tokenizer_dir
//
// Every tensor is generated from its own PRNG stream seeded by (seed, name)
// (splitmix64; no std distributions), so the bytes depend only on the seed and
// the config: same seed → byte-identical files.
#ifndef TANDEM_ENGINE_MODEL_MAKE_CHECKPOINT_H_
#define TANDEM_ENGINE_MODEL_MAKE_CHECKPOINT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/model/config.h"
#include "engine/model/safetensors.h"
#include "engine/model/tensor_table.h"

namespace tandem::model {

// The published K3 config (every field the release's config.json has).
ModelConfig PublishedK3Config();
// "tiny": 8 layers (KDA ×6, MLA at 4 and 8 1-based), hidden 64, full vocab,
// K3's 1,048,576-token context (max_position_embeddings), as "mid" has,
// 16 experts top-4; a ~45 MB checkpoint for tests.
ModelConfig TinyConfig();
// "mid": 16 layers, hidden 1024, 64 experts top-8; ~1.4 GB for benchmarks.
ModelConfig MidConfig();
// "tiny" | "mid".
absl::StatusOr<ModelConfig> ConfigForSize(absl::string_view size);

struct MakeCheckpointOptions {
  std::string out_dir;  // created if absent
  ModelConfig config;
  uint64_t seed = 0;
  int num_shards = 3;  // >= 1; fewer when tensors do not fill them
  // Directory holding tiktoken.model, tokenizer_config.json and pat_str.json;
  // empty: copy none.
  std::string tokenizer_dir;
  // Generator threads (0: one per core, at most 16). The output does not depend
  // on it.
  int num_threads = 0;
};

// Files the generator writes for `num_shards` shards (relative names).
std::vector<std::string> CheckpointFileNames(int num_shards);

absl::Status MakeCheckpoint(const MakeCheckpointOptions& options);

// The bytes of one tensor as the generator makes them (exposed for tests).
// Initialisation by kind (fan_in = the last dimension of a [out, in] matrix):
//   embedding ~ N(0, 1); lm_head and matrices ~ N(0, 1/fan_in);
//   norms 1 + N(0, 0.02²); attention-residual queries ~ N(0, 1/H);
//   conv ~ U(±1/sqrt(K)); A_log[:h] = log U(1, 16), padding 0;
//   dt_bias = softplus⁻¹(dt), log dt ~ U(log 1e-3, log 1e-1);
//   e_score_correction_bias ~ U(±0.1) (never 0);
//   MXFP4 experts: a N(0, 1/in) matrix quantised with QuantizeMxfp4.
// N(·) here is the Irwin–Hall sum of four uniforms, rescaled to unit variance.
absl::StatusOr<TensorData> GenerateTensor(const ModelConfig& config,
                                          const ExpectedTensor& tensor, uint64_t seed);

}  // namespace tandem::model

#endif  // TANDEM_ENGINE_MODEL_MAKE_CHECKPOINT_H_
