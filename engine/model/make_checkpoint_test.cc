#include "engine/model/make_checkpoint.h"

#include <sys/stat.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/model/bf16.h"
#include "engine/model/checkpoint.h"
#include "engine/model/mxfp4.h"
#include "engine/model/vision_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::model {
namespace {

constexpr char kTiny[] = "engine/model/tiny_checkpoint";
constexpr char kTokenizer[] = "third_party/kimi_k3_tokenizer";

std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(base ? base : "/tmp") + "/" + name;
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(TinyConfigTest, HasTheShapeTestsNeed) {
  const ModelConfig c = TinyConfig();
  ASSERT_TRUE(ValidateModelConfig(c).ok()) << ValidateModelConfig(c);
  const auto layers = c.Layers();
  EXPECT_GE(layers.size(), 6u);
  EXPECT_EQ(layers.back().attention, AttentionKind::kMla);
  EXPECT_GE(c.NumKdaLayers(), 2);
  EXPECT_GE(c.NumMlaLayers(), 2);
  EXPECT_EQ(layers.front().attention, AttentionKind::kKda);
  EXPECT_EQ(layers.front().ffn, FfnKind::kDense);
  for (size_t i = 1; i < layers.size(); ++i) EXPECT_EQ(layers[i].ffn, FfnKind::kMoe);
  EXPECT_GE(c.NumResBlocks(), 2);
  int starts = 0;
  for (const auto& l : layers) starts += l.starts_res_block;
  EXPECT_EQ(starts, c.NumResBlocks());
  EXPECT_LT(c.text.num_experts_per_token, c.text.num_experts);
  EXPECT_GT(c.text.num_experts_per_token, 1);
  EXPECT_NE(c.text.routed_scaling_factor, 1.0);
  EXPECT_GE(c.text.num_shared_experts, 1);
  EXPECT_EQ(c.text.vocab_size, 163840);
  EXPECT_EQ(c.text.routed_expert_hidden_size % 32, 0);
  EXPECT_EQ(c.text.moe_intermediate_size % 32, 0);
  EXPECT_GT(c.text.moe_intermediate_size / 32, 1);  // several MXFP4 groups per w2 row
  // Every field the published config has, with the same token ids and switches.
  const ModelConfig p = PublishedK3Config();
  EXPECT_EQ(c.bos_token_id, p.bos_token_id);
  EXPECT_EQ(c.eos_token_id, p.eos_token_id);
  EXPECT_EQ(c.pad_token_id, p.pad_token_id);
  EXPECT_EQ(c.text.quantization_config, p.text.quantization_config);
  // The tiny tower of VISION.md section 4, projecting to the tiny text width.
  EXPECT_EQ(c.vision_config_json, TinyVisionConfig(c.text.hidden_size).ToJson());
  // K3's own context, so that sizing and admission run at the real length.
  EXPECT_EQ(c.text.max_position_embeddings, 1048576);
  EXPECT_EQ(MidConfig().text.max_position_embeddings, 1048576);
}

TEST(MidConfigTest, IsValidAndSized) {
  const ModelConfig c = MidConfig();
  ASSERT_TRUE(ValidateModelConfig(c).ok()) << ValidateModelConfig(c);
  uint64_t bytes = 0;
  for (const auto& t : ExpectedTensors(c)) bytes += t.nbytes();
  EXPECT_GT(bytes, 300ull << 20);
  EXPECT_LT(bytes, 2ull << 30);
  EXPECT_EQ(c.Layers().back().attention, AttentionKind::kMla);
}

TEST(PublishedConfigTest, MatchesTheTestdataFile) {
  auto parsed = LoadModelConfig("engine/model/testdata/kimi_k3_config.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed, PublishedK3Config());
}

TEST(MakeCheckpointTest, TinyGenruleOutputLoadsAndValidates) {
  auto ckpt = Checkpoint::Open(kTiny);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_TRUE((*ckpt)->ValidateAgainstConfig().ok())
      << (*ckpt)->ValidateAgainstConfig();
  // Tokenizer files are copies; generation_config carries the K3 ids.
  for (const char* f : {"tiktoken.model", "tokenizer_config.json", "pat_str.json"}) {
    EXPECT_EQ(ReadAll(std::string(kTiny) + "/" + f),
              ReadAll(std::string(kTokenizer) + "/" + f))
        << f;
  }
  const std::string gen = ReadAll(std::string(kTiny) + "/generation_config.json");
  EXPECT_THAT(gen, ::testing::HasSubstr("\"eos_token_id\": 163586"));
  EXPECT_THAT(gen, ::testing::HasSubstr("\"bos_token_id\": 163584"));
  EXPECT_EQ((*ckpt)->config().text.max_position_embeddings, 1048576);
  // The index total is the sum of tensor bytes.
  const std::string index =
      ReadAll(std::string(kTiny) + "/model.safetensors.index.json");
  EXPECT_THAT(index, ::testing::HasSubstr(absl::StrCat(
                         "\"total_size\": ", (*ckpt)->tensors().total_tensor_bytes())));
}

TEST(MakeCheckpointTest, DeterministicPerSeed) {
  MakeCheckpointOptions options;
  options.config = TinyConfig();
  options.num_shards = 3;
  options.tokenizer_dir = kTokenizer;
  options.seed = 0;
  options.num_threads = 1;
  options.out_dir = TempDir("seed0");
  ASSERT_TRUE(MakeCheckpoint(options).ok());
  options.seed = 1;
  options.num_threads = 3;  // thread count does not change the bytes
  options.out_dir = TempDir("seed1");
  ASSERT_TRUE(MakeCheckpoint(options).ok());
  // Seed 0 here (library, this process) == seed 0 from the genrule (binary).
  for (const std::string& f : CheckpointFileNames(3)) {
    EXPECT_EQ(ReadAll(TempDir("seed0") + "/" + f),
              ReadAll(std::string(kTiny) + "/" + f))
        << f;
  }
  // Another seed: same config and layout, different weights in every shard.
  EXPECT_EQ(ReadAll(TempDir("seed1") + "/config.json"),
            ReadAll(TempDir("seed0") + "/config.json"));
  EXPECT_EQ(ReadAll(TempDir("seed1") + "/model.safetensors.index.json"),
            ReadAll(TempDir("seed0") + "/model.safetensors.index.json"));
  for (int i = 3; i < 6; ++i) {
    const std::string f = CheckpointFileNames(3)[i];
    EXPECT_NE(ReadAll(TempDir("seed1") + "/" + f), ReadAll(TempDir("seed0") + "/" + f))
        << f;
  }
}

double Rms(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += static_cast<double>(x) * x;
  return std::sqrt(s / v.size());
}

double Mean(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += x;
  return s / v.size();
}

// Weight statistics per tensor kind: activations stay well scaled when every
// projection has RMS ~ 1/sqrt(fan_in), norms ~ 1 and the KDA gates sit in the
// ranges upstream initialises them to.
TEST(MakeCheckpointTest, WeightStatisticsAreInTheIntendedRange) {
  auto ckpt = Checkpoint::Open(kTiny);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const ModelConfig& c = (*ckpt)->config();
  std::map<TensorKind, int> seen;
  for (const ExpectedTensor& e : ExpectedTensors(c)) {
    auto view = (*ckpt)->Get(e.name);
    ASSERT_TRUE(view.ok()) << view.status();
    ++seen[e.kind];
    const double fan_in = static_cast<double>(e.shape.back());
    switch (e.kind) {
      case TensorKind::kEmbedding: {
        auto v = *view->ToFloat();
        EXPECT_NEAR(Rms(v), 1.0, 0.02) << e.name;
        EXPECT_NEAR(Mean(v), 0.0, 0.01) << e.name;
        break;
      }
      case TensorKind::kLmHead:
      case TensorKind::kMatrix: {
        auto v = *view->ToFloat();
        const double tol = v.size() >= 4096 ? 0.1 : 0.25;
        EXPECT_NEAR(Rms(v) * std::sqrt(fan_in), 1.0, tol) << e.name;
        break;
      }
      case TensorKind::kNorm: {
        auto v = *view->ToFloat();
        EXPECT_NEAR(Mean(v), 1.0, 0.02) << e.name;
        for (float x : v) ASSERT_NEAR(x, 1.0, 0.1) << e.name;
        break;
      }
      case TensorKind::kResProj: {
        auto v = *view->ToFloat();
        EXPECT_NEAR(Rms(v) * std::sqrt(c.text.hidden_size), 1.0, 0.3) << e.name;
        break;
      }
      case TensorKind::kConv: {
        auto v = *view->ToFloat();
        for (float x : v) ASSERT_LE(std::fabs(x), 0.5f) << e.name;
        EXPECT_NEAR(Rms(v), 0.5 / std::sqrt(3.0), 0.03) << e.name;
        break;
      }
      case TensorKind::kALog: {
        auto v = *view->F32();
        const int64_t h = c.text.linear_attn_config.num_heads;
        for (int64_t i = 0; i < static_cast<int64_t>(v.size()); ++i) {
          if (i < h) {
            EXPECT_GE(v[i], 0.0f) << e.name;
            EXPECT_LE(v[i], std::log(16.0f) + 1e-6f) << e.name;
          } else {
            EXPECT_EQ(v[i], 0.0f) << e.name << " padding " << i;
          }
        }
        break;
      }
      case TensorKind::kDtBias: {
        auto v = *view->F32();
        for (float x : v) {
          const double dt = std::log1p(std::exp(static_cast<double>(x)));  // softplus
          ASSERT_GE(dt, 0.99e-3) << e.name;
          ASSERT_LE(dt, 0.101) << e.name;
        }
        break;
      }
      case TensorKind::kRouterBias: {
        auto v = *view->F32();
        for (float x : v) {
          ASSERT_NE(x, 0.0f) << e.name;
          ASSERT_LE(std::fabs(x), 0.1f) << e.name;
        }
        EXPECT_GT(Rms(std::vector<float>(v.begin(), v.end())), 0.02) << e.name;
        break;
      }
      case TensorKind::kMxfp4Packed: {
        // Dequantise with the partner scale: RMS ~ 1/sqrt(in), scales in range.
        const std::string base = e.name.substr(0, e.name.rfind('.'));
        auto scale = (*ckpt)->Get(base + ".weight_scale");
        ASSERT_TRUE(scale.ok()) << scale.status();
        const size_t rows = e.shape[0], in = e.shape[1] * 2;
        std::vector<float> w;
        ASSERT_TRUE(DequantizeMxfp4(*view->U8(), *scale->U8(), rows, in, &w).ok());
        EXPECT_NEAR(Rms(w) * std::sqrt(static_cast<double>(in)), 1.0, 0.25) << e.name;
        const absl::Span<const uint8_t> scale_bytes = *scale->U8();
        for (uint8_t s : scale_bytes) {
          // amax of a N(0, 1/in) group of 32 is ~2.5/sqrt(in): exponent near
          // log2(2.5/sqrt(in)) - 2.
          ASSERT_GT(s, 127 - 10) << e.name;
          ASSERT_LT(s, 127) << e.name;
        }
        break;
      }
      case TensorKind::kMxfp4Scale:
        break;  // checked with its packed partner
    }
  }
  EXPECT_EQ(seen.size(), 11u);  // every kind occurs in the tiny model
}

TEST(MakeCheckpointTest, GenerateTensorMatchesTheFile) {
  auto ckpt = Checkpoint::Open(kTiny);
  ASSERT_TRUE(ckpt.ok());
  for (const ExpectedTensor& e : ExpectedTensors(TinyConfig())) {
    if (e.name.find("layers.2.") == std::string::npos) continue;
    auto d = GenerateTensor(TinyConfig(), e, /*seed=*/0);
    ASSERT_TRUE(d.ok()) << d.status();
    auto v = (*ckpt)->Get(e.name);
    ASSERT_TRUE(v.ok());
    ASSERT_EQ(d->bytes.size(), v->nbytes) << e.name;
    EXPECT_EQ(d->bytes, std::string(reinterpret_cast<const char*>(v->data), v->nbytes))
        << e.name;
  }
}

TEST(MakeCheckpointTest, RejectsBadOptions) {
  MakeCheckpointOptions options;
  options.config = TinyConfig();
  options.out_dir = TempDir("bad");
  options.num_shards = 0;
  EXPECT_FALSE(MakeCheckpoint(options).ok());
  options.num_shards = 2;
  options.config.text.hidden_act = "gelu";
  EXPECT_FALSE(MakeCheckpoint(options).ok());
  EXPECT_FALSE(ConfigForSize("huge").ok());
  options.config = TinyConfig();
  options.tokenizer_dir = "/nonexistent";
  EXPECT_FALSE(MakeCheckpoint(options).ok());
}

}  // namespace
}  // namespace tandem::model
