#include "kvtransfer/plan.h"

#include <map>
#include <numeric>
#include <string>

#include "gtest/gtest.h"

namespace tandem::kvtransfer {
namespace {

using tandem::v1::KvLayout;

KvLayout K3Layout(int block_size, int mla_layers = 2, int kda_layers = 2) {
  KvLayout l;
  l.set_block_size(block_size);
  l.set_num_mla_layers(mla_layers);
  l.set_num_kda_layers(kda_layers);
  l.set_mla_token_bytes(1152);
  l.set_kda_state_bytes(96 * 128 * 128 * 4);
  l.set_kda_conv_bytes(3 * 3 * 96 * 128 * 4);
  l.set_tp_rank(0);
  l.set_tp_size(1);
  return l;
}

std::vector<int32_t> Ids(std::initializer_list<int32_t> ids) { return ids; }

// Simulates a plan: copies every byte through the segments and checks that the
// receiver's token order equals the sender's, by tagging each byte with its
// (layer, token, byte) on the sender side.
struct PlanCase {
  std::string name;
  int src_block;
  int dst_block;
  int64_t tokens;
  std::vector<int32_t> src_blocks;
  std::vector<int32_t> dst_blocks;
  int64_t want_raw;        // pieces before coalescing, MLA layer 0
  int64_t want_coalesced;  // after, MLA layer 0
};

class PlanLayerTest : public ::testing::TestWithParam<PlanCase> {};

TEST_P(PlanLayerTest, SegmentsCoverTokensInOrder) {
  const PlanCase& c = GetParam();
  RankLayout src = ContiguousRankLayout(K3Layout(c.src_block), 16, 2, /*region=*/1);
  RankLayout dst = ContiguousRankLayout(K3Layout(c.dst_block), 16, 2, /*region=*/9);
  src.block_ids = c.src_blocks;
  dst.block_ids = c.dst_blocks;
  auto plan = PlanLayer(src, dst, {LayerKind::kMla, 0}, c.tokens);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->segments_before_coalescing, c.want_raw);
  EXPECT_EQ(static_cast<int64_t>(plan->segments.size()), c.want_coalesced);
  EXPECT_EQ(plan->bytes, static_cast<uint64_t>(c.tokens) * 1152);
  // Every token byte lands where the receiver expects that token.
  std::map<uint64_t, uint64_t>
      dst_of_src;  // src offset -> dst offset (per byte run start)
  uint64_t covered = 0;
  for (const Segment& s : plan->segments) {
    EXPECT_EQ(s.local_region, 1u);
    EXPECT_EQ(s.remote_region, 9u);
    for (uint64_t b = 0; b < s.length; b += 1152 / 4) {
      const uint64_t so = s.local_offset + b;
      const uint64_t do_ = s.remote_offset + b;
      // Token index from each side's layout.
      const uint64_t sblock_pos = so / (c.src_block * 1152);
      const uint64_t sin = so % (c.src_block * 1152);
      const auto sit = std::find(c.src_blocks.begin(), c.src_blocks.end(), sblock_pos);
      ASSERT_NE(sit, c.src_blocks.end());
      const uint64_t stoken = (sit - c.src_blocks.begin()) * c.src_block + sin / 1152;
      const uint64_t dblock_pos = do_ / (c.dst_block * 1152);
      const uint64_t din = do_ % (c.dst_block * 1152);
      const auto dit = std::find(c.dst_blocks.begin(), c.dst_blocks.end(), dblock_pos);
      ASSERT_NE(dit, c.dst_blocks.end());
      const uint64_t dtoken = (dit - c.dst_blocks.begin()) * c.dst_block + din / 1152;
      EXPECT_EQ(stoken, dtoken);
      EXPECT_EQ(sin % 1152, din % 1152);
    }
    covered += s.length;
  }
  EXPECT_EQ(covered, plan->bytes);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, PlanLayerTest,
    ::testing::Values(
        // Same block size, blocks adjacent on both sides: one segment.
        PlanCase{"same_contiguous", 16, 16, 64, Ids({0, 1, 2, 3}), Ids({4, 5, 6, 7}), 4,
                 1},
        // Same block size, receiver scattered: one per block.
        PlanCase{"same_scattered", 16, 16, 64, Ids({0, 1, 2, 3}), Ids({7, 2, 5, 0}), 4,
                 4},
        // Partial last block.
        PlanCase{"partial_last", 16, 16, 40, Ids({3, 4, 5}), Ids({3, 4, 5}), 3, 1},
        // Different block sizes, contiguous both sides: still one segment.
        PlanCase{"16_to_64_contiguous", 16, 64, 128, Ids({0, 1, 2, 3, 4, 5, 6, 7}),
                 Ids({2, 3}), 8, 1},
        // 64 -> 16, receiver blocks scattered: cut at every receiver block.
        PlanCase{"64_to_16_scattered", 64, 16, 100, Ids({1, 0}),
                 Ids({9, 3, 8, 2, 7, 1, 6}), 7, 7},
        // 16 -> 64 with sender scattered.
        PlanCase{"16_to_64_scattered", 16, 64, 80, Ids({5, 1, 9, 0, 3}), Ids({0, 1}), 5,
                 5},
        // A single token.
        PlanCase{"one_token", 64, 16, 1, Ids({3}), Ids({11}), 1, 1},
        // Zero tokens: nothing to send.
        PlanCase{"zero_tokens", 16, 16, 0, Ids({}), Ids({}), 0, 0}),
    [](const ::testing::TestParamInfo<PlanCase>& info) { return info.param.name; });

TEST(PlanTest, KdaLayerStateAndConvCoalesce) {
  RankLayout src = ContiguousRankLayout(K3Layout(16), 4, 3, 1);
  RankLayout dst = ContiguousRankLayout(K3Layout(64), 4, 5, 2);
  src.state_slot = 2;
  dst.state_slot = 4;
  auto plan = PlanLayer(src, dst, {LayerKind::kKda, 1}, 0);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->segments_before_coalescing, 2);
  ASSERT_EQ(plan->segments.size(), 1u);
  const uint64_t slot = src.layout.kda_state_bytes() + src.layout.kda_conv_bytes();
  EXPECT_EQ(plan->segments[0].length, slot);
  EXPECT_EQ(plan->segments[0].local_offset, src.kda[1].offset + 2 * slot);
  EXPECT_EQ(plan->segments[0].remote_offset, dst.kda[1].offset + 4 * slot);
}

