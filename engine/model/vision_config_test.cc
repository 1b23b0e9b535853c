#include "engine/model/vision_config.h"

#include <string>

#include "engine/model/config.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::model {
namespace {

using nlohmann::json;

constexpr char kPublished[] = "engine/model/testdata/kimi_k3_config.json";

TEST(VisionConfigTest, ParsesThePublishedConfig) {
  absl::StatusOr<ModelConfig> m = LoadModelConfig(kPublished);
  ASSERT_TRUE(m.ok()) << m.status();
  absl::StatusOr<VisionConfig> v = VisionConfigOf(*m);
  ASSERT_TRUE(v.ok()) << v.status();
  // The published values (VISION.md section 0) plus the two assumed defaults.
  EXPECT_EQ(*v, PublishedVisionConfig());
  EXPECT_EQ(v->head_dim(), 128);
  EXPECT_EQ(v->patch_dim(), 588);
  EXPECT_EQ(v->vt_norm_eps, 0x1.0p-23);
  // 6L + 3 tower tensors + 3 projector tensors; ~401 M + ~46 M parameters.
  const auto table = ExpectedVisionTensors(*v);
  EXPECT_EQ(table.size(), 6u * 27 + 3 + 3);
  uint64_t tower = 0, projector = 0;
  for (const ExpectedTensor& t : table) {
    (t.name.rfind("mm_projector.", 0) == 0 ? projector : tower) += t.nbytes() / 2;
  }
  EXPECT_NEAR(tower / 1e6, 401, 5);
  EXPECT_NEAR(projector / 1e6, 46, 1);
}

TEST(VisionConfigTest, RoundTripsAndKeepsTheAssumedFields) {
  VisionConfig c = TinyVisionConfig(64);
  c.vt_norm_eps = 0x1.0p-7;  // the other port's value
  c.vt_rope_theta = 500.0;
  absl::StatusOr<VisionConfig> again = ParseVisionConfig(c.ToJson());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, c);
  EXPECT_TRUE(ValidateVisionConfig(MidVisionConfig(1024)).ok());
}

TEST(VisionConfigTest, RejectsWhatTheTowerDoesNotImplement) {
  const json base = json::parse(TinyVisionConfig(64).ToJson());
  struct Case {
    const char* key;
    json value;
    const char* says;
  };
  const Case cases[] = {
      {"norm_type", "layernorm", "norm_type"},
      {"attn_bias", true, "attn_bias"},
      {"merge_kernel_size", json::array({3, 3}), "merge_kernel_size"},
      {"mm_projector_type", "mlp", "mm_projector_type"},
      {"activation_func", "relu", "activation_func"},
      {"pos_emb_interpolation_mode", "bicubic", "pos_emb_interpolation_mode"},
      {"qkv_hidden_size", 100, "head_dim"},
      {"mm_hidden_size", 32, "mm_hidden_size"},
      {"vt_hidden_size", "64", "vt_hidden_size"},
      {"vt_norm_eps", 0, "vt_norm_eps"},
      {"patch_size", 0, "patch_size"},
  };
  for (const Case& c : cases) {
    json j = base;
    j[c.key] = c.value;
    absl::StatusOr<VisionConfig> v = ParseVisionConfig(j.dump());
    ASSERT_FALSE(v.ok()) << c.key;
    EXPECT_NE(std::string(v.status().message()).find(c.says), std::string::npos)
        << v.status();
  }
  json missing = base;
  missing.erase("vt_num_hidden_layers");
  EXPECT_NE(std::string(ParseVisionConfig(missing.dump()).status().message())
                .find("missing field vision_config.vt_num_hidden_layers"),
            std::string::npos);
}

TEST(VisionConfigTest, TextWidthMustMatchAndAbsenceIsNotFound) {
  ModelConfig m;
  m.text.hidden_size = 64;
  EXPECT_EQ(VisionConfigOf(m).status().code(), absl::StatusCode::kNotFound);
  m.vision_config_json = TinyVisionConfig(128).ToJson();
  absl::StatusOr<VisionConfig> v = VisionConfigOf(m);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(std::string(v.status().message()).find("text_hidden_size 128"),
            std::string::npos);
}

}  // namespace
}  // namespace tandem::model
