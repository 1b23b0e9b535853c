// ShardDimsOf on the engine's three configs gives exactly the dimensions that
// parallel/sharding_test uses (written by hand in parallel/sharding_test_dims.h),
// so its tables hold for the real models; each field comes from its config field.
#include "engine/runtime/shard_dims.h"

#include <string>

#include "engine/model/make_checkpoint.h"
#include "gtest/gtest.h"
#include "parallel/sharding_test_dims.h"

namespace tandem::engine {
namespace {

TEST(ShardDimsTest, TheConfigsGiveTheDimensionsShardingTestUses) {
  EXPECT_EQ(ShardDimsOf(model::PublishedK3Config()), parallel::testing::K3Dims());
  EXPECT_EQ(ShardDimsOf(model::MidConfig()), parallel::testing::MidDims());
  EXPECT_EQ(ShardDimsOf(model::TinyConfig()), parallel::testing::TinyDims());
}

TEST(ShardDimsTest, EachFieldComesFromItsConfigField) {
  model::ModelConfig c = model::TinyConfig();
  c.text.linear_attn_config.num_heads = 6;
  c.text.linear_attn_config.head_dim = 7;
  c.text.num_attention_heads = 10;
  c.text.intermediate_size = 12;
  c.text.moe_intermediate_size = 5;
  c.text.num_shared_experts = 4;
  c.text.num_experts = 14;
  c.text.vocab_size = 18;
  const parallel::ShardDims d = ShardDimsOf(c);
  EXPECT_EQ(d.kda_heads, 6);
  EXPECT_EQ(d.kda_head_dim, 7);
  EXPECT_EQ(d.mla_heads, 10);
  EXPECT_EQ(d.dense_rows, 12);
  EXPECT_EQ(d.shared_rows, 20);
  EXPECT_EQ(d.num_experts, 14);
  EXPECT_EQ(d.vocab_size, 18);
  // TP 2 divides every dimension; TP 4 does not divide the 6 KDA heads.
  EXPECT_TRUE(parallel::CheckTpSize(d, 2).ok());
  const absl::Status s = parallel::CheckTpSize(d, 4);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("linear_attn_config.num_heads = 6"),
            std::string::npos)
      << s;
}

}  // namespace
}  // namespace tandem::engine
