#include "engine/model/make_checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/splitmix.h"
#include "common/status.h"
#include "engine/model/bf16.h"
#include "engine/model/mxfp4.h"
#include "engine/model/vision_config.h"
#include "nlohmann/json.hpp"

namespace tandem::model {
namespace {

// The generator's weight stream: SplitMix64 (common/splitmix.h) with the
// float draws the initialisers need.
class WeightRng {
 public:
  explicit WeightRng(uint64_t seed) : mix_(seed) {}
  uint64_t Next() { return mix_.Next(); }
  // Uniform in [0, 1) with 24 bits.
  float Uniform() { return static_cast<float>(Next() >> 40) * 0x1.0p-24f; }
  // Approximately N(0, 1): sum of four 16-bit uniforms in (0, 1), centred and
  // scaled to unit variance (Irwin–Hall, n = 4: variance 1/3).
  float Normal() {
    const uint64_t r = Next();
    float sum = 0.0f;
    for (int i = 0; i < 4; ++i) {
      sum += (static_cast<float>((r >> (16 * i)) & 0xffff) + 0.5f) * 0x1.0p-16f;
    }
    return (sum - 2.0f) * 1.7320508f;
  }

 private:
  SplitMix64 mix_;
};

uint64_t StreamSeed(uint64_t seed, absl::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (char c : name) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return SplitMix64(seed ^ h).Next();
}

std::string Bf16Bytes(const std::vector<float>& values) {
  std::string out(values.size() * 2, '\0');
  for (size_t i = 0; i < values.size(); ++i) {
    uint16_t b = FloatToBf16(values[i]);
    std::memcpy(&out[2 * i], &b, 2);
  }
  return out;
}

std::string F32Bytes(const std::vector<float>& values) {
  std::string out(values.size() * 4, '\0');
  std::memcpy(out.data(), values.data(), out.size());
  return out;
}

uint64_t Elements(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

// The float matrix behind a routed expert projection, quantised to MXFP4.
absl::Status ExpertWeight(const ExpectedTensor& t, uint64_t seed,
                          std::vector<uint8_t>* packed, std::vector<uint8_t>* scales) {
  // Both halves of the pair use the stream of the projection's base name.
  absl::string_view base = t.name;
  const size_t dot = base.rfind('.');
  base = base.substr(0, dot);
  const int64_t rows = t.shape[0];
  const int64_t in = t.kind == TensorKind::kMxfp4Packed ? t.shape[1] * 2
                                                        : t.shape[1] * kMxfp4GroupSize;
  WeightRng rng(StreamSeed(seed, base));
  const float sigma = 1.0f / std::sqrt(static_cast<float>(in));
  std::vector<float> w(static_cast<size_t>(rows * in));
  for (float& x : w) x = rng.Normal() * sigma;
  return QuantizeMxfp4(w, rows, in, packed, scales);
}

absl::Status EnsureDir(const std::string& dir) {
  if (dir.empty()) return InvalidArgument("output directory is empty");
  std::string partial;
  for (size_t i = 0; i <= dir.size(); ++i) {
    if (i == dir.size() || dir[i] == '/') {
      if (!partial.empty() && ::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
        return Internal(partial, ": mkdir: ", std::strerror(errno));
      }
    }
    if (i < dir.size()) partial.push_back(dir[i]);
  }
  return absl::OkStatus();
}

absl::Status WriteText(const std::string& path, absl::string_view text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return Internal(path, ": cannot create: ", std::strerror(errno));
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  out.close();
  if (!out) return Internal(path, ": write failed");
  return absl::OkStatus();
}

absl::Status CopyFile(const std::string& from, const std::string& to) {
  std::ifstream in(from, std::ios::binary);
  if (!in) return NotFound(from, ": cannot open: ", std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  return WriteText(to, ss.str());
}

std::string ShardName(int i, int n) {
  return absl::StrFormat("model-%05d-of-%05d.safetensors", i + 1, n);
}

// Salt of the vision tensors' PRNG streams.
constexpr uint64_t kVisionStream = 0x5649534e544f5752ull;  // "VISNTOWR"

constexpr const char* kTokenizerFiles[] = {"tiktoken.model", "tokenizer_config.json",
                                           "pat_str.json"};

}  // namespace

ModelConfig PublishedK3Config() {
  ModelConfig c;
  c.architectures = {"KimiK3ForConditionalGeneration"};
  c.bos_token_id = 163584;
  c.eos_token_id = 163586;
  c.media_placeholder_token_id = 163605;
  c.model_type = "kimi_k3";
  c.pad_token_id = 163839;
  c.tie_word_embeddings = false;
  c.vision_config_json = PublishedVisionConfig().ToJson();
  TextConfig& t = c.text;
  t.activation_situ_beta = 4.0;
  t.activation_situ_linear_beta = 25.0;
  t.attn_res_block_size = 12;
  t.eos_token_id = 163586;
  t.first_k_dense_replace = 1;
  t.hidden_act = "situ";
  t.hidden_size = 7168;
  t.intermediate_size = 33792;
  t.kv_lora_rank = 512;
  t.latent_moe_use_norm = true;
  t.max_position_embeddings = 1048576;
  t.mla_use_nope = true;
  t.mla_use_output_gate = true;
  t.model_type = "kimi_linear";
  t.moe_intermediate_size = 3072;
  t.moe_layer_freq = 1;
  t.moe_renormalize = true;
  t.moe_router_activation_func = "sigmoid";
  t.num_attention_heads = 96;
  t.num_expert_group = 1;
  t.num_experts = 896;
  t.num_experts_per_token = 16;
  t.num_hidden_layers = 93;
  t.num_key_value_heads = 96;
  t.num_nextn_predict_layers = 0;
  t.num_shared_experts = 2;
  t.q_lora_rank = 1536;
  t.qk_nope_head_dim = 128;
  t.qk_rope_head_dim = 64;
  t.rms_norm_eps = 1e-5;
  t.routed_expert_hidden_size = 3584;
  t.routed_scaling_factor = 1.0;
  t.tie_word_embeddings = false;
  t.topk_group = 1;
  t.use_grouped_topk = true;
  t.v_head_dim = 128;
  t.vocab_size = 163840;
  LinearAttnConfig& la = t.linear_attn_config;
  la.full_attn_layers.clear();
  la.kda_layers.clear();
  for (int l = 1; l <= 93; ++l) {
    if (l % 4 == 0 || l == 93) {
      la.full_attn_layers.push_back(l);
    } else {
      la.kda_layers.push_back(l);
    }
  }
  la.gate_lower_bound = -5.0;
  la.head_dim = 128;
  la.num_heads = 96;
  la.short_conv_kernel_size = 4;
  la.use_full_rank_gate = true;
  QuantizationConfig& q = t.quantization_config;
  q.format = "mxfp4-pack-quantized";
  q.quant_method = "compressed-tensors";
  q.ignore = {"re:.*shared_experts.*"};
  q.group_name = "group_0";
  q.group_format = "mxfp4-pack-quantized";
  q.targets = {"Linear"};
  q.num_bits = 4;
  q.group_size = 32;
  return c;
}

namespace {

// Layers 1..n (1-based): MLA every `period`-th layer and the last; KDA otherwise.
void SetLayerKinds(ModelConfig* c, int n, int period) {
  LinearAttnConfig& la = c->text.linear_attn_config;
  la.full_attn_layers.clear();
  la.kda_layers.clear();
  for (int l = 1; l <= n; ++l) {
    if (l % period == 0 || l == n) {
      la.full_attn_layers.push_back(l);
    } else {
      la.kda_layers.push_back(l);
    }
  }
  c->text.num_hidden_layers = n;
}

}  // namespace

ModelConfig TinyConfig() {
  ModelConfig c = PublishedK3Config();
  TextConfig& t = c.text;
  SetLayerKinds(&c, /*n=*/8, /*period=*/4);  // MLA at 4 and 8 (1-based)
  t.attn_res_block_size = 3;                 // blocks start at layers 0, 3, 6
  t.hidden_size = 64;
  t.intermediate_size = 128;
  t.max_position_embeddings = 1048576;  // K3's context, as the published config
  t.linear_attn_config.num_heads = 4;
  t.linear_attn_config.head_dim = 16;
  t.num_attention_heads = 4;
  t.num_key_value_heads = 4;
  t.q_lora_rank = 32;
  t.kv_lora_rank = 32;
  t.qk_nope_head_dim = 16;
  t.qk_rope_head_dim = 8;
  t.v_head_dim = 16;
  t.num_experts = 16;
  t.num_experts_per_token = 4;
  t.moe_intermediate_size = 64;
  t.routed_expert_hidden_size = 32;
  t.num_shared_experts = 2;
  t.routed_scaling_factor = 2.5;
  c.vision_config_json = TinyVisionConfig(t.hidden_size).ToJson();
  return c;
}

ModelConfig MidConfig() {
  ModelConfig c = PublishedK3Config();
  TextConfig& t = c.text;
  SetLayerKinds(&c, /*n=*/16, /*period=*/4);
  t.attn_res_block_size = 4;
  t.hidden_size = 1024;
  t.intermediate_size = 2816;
  t.max_position_embeddings = 1048576;  // K3's context, as the published config
  t.linear_attn_config.num_heads = 8;
  t.linear_attn_config.head_dim = 128;
  t.num_attention_heads = 8;
  t.num_key_value_heads = 8;
  t.q_lora_rank = 384;
  t.kv_lora_rank = 256;
  t.qk_nope_head_dim = 64;
  t.qk_rope_head_dim = 32;
  t.v_head_dim = 64;
  t.num_experts = 64;
  t.num_experts_per_token = 8;
  t.moe_intermediate_size = 512;
  t.routed_expert_hidden_size = 512;
  t.num_shared_experts = 2;
  t.routed_scaling_factor = 2.5;
  c.vision_config_json = MidVisionConfig(t.hidden_size).ToJson();
  return c;
}

absl::StatusOr<ModelConfig> ConfigForSize(absl::string_view size) {
  if (size == "tiny") return TinyConfig();
  if (size == "mid") return MidConfig();
  return InvalidArgument("--size must be tiny or mid, got \"", size, "\"");
}

std::vector<std::string> CheckpointFileNames(int num_shards) {
  std::vector<std::string> names = {"config.json", "generation_config.json",
                                    "model.safetensors.index.json"};
  for (int i = 0; i < num_shards; ++i) names.push_back(ShardName(i, num_shards));
  for (const char* f : kTokenizerFiles) names.push_back(f);
  return names;
}

absl::StatusOr<TensorData> GenerateTensor(const ModelConfig& config,
                                          const ExpectedTensor& tensor, uint64_t seed) {
  TensorData out;
  out.name = tensor.name;
  out.dtype = tensor.dtype;
  out.shape = tensor.shape;
  const uint64_t n = Elements(tensor.shape);
  if (IsVisionTensor(tensor.name)) {
    // The vision tensors: their own stream family (seed ^ kVisionStream), so
    // adding them left every text tensor's bytes as they were.
    WeightRng vrng(StreamSeed(seed ^ kVisionStream, tensor.name));
    std::vector<float> w(n);
    float sigma = 0.0f;
    switch (tensor.kind) {
      case TensorKind::kNorm:
        for (float& x : w) x = 1.0f + 0.1f * vrng.Normal();
        return TensorData{out.name, out.dtype, out.shape, Bf16Bytes(w)};
      case TensorKind::kEmbedding:  // the position table
        sigma = 0.1f;
        break;
      default: {
        // [out, in] or [D, 3, p, p]: fan_in = every dimension but the first.
        const uint64_t fan_in = tensor.shape.empty() ? 1 : n / tensor.shape[0];
        sigma = 1.0f / std::sqrt(static_cast<float>(std::max<uint64_t>(1, fan_in)));
      }
    }
    for (float& x : w) x = vrng.Normal() * sigma;
    return TensorData{out.name, out.dtype, out.shape, Bf16Bytes(w)};
  }
  WeightRng rng(StreamSeed(seed, tensor.name));
  std::vector<float> v;
  auto normal = [&](float sigma) {
    v.resize(n);
    for (float& x : v) x = rng.Normal() * sigma;
  };
  const int64_t last = tensor.shape.empty() ? 1 : tensor.shape.back();
  switch (tensor.kind) {
    case TensorKind::kEmbedding:
      normal(1.0f);
      break;
    case TensorKind::kLmHead:
    case TensorKind::kMatrix:
      normal(1.0f / std::sqrt(static_cast<float>(last)));
      break;
    case TensorKind::kNorm:
      normal(0.02f);
      for (float& x : v) x += 1.0f;
      break;
    case TensorKind::kResProj:
      normal(1.0f / std::sqrt(static_cast<float>(config.text.hidden_size)));
      break;
    case TensorKind::kConv: {
      const float bound = 1.0f / std::sqrt(static_cast<float>(last));
      v.resize(n);
      for (float& x : v) x = (2.0f * rng.Uniform() - 1.0f) * bound;
      break;
    }
    case TensorKind::kALog: {
      v.assign(n, 0.0f);
      const int64_t h = config.text.linear_attn_config.num_heads;
      for (int64_t i = 0; i < h && i < static_cast<int64_t>(n); ++i) {
        v[i] = std::log(1.0f + 15.0f * rng.Uniform());
      }
      break;
    }
    case TensorKind::kDtBias: {
      v.resize(n);
      const float lo = std::log(1e-3f), hi = std::log(1e-1f);
      for (float& x : v) {
        const float dt = std::exp(lo + (hi - lo) * rng.Uniform());
        x = dt + std::log(-std::expm1(-dt));  // softplus(x) == dt
      }
      break;
    }
    case TensorKind::kRouterBias:
      v.resize(n);
      for (float& x : v) {
        x = (2.0f * rng.Uniform() - 1.0f) * 0.1f;
        if (x == 0.0f) x = 0x1.0p-10f;
      }
      break;
    case TensorKind::kMxfp4Packed:
    case TensorKind::kMxfp4Scale: {
      std::vector<uint8_t> packed, scales;
      TANDEM_RETURN_IF_ERROR(ExpertWeight(tensor, seed, &packed, &scales));
      const std::vector<uint8_t>& mine =
          tensor.kind == TensorKind::kMxfp4Packed ? packed : scales;
      out.bytes.assign(mine.begin(), mine.end());
      return out;
    }
  }
  switch (tensor.dtype) {
    case DType::kBF16:
      out.bytes = Bf16Bytes(v);
      break;
    case DType::kF32:
      out.bytes = F32Bytes(v);
      break;
    default:
      return Internal("generator: tensor '", tensor.name, "' has unexpected dtype ",
                      DTypeName(tensor.dtype));
  }
  return out;
}

absl::Status MakeCheckpoint(const MakeCheckpointOptions& options) {
  const ModelConfig& config = options.config;
  TANDEM_RETURN_IF_ERROR(ValidateModelConfig(config));
  if (options.num_shards < 1) {
    return InvalidArgument("num_shards must be >= 1, got ", options.num_shards);
  }
  TANDEM_RETURN_IF_ERROR(EnsureDir(options.out_dir));
  const std::string dir = options.out_dir + "/";

  // Shard assignment: a tensor goes to the shard its byte midpoint falls in.
  const std::vector<ExpectedTensor> table = ExpectedTensors(config);
  uint64_t total = 0;
  for (const ExpectedTensor& t : table) total += t.nbytes();
  std::vector<std::vector<const ExpectedTensor*>> shards(options.num_shards);
  uint64_t cum = 0;
  for (const ExpectedTensor& t : table) {
    const uint64_t mid = cum + t.nbytes() / 2;
    size_t s = total == 0
                   ? 0
                   : static_cast<size_t>(
                         (static_cast<long double>(mid) * options.num_shards) / total);
    if (s >= shards.size()) s = shards.size() - 1;
    shards[s].push_back(&t);
    cum += t.nbytes();
  }
  std::vector<std::vector<const ExpectedTensor*>> nonempty;
  for (auto& s : shards) {
    if (!s.empty()) nonempty.push_back(std::move(s));
  }
  // The vision tower and projector (when the config has a vision_config) go
  // after the text tensors into the last shard: the text shards' placement and
  // bytes are those of a text-only checkpoint.
  std::vector<ExpectedTensor> vision_table;
  if (!config.vision_config_json.empty()) {
    TANDEM_ASSIGN_OR_RETURN(VisionConfig vision, VisionConfigOf(config));
    vision_table = ExpectedVisionTensors(vision);
    if (nonempty.empty()) nonempty.emplace_back();
    for (const ExpectedTensor& t : vision_table) {
      nonempty.back().push_back(&t);
      total += t.nbytes();
    }
  }
  const int n = static_cast<int>(nonempty.size());

  const int threads =
      options.num_threads > 0
          ? options.num_threads
          : std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  nlohmann::json weight_map = nlohmann::json::object();
  for (int i = 0; i < n; ++i) {
    const std::string shard = ShardName(i, n);
    const std::vector<const ExpectedTensor*>& items = nonempty[i];
    for (const ExpectedTensor* t : items) weight_map[t->name] = shard;
    // A weight_packed item also fills its weight_scale partner's slot when the
    // partner is in this shard (one float matrix, quantised once).
    std::map<std::string, size_t, std::less<>> slot;
    for (size_t k = 0; k < items.size(); ++k) slot.emplace(items[k]->name, k);
    std::vector<size_t> partner(items.size(), SIZE_MAX);
    std::vector<char> filled_by_partner(items.size(), 0);
    for (size_t k = 0; k < items.size(); ++k) {
      if (items[k]->kind != TensorKind::kMxfp4Packed) continue;
      const std::string& name = items[k]->name;
      auto it = slot.find(name.substr(0, name.rfind('.')) + ".weight_scale");
      if (it != slot.end()) {
        partner[k] = it->second;
        filled_by_partner[it->second] = 1;
      }
    }
    std::vector<TensorData> data(items.size());
    std::vector<absl::Status> errors(items.size());
    std::atomic<size_t> next{0};
    auto work = [&]() {
      for (size_t k = next++; k < items.size(); k = next++) {
        if (filled_by_partner[k]) continue;
        const ExpectedTensor& t = *items[k];
        if (partner[k] != SIZE_MAX) {
          std::vector<uint8_t> packed, scales;
          errors[k] = ExpertWeight(t, options.seed, &packed, &scales);
          if (!errors[k].ok()) continue;
          data[k] = TensorData{t.name, t.dtype, t.shape,
                               std::string(packed.begin(), packed.end())};
          const ExpectedTensor& s = *items[partner[k]];
          data[partner[k]] = TensorData{s.name, s.dtype, s.shape,
                                        std::string(scales.begin(), scales.end())};
          continue;
        }
        absl::StatusOr<TensorData> d = GenerateTensor(config, t, options.seed);
        if (!d.ok()) {
          errors[k] = d.status();
          continue;
        }
        data[k] = *std::move(d);
      }
    };
    std::vector<std::thread> pool;
    for (int w = 1; w < threads; ++w) pool.emplace_back(work);
    work();
    for (std::thread& th : pool) th.join();
    for (const absl::Status& e : errors) TANDEM_RETURN_IF_ERROR(e);
    TANDEM_RETURN_IF_ERROR(WriteSafetensors(dir + shard, data));
  }
  nlohmann::json index = {{"metadata", {{"total_size", total}}},
                          {"weight_map", weight_map}};
  TANDEM_RETURN_IF_ERROR(
      WriteText(dir + "model.safetensors.index.json", index.dump(2) + "\n"));
  TANDEM_RETURN_IF_ERROR(WriteText(dir + "config.json", config.ToJson()));
  nlohmann::json generation = {{"bos_token_id", config.bos_token_id},
                               {"eos_token_id", config.eos_token_id},
                               {"pad_token_id", config.pad_token_id}};
  TANDEM_RETURN_IF_ERROR(
      WriteText(dir + "generation_config.json", generation.dump(2) + "\n"));
  if (!options.tokenizer_dir.empty()) {
    for (const char* f : kTokenizerFiles) {
      TANDEM_RETURN_IF_ERROR(CopyFile(options.tokenizer_dir + "/" + f, dir + f));
    }
  }
  return absl::OkStatus();
}

}  // namespace tandem::model