TEST(PlanTest, SeparateConvTailsStaySeparate) {
  RankLayout src = ContiguousRankLayout(K3Layout(16), 4, 3, 1);
  RankLayout dst = ContiguousRankLayout(K3Layout(16), 4, 3, 2);
  // Receiver keeps conv tails 4 KiB after the state (padding).
  for (KdaPool& p : dst.kda) {
    p.conv_offset = dst.layout.kda_state_bytes() + 4096;
    p.slot_stride = p.conv_offset + dst.layout.kda_conv_bytes();
  }
  auto plan = PlanLayer(src, dst, {LayerKind::kKda, 0}, 0);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->segments.size(), 2u);
  EXPECT_EQ(plan->segments[1].remote_offset - plan->segments[0].remote_offset,
            dst.layout.kda_state_bytes() + 4096);
}

TEST(PlanTest, PlanAllCoalescesAcrossLayers) {
  // One block per layer pool, sequence in block 0 on both sides, full block: the
  // layers' caches are back to back, so all MLA layers merge into one segment.
  KvLayout l = K3Layout(16, 3, 2);
  RankLayout src = ContiguousRankLayout(l, 1, 1, 1);
  RankLayout dst = ContiguousRankLayout(l, 1, 1, 2);
  src.block_ids = dst.block_ids = {0};
  auto plan = PlanAll(src, dst, 16);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->segments_before_coalescing, 3 + 2 * 2);
  ASSERT_EQ(plan->segments.size(), 1u);
  EXPECT_EQ(plan->bytes, ContiguousRegionBytes(l, 1, 1));
}

TEST(PlanTest, PerLayerPlansConcatenateToPlanAll) {
  KvLayout l = K3Layout(16, 2, 2);
  RankLayout src = ContiguousRankLayout(l, 8, 2, 1);
  RankLayout dst = ContiguousRankLayout(K3Layout(64, 2, 2), 8, 2, 2);
  src.block_ids = {7, 6, 5, 4, 3};
  dst.block_ids = {1, 0};
  dst.state_slot = 1;
  uint64_t bytes = 0;
  for (LayerRef layer : {LayerRef{LayerKind::kMla, 0}, LayerRef{LayerKind::kMla, 1},
                         LayerRef{LayerKind::kKda, 0}, LayerRef{LayerKind::kKda, 1}}) {
    auto p = PlanLayer(src, dst, layer, 70);
    ASSERT_TRUE(p.ok());
    bytes += p->bytes;
  }
  auto all = PlanAll(src, dst, 70);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->bytes, bytes);
  EXPECT_EQ(bytes, 2u * 70 * 1152 + 2u * (l.kda_state_bytes() + l.kda_conv_bytes()));
}

