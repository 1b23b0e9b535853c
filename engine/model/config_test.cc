#include "engine/model/config.h"

#include <fstream>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::model {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

constexpr char kPublished[] = "engine/model/testdata/kimi_k3_config.json";

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json Published() { return json::parse(ReadFile(kPublished)); }

TEST(ConfigTest, ParsesThePublishedConfig) {
  absl::StatusOr<ModelConfig> c = LoadModelConfig(kPublished);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architectures,
            std::vector<std::string>{"KimiK3ForConditionalGeneration"});
  EXPECT_EQ(c->bos_token_id, 163584);
  EXPECT_EQ(c->eos_token_id, 163586);
  EXPECT_EQ(c->pad_token_id, 163839);
  EXPECT_EQ(c->media_placeholder_token_id, 163605);
  EXPECT_EQ(c->text.hidden_size, 7168);
  EXPECT_EQ(c->text.vocab_size, 163840);
  EXPECT_EQ(c->text.num_experts, 896);
  EXPECT_EQ(c->text.num_experts_per_token, 16);
  EXPECT_EQ(c->text.routed_expert_hidden_size, 3584);
  EXPECT_EQ(c->text.linear_attn_config.num_heads, 96);
  EXPECT_EQ(c->text.linear_attn_config.gate_lower_bound, -5.0);
  EXPECT_EQ(c->text.rms_norm_eps, 1e-5);
  EXPECT_EQ(c->text.quantization_config.group_size, 32);
  EXPECT_EQ(c->text.quantization_config.ignore,
            std::vector<std::string>{"re:.*shared_experts.*"});
}

TEST(ConfigTest, DerivedFactsOfThePublishedConfig) {
  absl::StatusOr<ModelConfig> c = LoadModelConfig(kPublished);
  ASSERT_TRUE(c.ok()) << c.status();
  const std::vector<LayerSpec> layers = c->Layers();
  ASSERT_EQ(layers.size(), 93u);
  EXPECT_EQ(c->NumKdaLayers(), 69);
  EXPECT_EQ(c->NumMlaLayers(), 24);
  EXPECT_EQ(c->NumMoeLayers(), 92);  // first_k_dense_replace = 1 of 93
  EXPECT_EQ(layers[92].attention, AttentionKind::kMla);
  EXPECT_EQ(layers[91].attention, AttentionKind::kMla);  // 1-based 92
  EXPECT_EQ(layers[90].attention, AttentionKind::kKda);
  EXPECT_EQ(layers[3].attention, AttentionKind::kMla);  // 1-based 4
  EXPECT_EQ(layers[0].attention, AttentionKind::kKda);
  EXPECT_EQ(layers[0].ffn, FfnKind::kDense);
  for (int i = 1; i < 93; ++i) EXPECT_EQ(layers[i].ffn, FfnKind::kMoe) << i;
  int blocks = 0;
  for (const LayerSpec& l : layers) {
    EXPECT_EQ(l.starts_res_block, l.index % 12 == 0) << l.index;
    blocks += l.starts_res_block ? 1 : 0;
  }
  EXPECT_EQ(blocks, 8);
  EXPECT_EQ(c->NumResBlocks(), 8);
  EXPECT_EQ(c->KdaProjectionSize(), 12288);
  EXPECT_EQ(c->ALogPaddedLength(), 128);
  EXPECT_EQ(c->KdaRecurrentStateBytes(), 96 * 128 * 128 * 4);  // 6 MiB
  EXPECT_EQ(c->KdaRecurrentStateBytes(), 6 * 1024 * 1024);
  EXPECT_EQ(c->KdaConvStateBytes(), 3 * 3 * 12288 * 4);
  EXPECT_EQ(c->KdaStateBytesPerSequence(), 6291456 + 442368);
  EXPECT_EQ(c->MlaCacheValuesPerToken(), 576);
  EXPECT_EQ(c->MlaCacheBytesPerToken(), 576 * 2);
  EXPECT_EQ(c->QHeadDim(), 192);
  // Whole-model figures from ARCHITECTURE.md: 27.6 KB/token MLA, ~430 MiB KDA.
  EXPECT_EQ(c->NumMlaLayers() * c->MlaCacheBytesPerToken(), 27648);
}

