#include "engine/model/vision_config.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace tandem::model {
namespace {

using nlohmann::json;

constexpr absl::string_view kWhere = "vision_config.";

absl::StatusOr<const json*> Field(const json& o, absl::string_view key) {
  auto it = o.find(std::string(key));
  if (it == o.end()) return InvalidArgument("config: missing field ", kWhere, key);
  return &*it;
}

absl::Status Int(const json& o, absl::string_view key, int64_t* out) {
  TANDEM_ASSIGN_OR_RETURN(const json* v, Field(o, key));
  if (!v->is_number_integer()) {
    return InvalidArgument("config: ", kWhere, key, " must be an integer, got ",
                           v->dump());
  }
  *out = v->get<int64_t>();
  return absl::OkStatus();
}

absl::Status Double(const json& o, absl::string_view key, double* out) {
  TANDEM_ASSIGN_OR_RETURN(const json* v, Field(o, key));
  if (!v->is_number() || !std::isfinite(v->get<double>())) {
    return InvalidArgument("config: ", kWhere, key, " must be a finite number, got ",
                           v->dump());
  }
  *out = v->get<double>();
  return absl::OkStatus();
}

absl::Status OptionalDouble(const json& o, absl::string_view key, double* out) {
  if (o.find(std::string(key)) == o.end()) return absl::OkStatus();
  return Double(o, key, out);
}

absl::Status Bool(const json& o, absl::string_view key, bool* out) {
  TANDEM_ASSIGN_OR_RETURN(const json* v, Field(o, key));
  if (!v->is_boolean()) {
    return InvalidArgument("config: ", kWhere, key, " must be true or false, got ",
                           v->dump());
  }
  *out = v->get<bool>();
  return absl::OkStatus();
}

absl::Status String(const json& o, absl::string_view key, std::string* out) {
  TANDEM_ASSIGN_OR_RETURN(const json* v, Field(o, key));
  if (!v->is_string()) {
    return InvalidArgument("config: ", kWhere, key, " must be a string, got ",
                           v->dump());
  }
  *out = v->get<std::string>();
  return absl::OkStatus();
}

absl::Status IntList(const json& o, absl::string_view key, std::vector<int>* out) {
  TANDEM_ASSIGN_OR_RETURN(const json* v, Field(o, key));
  if (!v->is_array()) {
    return InvalidArgument("config: ", kWhere, key, " must be a list, got ", v->dump());
  }
  out->clear();
  for (const json& e : *v) {
    if (!e.is_number_integer()) {
      return InvalidArgument("config: ", kWhere, key, " holds ", e.dump(),
                             ", not an integer");
    }
    out->push_back(static_cast<int>(e.get<int64_t>()));
  }
  return absl::OkStatus();
}

absl::Status Expect(absl::string_view key, const std::string& got,
                    absl::string_view want) {
  if (got == want) return absl::OkStatus();
  return InvalidArgument("config: ", kWhere, key, " is \"", got,
                         "\"; the tower implements only \"", want, "\"");
}

ExpectedTensor Bf16(std::string name, std::vector<int64_t> shape, TensorKind kind,
                    int layer = -1) {
  ExpectedTensor t;
  t.name = std::move(name);
  t.dtype = DType::kBF16;
  t.shape = std::move(shape);
  t.kind = kind;
  t.layer = layer;
  return t;
}

}  // namespace

std::string VisionConfig::ToJson() const {
  json j = {{"patch_size", patch_size},
            {"vt_hidden_size", vt_hidden_size},
            {"qkv_hidden_size", qkv_hidden_size},
            {"vt_num_attention_heads", vt_num_attention_heads},
            {"vt_intermediate_size", vt_intermediate_size},
            {"vt_num_hidden_layers", vt_num_hidden_layers},
            {"init_pos_emb_height", init_pos_emb_height},
            {"init_pos_emb_width", init_pos_emb_width},
            {"init_pos_emb_time", init_pos_emb_time},
            {"pos_emb_type", pos_emb_type},
            {"pos_emb_interpolation_mode", pos_emb_interpolation_mode},
            {"norm_type", norm_type},
            {"attn_bias", attn_bias},
            {"linear_bias", linear_bias},
            {"patch_embed_proj_bias", patch_embed_proj_bias},
            {"mlp_type", mlp_type},
            {"activation_func", activation_func},
            {"merge_kernel_size", merge_kernel_size},
            {"merge_type", merge_type},
            {"mm_projector_type", mm_projector_type},
            {"mm_hidden_size", mm_hidden_size},
            {"text_hidden_size", text_hidden_size},
            {"projector_hidden_act", projector_hidden_act},
            {"projector_ln_eps", projector_ln_eps}};
  // Tandem's fields only when they differ from the assumed defaults, so the
  // published config writes back as published.
  const VisionConfig defaults;
  if (vt_norm_eps != defaults.vt_norm_eps) j["vt_norm_eps"] = vt_norm_eps;
  if (vt_rope_theta != defaults.vt_rope_theta) j["vt_rope_theta"] = vt_rope_theta;
  return j.dump();
}

