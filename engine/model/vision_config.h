// Kimi K3's vision tower configuration (config.json "vision_config", MoonViT-V2 +
// the patchmergerv2 projector; ../shared/reference/kimi-k3/VISION.md section 0) and
// the vision tensor table (section 2) it implies.
//
// ModelConfig keeps "vision_config" verbatim (the text engine does not need it);
// ParseVisionConfig turns it into a typed, validated VisionConfig, refusing any
// flag value the tower does not implement, each error naming the field. Two
// fields are Tandem's own, because the release leaves them unstated
// (VISION.md section 5): vt_norm_eps (the tower's RMSNorm eps, PyTorch's default
// 2^-23 when absent) and vt_rope_theta (10000 when absent).
#ifndef TANDEM_ENGINE_MODEL_VISION_CONFIG_H_
#define TANDEM_ENGINE_MODEL_VISION_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/model/config.h"
#include "engine/model/tensor_table.h"

namespace tandem::model {

struct VisionConfig {
  int64_t patch_size = 14;             // p
  int64_t vt_hidden_size = 0;          // D
  int64_t qkv_hidden_size = 0;         // Q (attention width)
  int64_t vt_num_attention_heads = 0;  // nh; head_dim = Q / nh
  int64_t vt_intermediate_size = 0;    // I
  int64_t vt_num_hidden_layers = 0;    // L
  int64_t init_pos_emb_height = 0;     // position table [H, W, D]
  int64_t init_pos_emb_width = 0;
  int64_t init_pos_emb_time = 4;  // the video term (t > 1, unused for images)
  std::string pos_emb_type = "divided_fixed";
  std::string pos_emb_interpolation_mode = "bilinear";
  std::string norm_type = "rmsnorm";
  bool attn_bias = false;
  bool linear_bias = false;
  bool patch_embed_proj_bias = false;
  std::string mlp_type = "mlp2";
  std::string activation_func = "gelu_pytorch_tanh";
  std::vector<int> merge_kernel_size = {2, 2};
  std::string merge_type = "sd2_tpool";
  std::string mm_projector_type = "patchmergerv2";
  int64_t mm_hidden_size = 0;    // M (= D: the merge concatenates 4 patches)
  int64_t text_hidden_size = 0;  // Ht (= text_config.hidden_size)
  std::string projector_hidden_act = "gelu";
  double projector_ln_eps = 1e-5;
  // Tandem's (VISION.md section 5: assumed for K3).
  double vt_norm_eps = 1.1920928955078125e-7;  // 2^-23
  double vt_rope_theta = 10000.0;

  bool operator==(const VisionConfig&) const = default;

  int64_t head_dim() const { return qkv_hidden_size / vt_num_attention_heads; }
  int64_t patch_dim() const { return 3 * patch_size * patch_size; }  // 588
  int64_t merged_dim() const { return 4 * mm_hidden_size; }          // 4M
  // Compact JSON with every published field (the two Tandem fields when they
  // differ from their defaults).
  std::string ToJson() const;
};

// The published K3 values (VISION.md section 0; vt_hidden_size 1024).
VisionConfig PublishedVisionConfig();
// VISION.md section 4: D 64, Q 96, 2 heads, I 128, 2 layers, table 8x8.
VisionConfig TinyVisionConfig(int64_t text_hidden_size);
// For benchmarks: D 384, Q 384, 6 heads (hd 64), I 1536, 6 layers, table 64x64.
VisionConfig MidVisionConfig(int64_t text_hidden_size);

// Parses and validates vision_config JSON text.
absl::StatusOr<VisionConfig> ParseVisionConfig(absl::string_view json_text);
// The checkpoint's vision config: NotFound when config.json has none; otherwise
// ParseVisionConfig plus text_hidden_size == text_config.hidden_size.
absl::StatusOr<VisionConfig> VisionConfigOf(const ModelConfig& config);
absl::Status ValidateVisionConfig(const VisionConfig& c);

// Every vision tensor (VISION.md section 2), in order: patch embed, position
// table, blocks 0..L-1, final norm, projector. All BF16; kinds kMatrix / kNorm /
// kEmbedding (the position table).
std::vector<ExpectedTensor> ExpectedVisionTensors(const VisionConfig& c);

}  // namespace tandem::model

#endif  // TANDEM_ENGINE_MODEL_VISION_CONFIG_H_
