#include "kvtransfer/plan.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <tuple>

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

// PlanLayerRows: one layer's rows [begin, end) (a prefill chunk), cut at both
// sides' block boundaries.
struct RowsCase {
  std::string name;
  int src_block;
  int dst_block;
  int64_t begin;
  int64_t end;
  std::vector<int32_t> src_blocks;
  std::vector<int32_t> dst_blocks;
  int64_t want_raw;
  std::vector<Segment> want;  // offsets relative to each side's MLA layer-1 pool
};

class PlanLayerRowsTest : public ::testing::TestWithParam<RowsCase> {};

TEST_P(PlanLayerRowsTest, SegmentsOfTheChunk) {
  const RowsCase& c = GetParam();
  RankLayout src = ContiguousRankLayout(K3Layout(c.src_block), 16, 2, /*region=*/1);
  RankLayout dst = ContiguousRankLayout(K3Layout(c.dst_block), 16, 2, /*region=*/9);
  src.block_ids = c.src_blocks;
  dst.block_ids = c.dst_blocks;
  auto plan = PlanLayerRows(src, dst, {LayerKind::kMla, 1}, c.begin, c.end);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->segments_before_coalescing, c.want_raw);
  EXPECT_EQ(plan->bytes, static_cast<uint64_t>(c.end - c.begin) * 1152);
  std::vector<Segment> want = c.want;
  for (Segment& s : want) {
    s.local_region = 1;
    s.remote_region = 9;
    s.local_offset += src.mla[1].offset;
    s.remote_offset += dst.mla[1].offset;
  }
  EXPECT_EQ(plan->segments, want);
}

constexpr uint64_t kTb = 1152;  // K3Layout's MLA token bytes

INSTANTIATE_TEST_SUITE_P(
    Cases, PlanLayerRowsTest,
    ::testing::Values(
        // A chunk of two whole sender blocks (adjacent) inside one receiver block.
        RowsCase{"two_blocks_into_one",
                 16,
                 64,
                 16,
                 48,
                 Ids({0, 1, 2, 3}),
                 Ids({5}),
                 2,
                 {{0, 16 * kTb, 0, 5 * 64 * kTb + 16 * kTb, 32 * kTb}}},
        // Starts and ends inside blocks of both sides; sender scattered.
        RowsCase{"mid_block_both_sides",
                 16,
                 8,
                 10,
                 20,
                 Ids({3, 1}),
                 Ids({0, 1, 2}),
                 2,
                 {{0, 3 * 16 * kTb + 10 * kTb, 0, 1 * 8 * kTb + 2 * kTb, 6 * kTb},
                  {0, 1 * 16 * kTb, 0, 2 * 8 * kTb, 4 * kTb}}},
        // Receiver blocks smaller and scattered: cut at each receiver block.
        RowsCase{"receiver_cuts",
                 64,
                 16,
                 20,
                 50,
                 Ids({2}),
                 Ids({9, 4, 7, 0}),
                 3,
                 {{0, 2 * 64 * kTb + 20 * kTb, 0, 4 * 16 * kTb + 4 * kTb, 12 * kTb},
                  {0, 2 * 64 * kTb + 32 * kTb, 0, 7 * 16 * kTb, 16 * kTb},
                  {0, 2 * 64 * kTb + 48 * kTb, 0, 0, 2 * kTb}}},
        // One row.
        RowsCase{"one_row",
                 16,
                 16,
                 17,
                 18,
                 Ids({4, 6}),
                 Ids({1, 3}),
                 1,
                 {{0, 6 * 16 * kTb + kTb, 0, 3 * 16 * kTb + kTb, kTb}}},
        // An empty chunk.
        RowsCase{"empty", 16, 16, 16, 16, Ids({4, 6}), Ids({1, 3}), 0, {}}),
    [](const ::testing::TestParamInfo<RowsCase>& info) { return info.param.name; });