VisionConfig PublishedVisionConfig() {
  VisionConfig c;
  c.vt_hidden_size = 1024;
  c.qkv_hidden_size = 1536;
  c.vt_num_attention_heads = 12;
  c.vt_intermediate_size = 4096;
  c.vt_num_hidden_layers = 27;
  c.init_pos_emb_height = 64;
  c.init_pos_emb_width = 64;
  c.mm_hidden_size = 1024;
  c.text_hidden_size = 7168;
  return c;
}

VisionConfig TinyVisionConfig(int64_t text_hidden_size) {
  VisionConfig c;
  c.vt_hidden_size = 64;
  c.qkv_hidden_size = 96;
  c.vt_num_attention_heads = 2;
  c.vt_intermediate_size = 128;
  c.vt_num_hidden_layers = 2;
  c.init_pos_emb_height = 8;
  c.init_pos_emb_width = 8;
  c.mm_hidden_size = 64;
  c.text_hidden_size = text_hidden_size;
  return c;
}

VisionConfig MidVisionConfig(int64_t text_hidden_size) {
  VisionConfig c;
  c.vt_hidden_size = 384;
  c.qkv_hidden_size = 384;
  c.vt_num_attention_heads = 6;
  c.vt_intermediate_size = 1536;
  c.vt_num_hidden_layers = 6;
  c.init_pos_emb_height = 64;
  c.init_pos_emb_width = 64;
  c.mm_hidden_size = 384;
  c.text_hidden_size = text_hidden_size;
  return c;
}

absl::StatusOr<VisionConfig> ParseVisionConfig(absl::string_view json_text) {
  json o = json::parse(json_text.begin(), json_text.end(), nullptr,
                       /*allow_exceptions=*/false);
  if (o.is_discarded() || !o.is_object()) {
    return InvalidArgument("config: vision_config is not a JSON object");
  }
  VisionConfig c;
  TANDEM_RETURN_IF_ERROR(Int(o, "patch_size", &c.patch_size));
  TANDEM_RETURN_IF_ERROR(Int(o, "vt_hidden_size", &c.vt_hidden_size));
  TANDEM_RETURN_IF_ERROR(Int(o, "qkv_hidden_size", &c.qkv_hidden_size));
  TANDEM_RETURN_IF_ERROR(Int(o, "vt_num_attention_heads", &c.vt_num_attention_heads));
  TANDEM_RETURN_IF_ERROR(Int(o, "vt_intermediate_size", &c.vt_intermediate_size));
  TANDEM_RETURN_IF_ERROR(Int(o, "vt_num_hidden_layers", &c.vt_num_hidden_layers));
  TANDEM_RETURN_IF_ERROR(Int(o, "init_pos_emb_height", &c.init_pos_emb_height));
  TANDEM_RETURN_IF_ERROR(Int(o, "init_pos_emb_width", &c.init_pos_emb_width));
  TANDEM_RETURN_IF_ERROR(Int(o, "init_pos_emb_time", &c.init_pos_emb_time));
  TANDEM_RETURN_IF_ERROR(String(o, "pos_emb_type", &c.pos_emb_type));
  TANDEM_RETURN_IF_ERROR(
      String(o, "pos_emb_interpolation_mode", &c.pos_emb_interpolation_mode));
  TANDEM_RETURN_IF_ERROR(String(o, "norm_type", &c.norm_type));
  TANDEM_RETURN_IF_ERROR(Bool(o, "attn_bias", &c.attn_bias));
  TANDEM_RETURN_IF_ERROR(Bool(o, "linear_bias", &c.linear_bias));
  TANDEM_RETURN_IF_ERROR(Bool(o, "patch_embed_proj_bias", &c.patch_embed_proj_bias));
  TANDEM_RETURN_IF_ERROR(String(o, "mlp_type", &c.mlp_type));
  TANDEM_RETURN_IF_ERROR(String(o, "activation_func", &c.activation_func));
  TANDEM_RETURN_IF_ERROR(IntList(o, "merge_kernel_size", &c.merge_kernel_size));
  TANDEM_RETURN_IF_ERROR(String(o, "merge_type", &c.merge_type));
  TANDEM_RETURN_IF_ERROR(String(o, "mm_projector_type", &c.mm_projector_type));
  TANDEM_RETURN_IF_ERROR(Int(o, "mm_hidden_size", &c.mm_hidden_size));
  TANDEM_RETURN_IF_ERROR(Int(o, "text_hidden_size", &c.text_hidden_size));
  TANDEM_RETURN_IF_ERROR(String(o, "projector_hidden_act", &c.projector_hidden_act));
  TANDEM_RETURN_IF_ERROR(Double(o, "projector_ln_eps", &c.projector_ln_eps));
  TANDEM_RETURN_IF_ERROR(OptionalDouble(o, "vt_norm_eps", &c.vt_norm_eps));
  TANDEM_RETURN_IF_ERROR(OptionalDouble(o, "vt_rope_theta", &c.vt_rope_theta));
  TANDEM_RETURN_IF_ERROR(ValidateVisionConfig(c));
  return c;
}