TEST(ConfigTest, ToJsonRoundTrips) {
  absl::StatusOr<ModelConfig> c = LoadModelConfig(kPublished);
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<ModelConfig> again = ParseModelConfig(c->ToJson());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *c);
  // And the JSON carries every field of the published file.
  json written = json::parse(c->ToJson());
  json published = Published();
  for (const auto& [k, v] : published.items()) {
    EXPECT_TRUE(written.contains(k)) << k;
  }
  for (const auto& [k, v] : published["text_config"].items()) {
    EXPECT_TRUE(written["text_config"].contains(k)) << k;
    if (k != "quantization_config") {
      EXPECT_EQ(written["text_config"][k], v) << k;
    }
  }
  EXPECT_EQ(written["vision_config"], published["vision_config"]);
}

TEST(ConfigTest, RoundTripKeepsEditedValues) {
  absl::StatusOr<ModelConfig> c = LoadModelConfig(kPublished);
  ASSERT_TRUE(c.ok());
  ModelConfig x = *c;
  x.text.routed_scaling_factor = 2.5;
  x.text.rms_norm_eps = 1e-6;
  x.text.attn_res_block_size = 5;
  x.text.quantization_config.ignore.push_back("re:.*lm_head.*");
  x.vision_config_json.clear();
  absl::StatusOr<ModelConfig> again = ParseModelConfig(x.ToJson());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, x);
}

struct Mutation {
  const char* label;
  // JSON pointer → new value (null pointer string: remove the field).
  std::string pointer;
  json value;
  bool remove;
  absl::StatusCode code;
  const char* message;
};

class ConfigRejectTest : public ::testing::TestWithParam<Mutation> {};

TEST_P(ConfigRejectTest, RejectsWithFieldAndValue) {
  const Mutation& m = GetParam();
  json j = Published();
  json::json_pointer ptr(m.pointer);
  if (m.remove) {
    json& parent = j[ptr.parent_pointer()];
    if (parent.is_array()) {
      parent.erase(std::stoul(ptr.back()));
    } else {
      parent.erase(ptr.back());
    }
  } else {
    j[ptr] = m.value;
  }
  absl::StatusOr<ModelConfig> c = ParseModelConfig(j.dump());
  ASSERT_FALSE(c.ok()) << m.label;
  EXPECT_EQ(c.status().code(), m.code) << m.label << ": " << c.status();
  EXPECT_THAT(std::string(c.status().message()), HasSubstr(m.message)) << m.label;
}

const auto kInvalid = absl::StatusCode::kInvalidArgument;
const auto kUnimpl = absl::StatusCode::kUnimplemented;

