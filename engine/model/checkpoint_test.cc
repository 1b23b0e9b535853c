#include "engine/model/checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "engine/model/make_checkpoint.h"
#include "engine/model/vision_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::model {
namespace {

using ::testing::HasSubstr;

constexpr char kTiny[] = "engine/model/tiny_checkpoint";

std::string TempDir(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string dir = std::string(base ? base : "/tmp") + "/" + name;
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

TEST(CheckpointTest, TinyOpensAndValidates) {
  auto ckpt = Checkpoint::Open(kTiny);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_TRUE((*ckpt)->ValidateAgainstConfig().ok())
      << (*ckpt)->ValidateAgainstConfig();
  EXPECT_EQ((*ckpt)->config(), TinyConfig());
  EXPECT_EQ((*ckpt)->tensors().files().size(), 3u);
  // The text tensors and the tiny vision tower's (VISION.md section 4).
  auto vision = VisionConfigOf(TinyConfig());
  ASSERT_TRUE(vision.ok()) << vision.status();
  EXPECT_EQ((*ckpt)->tensors().size(), ExpectedTensors(TinyConfig()).size() +
                                           ExpectedVisionTensors(*vision).size());
}

TEST(CheckpointTest, LookupWithOrWithoutPrefix) {
  auto ckpt = Checkpoint::Open(kTiny);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto a = (*ckpt)->Get("model.norm.weight");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->name, "language_model.model.norm.weight");
  auto b = (*ckpt)->Get("language_model.model.norm.weight");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(a->data, b->data);
  EXPECT_EQ(a->shape, std::vector<int64_t>{64});
  auto missing = (*ckpt)->Get("model.layers.99.mlp.gate_proj.weight");
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("layers.99"));

  auto checked =
      (*ckpt)->GetChecked("model.layers.0.self_attn.A_log", DType::kF32, {128});
  EXPECT_TRUE(checked.ok()) << checked.status();
  checked = (*ckpt)->GetChecked("model.layers.0.self_attn.A_log", DType::kBF16, {4});
  ASSERT_FALSE(checked.ok());
  EXPECT_THAT(std::string(checked.status().message()),
              HasSubstr("expected BF16[4], got F32[128]"));
}

// Copies the tiny checkpoint's tensors into one model.safetensors under `dir`,
// renamed/edited by `edit`, with the tiny config.
template <typename Edit>
std::string Rewrite(const std::string& name, Edit edit) {
  const std::string dir = TempDir(name);
  auto set = SafetensorsSet::OpenDirectory(kTiny);
  EXPECT_TRUE(set.ok());
  std::vector<TensorData> out;
  for (const std::string& n : (*set)->Names()) {
    TensorView v = *(*set)->Get(n);
    TensorData d{n, v.dtype, v.shape,
                 std::string(reinterpret_cast<const char*>(v.data), v.nbytes)};
    if (edit(&d)) out.push_back(std::move(d));
  }
  EXPECT_TRUE(WriteSafetensors(dir + "/model.safetensors", out).ok());
  WriteAll(dir + "/config.json", ReadAll(std::string(kTiny) + "/config.json"));
  return dir;
}

TEST(CheckpointTest, UnprefixedSingleFileValidates) {
  const std::string dir = Rewrite("unprefixed", [](TensorData* d) {
    d->name = std::string(StripTextPrefix(d->name));
    return true;
  });
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_TRUE((*ckpt)->ValidateAgainstConfig().ok())
      << (*ckpt)->ValidateAgainstConfig();
  auto v = (*ckpt)->Get("language_model.model.norm.weight");
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->name, "model.norm.weight");
}