absl::Status ValidateVisionConfig(const VisionConfig& c) {
  auto positive = [](absl::string_view key, int64_t v) -> absl::Status {
    if (v > 0 && v <= (int64_t{1} << 20)) return absl::OkStatus();
    return InvalidArgument("config: ", kWhere, key, " must be in 1..2^20, got ", v);
  };
  TANDEM_RETURN_IF_ERROR(positive("patch_size", c.patch_size));
  TANDEM_RETURN_IF_ERROR(positive("vt_hidden_size", c.vt_hidden_size));
  TANDEM_RETURN_IF_ERROR(positive("qkv_hidden_size", c.qkv_hidden_size));
  TANDEM_RETURN_IF_ERROR(positive("vt_num_attention_heads", c.vt_num_attention_heads));
  TANDEM_RETURN_IF_ERROR(positive("vt_intermediate_size", c.vt_intermediate_size));
  TANDEM_RETURN_IF_ERROR(positive("vt_num_hidden_layers", c.vt_num_hidden_layers));
  TANDEM_RETURN_IF_ERROR(positive("init_pos_emb_height", c.init_pos_emb_height));
  TANDEM_RETURN_IF_ERROR(positive("init_pos_emb_width", c.init_pos_emb_width));
  TANDEM_RETURN_IF_ERROR(positive("init_pos_emb_time", c.init_pos_emb_time));
  TANDEM_RETURN_IF_ERROR(positive("mm_hidden_size", c.mm_hidden_size));
  TANDEM_RETURN_IF_ERROR(positive("text_hidden_size", c.text_hidden_size));
  if (c.qkv_hidden_size % c.vt_num_attention_heads != 0 || c.head_dim() % 4 != 0) {
    return InvalidArgument(
        "config: ", kWhere, "qkv_hidden_size ", c.qkv_hidden_size,
        " / vt_num_attention_heads ", c.vt_num_attention_heads,
        " must be a whole head_dim that is a multiple of 4 (2-D RoPE)");
  }
  if (c.mm_hidden_size != c.vt_hidden_size) {
    return InvalidArgument(
        "config: ", kWhere, "mm_hidden_size ", c.mm_hidden_size,
        " must equal vt_hidden_size ", c.vt_hidden_size,
        " (the 2x2 merge feeds 4 * vt_hidden_size into the projector)");
  }
  TANDEM_RETURN_IF_ERROR(Expect("pos_emb_type", c.pos_emb_type, "divided_fixed"));
  TANDEM_RETURN_IF_ERROR(
      Expect("pos_emb_interpolation_mode", c.pos_emb_interpolation_mode, "bilinear"));
  TANDEM_RETURN_IF_ERROR(Expect("norm_type", c.norm_type, "rmsnorm"));
  TANDEM_RETURN_IF_ERROR(Expect("mlp_type", c.mlp_type, "mlp2"));
  TANDEM_RETURN_IF_ERROR(
      Expect("activation_func", c.activation_func, "gelu_pytorch_tanh"));
  TANDEM_RETURN_IF_ERROR(Expect("merge_type", c.merge_type, "sd2_tpool"));
  TANDEM_RETURN_IF_ERROR(
      Expect("mm_projector_type", c.mm_projector_type, "patchmergerv2"));
  TANDEM_RETURN_IF_ERROR(
      Expect("projector_hidden_act", c.projector_hidden_act, "gelu"));
  for (auto [key, v] : {std::pair<absl::string_view, bool>{"attn_bias", c.attn_bias},
                        {"linear_bias", c.linear_bias},
                        {"patch_embed_proj_bias", c.patch_embed_proj_bias}}) {
    if (v) {
      return InvalidArgument("config: ", kWhere, key,
                             " is true; the tower implements only bias-free layers");
    }
  }
  if (c.merge_kernel_size != std::vector<int>{2, 2}) {
    return InvalidArgument(
        "config: ", kWhere,
        "merge_kernel_size must be [2, 2] (the only merge implemented)");
  }
  for (auto [key, v] :
       {std::pair<absl::string_view, double>{"projector_ln_eps", c.projector_ln_eps},
        {"vt_norm_eps", c.vt_norm_eps}}) {
    if (!(v > 0 && v < 1)) {
      return InvalidArgument("config: ", kWhere, key, " must be in (0, 1), got ", v);
    }
  }
  if (!(c.vt_rope_theta > 1 && std::isfinite(c.vt_rope_theta))) {
    return InvalidArgument("config: ", kWhere, "vt_rope_theta must be > 1, got ",
                           c.vt_rope_theta);
  }
  return absl::OkStatus();
}

