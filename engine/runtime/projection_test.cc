// The projection's inputs come from the code that serves the small checkpoints:
// SizeModelWeights is the loader's own walk (it must agree with LoadModelWeights
// byte for byte), the cache is the workers' sizing. These tests check that, then
// the K3 figures against values worked out by hand from the published config.
#include "engine/runtime/projection.h"

#include <cmath>

#include "engine/model/checkpoint.h"
#include "engine/model/config.h"
#include "engine/model/tensor_table.h"
#include "engine/runtime/test_util.h"
#include "engine/runtime/weights.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

constexpr char kK3Config[] = "engine/model/testdata/kimi_k3_config.json";

model::ModelConfig K3() {
  auto c = model::LoadModelConfig(kK3Config);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

uint64_t TableBytes(const model::ModelConfig& c) {
  uint64_t sum = 0;
  for (const model::ExpectedTensor& t : model::ExpectedTensors(c)) sum += t.nbytes();
  return sum;
}

TEST(SizeModelWeightsTest, AgreesWithTheLoaderOnEveryRank) {
  auto ckpt = model::Checkpoint::Open(testing::kTinyCheckpointDir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  for (int size : {1, 2, 4}) {
    for (int r = 0; r < size; ++r) {
      SCOPED_TRACE(::testing::Message() << "rank " << r << " of " << size);
      auto loaded = LoadModelWeights(**ckpt, {r, size});
      auto sized = SizeModelWeights((*ckpt)->config(), {r, size});
      ASSERT_TRUE(loaded.ok()) << loaded.status();
      ASSERT_TRUE(sized.ok()) << sized.status();
      EXPECT_EQ((*sized)->dense_bytes, (*loaded)->dense_bytes);
      EXPECT_EQ((*sized)->expert_bytes_each, (*loaded)->expert_bytes_each);
      EXPECT_EQ((*sized)->routed_expert_bytes, (*loaded)->routed_expert_bytes);
      EXPECT_EQ((*sized)->rank_bytes, (*loaded)->rank_bytes);
      EXPECT_EQ((*sized)->vocab_rows, (*loaded)->vocab_rows);
      EXPECT_GT((*sized)->rank_bytes, 0u);
      // Counting only: nothing points anywhere.
      EXPECT_EQ((*sized)->embed, nullptr);
      EXPECT_EQ((*sized)->layers.size(), (*loaded)->layers.size());
    }
  }
}

// At TP 1 a rank holds every text tensor exactly once: the walk's total is the
// tensor table's (which ValidateAgainstConfig and the generator use), less the
// zero padding of each KDA layer's A_log (stored rounded up to 128 heads; the
// loader views the heads only).
TEST(SizeModelWeightsTest, OneRankHoldsEveryTensorOnce) {
  auto ckpt = model::Checkpoint::Open(testing::kTinyCheckpointDir);
  ASSERT_TRUE(ckpt.ok());
  for (const model::ModelConfig& c : {(*ckpt)->config(), K3()}) {
    auto w = SizeModelWeights(c);
    ASSERT_TRUE(w.ok()) << w.status();
    const uint64_t padding =
        static_cast<uint64_t>(c.NumKdaLayers()) *
        (c.ALogPaddedLength() - c.text.linear_attn_config.num_heads) * 4;
    EXPECT_EQ((*w)->rank_bytes, TableBytes(c) - padding);
  }
}

// K3 by hand: L = routed_expert_hidden_size 3584, M = moe_intermediate_size 3072.
// w1, w3: [M, L/2] nibbles + [M, L/32] scales; w2: [L, M/2] + [L, M/32]; each
// 3072 * 1792 + 3072 * 112 = 5,849,088 bytes, three of them 17,547,264. 92 MoE
// layers (the first is dense) of 896 experts.
TEST(SizeModelWeightsTest, K3ExpertsByHandAndPartitionedAcrossRanks) {
  const model::ModelConfig c = K3();
  auto whole = SizeModelWeights(c);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ((*whole)->expert_bytes_each, 17'547'264u);
  EXPECT_EQ((*whole)->routed_expert_bytes, uint64_t{896} * 92 * 17'547'264u);
  // About 2.8T parameters: 2.72T in 1.45 TB of MXFP4 experts plus the BF16 rest.
  EXPECT_GT((*whole)->rank_bytes, 1'500'000'000'000u);
  EXPECT_LT((*whole)->rank_bytes, 2'000'000'000'000u);
  uint64_t experts = 0, held = 0;
  for (int r = 0; r < 8; ++r) {
    auto w = SizeModelWeights(c, {r, 8});
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ((*w)->routed_expert_bytes, uint64_t{112} * 92 * 17'547'264u);
    experts += (*w)->routed_expert_bytes;
    held += (*w)->rank_bytes;
  }
  EXPECT_EQ(experts, (*whole)->routed_expert_bytes);
  // Replicated tensors are held by every rank.
  EXPECT_GT(held, (*whole)->rank_bytes);
}

TEST(ProjectionTest, ExpectedExpertsTouched) {
  // One token reaches top_k of E: a rank owning `owned` expects owned * k / E.
  EXPECT_NEAR(ExpectedExpertsTouched(896, 16, 896, 1), 16.0, 1e-9);
  EXPECT_NEAR(ExpectedExpertsTouched(896, 16, 112, 1), 2.0, 1e-9);
  EXPECT_NEAR(ExpectedExpertsTouched(896, 16, 112, 8),
              112 * (1 - std::pow(880.0 / 896.0, 8)), 1e-9);
  // Monotone in the batch, bounded by what the rank owns.
  double last = 0;
  for (int64_t b : {1, 2, 8, 64, 512, 100000}) {
    const double t = ExpectedExpertsTouched(896, 16, 112, b);
    EXPECT_GT(t, last);
    EXPECT_LE(t, 112.0);
    last = t;
  }
  EXPECT_NEAR(last, 112.0, 1e-6);
  EXPECT_EQ(ExpectedExpertsTouched(896, 16, 112, 0), 0.0);
}

TEST(ProjectionTest, DecodeStepBytesOfOneRank) {
  auto ckpt = model::Checkpoint::Open(testing::kTinyCheckpointDir);
  ASSERT_TRUE(ckpt.ok());
  const model::ModelConfig& c = (*ckpt)->config();
  auto w = LoadModelWeights(**ckpt);
  ASSERT_TRUE(w.ok());
  int64_t moe = 0;
  for (const auto& l : c.Layers()) moe += l.ffn == model::FfnKind::kMoe;
  const DecodeStepBytes b = DecodeStepBytesPerRank(**w, 1, 100);
  EXPECT_EQ(b.dense, static_cast<double>((*w)->dense_bytes));
  EXPECT_NEAR(b.experts_touched, static_cast<double>(c.text.num_experts_per_token),
              1e-9);
  const double experts =
      static_cast<double>(moe * c.text.num_experts_per_token * (*w)->expert_bytes_each);
  EXPECT_NEAR(b.experts, experts, experts * 1e-12);
  EXPECT_DOUBLE_EQ(b.mla_cache, 100.0 * c.NumMlaLayers() * c.MlaCacheBytesPerToken());
  EXPECT_DOUBLE_EQ(b.kda_state, 2.0 * c.NumKdaLayers() * c.KdaStateBytesPerSequence());
  // A batch of 4 reads the cache and state 4 times, the dense weights once.
  const DecodeStepBytes b4 = DecodeStepBytesPerRank(**w, 4, 100);
  EXPECT_EQ(b4.dense, b.dense);
  EXPECT_DOUBLE_EQ(b4.mla_cache, 4 * b.mla_cache);
  EXPECT_DOUBLE_EQ(b4.kda_state, 4 * b.kda_state);
}

ProjectionInput K3OnB300() {
  ProjectionInput in;
  in.config = K3();
  auto hw = FindHardware("B300");
  EXPECT_TRUE(hw.ok()) << hw.status();
  in.hardware = *hw;
  in.batches = {1, 32};
  in.contexts = {4096, 1048576};
  in.handoff_prompts = {1048576};
  return in;
}

TEST(ProjectionTest, K3OnEightB300s) {
  auto p = Project(K3OnB300());
  ASSERT_TRUE(p.ok()) << p.status();
  // Every rank's weights fit, and the node holds at least the whole model.
  EXPECT_LT(p->max_rank_bytes, static_cast<uint64_t>(288e9 * 0.9));
  EXPECT_GE(p->node_weight_bytes, p->total_weight_bytes);
  EXPECT_EQ(p->collectives_per_step, 2 + 2 * 93);
  // The workers' sizing: what the budget leaves after the weights and the
  // assumed activation peak, on every rank.
  const int64_t per_device = static_cast<int64_t>(0.9 * 288e9) -
                             static_cast<int64_t>(p->max_rank_bytes) -
                             (int64_t{8} << 30);
  EXPECT_NEAR(static_cast<double>(p->memory.budget_per_device_bytes),
              static_cast<double>(per_device), 1.0);
  EXPECT_EQ(p->memory.budget_bytes, 8 * p->memory.budget_per_device_bytes);
  EXPECT_GT(p->cache.num_blocks, 0);
  EXPECT_LE(p->cache.total_bytes(), p->memory.budget_bytes);
  ASSERT_EQ(p->decode.size(), 4u);
  // batch 1 at 4k: rank 0's dense slice + 2 experts per MoE layer + the latent
  // of 4096 tokens + its 12 KDA heads' state read and written, at 8 TB/s.
  const DecodeProjection& d = p->decode[0];
  EXPECT_EQ(d.batch, 1);
  EXPECT_EQ(d.context, 4096);
  EXPECT_NEAR(d.bytes.experts, 92 * 2.0 * 17'547'264, 1e-3);
  EXPECT_DOUBLE_EQ(d.bytes.mla_cache, 4096.0 * 24 * 576 * 2);
  const double kda_layer = 96.0 * 128 * 128 * 4 + 3.0 * 3 * 96 * 128 * 4;
  EXPECT_DOUBLE_EQ(d.bytes.kda_state, 2.0 * 69 * kda_layer / 8);
  EXPECT_DOUBLE_EQ(d.roofline_s, d.bytes.total() / 8e12);
  EXPECT_DOUBLE_EQ(d.efficiency, 1.0);
  EXPECT_GT(d.collectives_s, 188 * 10e-6);
  EXPECT_DOUBLE_EQ(d.step_s, d.roofline_s + d.collectives_s);
  EXPECT_TRUE(d.fits);
  // 32 sequences of 1M tokens do not fit one node's cache.
  EXPECT_FALSE(p->decode[3].fits);
  ASSERT_EQ(p->handoff.size(), 1u);
  const double latent = 1048576.0 * 24 * 576 * 2;
  EXPECT_DOUBLE_EQ(p->handoff[0].bytes_sent, 8 * latent + 69 * kda_layer);
  EXPECT_DOUBLE_EQ(p->handoff[0].bytes_latent_once, latent + 69 * kda_layer);
  EXPECT_DOUBLE_EQ(p->handoff[0].network_s, p->handoff[0].bytes_sent / 800e9);
}

// K3 per token: about 104B active parameters (the published figure), so about
// 2 x 102B matrix FLOPs at TP 1 without lm_head; a TP 8 rank computes its
// slices, every replicated matrix, and 16/8 experts per MoE layer.
TEST(ProjectionTest, MatrixFlopsPerToken) {
  const model::ModelConfig c = K3();
  auto whole = SizeModelWeights(c);
  ASSERT_TRUE(whole.ok());
  const double one = MatrixFlopsPerToken(**whole);
  EXPECT_GT(one, 2 * 100e9);
  EXPECT_LT(one, 2 * 104e9);
  // The routed part by hand: 92 layers x 16 experts x 3 x 3072 x 3584 weights.
  const double routed = 2.0 * 92 * 16 * 3 * 3072 * 3584;
  const double dense_tp1 = one - routed;
  auto r0 = SizeModelWeights(c, {0, 8});
  ASSERT_TRUE(r0.ok());
  const double rank = MatrixFlopsPerToken(**r0);
  EXPECT_NEAR(rank - routed / 8,
              2.0 * ((*r0)->dense_bytes - (*r0)->vocab_rows * 7168.0 * 2) / 2, 1.0);
  // A rank does more than an eighth: the replicated matrices run on all eight.
  EXPECT_GT(rank, one / 8);
  EXPECT_LT(rank - routed / 8, dense_tp1);
}

TEST(ProjectionTest, AttentionFlopsByHandAndAdditive) {
  const model::ModelConfig c = K3();
  // Two tokens at TP 8: 1 + 2 attended positions; MLA 2 x 12 heads x (128 + 64 +
  // 128) per pair over 24 layers; KDA 8 x 128^2 per head per token, 12 heads,
  // 69 layers.
  const double mla = 24 * 2.0 * 12 * 320 * 3;
  const double kda = 69 * 12 * 8.0 * 128 * 128 * 2;
  EXPECT_DOUBLE_EQ(AttentionFlops(c, 8, 0, 2), mla + kda);
  EXPECT_EQ(AttentionFlops(c, 8, 5, 5), 0.0);
  // Chunks add up to the whole prompt.
  const double whole = AttentionFlops(c, 8, 0, 10000);
  const double parts =
      AttentionFlops(c, 8, 0, 8192) + AttentionFlops(c, 8, 8192, 10000);
  EXPECT_NEAR(parts, whole, whole * 1e-12);
}

TEST(ProjectionTest, PrefillIsChunkedAndBounded) {
  ProjectionInput in = K3OnB300();
  in.handoff_prompts = {4096, 20000};
  auto p = Project(in);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->prefill.size(), 2u);
  const PrefillProjection& a = p->prefill[0];
  EXPECT_EQ(a.chunks, 1);
  auto r0 = SizeModelWeights(in.config, {0, 8});
  ASSERT_TRUE(r0.ok());
  EXPECT_NEAR(a.matrix_flops, 4096 * MatrixFlopsPerToken(**r0), 1e3);
  EXPECT_DOUBLE_EQ(a.attention_flops, AttentionFlops(in.config, 8, 0, 4096));
  // One chunk: the larger of its arithmetic and its weight bytes. On "cuda" (the
  // default) a matrix product takes two mma, an attention one three.
  EXPECT_EQ(in.backend, "cuda");
  EXPECT_DOUBLE_EQ(a.tensor_flops, 2 * a.matrix_flops + 3 * a.attention_flops);
  const double compute = a.tensor_flops / 2250e12;
  EXPECT_DOUBLE_EQ(a.bound_s, std::max(compute, a.weight_bytes / 8e12));
  EXPECT_DOUBLE_EQ(a.at_efficiency_s, std::max(compute / 0.4, a.weight_bytes / 8e12));
  const PrefillProjection& b = p->prefill[1];
  EXPECT_EQ(b.chunks, 3);  // 8192 + 8192 + 3616
  EXPECT_NEAR(b.attention_flops, AttentionFlops(in.config, 8, 0, 20000),
              b.attention_flops * 1e-12);
  EXPECT_DOUBLE_EQ(b.tokens_per_s, 20000 / b.at_efficiency_s);
  in.prefill_efficiency = 0;
  EXPECT_EQ(Project(in).status().code(), absl::StatusCode::kInvalidArgument);
}

// "cuda_bf16" rounds the tensor cores' operands once: one mma a product, the same
// FLOPs; a prompt whose chunk is compute-bound on both is 2-3x faster there.
TEST(ProjectionTest, PrefillTensorWorkFollowsTheBackend) {
  ProjectionInput in = K3OnB300();
  in.handoff_prompts = {131072};
  auto exact = Project(in);
  in.backend = "cuda_bf16";
  auto bf16 = Project(in);
  ASSERT_TRUE(exact.ok() && bf16.ok());
  const PrefillProjection &e = exact->prefill[0], &b = bf16->prefill[0];
  EXPECT_DOUBLE_EQ(b.matrix_flops, e.matrix_flops);
  EXPECT_DOUBLE_EQ(b.attention_flops, e.attention_flops);
  EXPECT_DOUBLE_EQ(b.tensor_flops, b.matrix_flops + b.attention_flops);
  const double ratio = e.at_efficiency_s / b.at_efficiency_s;
  EXPECT_GT(ratio, 2.0);
  EXPECT_LT(ratio, 3.0);
  in.backend = "cpu";
  EXPECT_EQ(Project(in).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ProjectionTest, MeasuredEfficiencyOfTheNearestBatch) {
  ProjectionInput in = K3OnB300();
  in.batches = {1, 32};
  in.contexts = {4096};
  in.bandwidth_share = 0.9;
  in.efficiency_by_batch = {{1, 0.5}, {64, 0.8}};
  auto p = Project(in);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->decode.size(), 2u);
  EXPECT_DOUBLE_EQ(p->decode[0].efficiency, 0.9 * 0.5);
  EXPECT_DOUBLE_EQ(p->decode[1].efficiency, 0.9 * 0.8);  // 32 is nearer 64 than 1
  EXPECT_DOUBLE_EQ(p->decode[1].step_s,
                   p->decode[1].roofline_s / (0.9 * 0.8) + p->decode[1].collectives_s);
}

TEST(ProjectionTest, RefusesBadInput) {
  ProjectionInput in = K3OnB300();
  in.tp = 5;  // 96 heads do not split 5 ways
  EXPECT_EQ(Project(in).status().code(), absl::StatusCode::kInvalidArgument);
  in = K3OnB300();
  in.bandwidth_share = 0;
  EXPECT_EQ(Project(in).status().code(), absl::StatusCode::kInvalidArgument);
  in = K3OnB300();
  in.efficiency_by_batch = {{8, 3.0}};
  EXPECT_EQ(Project(in).status().code(), absl::StatusCode::kInvalidArgument);
  in = K3OnB300();
  in.contexts = {};
  EXPECT_EQ(Project(in).status().code(), absl::StatusCode::kInvalidArgument);
  in = K3OnB300();
  in.batches = {0};
  EXPECT_EQ(Project(in).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(FindHardware("a100").status().code(), absl::StatusCode::kNotFound);
  // K3 on one H100: the weights alone do not fit; the budget says what would.
  in = K3OnB300();
  in.tp = 1;
  auto h100 = FindHardware("h100");
  ASSERT_TRUE(h100.ok());
  in.hardware = *h100;
  EXPECT_EQ(Project(in).status().code(), absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace tandem::engine
