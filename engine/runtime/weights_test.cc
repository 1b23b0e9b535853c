// ModelWeights over the tiny checkpoint: pointers are the mapped tensors
// themselves (no copies), small gains are exact fp32 conversions, the layer
// schedule and expert tables follow the config, TP sizes > 1 are refused.
#include "engine/runtime/weights.h"

#include "engine/model/bf16.h"
#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"

namespace tandem::runtime {
namespace {

TEST(WeightsTest, ViewsPointIntoTheCheckpoint) {
  auto ckpt = model::Checkpoint::Open(testing::kTinyCheckpointDir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto w = LoadModelWeights(**ckpt);
  ASSERT_TRUE(w.ok()) << w.status();
  const model::ModelConfig& c = (*w)->config;
  ASSERT_EQ((*w)->layers.size(), static_cast<size_t>(c.text.num_hidden_layers));
  auto embed = (*ckpt)->Get("model.embed_tokens.weight");
  ASSERT_TRUE(embed.ok());
  EXPECT_EQ(reinterpret_cast<const uint8_t*>((*w)->embed), embed->data);
  int kda = 0, mla = 0;
  for (const LayerWeights& l : (*w)->layers) {
    const std::string p = "model.layers." + std::to_string(l.spec.index) + ".";
    if (l.spec.attention == model::AttentionKind::kKda) {
      EXPECT_EQ(l.kda_index, kda++);
      auto q = (*ckpt)->Get(p + "self_attn.q_proj.weight");
      ASSERT_TRUE(q.ok());
      EXPECT_EQ(reinterpret_cast<const uint8_t*>(l.kda.q_proj), q->data);
    } else {
      EXPECT_EQ(l.mla_index, mla++);
      ASSERT_EQ(l.mla.kv_a_norm.size(), static_cast<size_t>(c.text.kv_lora_rank));
    }
    auto norm = (*ckpt)->Get(p + "input_layernorm.weight");
    ASSERT_TRUE(norm.ok());
    auto bits = norm->BF16Bits();
    ASSERT_TRUE(bits.ok());
    for (size_t i = 0; i < bits->size(); ++i) {
      ASSERT_EQ(l.input_norm[i], model::Bf16ToFloat((*bits)[i]));
    }
    if (l.spec.ffn == model::FfnKind::kMoe) {
      ASSERT_EQ(l.moe.experts.size(), static_cast<size_t>(c.text.num_experts));
      for (const auto& e : l.moe.experts) EXPECT_NE(e.w2_scale, nullptr);
    } else {
      EXPECT_NE(l.dense.gate, nullptr);
    }
  }
  EXPECT_EQ(kda, c.NumKdaLayers());
  EXPECT_EQ(mla, c.NumMlaLayers());
  EXPECT_GT((*w)->expert_bytes_each, 0u);
  EXPECT_GT((*w)->dense_bytes, 0u);
}

TEST(WeightsTest, RefusesTensorParallelShards) {
  auto ckpt = model::Checkpoint::Open(testing::kTinyCheckpointDir);
  ASSERT_TRUE(ckpt.ok());
  EXPECT_FALSE(LoadModelWeights(**ckpt, ShardSpec{1, 2}).ok());
}

TEST(ShardSpecTest, EvenSplitsCoverEverything) {
  for (int size : {1, 2, 8}) {
    int64_t covered = 0;
    for (int r = 0; r < size; ++r) {
      ShardSpec s{r, size};
      EXPECT_EQ(s.Begin(96), covered);
      covered = s.End(96);
    }
    EXPECT_EQ(covered, 96);
  }
  EXPECT_TRUE((ShardSpec{3, 8}.OwnsExpert(11)));
  EXPECT_FALSE((ShardSpec{2, 8}.OwnsExpert(11)));
}

}  // namespace
}  // namespace tandem::runtime