absl::StatusOr<VisionConfig> VisionConfigOf(const ModelConfig& config) {
  if (config.vision_config_json.empty()) {
    return NotFound("config.json has no vision_config: this model takes no images");
  }
  TANDEM_ASSIGN_OR_RETURN(VisionConfig c, ParseVisionConfig(config.vision_config_json));
  if (c.text_hidden_size != config.text.hidden_size) {
    return InvalidArgument("config: vision_config.text_hidden_size ",
                           c.text_hidden_size, " != text_config.hidden_size ",
                           config.text.hidden_size);
  }
  return c;
}

std::vector<ExpectedTensor> ExpectedVisionTensors(const VisionConfig& c) {
  const int64_t D = c.vt_hidden_size, Q = c.qkv_hidden_size, I = c.vt_intermediate_size;
  const int64_t p = c.patch_size, M4 = c.merged_dim(), Ht = c.text_hidden_size;
  std::vector<ExpectedTensor> out;
  const std::string vt = "vision_tower.";
  out.push_back(
      Bf16(vt + "patch_embed.proj.weight", {D, 3, p, p}, TensorKind::kMatrix));
  out.push_back(Bf16(vt + "patch_embed.pos_emb.weight",
                     {c.init_pos_emb_height, c.init_pos_emb_width, D},
                     TensorKind::kEmbedding));
  for (int l = 0; l < c.vt_num_hidden_layers; ++l) {
    const std::string b = absl::StrCat(vt, "encoder.blocks.", l, ".");
    out.push_back(Bf16(b + "norm0.weight", {D}, TensorKind::kNorm, l));
    out.push_back(Bf16(b + "norm1.weight", {D}, TensorKind::kNorm, l));
    out.push_back(Bf16(b + "wqkv.weight", {3 * Q, D}, TensorKind::kMatrix, l));
    out.push_back(Bf16(b + "wo.weight", {D, Q}, TensorKind::kMatrix, l));
    out.push_back(Bf16(b + "mlp.fc0.weight", {I, D}, TensorKind::kMatrix, l));
    out.push_back(Bf16(b + "mlp.fc1.weight", {D, I}, TensorKind::kMatrix, l));
  }
  out.push_back(Bf16(vt + "encoder.final_layernorm.weight", {D}, TensorKind::kNorm));
  out.push_back(Bf16("mm_projector.proj.0.weight", {M4, M4}, TensorKind::kMatrix));
  out.push_back(Bf16("mm_projector.proj.2.weight", {Ht, M4}, TensorKind::kMatrix));
  out.push_back(Bf16("mm_projector.post_norm.weight", {Ht}, TensorKind::kNorm));
  return out;
}

}  // namespace tandem::model