INSTANTIATE_TEST_SUITE_P(
    All, ConfigRejectTest,
    ::testing::Values(
        Mutation{"missing hidden_size", "/text_config/hidden_size", nullptr, true,
                 kInvalid, "missing field text_config.hidden_size"},
        Mutation{"string hidden_size", "/text_config/hidden_size", "7168", false,
                 kInvalid, "text_config.hidden_size must be an integer, got \"7168\""},
        Mutation{"float layers", "/text_config/num_hidden_layers", 93.5, false,
                 kInvalid, "num_hidden_layers must be an integer"},
        Mutation{"zero heads", "/text_config/num_attention_heads", 0, false, kInvalid,
                 "num_attention_heads must be > 0, got 0"},
        Mutation{"negative vocab", "/text_config/vocab_size", -5, false, kInvalid,
                 "vocab_size must be > 0, got -5"},
        Mutation{"bool as string", "/text_config/mla_use_nope", "true", false, kInvalid,
                 "mla_use_nope must be true or false"},
        Mutation{"no rope", "/text_config/mla_use_nope", false, false, kUnimpl,
                 "mla_use_nope false"},
        Mutation{"expert groups", "/text_config/num_expert_group", 8, false, kUnimpl,
                 "num_expert_group 8"},
        Mutation{"topk group", "/text_config/topk_group", 4, false, kUnimpl,
                 "topk_group 4"},
        Mutation{"silu", "/text_config/hidden_act", "silu", false, kUnimpl,
                 "hidden_act \"silu\""},
        Mutation{"softmax router", "/text_config/moe_router_activation_func", "softmax",
                 false, kUnimpl, "moe_router_activation_func \"softmax\""},
        Mutation{"mtp", "/text_config/num_nextn_predict_layers", 1, false, kUnimpl,
                 "num_nextn_predict_layers 1"},
        Mutation{"low rank gate", "/text_config/linear_attn_config/use_full_rank_gate",
                 false, false, kUnimpl, "use_full_rank_gate false"},
        Mutation{"int8 quant", "/text_config/quantization_config/format",
                 "int-quantized", false, kUnimpl, "format \"int-quantized\""},
        Mutation{
            "group 16",
            "/text_config/quantization_config/config_groups/group_0/weights/group_size",
            16, false, kUnimpl, "group_size 16"},
        Mutation{
            "8 bits",
            "/text_config/quantization_config/config_groups/group_0/weights/num_bits",
            8, false, kUnimpl, "num_bits 8"},
        Mutation{
            "activations quantised",
            "/text_config/quantization_config/config_groups/group_0/input_activations",
            json{{"num_bits", 8}}, false, kUnimpl, "input_activations"},
        Mutation{"latent not /32", "/text_config/routed_expert_hidden_size", 3580,
                 false, kInvalid, "routed_expert_hidden_size 3580 is not a multiple"},
        Mutation{"moe inter not /32", "/text_config/moe_intermediate_size", 3000, false,
                 kInvalid, "moe_intermediate_size 3000 is not a multiple"},
        Mutation{"topk > experts", "/text_config/num_experts_per_token", 897, false,
                 kInvalid, "num_experts_per_token 897 exceeds num_experts 896"},
        Mutation{"layer 0 in list", "/text_config/linear_attn_config/kda_layers/0", 0,
                 false, kInvalid, "holds 0, outside 1..93"},
        Mutation{"overlap", "/text_config/linear_attn_config/kda_layers/0", 4, false,
                 kInvalid, "repeats layer 4"},
        Mutation{"missing layer", "/text_config/linear_attn_config/kda_layers/0",
                 nullptr, true, kInvalid, "missing 1"},
        Mutation{"last not MLA", "/text_config/num_hidden_layers", 91, false, kInvalid,
                 "outside 1..91"},
        Mutation{"tied", "/text_config/tie_word_embeddings", true, false, kUnimpl,
                 "tie_word_embeddings"},
        Mutation{"gqa", "/text_config/num_key_value_heads", 8, false, kUnimpl,
                 "num_key_value_heads 8"},
        Mutation{"eos outside vocab", "/eos_token_id", 200000, false, kInvalid,
                 "eos_token_id 200000 is outside the vocabulary"},
        Mutation{"wrong model type", "/model_type", "deepseek_v3", false, kInvalid,
                 "model_type must be \"kimi_k3\""},
        Mutation{"lac not object", "/text_config/linear_attn_config", json::array(),
                 false, kInvalid, "linear_attn_config must be an object"},
        Mutation{"layer list not ints",
                 "/text_config/linear_attn_config/full_attn_layers", json::array({"4"}),
                 false, kInvalid, "full_attn_layers holds \"4\""},
        Mutation{"eps zero", "/text_config/rms_norm_eps", 0.0, false, kInvalid,
                 "rms_norm_eps must be > 0"},
        Mutation{"block size 0", "/text_config/attn_res_block_size", 0, false, kInvalid,
                 "attn_res_block_size must be > 0"},
        Mutation{"two groups", "/text_config/quantization_config/config_groups/group_1",
                 json::object(), false, kUnimpl, "has 2 groups"}),
    [](const ::testing::TestParamInfo<Mutation>& info) {
      std::string s = info.param.label;
      for (char& c : s) {
        if (!isalnum(static_cast<unsigned char>(c))) c = '_';
      }
      return s;
    });

TEST(ConfigTest, LastLayerMustBeMla) {
  json j = Published();
  auto& la = j["text_config"]["linear_attn_config"];
  // Move layer 93 from full_attn_layers to kda_layers.
  la["full_attn_layers"].erase(la["full_attn_layers"].size() - 1);
  la["kda_layers"].push_back(93);
  absl::StatusOr<ModelConfig> c = ParseModelConfig(j.dump());
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("last layer (93) must be MLA"));
}

TEST(ConfigTest, ReportsEveryProblemAtOnce) {
  json j = Published();
  j["text_config"]["hidden_act"] = "gelu";
  j["text_config"]["num_experts_per_token"] = 1000;
  absl::StatusOr<ModelConfig> c = ParseModelConfig(j.dump());
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("hidden_act \"gelu\""));
  EXPECT_THAT(std::string(c.status().message()),
              HasSubstr("num_experts_per_token 1000"));
}

TEST(ConfigTest, RejectsGarbageAndMissingFiles) {
  EXPECT_FALSE(ParseModelConfig("").ok());
  EXPECT_FALSE(ParseModelConfig("[]").ok());
  EXPECT_FALSE(ParseModelConfig("{\"text_config\": 3}").ok());
  absl::StatusOr<ModelConfig> c = LoadModelConfig("/nonexistent/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("/nonexistent/config.json"));
}

}  // namespace
}  // namespace tandem::model