TEST(PlanTest, CoalesceMergesOnlyWhenContiguousOnBothSides) {
  std::vector<Segment> s = {{1, 0, 2, 100, 10},
                            {1, 10, 2, 110, 5},   // merge
                            {1, 15, 2, 200, 5},   // remote gap
                            {1, 30, 2, 205, 5},   // local gap
                            {3, 35, 2, 210, 5}};  // other region
  EXPECT_EQ(Coalesce(&s), 4u);
  EXPECT_EQ(s[0], (Segment{1, 0, 2, 100, 15}));
  EXPECT_EQ(s[3], (Segment{3, 35, 2, 210, 5}));
  std::vector<Segment> empty;
  EXPECT_EQ(Coalesce(&empty), 0u);
}

struct BadCase {
  std::string name;
  std::function<void(RankLayout* src, RankLayout* dst)> mutate;
  std::string message;
};

class PlanValidationTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(PlanValidationTest, Rejected) {
  RankLayout src = ContiguousRankLayout(K3Layout(16), 8, 2, 1);
  RankLayout dst = ContiguousRankLayout(K3Layout(64), 8, 2, 2);
  src.block_ids = {0, 1, 2, 3};
  dst.block_ids = {0};
  GetParam().mutate(&src, &dst);
  auto plan = PlanAll(src, dst, 64);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find(GetParam().message), std::string::npos)
      << plan.status().message();
}

INSTANTIATE_TEST_SUITE_P(
    Cases, PlanValidationTest,
    ::testing::Values(
        BadCase{"short_block_table",
                [](RankLayout* s, RankLayout*) { s->block_ids.pop_back(); },
                "block table too short"},
        BadCase{"token_bytes",
                [](RankLayout*, RankLayout* d) { d->layout.set_mla_token_bytes(1024); },
                "MLA token bytes mismatch"},
        BadCase{"mla_layers",
                [](RankLayout*, RankLayout* d) {
                  d->layout.set_num_mla_layers(3);
                  d->mla.push_back(d->mla.back());
                },
                "MLA layer count mismatch"},
        BadCase{"pool_count", [](RankLayout* s, RankLayout*) { s->kda.pop_back(); },
                "layer count mismatch"},
        BadCase{"tp_size", [](RankLayout*, RankLayout* d) { d->layout.set_tp_size(8); },
                "TP size mismatch"},
        BadCase{"dtype",
                [](RankLayout*, RankLayout* d) { d->layout.set_mla_dtype("fp8_e4m3"); },
                "MLA dtype mismatch"},
        BadCase{"kda_state",
                [](RankLayout*, RankLayout* d) { d->layout.set_kda_state_bytes(1024); },
                "KDA state bytes mismatch"},
        BadCase{"block_id_range",
                [](RankLayout*, RankLayout* d) { d->block_ids = {8}; },
                "outside MLA layer"},
        BadCase{"slot_range", [](RankLayout*, RankLayout* d) { d->state_slot = 2; },
                "state slot 2"},
        BadCase{"block_size_zero",
                [](RankLayout* s, RankLayout*) { s->layout.set_block_size(0); },
                "block_size 0"}),
    [](const ::testing::TestParamInfo<BadCase>& info) { return info.param.name; });

TEST(PlanTest, LayerIndexChecked) {
  RankLayout src = ContiguousRankLayout(K3Layout(16), 8, 2, 1);
  src.block_ids = {0};
  EXPECT_EQ(PlanLayer(src, src, {LayerKind::kMla, 2}, 16).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LayerRanges(src, {LayerKind::kKda, -1}, 16).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PlanTest, K3ScaleSegmentCounts) {
  // 4096 tokens, 24 MLA layers, sender block 16 scattered (worst case), receiver 64.
  KvLayout l = K3Layout(16, 24, 4);
  RankLayout src = ContiguousRankLayout(l, 512, 1, 1);
  KvLayout ld = l;
  ld.set_block_size(64);
  RankLayout dst = ContiguousRankLayout(ld, 128, 1, 2);
  for (int i = 0; i < 256; ++i) src.block_ids.push_back((i * 7) % 512);  // non-adjacent
  for (int i = 0; i < 64; ++i) dst.block_ids.push_back(i);
  auto plan = PlanAll(src, dst, 4096);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->segments_before_coalescing, 24 * 256 + 4 * 2);
  // Sender blocks are never adjacent: one segment per sender block. With one slot
  // per KDA pool, the 4 KDA layers (state + conv) are back to back on both sides
  // and merge into a single segment.
  EXPECT_EQ(plan->segments.size(), 24u * 256 + 1u);
  EXPECT_EQ(plan->bytes,
            24ull * 4096 * 1152 + 4ull * (l.kda_state_bytes() + l.kda_conv_bytes()));
}

}  // namespace
}  // namespace tandem::kvtransfer
