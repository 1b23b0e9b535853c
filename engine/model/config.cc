#include "engine/model/config.h"

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace tandem::model {
namespace {

using nlohmann::json;

constexpr int64_t kALogPadding = 128;

std::string Show(const json& v) {
  std::string s = v.dump();
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

// Reads typed fields of one JSON object; every error names `where.key`.
class Fields {
 public:
  Fields(const json& obj, std::string where) : obj_(obj), where_(std::move(where)) {}

  std::string Path(absl::string_view key) const {
    return where_.empty() ? std::string(key) : absl::StrCat(where_, ".", key);
  }

  absl::StatusOr<const json*> Required(absl::string_view key) const {
    auto it = obj_.find(std::string(key));
    if (it == obj_.end()) return InvalidArgument("config: missing field ", Path(key));
    return &*it;
  }

  absl::Status Int(absl::string_view key, int64_t* out) const {
    TANDEM_ASSIGN_OR_RETURN(const json* v, Required(key));
    if (!v->is_number_integer()) {
      return InvalidArgument("config: ", Path(key), " must be an integer, got ",
                             Show(*v));
    }
    *out = v->get<int64_t>();
    if (v->is_number_unsigned() &&
        v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      return InvalidArgument("config: ", Path(key), " is out of range: ", Show(*v));
    }
    return absl::OkStatus();
  }

  absl::Status Double(absl::string_view key, double* out) const {
    TANDEM_ASSIGN_OR_RETURN(const json* v, Required(key));
    if (!v->is_number()) {
      return InvalidArgument("config: ", Path(key), " must be a number, got ",
                             Show(*v));
    }
    *out = v->get<double>();
    if (!std::isfinite(*out)) {
      return InvalidArgument("config: ", Path(key), " must be finite, got ", Show(*v));
    }
    return absl::OkStatus();
  }

  absl::Status Bool(absl::string_view key, bool* out) const {
    TANDEM_ASSIGN_OR_RETURN(const json* v, Required(key));
    if (!v->is_boolean()) {
      return InvalidArgument("config: ", Path(key), " must be true or false, got ",
                             Show(*v));
    }
    *out = v->get<bool>();
    return absl::OkStatus();
  }

  absl::Status String(absl::string_view key, std::string* out) const {
    TANDEM_ASSIGN_OR_RETURN(const json* v, Required(key));
    if (!v->is_string()) {
      return InvalidArgument("config: ", Path(key), " must be a string, got ",
                             Show(*v));
    }
    *out = v->get<std::string>();
    return absl::OkStatus();
  }

  absl::Status IntList(absl::string_view key, std::vector<int>* out) const {
    TANDEM_ASSIGN_OR_RETURN(const json* v, Required(key));
    if (!v->is_array()) {
      return InvalidArgument("config: ", Path(key), " must be a list of integers, got ",
                             Show(*v));
    }
    out->clear();
    for (const json& e : *v) {
      if (!e.is_number_integer() || e.get<int64_t>() < INT32_MIN ||
          e.get<int64_t>() > INT32_MAX) {
        return InvalidArgument("config: ", Path(key), " holds ", Show(e),
                               ", not an integer");
      }
      out->push_back(static_cast<int>(e.get<int64_t>()));
    }
    return absl::OkStatus();
  }

  absl::Status StringList(absl::string_view key, std::vector<std::string>* out) const {
    TANDEM_ASSIGN_OR_RETURN(const json* v, Required(key));
    if (!v->is_array()) {
      return InvalidArgument("config: ", Path(key), " must be a list of strings, got ",
                             Show(*v));
    }
    out->clear();
    for (const json& e : *v) {
      if (!e.is_string()) {
        return InvalidArgument("config: ", Path(key), " holds ", Show(e),
                               ", not a string");
      }
      out->push_back(e.get<std::string>());
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Fields> Object(absl::string_view key) const {
    TANDEM_ASSIGN_OR_RETURN(const json* v, Required(key));
    if (!v->is_object()) {
      return InvalidArgument("config: ", Path(key), " must be an object, got ",
                             Show(*v));
    }
    return Fields(*v, Path(key));
  }

  const json& obj() const { return obj_; }
  const std::string& where() const { return where_; }

 private:
  const json& obj_;
  std::string where_;
};

absl::Status ParseLinearAttn(const Fields& f, LinearAttnConfig* c) {
  TANDEM_RETURN_IF_ERROR(f.IntList("full_attn_layers", &c->full_attn_layers));
  TANDEM_RETURN_IF_ERROR(f.Double("gate_lower_bound", &c->gate_lower_bound));
  TANDEM_RETURN_IF_ERROR(f.Int("head_dim", &c->head_dim));
  TANDEM_RETURN_IF_ERROR(f.IntList("kda_layers", &c->kda_layers));
  TANDEM_RETURN_IF_ERROR(f.Int("num_heads", &c->num_heads));
  TANDEM_RETURN_IF_ERROR(f.Int("short_conv_kernel_size", &c->short_conv_kernel_size));
  TANDEM_RETURN_IF_ERROR(f.Bool("use_full_rank_gate", &c->use_full_rank_gate));
  return absl::OkStatus();
}

absl::Status ParseQuantization(const Fields& f, QuantizationConfig* q) {
  TANDEM_RETURN_IF_ERROR(f.String("format", &q->format));
  TANDEM_RETURN_IF_ERROR(f.String("quant_method", &q->quant_method));
  if (f.obj().contains("ignore")) {
    TANDEM_RETURN_IF_ERROR(f.StringList("ignore", &q->ignore));
  }
  TANDEM_ASSIGN_OR_RETURN(Fields groups, f.Object("config_groups"));
  if (groups.obj().size() != 1) {
    return Unimplemented("config: ", groups.where(), " has ", groups.obj().size(),
                         " groups; the engine implements exactly one (MXFP4 experts)");
  }
  q->group_name = groups.obj().begin().key();
  TANDEM_ASSIGN_OR_RETURN(Fields g, groups.Object(q->group_name));
  TANDEM_RETURN_IF_ERROR(g.String("format", &q->group_format));
  TANDEM_RETURN_IF_ERROR(g.StringList("targets", &q->targets));
  auto act = g.obj().find("input_activations");
  if (act != g.obj().end() && !act->is_null()) {
    return Unimplemented("config: ", g.Path("input_activations"), " is ", Show(*act),
                         "; only weight-only quantisation (null) is implemented");
  }
  TANDEM_ASSIGN_OR_RETURN(Fields w, g.Object("weights"));
  TANDEM_RETURN_IF_ERROR(w.Int("num_bits", &q->num_bits));
  TANDEM_RETURN_IF_ERROR(w.Int("group_size", &q->group_size));
  // Optional fields a fuller compressed-tensors config carries: must agree.
  struct Expect {
    const char* key;
    json value;
  };
  const Expect expectations[] = {{"type", "float"},
                                 {"symmetric", true},
                                 {"strategy", "group"},
                                 {"dynamic", false}};
  for (const Expect& e : expectations) {
    auto it = w.obj().find(e.key);
    if (it != w.obj().end() && *it != e.value) {
      return Unimplemented("config: ", w.Path(e.key), " is ", Show(*it),
                           "; the engine implements ", Show(e.value));
    }
  }
  for (const char* key : {"actorder", "block_structure"}) {
    auto it = w.obj().find(key);
    if (it != w.obj().end() && !it->is_null()) {
      return Unimplemented("config: ", w.Path(key), " is ", Show(*it),
                           "; permuted or blocked layouts are not implemented");
    }
  }
  auto status_it = f.obj().find("quantization_status");
  if (status_it != f.obj().end() && *status_it != "compressed") {
    return Unimplemented("config: ", f.Path("quantization_status"), " is ",
                         Show(*status_it), "; only \"compressed\" is implemented");
  }
  return absl::OkStatus();
}

absl::Status ParseText(const Fields& f, TextConfig* t) {
  TANDEM_RETURN_IF_ERROR(f.Double("activation_situ_beta", &t->activation_situ_beta));
  TANDEM_RETURN_IF_ERROR(
      f.Double("activation_situ_linear_beta", &t->activation_situ_linear_beta));
  TANDEM_RETURN_IF_ERROR(f.Int("attn_res_block_size", &t->attn_res_block_size));
  TANDEM_RETURN_IF_ERROR(f.Int("eos_token_id", &t->eos_token_id));
  TANDEM_RETURN_IF_ERROR(f.Int("first_k_dense_replace", &t->first_k_dense_replace));
  TANDEM_RETURN_IF_ERROR(f.String("hidden_act", &t->hidden_act));
  TANDEM_RETURN_IF_ERROR(f.Int("hidden_size", &t->hidden_size));
  TANDEM_RETURN_IF_ERROR(f.Int("intermediate_size", &t->intermediate_size));
  TANDEM_RETURN_IF_ERROR(f.Int("kv_lora_rank", &t->kv_lora_rank));
  TANDEM_RETURN_IF_ERROR(f.Bool("latent_moe_use_norm", &t->latent_moe_use_norm));
  TANDEM_ASSIGN_OR_RETURN(Fields lac, f.Object("linear_attn_config"));
  TANDEM_RETURN_IF_ERROR(ParseLinearAttn(lac, &t->linear_attn_config));
  TANDEM_RETURN_IF_ERROR(f.Int("max_position_embeddings", &t->max_position_embeddings));
  TANDEM_RETURN_IF_ERROR(f.Bool("mla_use_nope", &t->mla_use_nope));
  TANDEM_RETURN_IF_ERROR(f.Bool("mla_use_output_gate", &t->mla_use_output_gate));
  TANDEM_RETURN_IF_ERROR(f.String("model_type", &t->model_type));
  TANDEM_RETURN_IF_ERROR(f.Int("moe_intermediate_size", &t->moe_intermediate_size));
  TANDEM_RETURN_IF_ERROR(f.Int("moe_layer_freq", &t->moe_layer_freq));
  TANDEM_RETURN_IF_ERROR(f.Bool("moe_renormalize", &t->moe_renormalize));
  TANDEM_RETURN_IF_ERROR(
      f.String("moe_router_activation_func", &t->moe_router_activation_func));
  TANDEM_RETURN_IF_ERROR(f.Int("num_attention_heads", &t->num_attention_heads));
  TANDEM_RETURN_IF_ERROR(f.Int("num_expert_group", &t->num_expert_group));
  TANDEM_RETURN_IF_ERROR(f.Int("num_experts", &t->num_experts));
  TANDEM_RETURN_IF_ERROR(f.Int("num_experts_per_token", &t->num_experts_per_token));
  TANDEM_RETURN_IF_ERROR(f.Int("num_hidden_layers", &t->num_hidden_layers));
  TANDEM_RETURN_IF_ERROR(f.Int("num_key_value_heads", &t->num_key_value_heads));
  TANDEM_RETURN_IF_ERROR(
      f.Int("num_nextn_predict_layers", &t->num_nextn_predict_layers));
  TANDEM_RETURN_IF_ERROR(f.Int("num_shared_experts", &t->num_shared_experts));
  TANDEM_RETURN_IF_ERROR(f.Int("q_lora_rank", &t->q_lora_rank));
  TANDEM_RETURN_IF_ERROR(f.Int("qk_nope_head_dim", &t->qk_nope_head_dim));
  TANDEM_RETURN_IF_ERROR(f.Int("qk_rope_head_dim", &t->qk_rope_head_dim));
  TANDEM_ASSIGN_OR_RETURN(Fields quant, f.Object("quantization_config"));
  TANDEM_RETURN_IF_ERROR(ParseQuantization(quant, &t->quantization_config));
  TANDEM_RETURN_IF_ERROR(f.Double("rms_norm_eps", &t->rms_norm_eps));
  TANDEM_RETURN_IF_ERROR(
      f.Int("routed_expert_hidden_size", &t->routed_expert_hidden_size));
  TANDEM_RETURN_IF_ERROR(f.Double("routed_scaling_factor", &t->routed_scaling_factor));
  TANDEM_RETURN_IF_ERROR(f.Bool("tie_word_embeddings", &t->tie_word_embeddings));
  TANDEM_RETURN_IF_ERROR(f.Int("topk_group", &t->topk_group));
  TANDEM_RETURN_IF_ERROR(f.Bool("use_grouped_topk", &t->use_grouped_topk));
  TANDEM_RETURN_IF_ERROR(f.Int("v_head_dim", &t->v_head_dim));
  TANDEM_RETURN_IF_ERROR(f.Int("vocab_size", &t->vocab_size));
  return absl::OkStatus();
}

// Collects every problem; Unimplemented wins over InvalidArgument when only
// unsupported-feature problems are present.
class Problems {
 public:
  void Invalid(std::string s) { invalid_.push_back(std::move(s)); }
  void Unsupported(std::string s) { unsupported_.push_back(std::move(s)); }
  absl::Status ToStatus() const {
    if (invalid_.empty() && unsupported_.empty()) return absl::OkStatus();
    std::vector<std::string> all = invalid_;
    for (const std::string& s : unsupported_) all.push_back(s + " (not implemented)");
    std::string msg = absl::StrCat("config: ", absl::StrJoin(all, "; "));
    if (invalid_.empty()) return absl::UnimplementedError(msg);
    return absl::InvalidArgumentError(msg);
  }

 private:
  std::vector<std::string> invalid_;
  std::vector<std::string> unsupported_;
};

}  // namespace

absl::Status ValidateModelConfig(const ModelConfig& c) {
  Problems p;
  const TextConfig& t = c.text;
  const LinearAttnConfig& la = t.linear_attn_config;
  const QuantizationConfig& q = t.quantization_config;

  auto positive = [&](absl::string_view name, int64_t v) {
    if (v <= 0) p.Invalid(absl::StrCat(name, " must be > 0, got ", v));
  };
  positive("text_config.hidden_size", t.hidden_size);
  positive("text_config.intermediate_size", t.intermediate_size);
  positive("text_config.vocab_size", t.vocab_size);
  positive("text_config.num_hidden_layers", t.num_hidden_layers);
  positive("text_config.num_attention_heads", t.num_attention_heads);
  positive("text_config.num_key_value_heads", t.num_key_value_heads);
  positive("text_config.q_lora_rank", t.q_lora_rank);
  positive("text_config.kv_lora_rank", t.kv_lora_rank);
  positive("text_config.qk_nope_head_dim", t.qk_nope_head_dim);
  positive("text_config.qk_rope_head_dim", t.qk_rope_head_dim);
  positive("text_config.v_head_dim", t.v_head_dim);
  positive("text_config.max_position_embeddings", t.max_position_embeddings);
  positive("text_config.attn_res_block_size", t.attn_res_block_size);
  positive("text_config.moe_intermediate_size", t.moe_intermediate_size);
  positive("text_config.routed_expert_hidden_size", t.routed_expert_hidden_size);
  positive("text_config.num_experts", t.num_experts);
  positive("text_config.num_experts_per_token", t.num_experts_per_token);
  positive("text_config.num_shared_experts", t.num_shared_experts);
  positive("text_config.linear_attn_config.num_heads", la.num_heads);
  positive("text_config.linear_attn_config.head_dim", la.head_dim);
  positive("text_config.linear_attn_config.short_conv_kernel_size",
           la.short_conv_kernel_size);
  positive("text_config.moe_layer_freq", t.moe_layer_freq);

  if (c.model_type != "kimi_k3") {
    p.Invalid(
        absl::StrCat("model_type must be \"kimi_k3\", got \"", c.model_type, "\""));
  }
  if (t.model_type != "kimi_linear") {
    p.Invalid(absl::StrCat("text_config.model_type must be \"kimi_linear\", got \"",
                           t.model_type, "\""));
  }
  if (c.architectures.empty()) p.Invalid("architectures is empty");
  if (!(t.rms_norm_eps > 0)) {
    p.Invalid(
        absl::StrCat("text_config.rms_norm_eps must be > 0, got ", t.rms_norm_eps));
  }
  if (!(t.routed_scaling_factor > 0)) {
    p.Invalid(absl::StrCat("text_config.routed_scaling_factor must be > 0, got ",
                           t.routed_scaling_factor));
  }
  if (!(t.activation_situ_beta > 0)) {
    p.Invalid(absl::StrCat("text_config.activation_situ_beta must be > 0, got ",
                           t.activation_situ_beta));
  }
  if (!(t.activation_situ_linear_beta > 0)) {
    p.Invalid(absl::StrCat("text_config.activation_situ_linear_beta must be > 0, got ",
                           t.activation_situ_linear_beta));
  }
  if (!(la.gate_lower_bound < 0)) {
    p.Invalid(
        absl::StrCat("text_config.linear_attn_config.gate_lower_bound must be < 0, "
                     "got ",
                     la.gate_lower_bound));
  }

  // Token ids inside the vocabulary.
  if (t.vocab_size > 0) {
    const std::pair<const char*, int64_t> ids[] = {
        {"bos_token_id", c.bos_token_id},
        {"eos_token_id", c.eos_token_id},
        {"pad_token_id", c.pad_token_id},
        {"media_placeholder_token_id", c.media_placeholder_token_id},
        {"text_config.eos_token_id", t.eos_token_id}};
    for (const auto& [name, id] : ids) {
      if (id < 0 || id >= t.vocab_size) {
        p.Invalid(absl::StrCat(name, " ", id, " is outside the vocabulary [0, ",
                               t.vocab_size, ")"));
      }
    }
  }

  // MoE shape rules.
  if (t.num_experts > 0 && t.num_experts_per_token > t.num_experts) {
    p.Invalid(absl::StrCat("text_config.num_experts_per_token ",
                           t.num_experts_per_token, " exceeds num_experts ",
                           t.num_experts));
  }
  if (t.first_k_dense_replace < 0 || t.first_k_dense_replace > t.num_hidden_layers) {
    p.Invalid(absl::StrCat("text_config.first_k_dense_replace ",
                           t.first_k_dense_replace,
                           " is outside [0, num_hidden_layers]"));
  }
  if (t.num_key_value_heads != t.num_attention_heads) {
    p.Unsupported(absl::StrCat("text_config.num_key_value_heads ",
                               t.num_key_value_heads, " != num_attention_heads ",
                               t.num_attention_heads));
  }

  // Quantisation: MXFP4 experts, group 32, 4 bits.
  if (q.quant_method != "compressed-tensors") {
    p.Unsupported(absl::StrCat("text_config.quantization_config.quant_method \"",
                               q.quant_method, "\""));
  }
  if (q.format != "mxfp4-pack-quantized") {
    p.Unsupported(
        absl::StrCat("text_config.quantization_config.format \"", q.format, "\""));
  }
  if (q.group_format != "mxfp4-pack-quantized") {
    p.Unsupported(absl::StrCat("text_config.quantization_config.config_groups.",
                               q.group_name, ".format \"", q.group_format, "\""));
  }
  if (q.num_bits != 4) {
    p.Unsupported(absl::StrCat("text_config.quantization_config.config_groups.",
                               q.group_name, ".weights.num_bits ", q.num_bits));
  }
  if (q.group_size != 32) {
    p.Unsupported(absl::StrCat("text_config.quantization_config.config_groups.",
                               q.group_name, ".weights.group_size ", q.group_size));
  }
  if (q.group_size > 0) {
    const std::pair<const char*, int64_t> dims[] = {
        {"text_config.routed_expert_hidden_size", t.routed_expert_hidden_size},
        {"text_config.moe_intermediate_size", t.moe_intermediate_size}};
    for (const auto& [name, d] : dims) {
      if (d > 0 && d % q.group_size != 0) {
        p.Invalid(absl::StrCat(
            name, " ", d, " is not a multiple of the MXFP4 group size ", q.group_size));
      }
    }
  }

  // Features the engine does not implement.
  if (!t.mla_use_nope) p.Unsupported("text_config.mla_use_nope false (rotary MLA)");
  if (!t.mla_use_output_gate) {
    p.Unsupported("text_config.mla_use_output_gate false (MLA without g_proj)");
  }
  if (!t.latent_moe_use_norm) {
    p.Unsupported("text_config.latent_moe_use_norm false (LatentMoE without norm)");
  }
  if (t.num_expert_group != 1) {
    p.Unsupported(absl::StrCat("text_config.num_expert_group ", t.num_expert_group,
                               " (grouped top-k routing)"));
  }
  if (t.topk_group != 1) {
    p.Unsupported(absl::StrCat("text_config.topk_group ", t.topk_group,
                               " (grouped top-k routing)"));
  }
  if (t.hidden_act != "situ") {
    p.Unsupported(absl::StrCat("text_config.hidden_act \"", t.hidden_act, "\""));
  }
  if (t.moe_router_activation_func != "sigmoid") {
    p.Unsupported(absl::StrCat("text_config.moe_router_activation_func \"",
                               t.moe_router_activation_func, "\""));
  }
  if (t.num_nextn_predict_layers != 0) {
    p.Unsupported(absl::StrCat("text_config.num_nextn_predict_layers ",
                               t.num_nextn_predict_layers,
                               " (multi-token prediction)"));
  }
  if (!la.use_full_rank_gate) {
    p.Unsupported(
        "text_config.linear_attn_config.use_full_rank_gate false (low-rank gate)");
  }
  if (t.moe_layer_freq > 1) {
    p.Unsupported(absl::StrCat("text_config.moe_layer_freq ", t.moe_layer_freq));
  }
  if (c.tie_word_embeddings || t.tie_word_embeddings) {
    p.Unsupported("tie_word_embeddings true (lm_head shared with embed_tokens)");
  }

  // Layer lists: 1-based, disjoint, covering 1..L exactly, last layer MLA.
  if (t.num_hidden_layers > 0) {
    const int64_t n = t.num_hidden_layers;
    std::set<int> seen;
    auto check = [&](const std::vector<int>& list, const char* name) {
      for (int l : list) {
        if (l < 1 || l > n) {
          p.Invalid(absl::StrCat("text_config.linear_attn_config.", name, " holds ", l,
                                 ", outside 1..", n, " (the lists are 1-based)"));
        } else if (!seen.insert(l).second) {
          p.Invalid(
              absl::StrCat("text_config.linear_attn_config.", name, " repeats layer ",
                           l, " (kda_layers and full_attn_layers must be disjoint)"));
        }
      }
    };
    check(la.kda_layers, "kda_layers");
    check(la.full_attn_layers, "full_attn_layers");
    if (static_cast<int64_t>(seen.size()) != n) {
      std::vector<int> missing;
      for (int l = 1; l <= n && missing.size() < 8; ++l) {
        if (!seen.count(l)) missing.push_back(l);
      }
      if (!missing.empty()) {
        p.Invalid(
            absl::StrCat("text_config.linear_attn_config: kda_layers and "
                         "full_attn_layers do not cover "
                         "layers 1..",
                         n, "; missing ", absl::StrJoin(missing, ",")));
      }
    }
    bool last_mla = false;
    for (int l : la.full_attn_layers) last_mla |= (l == n);
    if (!last_mla) {
      p.Invalid(absl::StrCat("text_config.linear_attn_config: the last layer (", n,
                             ") must be MLA (in full_attn_layers)"));
    }
  }
  return p.ToStatus();
}

absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text) {
  json root = json::parse(json_text.begin(), json_text.end(), nullptr,
                          /*allow_exceptions=*/false);
  if (root.is_discarded()) return InvalidArgument("config: JSON does not parse");
  if (!root.is_object()) return InvalidArgument("config: JSON is not an object");
  ModelConfig c;
  Fields f(root, "");
  TANDEM_RETURN_IF_ERROR(f.StringList("architectures", &c.architectures));
  TANDEM_RETURN_IF_ERROR(f.Int("bos_token_id", &c.bos_token_id));
  TANDEM_RETURN_IF_ERROR(f.Int("eos_token_id", &c.eos_token_id));
  TANDEM_RETURN_IF_ERROR(
      f.Int("media_placeholder_token_id", &c.media_placeholder_token_id));
  TANDEM_RETURN_IF_ERROR(f.String("model_type", &c.model_type));
  TANDEM_RETURN_IF_ERROR(f.Int("pad_token_id", &c.pad_token_id));
  TANDEM_RETURN_IF_ERROR(f.Bool("tie_word_embeddings", &c.tie_word_embeddings));
  TANDEM_ASSIGN_OR_RETURN(Fields text, f.Object("text_config"));
  TANDEM_RETURN_IF_ERROR(ParseText(text, &c.text));
  auto vision = root.find("vision_config");
  if (vision != root.end()) c.vision_config_json = vision->dump();
  TANDEM_RETURN_IF_ERROR(ValidateModelConfig(c));
  return c;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound(path, ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  absl::StatusOr<ModelConfig> config = ParseModelConfig(ss.str());
  if (!config.ok()) return Annotate(config.status(), path);
  return config;
}

std::string ModelConfig::ToJson() const {
  const TextConfig& t = text;
  const LinearAttnConfig& la = t.linear_attn_config;
  const QuantizationConfig& q = t.quantization_config;
  json lac = {{"full_attn_layers", la.full_attn_layers},
              {"gate_lower_bound", la.gate_lower_bound},
              {"head_dim", la.head_dim},
              {"kda_layers", la.kda_layers},
              {"num_heads", la.num_heads},
              {"short_conv_kernel_size", la.short_conv_kernel_size},
              {"use_full_rank_gate", la.use_full_rank_gate}};
  json group = {{"format", q.group_format},
                {"targets", q.targets},
                {"input_activations", nullptr},
                {"weights", {{"num_bits", q.num_bits}, {"group_size", q.group_size}}}};
  json quant = {{"format", q.format},
                {"quant_method", q.quant_method},
                {"ignore", q.ignore},
                {"config_groups", {{q.group_name, group}}}};
  json tc = {{"activation_situ_beta", t.activation_situ_beta},
             {"activation_situ_linear_beta", t.activation_situ_linear_beta},
             {"attn_res_block_size", t.attn_res_block_size},
             {"eos_token_id", t.eos_token_id},
             {"first_k_dense_replace", t.first_k_dense_replace},
             {"hidden_act", t.hidden_act},
             {"hidden_size", t.hidden_size},
             {"intermediate_size", t.intermediate_size},
             {"kv_lora_rank", t.kv_lora_rank},
             {"latent_moe_use_norm", t.latent_moe_use_norm},
             {"linear_attn_config", lac},
             {"max_position_embeddings", t.max_position_embeddings},
             {"mla_use_nope", t.mla_use_nope},
             {"mla_use_output_gate", t.mla_use_output_gate},
             {"model_type", t.model_type},
             {"moe_intermediate_size", t.moe_intermediate_size},
             {"moe_layer_freq", t.moe_layer_freq},
             {"moe_renormalize", t.moe_renormalize},
             {"moe_router_activation_func", t.moe_router_activation_func},
             {"num_attention_heads", t.num_attention_heads},
             {"num_expert_group", t.num_expert_group},
             {"num_experts", t.num_experts},
             {"num_experts_per_token", t.num_experts_per_token},
             {"num_hidden_layers", t.num_hidden_layers},
             {"num_key_value_heads", t.num_key_value_heads},
             {"num_nextn_predict_layers", t.num_nextn_predict_layers},
             {"num_shared_experts", t.num_shared_experts},
             {"q_lora_rank", t.q_lora_rank},
             {"qk_nope_head_dim", t.qk_nope_head_dim},
             {"qk_rope_head_dim", t.qk_rope_head_dim},
             {"quantization_config", quant},
             {"rms_norm_eps", t.rms_norm_eps},
             {"routed_expert_hidden_size", t.routed_expert_hidden_size},
             {"routed_scaling_factor", t.routed_scaling_factor},
             {"tie_word_embeddings", t.tie_word_embeddings},
             {"topk_group", t.topk_group},
             {"use_grouped_topk", t.use_grouped_topk},
             {"v_head_dim", t.v_head_dim},
             {"vocab_size", t.vocab_size}};
  json root = {{"architectures", architectures},
               {"bos_token_id", bos_token_id},
               {"eos_token_id", eos_token_id},
               {"media_placeholder_token_id", media_placeholder_token_id},
               {"model_type", model_type},
               {"pad_token_id", pad_token_id},
               {"tie_word_embeddings", tie_word_embeddings},
               {"text_config", tc}};
  if (!vision_config_json.empty()) {
    json vision = json::parse(vision_config_json, nullptr, /*allow_exceptions=*/false);
    if (!vision.is_discarded()) root["vision_config"] = vision;
  }
  return root.dump(2) + "\n";
}

std::vector<LayerSpec> ModelConfig::Layers() const {
  std::vector<LayerSpec> layers;
  for (int i = 0; i < text.num_hidden_layers; ++i) {
    LayerSpec l;
    l.index = i;
    l.attention = IsKda(i) ? AttentionKind::kKda : AttentionKind::kMla;
    l.ffn = i < text.first_k_dense_replace ? FfnKind::kDense : FfnKind::kMoe;
    l.starts_res_block =
        text.attn_res_block_size > 0 && i % text.attn_res_block_size == 0;
    layers.push_back(l);
  }
  return layers;
}

bool ModelConfig::IsKda(int layer) const {
  for (int l : text.linear_attn_config.kda_layers) {
    if (l == layer + 1) return true;
  }
  return false;
}

int ModelConfig::NumKdaLayers() const {
  int n = 0;
  for (int i = 0; i < text.num_hidden_layers; ++i) n += IsKda(i) ? 1 : 0;
  return n;
}

int ModelConfig::NumMoeLayers() const {
  int n = 0;
  for (const LayerSpec& l : Layers()) n += l.ffn == FfnKind::kMoe;
  return n;
}

int ModelConfig::NumMlaLayers() const {
  return static_cast<int>(text.num_hidden_layers) - NumKdaLayers();
}

int ModelConfig::NumResBlocks() const {
  if (text.attn_res_block_size <= 0) return 0;
  return static_cast<int>((text.num_hidden_layers + text.attn_res_block_size - 1) /
                          text.attn_res_block_size);
}

int64_t ModelConfig::KdaProjectionSize() const {
  return text.linear_attn_config.num_heads * text.linear_attn_config.head_dim;
}

int64_t ModelConfig::ALogPaddedLength() const {
  const int64_t h = text.linear_attn_config.num_heads;
  return (h + kALogPadding - 1) / kALogPadding * kALogPadding;
}

int64_t ModelConfig::KdaRecurrentStateBytes() const {
  const int64_t d = text.linear_attn_config.head_dim;
  return text.linear_attn_config.num_heads * d * d * 4;
}

int64_t ModelConfig::KdaConvStateBytes() const {
  return 3 * (text.linear_attn_config.short_conv_kernel_size - 1) *
         KdaProjectionSize() * 4;
}

int64_t ModelConfig::KdaStateBytesPerSequence() const {
  return KdaRecurrentStateBytes() + KdaConvStateBytes();
}

int64_t ModelConfig::MlaCacheValuesPerToken() const {
  return text.kv_lora_rank + text.qk_rope_head_dim;
}

int64_t ModelConfig::MlaCacheBytesPerToken() const {
  return MlaCacheValuesPerToken() * 2;
}

int64_t ModelConfig::QHeadDim() const {
  return text.qk_nope_head_dim + text.qk_rope_head_dim;
}

}  // namespace tandem::model
