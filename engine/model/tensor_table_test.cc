#include "engine/model/tensor_table.h"

#include <map>
#include <set>

#include "gtest/gtest.h"

namespace tandem::model {
namespace {

constexpr char kPublished[] = "engine/model/testdata/kimi_k3_config.json";

std::map<std::string, ExpectedTensor> ByName(const ModelConfig& c) {
  std::map<std::string, ExpectedTensor> m;
  for (const ExpectedTensor& t : ExpectedTensors(c)) {
    EXPECT_TRUE(m.emplace(t.name, t).second) << "duplicate " << t.name;
  }
  return m;
}

TEST(TensorTableTest, PublishedShapesAndDtypes) {
  auto c = LoadModelConfig(kPublished);
  ASSERT_TRUE(c.ok()) << c.status();
  auto m = ByName(*c);
  auto expect = [&](const std::string& name, DType dtype, std::vector<int64_t> shape) {
    auto it = m.find("language_model." + name);
    ASSERT_NE(it, m.end()) << name;
    EXPECT_EQ(it->second.dtype, dtype) << name;
    EXPECT_EQ(it->second.shape, shape) << name;
  };
  expect("model.embed_tokens.weight", DType::kBF16, {163840, 7168});
  expect("lm_head.weight", DType::kBF16, {163840, 7168});
  expect("model.norm.weight", DType::kBF16, {7168});
  expect("model.output_attn_res_proj.weight", DType::kBF16, {1, 7168});
  expect("model.output_attn_res_norm.weight", DType::kBF16, {7168});
  // Layer 0: KDA + dense MLP.
  expect("model.layers.0.self_attn.q_proj.weight", DType::kBF16, {12288, 7168});
  expect("model.layers.0.self_attn.q_conv1d.weight", DType::kF32, {12288, 1, 4});
  expect("model.layers.0.self_attn.A_log", DType::kF32, {128});
  expect("model.layers.0.self_attn.dt_bias", DType::kF32, {12288});
  expect("model.layers.0.self_attn.f_a_proj.weight", DType::kBF16, {128, 7168});
  expect("model.layers.0.self_attn.f_b_proj.weight", DType::kBF16, {12288, 128});
  expect("model.layers.0.self_attn.b_proj.weight", DType::kBF16, {96, 7168});
  expect("model.layers.0.self_attn.g_proj.weight", DType::kBF16, {12288, 7168});
  expect("model.layers.0.self_attn.o_norm.weight", DType::kF32, {128});
  expect("model.layers.0.self_attn.o_proj.weight", DType::kBF16, {7168, 12288});
  expect("model.layers.0.mlp.gate_proj.weight", DType::kBF16, {33792, 7168});
  expect("model.layers.0.mlp.down_proj.weight", DType::kBF16, {7168, 33792});
  expect("model.layers.0.self_attention_res_proj.weight", DType::kBF16, {1, 7168});
  expect("model.layers.0.mlp_res_norm.weight", DType::kBF16, {7168});
  // Layer 3 (1-based 4): MLA + MoE.
  expect("model.layers.3.self_attn.q_a_proj.weight", DType::kBF16, {1536, 7168});
  expect("model.layers.3.self_attn.q_b_proj.weight", DType::kBF16, {96 * 192, 1536});
  expect("model.layers.3.self_attn.kv_a_proj_with_mqa.weight", DType::kBF16,
         {576, 7168});
  expect("model.layers.3.self_attn.kv_a_layernorm.weight", DType::kBF16, {512});
  expect("model.layers.3.self_attn.kv_b_proj.weight", DType::kBF16, {96 * 256, 512});
  expect("model.layers.3.self_attn.o_proj.weight", DType::kBF16, {7168, 12288});
  expect("model.layers.3.self_attn.g_proj.weight", DType::kBF16, {12288, 7168});
  expect("model.layers.3.block_sparse_moe.gate.weight", DType::kBF16, {896, 7168});
  expect("model.layers.3.block_sparse_moe.gate.e_score_correction_bias", DType::kF32,
         {896});
  expect("model.layers.3.block_sparse_moe.routed_expert_down_proj.weight", DType::kBF16,
         {3584, 7168});
  expect("model.layers.3.block_sparse_moe.routed_expert_up_proj.weight", DType::kBF16,
         {7168, 3584});
  expect("model.layers.3.block_sparse_moe.routed_expert_norm.weight", DType::kBF16,
         {3584});
  expect("model.layers.3.block_sparse_moe.shared_experts.gate_proj.weight",
         DType::kBF16, {6144, 7168});
  expect("model.layers.3.block_sparse_moe.shared_experts.down_proj.weight",
         DType::kBF16, {7168, 6144});
  expect("model.layers.3.block_sparse_moe.experts.895.w1.weight_packed", DType::kU8,
         {3072, 1792});
  expect("model.layers.3.block_sparse_moe.experts.895.w1.weight_scale", DType::kU8,
         {3072, 112});
  expect("model.layers.3.block_sparse_moe.experts.0.w2.weight_packed", DType::kU8,
         {3584, 1536});
  expect("model.layers.3.block_sparse_moe.experts.0.w2.weight_scale", DType::kU8,
         {3584, 96});
  expect("model.layers.92.self_attn.kv_b_proj.weight", DType::kBF16, {96 * 256, 512});
  // Absent: no MoE on layer 0, no KDA tensors on MLA layers, no expert 896.
  EXPECT_EQ(m.count("language_model.model.layers.0.block_sparse_moe.gate.weight"), 0u);
  EXPECT_EQ(m.count("language_model.model.layers.3.self_attn.A_log"), 0u);
  EXPECT_EQ(m.count("language_model.model.layers.3.block_sparse_moe.experts.896.w1."
                    "weight_packed"),
            0u);
}

TEST(TensorTableTest, PublishedCountsAndBytes) {
  auto c = LoadModelConfig(kPublished);
  ASSERT_TRUE(c.ok());
  auto table = ExpectedTensors(*c);
  // 5 global + 93*6 per layer + 69*14 KDA + 24*8 MLA + 3 dense + 92*(8 + 896*6).
  EXPECT_EQ(table.size(), 5u + 93 * 6 + 69 * 14 + 24 * 8 + 3 + 92 * (8 + 896 * 6));
  // One routed expert is 17,547,264 bytes (w1+w3+w2, packed+scale).
  uint64_t expert_bytes = 0;
  for (const auto& t : table) {
    if (t.layer == 1 &&
        t.name.find("block_sparse_moe.experts.0.") != std::string::npos) {
      expert_bytes += t.nbytes();
    }
  }
  EXPECT_EQ(expert_bytes, 17547264u);
}

TEST(TensorTableTest, PrefixHelpers) {
  EXPECT_EQ(StripTextPrefix("language_model.model.norm.weight"), "model.norm.weight");
  EXPECT_EQ(StripTextPrefix("model.norm.weight"), "model.norm.weight");
  EXPECT_TRUE(IsVisionTensor("vision_tower.blocks.0.w"));
  EXPECT_TRUE(IsVisionTensor("mm_projector.proj.weight"));
  EXPECT_FALSE(IsVisionTensor("model.norm.weight"));
}

}  // namespace
}  // namespace tandem::model
