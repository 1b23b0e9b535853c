#include "kvtransfer/checksum.h"

#include <random>

#include "gtest/gtest.h"
#include "kvtransfer/plan.h"

namespace tandem::kvtransfer {
namespace {

tandem::v1::KvLayout Layout(int block_size) {
  tandem::v1::KvLayout l;
  l.set_block_size(block_size);
  l.set_num_mla_layers(3);
  l.set_num_kda_layers(2);
  l.set_mla_token_bytes(1152);
  l.set_kda_state_bytes(4096);
  l.set_kda_conv_bytes(512);
  l.set_tp_size(1);
  return l;
}

RegionBytes One(RegionId id, const std::vector<uint8_t>& mem) {
  return [id, &mem](RegionId r) {
    return r == id ? absl::Span<const uint8_t>(mem) : absl::Span<const uint8_t>();
  };
}

// Copies src state into dst through the plan (as a transfer would).
void Apply(const TransferPlan& plan, const std::vector<uint8_t>& src,
           std::vector<uint8_t>* dst) {
  for (const Segment& s : plan.segments) {
    std::copy_n(src.begin() + s.local_offset, s.length, dst->begin() + s.remote_offset);
  }
}

class ChecksumTest : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(ChecksumTest, SenderAndReceiverAgreeAcrossBlockSizes) {
  const auto [sb, db] = GetParam();
  RankLayout src = ContiguousRankLayout(Layout(sb), 16, 2, 1);
  RankLayout dst = ContiguousRankLayout(Layout(db), 16, 3, 2);
  const int64_t tokens = 100;
  for (int i = 0; i < (tokens + sb - 1) / sb; ++i) src.block_ids.push_back(15 - i);
  for (int i = 0; i < (tokens + db - 1) / db; ++i)
    dst.block_ids.push_back((i * 3) % 16);
  dst.state_slot = 2;
  std::vector<uint8_t> smem(ContiguousRegionBytes(src.layout, 16, 2));
  std::vector<uint8_t> dmem(ContiguousRegionBytes(dst.layout, 16, 3), 0);
  std::mt19937 rng(sb * 100 + db);
  for (auto& b : smem) b = rng();
  auto plan = PlanAll(src, dst, tokens);
  ASSERT_TRUE(plan.ok()) << plan.status();
  Apply(*plan, smem, &dmem);
  auto want = ComputeChecksums(src, tokens, One(1, smem));
  auto got = ComputeChecksums(dst, tokens, One(2, dmem));
  ASSERT_TRUE(want.ok() && got.ok());
  EXPECT_EQ(want->mla_layer_size(), 3);
  EXPECT_EQ(want->kda_layer_size(), 2);
  EXPECT_TRUE(Verify(*want, *got).ok());
  EXPECT_EQ(want->total(), TotalChecksum(*want));
  // Layers differ from each other (random content).
  EXPECT_NE(want->mla_layer(0), want->mla_layer(1));

  // Corrupt one byte of MLA layer 1's last token on the receiver.
  auto ranges = LayerRanges(dst, {LayerKind::kMla, 1}, tokens);
  ASSERT_TRUE(ranges.ok());
  dmem[ranges->back().offset + ranges->back().length - 1] ^= 1;
  auto bad = ComputeChecksums(dst, tokens, One(2, dmem));
  ASSERT_TRUE(bad.ok());
  absl::Status st = Verify(*want, *bad);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("MLA layer 1"), std::string::npos) << st;
  dmem[ranges->back().offset + ranges->back().length - 1] ^= 1;

  // Corrupt KDA layer 0's conv tails.
  auto kr = LayerRanges(dst, {LayerKind::kKda, 0}, tokens);
  ASSERT_TRUE(kr.ok());
  dmem[kr->back().offset] ^= 0x80;
  bad = ComputeChecksums(dst, tokens, One(2, dmem));
  st = Verify(*want, *bad);
  EXPECT_NE(st.message().find("KDA layer 0"), std::string::npos) << st;
}

INSTANTIATE_TEST_SUITE_P(BlockSizes, ChecksumTest,
                         ::testing::Values(std::make_pair(16, 16),
                                           std::make_pair(16, 64),
                                           std::make_pair(64, 16),
                                           std::make_pair(8, 24)));

TEST(ChecksumVerifyTest, KnownValuesAndShapes) {
  // XXH3-64 of the empty input is a published constant.
  tandem::v1::StateChecksums empty;
  EXPECT_EQ(TotalChecksum(empty), 0x2D06800538D394C2ull);
  tandem::v1::StateChecksums a;
  a.add_mla_layer(1);
  a.add_kda_layer(2);
  a.set_total(TotalChecksum(a));
  tandem::v1::StateChecksums b = a;
  EXPECT_TRUE(Verify(a, b).ok());
  b.add_kda_layer(3);
  EXPECT_EQ(Verify(a, b).code(), absl::StatusCode::kDataLoss);
  b = a;
  b.set_total(a.total() + 1);
  EXPECT_NE(Verify(a, b).message().find("total"), std::string::npos);
}

TEST(ChecksumVerifyTest, RangeOutsideMemoryIsAnError) {
  RankLayout side = ContiguousRankLayout(Layout(16), 4, 1, 1);
  side.block_ids = {3};
  std::vector<uint8_t> small(100);
  EXPECT_EQ(ComputeChecksums(side, 16, One(1, small)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::kvtransfer
