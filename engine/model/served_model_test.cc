#include "engine/model/served_model.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"

namespace tandem::model {
namespace {

std::string WriteConfig(const std::string& name, const std::string& json) {
  std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/" + name;
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << json;
  return dir;
}

constexpr char kK3[] = R"({
  "model_type": "kimi_k3", "eos_token_id": 163586,
  "text_config": {"vocab_size": 163840, "max_position_embeddings": 1048576,
                  "eos_token_id": 163586}})";

TEST(ModelInfoTest, K3LayoutIsKimiK3) {
  auto m = LoadServedModel(WriteConfig("k3", kK3), "", 7);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->info.id(), "kimi-k3");
  EXPECT_EQ(m->info.vocab_size(), 163840);
  EXPECT_EQ(m->info.max_context_tokens(), 1048576);
  ASSERT_EQ(m->info.eos_token_ids_size(), 1);
  EXPECT_EQ(m->info.eos_token_ids(0), 163586);
  EXPECT_EQ(m->info.created_unix(), 7);
  EXPECT_EQ(m->fingerprint.size(), 16u);
}

TEST(ModelInfoTest, ServedNameAndFingerprintFollowContent) {
  std::string dir = WriteConfig("named", kK3);
  auto a = LoadServedModel(dir, "my-model", 0);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->info.id(), "my-model");
  auto b = LoadServedModel(WriteConfig("other", std::string(kK3) + " "), "", 0);
  ASSERT_TRUE(b.ok());
  EXPECT_NE(a->fingerprint, b->fingerprint);
}

TEST(ModelInfoTest, Errors) {
  EXPECT_EQ(LoadServedModel("/nonexistent", "", 0).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(LoadServedModel(WriteConfig("bad", "{not json"), "", 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto s = LoadServedModel(
      WriteConfig("novocab", R"({"text_config": {"max_position_embeddings": 1}})"), "",
      0);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("vocab_size"), absl::string_view::npos);
}

}  // namespace
}  // namespace tandem::model
