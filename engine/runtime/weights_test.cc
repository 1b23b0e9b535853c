// ModelWeights over the tiny checkpoint: pointers are the mapped tensors
// themselves (no copies), small gains are exact fp32 conversions, the layer
// schedule and expert tables follow the config; TP shards are slices of the
// same mapping, sizes the config does not divide are refused.
#include "engine/runtime/weights.h"

#include "engine/model/bf16.h"
#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"

namespace tandem::engine {
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

// Every rank's views are offsets into the same mapped tensors (row slices) or
// column offsets with the full leading dimension; experts are dealt round-robin.
TEST(WeightsTest, ShardsAreSlicesOfTheMappedTensors) {
  auto ckpt = model::Checkpoint::Open(testing::kTinyCheckpointDir);
  ASSERT_TRUE(ckpt.ok());
  auto full = LoadModelWeights(**ckpt);
  ASSERT_TRUE(full.ok());
  const model::TextConfig& t = (*full)->config.text;
  const int64_t H = t.hidden_size, V = t.vocab_size;
  const int64_t P = (*full)->config.KdaProjectionSize();
  const int64_t d = t.linear_attn_config.head_dim;
  for (int size : {2, 4}) {
    uint64_t dense_sum = 0;
    for (int r = 0; r < size; ++r) {
      auto w = LoadModelWeights(**ckpt, ShardSpec{r, size});
      ASSERT_TRUE(w.ok()) << w.status();
      const ModelWeights& s = **w;
      EXPECT_EQ(s.vocab_begin, V * r / size);
      EXPECT_EQ(s.vocab_rows, V / size);
      EXPECT_EQ(s.embed, (*full)->embed + s.vocab_begin * H);
      EXPECT_EQ(s.lm_head, (*full)->lm_head + s.vocab_begin * H);
      dense_sum += s.dense_bytes;
      for (size_t l = 0; l < s.layers.size(); ++l) {
        const LayerWeights& a = s.layers[l];
        const LayerWeights& f = (*full)->layers[l];
        if (a.spec.attention == model::AttentionKind::kKda) {
          const int64_t c0 = P * r / size;
          EXPECT_EQ(a.kda.heads, t.linear_attn_config.num_heads / size);
          EXPECT_EQ(a.kda.q_proj, f.kda.q_proj + c0 * H);
          EXPECT_EQ(a.kda.f_b_proj, f.kda.f_b_proj + c0 * d);
          EXPECT_EQ(a.kda.q_conv,
                    f.kda.q_conv + c0 * t.linear_attn_config.short_conv_kernel_size);
          EXPECT_EQ(a.kda.dt_bias, f.kda.dt_bias + c0);
          EXPECT_EQ(a.kda.a_log, f.kda.a_log + c0 / d);
          EXPECT_EQ(a.kda.f_a_proj, f.kda.f_a_proj);   // replicated
          EXPECT_EQ(a.kda.o_proj, f.kda.o_proj + c0);  // columns
          EXPECT_EQ(a.kda.o_proj_ld, P);
        } else {
          const int64_t h0 = t.num_attention_heads * r / size;
          EXPECT_EQ(a.mla.heads, t.num_attention_heads / size);
          EXPECT_EQ(a.mla.q_a_proj, f.mla.q_a_proj);
          EXPECT_EQ(a.mla.kv_a_proj, f.mla.kv_a_proj);
          EXPECT_EQ(a.mla.o_proj, f.mla.o_proj + h0 * t.v_head_dim);
          EXPECT_EQ(a.mla.o_proj_ld, f.mla.o_proj_ld);
          EXPECT_EQ(a.mla.kv_b_proj,
                    f.mla.kv_b_proj +
                        h0 * (t.qk_nope_head_dim + t.v_head_dim) * t.kv_lora_rank);
        }
        if (a.spec.ffn == model::FfnKind::kDense) {
          EXPECT_EQ(a.dense.inter, t.intermediate_size / size);
          EXPECT_EQ(a.dense.down_ld, t.intermediate_size);
          EXPECT_EQ(a.dense.gate, f.dense.gate + a.dense.inter * r * H);
          EXPECT_EQ(a.dense.down, f.dense.down + a.dense.inter * r);
        } else {
          EXPECT_EQ(a.moe.router, f.moe.router);
          EXPECT_EQ(a.moe.shared.down, f.moe.shared.down + a.moe.shared.inter * r);
          for (int64_t e = 0; e < t.num_experts; ++e) {
            if (e % size == r) {
              EXPECT_EQ(a.moe.experts[e].w1_packed, f.moe.experts[e].w1_packed);
            } else {
              EXPECT_EQ(a.moe.experts[e].w1_packed, nullptr);
            }
          }
        }
      }
    }
    // The split matrices add up; replicated ones are counted on every rank.
    EXPECT_GT(dense_sum, (*full)->dense_bytes);
  }
}

TEST(WeightsTest, RefusesSizesTheConfigDoesNotDivide) {
  auto ckpt = model::Checkpoint::Open(testing::kTinyCheckpointDir);
  ASSERT_TRUE(ckpt.ok());
  auto w = LoadModelWeights(**ckpt, ShardSpec{0, 8});
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(w.status().message().find("linear_attn_config.num_heads = 4"),
            std::string::npos)
      << w.status();
  EXPECT_FALSE(LoadModelWeights(**ckpt, ShardSpec{2, 2}).ok());
  EXPECT_FALSE(LoadModelWeights(**ckpt, ShardSpec{0, 3}).ok());
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
}  // namespace tandem::engine