TEST(PlanTest, LayerRowsKdaIsTheWholeSlotAndRangeIsChecked) {
  RankLayout src = ContiguousRankLayout(K3Layout(16), 4, 3, 1);
  RankLayout dst = ContiguousRankLayout(K3Layout(64), 4, 5, 2);
  src.block_ids = {0, 1};
  dst.block_ids = {3};
  src.state_slot = 2;
  dst.state_slot = 4;
  auto rows = PlanLayerRows(src, dst, {LayerKind::kKda, 1}, 16, 30);
  auto whole = PlanLayer(src, dst, {LayerKind::kKda, 1}, 30);
  ASSERT_TRUE(rows.ok() && whole.ok());
  EXPECT_EQ(rows->segments, whole->segments);
  EXPECT_EQ(rows->bytes, whole->bytes);
  EXPECT_EQ(PlanLayerRows(src, dst, {LayerKind::kMla, 0}, 8, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanLayerRows(src, dst, {LayerKind::kMla, 0}, -1, 4).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The end is validated against the block tables: 33 tokens need 3 sender blocks.
  EXPECT_EQ(PlanLayerRows(src, dst, {LayerKind::kMla, 0}, 16, 33).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A plan as a canonical map: sorted by sender byte, no sender byte twice, no
// receiver byte twice, maximal runs contiguous on both sides merged. Two segment
// lists move the same bytes to the same places iff their canonical forms match.
std::vector<Segment> Canonical(std::vector<Segment> segs, std::string* error) {
  auto by_remote = segs;
  std::sort(by_remote.begin(), by_remote.end(), [](const Segment& a, const Segment& b) {
    return std::tie(a.remote_region, a.remote_offset) <
           std::tie(b.remote_region, b.remote_offset);
  });
  for (size_t i = 1; i < by_remote.size(); ++i) {
    const Segment& a = by_remote[i - 1];
    const Segment& b = by_remote[i];
    if (a.remote_region == b.remote_region &&
        a.remote_offset + a.length > b.remote_offset)
      *error = "a receiver byte is written twice";
  }
  std::sort(segs.begin(), segs.end(), [](const Segment& a, const Segment& b) {
    return std::tie(a.local_region, a.local_offset) <
           std::tie(b.local_region, b.local_offset);
  });
  for (size_t i = 1; i < segs.size(); ++i) {
    const Segment& a = segs[i - 1];
    const Segment& b = segs[i];
    if (a.local_region == b.local_region && a.local_offset + a.length > b.local_offset)
      *error = "a sender byte is sent twice";
  }
  Coalesce(&segs);
  return segs;
}

// Property: streaming every layer chunk by chunk (MLA rows per chunk, each KDA
// layer once at the end) moves exactly the bytes of PlanAll: same bytes to the
// same places, no overlap, no gap; for many block sizes, placements and chunk
// boundaries.
TEST(PlanTest, StreamedChunksEqualTheWholeSequencePlan) {
  std::mt19937 rng(1234);
  const int kSizes[] = {1, 3, 8, 16, 64};
  for (int trial = 0; trial < 200; ++trial) {
    const int sb = kSizes[rng() % 5];
    const int db = kSizes[rng() % 5];
    const int64_t n = 1 + rng() % 300;
    const int mla = 1 + rng() % 3;
    const int kda = rng() % 3;
    KvLayout ls = K3Layout(sb, mla, kda);
    ls.set_kda_state_bytes(96);
    ls.set_kda_conv_bytes(rng() % 2 ? 40 : 0);
    ls.set_mla_token_bytes(8 + 8 * (trial % 3));
    KvLayout ld = ls;
    ld.set_block_size(db);
    const int64_t sblocks = (n + sb - 1) / sb + 4;
    const int64_t dblocks = (n + db - 1) / db + 4;
    RankLayout src = ContiguousRankLayout(ls, sblocks, 3, 1);
    RankLayout dst = ContiguousRankLayout(ld, dblocks, 4, 2, /*base_offset=*/64);
    std::vector<int32_t> sp(sblocks), dp(dblocks);
    std::iota(sp.begin(), sp.end(), 0);
    std::iota(dp.begin(), dp.end(), 0);
    if (trial % 4 != 0) {  // every 4th keeps blocks in order (max coalescing)
      std::shuffle(sp.begin(), sp.end(), rng);
      std::shuffle(dp.begin(), dp.end(), rng);
    }
    src.block_ids.assign(sp.begin(), sp.begin() + (n + sb - 1) / sb);
    dst.block_ids.assign(dp.begin(), dp.begin() + (n + db - 1) / db);
    src.state_slot = rng() % 3;
    dst.state_slot = rng() % 4;
    // Chunk boundaries: random cuts in (0, n).
    std::vector<int64_t> cuts = {0, n};
    for (int c = rng() % 5; c > 0; --c) cuts.push_back(rng() % n);
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());

    std::vector<Segment> streamed;
    uint64_t bytes = 0;
    for (size_t c = 0; c + 1 < cuts.size(); ++c) {
      for (int l = 0; l < mla; ++l) {
        auto p = PlanLayerRows(src, dst, {LayerKind::kMla, l}, cuts[c], cuts[c + 1]);
        ASSERT_TRUE(p.ok()) << p.status();
        bytes += p->bytes;
        streamed.insert(streamed.end(), p->segments.begin(), p->segments.end());
      }
    }
    for (int l = 0; l < kda; ++l) {
      auto p = PlanLayerRows(src, dst, {LayerKind::kKda, l}, cuts[cuts.size() - 2], n);
      ASSERT_TRUE(p.ok()) << p.status();
      bytes += p->bytes;
      streamed.insert(streamed.end(), p->segments.begin(), p->segments.end());
    }
    auto all = PlanAll(src, dst, n);
    ASSERT_TRUE(all.ok()) << all.status();
    EXPECT_EQ(bytes, all->bytes) << "trial " << trial;
    std::string err_streamed, err_all;
    const std::vector<Segment> a = Canonical(streamed, &err_streamed);
    const std::vector<Segment> b = Canonical(all->segments, &err_all);
    EXPECT_EQ(err_streamed, "") << "trial " << trial;
    EXPECT_EQ(err_all, "") << "trial " << trial;
    ASSERT_EQ(a, b) << "trial " << trial << " src block " << sb << " dst block " << db
                    << " tokens " << n << " chunks " << cuts.size() - 1;
  }
}

// A decode-side prefix hit: the receiver holds MLA rows [0, first) already, so
// PlanAll(.., first) moves the rows [first, n) of every MLA layer and every KDA
// slot, exactly what streaming the chunks clipped at `first` moves; nothing of
// the rows before it.
TEST(PlanTest, PlanAllFromFirstTokenSkipsTheHeldRows) {
  std::mt19937 rng(99);
  const int kSizes[] = {1, 4, 16, 64};
  for (int trial = 0; trial < 100; ++trial) {
    const int sb = kSizes[rng() % 4];
    const int db = kSizes[rng() % 4];
    const int64_t n = 1 + rng() % 300;
    const int64_t first = (rng() % (n + 1)) / db * db;  // receiver blocks are whole
    KvLayout ls = K3Layout(sb, 2, 1);
    ls.set_kda_state_bytes(96);
    ls.set_kda_conv_bytes(40);
    ls.set_mla_token_bytes(16);
    KvLayout ld = ls;
    ld.set_block_size(db);
    const int64_t sblocks = (n + sb - 1) / sb, dblocks = (n + db - 1) / db;
    RankLayout src = ContiguousRankLayout(ls, sblocks + 2, 2, 1);
    RankLayout dst = ContiguousRankLayout(ld, dblocks + 2, 2, 2);
    src.block_ids.resize(sblocks);
    dst.block_ids.resize(dblocks);
    std::iota(src.block_ids.begin(), src.block_ids.end(), 0);
    std::iota(dst.block_ids.begin(), dst.block_ids.end(), 1);
    std::shuffle(src.block_ids.begin(), src.block_ids.end(), rng);
    auto all = PlanAll(src, dst, n, first);
    ASSERT_TRUE(all.ok()) << all.status();
    EXPECT_EQ(all->bytes, 2u * static_cast<uint64_t>(n - first) * 16 + (96 + 40))
        << "trial " << trial;
    std::vector<Segment> clipped;
    for (int l = 0; l < 2; ++l) {
      auto p = PlanLayerRows(src, dst, {LayerKind::kMla, l}, first, n);
      ASSERT_TRUE(p.ok()) << p.status();
      clipped.insert(clipped.end(), p->segments.begin(), p->segments.end());
    }
    auto k = PlanLayerRows(src, dst, {LayerKind::kKda, 0}, 0, n);
    ASSERT_TRUE(k.ok());
    clipped.insert(clipped.end(), k->segments.begin(), k->segments.end());
    std::string e1, e2;
    EXPECT_EQ(Canonical(clipped, &e1), Canonical(all->segments, &e2))
        << "trial " << trial;
    // No byte of a held row is written: every remote MLA byte lies at a token
    // >= first of the receiver's sequence.
    auto held = PlanLayerRows(src, dst, {LayerKind::kMla, 0}, 0, first);
    ASSERT_TRUE(held.ok());
    for (const Segment& h : held->segments) {
      for (const Segment& g : all->segments) {
        const bool overlap = g.remote_offset < h.remote_offset + h.length &&
                             h.remote_offset < g.remote_offset + g.length;
        EXPECT_FALSE(overlap) << "trial " << trial;
      }
    }
  }
  RankLayout src = ContiguousRankLayout(K3Layout(16), 4, 1, 1);
  RankLayout dst = ContiguousRankLayout(K3Layout(16), 4, 1, 2);
  src.block_ids = dst.block_ids = {0, 1};
  EXPECT_FALSE(PlanAll(src, dst, 32, 33).ok());
  EXPECT_FALSE(PlanAll(src, dst, 32, -1).ok());
  auto none = PlanAll(src, dst, 32, 32);  // every row held: the KDA slots only
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->bytes,
            2u * (K3Layout(16).kda_state_bytes() + K3Layout(16).kda_conv_bytes()));
}

}  // namespace
}  // namespace tandem::kvtransfer
