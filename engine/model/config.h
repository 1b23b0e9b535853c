// Kimi K3 model configuration: the typed, validated form of the checkpoint's
// config.json (top level + text_config + linear_attn_config + quantization_config)
// and the per-layer schedule derived from it.
//
// Parse → validate every field (types, ranges, divisibility, layer lists) and
// refuse features the engine does not implement, each error naming the field
// and its value → ModelConfig. ToJson() writes the same layout back.
#ifndef TANDEM_ENGINE_MODEL_CONFIG_H_
#define TANDEM_ENGINE_MODEL_CONFIG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::model {

// text_config.linear_attn_config
struct LinearAttnConfig {
  std::vector<int> full_attn_layers;  // 1-based
  std::vector<int> kda_layers;        // 1-based
  double gate_lower_bound = -5.0;
  int64_t head_dim = 0;
  int64_t num_heads = 0;
  int64_t short_conv_kernel_size = 4;
  bool use_full_rank_gate = true;
  bool operator==(const LinearAttnConfig&) const = default;
};

// text_config.quantization_config (compressed-tensors, one config group).
struct QuantizationConfig {
  std::string format;        // "mxfp4-pack-quantized"
  std::string quant_method;  // "compressed-tensors"
  std::vector<std::string> ignore;
  std::string group_name = "group_0";
  std::string group_format;          // config_groups.<g>.format
  std::vector<std::string> targets;  // config_groups.<g>.targets
  int64_t num_bits = 4;
  int64_t group_size = 32;
  bool operator==(const QuantizationConfig&) const = default;
};

struct TextConfig {
  double activation_situ_beta = 4.0;
  double activation_situ_linear_beta = 25.0;
  int64_t attn_res_block_size = 0;
  int64_t eos_token_id = 0;
  int64_t first_k_dense_replace = 0;
  std::string hidden_act;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t kv_lora_rank = 0;
  bool latent_moe_use_norm = true;
  LinearAttnConfig linear_attn_config;
  int64_t max_position_embeddings = 0;
  bool mla_use_nope = true;
  bool mla_use_output_gate = true;
  std::string model_type;  // "kimi_linear"
  int64_t moe_intermediate_size = 0;
  int64_t moe_layer_freq = 1;
  bool moe_renormalize = true;
  std::string moe_router_activation_func;
  int64_t num_attention_heads = 0;
  int64_t num_expert_group = 1;
  int64_t num_experts = 0;
  int64_t num_experts_per_token = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_key_value_heads = 0;
  int64_t num_nextn_predict_layers = 0;
  int64_t num_shared_experts = 0;
  int64_t q_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  QuantizationConfig quantization_config;
  double rms_norm_eps = 1e-5;
  int64_t routed_expert_hidden_size = 0;
  double routed_scaling_factor = 1.0;
  bool tie_word_embeddings = false;
  int64_t topk_group = 1;
  bool use_grouped_topk = true;
  int64_t v_head_dim = 0;
  int64_t vocab_size = 0;
  bool operator==(const TextConfig&) const = default;
};

enum class AttentionKind { kKda, kMla };
enum class FfnKind { kDense, kMoe };

struct LayerSpec {
  int index = 0;  // 0-based
  AttentionKind attention = AttentionKind::kKda;
  FfnKind ffn = FfnKind::kDense;
  // True when this layer starts an attention-residual block
  // (index % attn_res_block_size == 0): the running sum is pushed to the bank.
  bool starts_res_block = false;
  bool operator==(const LayerSpec&) const = default;
};

struct ModelConfig {
  std::vector<std::string> architectures;
  int64_t bos_token_id = 0;
  int64_t eos_token_id = 0;
  int64_t media_placeholder_token_id = 0;
  std::string model_type;  // "kimi_k3"
  int64_t pad_token_id = 0;
  bool tie_word_embeddings = false;
  TextConfig text;
  // "vision_config" kept verbatim (compact JSON; "" when absent): the text engine
  // does not use it, ToJson writes it back.
  std::string vision_config_json;

  bool operator==(const ModelConfig&) const = default;

  // The per-layer schedule (num_hidden_layers entries).
  std::vector<LayerSpec> Layers() const;
  bool IsKda(int layer) const;  // 0-based
  int NumKdaLayers() const;
  int NumMlaLayers() const;
  int NumMoeLayers() const;  // FFN layers with routed experts (Layers()' kMoe)
  int NumResBlocks() const;  // ceil(num_hidden_layers / attn_res_block_size)

  // KDA sizes.
  int64_t KdaProjectionSize() const;  // num_heads * head_dim
  // Entries of the zero-padded A_log tensor: num_heads rounded up to 128.
  int64_t ALogPaddedLength() const;
  // Per sequence per KDA layer: the fp32 recurrent state h*d*d*4 plus the fp32
  // conv tails 3 (q,k,v) * (kernel-1) * P * 4.
  int64_t KdaRecurrentStateBytes() const;
  int64_t KdaConvStateBytes() const;
  int64_t KdaStateBytesPerSequence() const;  // both, one layer
  // MLA cache per token per layer: (kv_lora_rank + qk_rope_head_dim) BF16 values.
  int64_t MlaCacheValuesPerToken() const;
  int64_t MlaCacheBytesPerToken() const;
  int64_t QHeadDim() const;  // qk_nope_head_dim + qk_rope_head_dim

  // The config.json layout (2-space indented JSON).
  std::string ToJson() const;
};

// Parses and validates config.json text; errors name the field and its value.
absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text);
// Reads and parses a file; errors name the path.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path);
// The validation ParseModelConfig applies (exposed for configs built in code).
absl::Status ValidateModelConfig(const ModelConfig& config);

}  // namespace tandem::model

#endif  // TANDEM_ENGINE_MODEL_CONFIG_H_