TEST(CheckpointTest, ValidationNamesEveryProblem) {
  const std::string dir = Rewrite("broken", [](TensorData* d) {
    if (d->name == "language_model.model.layers.1.self_attn.A_log") {
      d->dtype = DType::kBF16;  // 128 F32 → 256 BF16: wrong dtype and shape
      d->shape = {256};
    }
    if (d->name == "language_model.model.layers.3.self_attn.kv_b_proj.weight") {
      std::swap(d->shape[0], d->shape[1]);  // transposed: byte-neutral
    }
    return d->name !=
           "language_model.model.layers.5.block_sparse_moe.experts.7.w2."
           "weight_scale";
  });
  // Extra tensors: one unknown text tensor, one vision tensor (ignored).
  {
    auto set = SafetensorsSet::OpenFile(dir + "/model.safetensors");
    ASSERT_TRUE(set.ok());
    std::vector<TensorData> all;
    for (const std::string& n : (*set)->Names()) {
      TensorView v = *(*set)->Get(n);
      all.push_back(
          TensorData{n, v.dtype, v.shape,
                     std::string(reinterpret_cast<const char*>(v.data), v.nbytes)});
    }
    all.push_back(TensorData{"language_model.model.layers.0.bogus.weight",
                             DType::kF32,
                             {1},
                             std::string(4, '\0')});
    all.push_back(TensorData{
        "vision_tower.patch_embed.weight", DType::kBF16, {2}, std::string(4, '\0')});
    set->reset();
    ASSERT_TRUE(WriteSafetensors(dir + "/model.safetensors", all).ok());
  }
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  absl::Status s = (*ckpt)->ValidateAgainstConfig();
  ASSERT_FALSE(s.ok());
  const std::string msg(s.message());
  EXPECT_THAT(msg, HasSubstr("5 problem(s)"));
  EXPECT_THAT(msg,
              HasSubstr("'language_model.model.layers.1.self_attn.A_log': expected "
                        "dtype F32, got BF16"));
  EXPECT_THAT(msg,
              HasSubstr("'language_model.model.layers.1.self_attn.A_log': expected "
                        "shape [128], got [256]"));
  EXPECT_THAT(msg,
              HasSubstr("'language_model.model.layers.3.self_attn.kv_b_proj.weight': "
                        "expected shape [128,32], got [32,128]"));
  EXPECT_THAT(msg,
              HasSubstr("missing tensor 'language_model.model.layers.5.block_sparse_"
                        "moe.experts.7.w2.weight_scale' (U8[32,2])"));
  EXPECT_THAT(msg,
              HasSubstr("unknown tensor 'language_model.model.layers.0.bogus.weight'"));
  EXPECT_THAT(msg, ::testing::Not(HasSubstr("vision_tower")));
}

TEST(CheckpointTest, ConfigThatDisagreesWithTensors) {
  // Same tensors, config with one more routed expert: 6 missing per MoE layer.
  const std::string dir = TempDir("more_experts");
  for (const std::string& f : CheckpointFileNames(3)) {
    if (f == "config.json") continue;
    char resolved[PATH_MAX];
    ASSERT_NE(::realpath((std::string(kTiny) + "/" + f).c_str(), resolved), nullptr)
        << f;
    const std::string target = resolved;
    ::unlink((dir + "/" + f).c_str());
    ASSERT_EQ(::symlink(target.c_str(), (dir + "/" + f).c_str()), 0) << target;
  }
  ModelConfig c = TinyConfig();
  c.text.num_experts = 17;
  WriteAll(dir + "/config.json", c.ToJson());
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  absl::Status s = (*ckpt)->ValidateAgainstConfig();
  ASSERT_FALSE(s.ok());
  // 7 MoE layers * (6 expert tensors) missing + gate/bias shape mismatches (2 each).
  EXPECT_THAT(std::string(s.message()), HasSubstr("(56 problem(s))"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("and 6 more"));
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("'language_model.model.layers.1.block_sparse_moe.gate.weight': "
                        "expected shape [17,64], got [16,64]"));
}

TEST(CheckpointTest, OpenErrorsNameThePath) {
  auto ckpt = Checkpoint::Open("/nonexistent/model");
  ASSERT_FALSE(ckpt.ok());
  EXPECT_THAT(std::string(ckpt.status().message()), HasSubstr("/nonexistent/model"));
  const std::string dir = TempDir("no_weights");
  WriteAll(dir + "/config.json", TinyConfig().ToJson());
  ckpt = Checkpoint::Open(dir);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_THAT(std::string(ckpt.status().message()), HasSubstr("model.safetensors"));
}

}  // namespace
}  // namespace tandem::model
