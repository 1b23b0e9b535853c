#include "parallel/sharding.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "parallel/sharding_test_dims.h"

namespace tandem::parallel {
namespace {

using ::testing::HasSubstr;

ShardDims Config(const std::string& name) {
  if (name == "k3") return testing::K3Dims();
  if (name == "mid") return testing::MidDims();
  return testing::TinyDims();
}

struct SizeCase {
  std::string config;
  int size;
  bool ok;
  std::string message;  // a fragment of the error when !ok
};

class CheckTpSizeTest : public ::testing::TestWithParam<SizeCase> {};

TEST_P(CheckTpSizeTest, AcceptsExactlyTheDividingSizes) {
  const SizeCase& c = GetParam();
  absl::Status s = CheckTpSize(Config(c.config), c.size);
  if (c.ok) {
    EXPECT_TRUE(s.ok()) << s;
  } else {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Table, CheckTpSizeTest,
    ::testing::Values(
        // K3: 96 KDA/MLA heads, I 33792, shared 2*3072, 896 experts, V 163840.
        SizeCase{"k3", 1, true, ""}, SizeCase{"k3", 2, true, ""},
        SizeCase{"k3", 4, true, ""}, SizeCase{"k3", 8, true, ""},
        SizeCase{"k3", 16, true, ""},
        SizeCase{"k3", 3, false,
                 "does not divide: num_experts = 896, vocab_size = 163840"},
        SizeCase{"k3", 5, false,
                 "linear_attn_config.num_heads = 96, num_attention_heads = 96"},
        SizeCase{"k3", 64, false, "num_attention_heads = 96"},
        SizeCase{"k3", 0, false, "must be >= 1"},
        SizeCase{"k3", -2, false, "must be >= 1"},
        // tiny: 4 heads, I 128, shared 2*64, 16 experts.
        SizeCase{"tiny", 2, true, ""}, SizeCase{"tiny", 4, true, ""},
        SizeCase{"tiny", 8, false, "linear_attn_config.num_heads = 4"},
        // mid: 8 heads, I 2816, shared 2*512, 64 experts.
        SizeCase{"mid", 8, true, ""},
        SizeCase{"mid", 16, false,
                 "linear_attn_config.num_heads = 8, num_attention_heads = 8"}));

struct ShardCase {
  std::string config;
  TpShard shard;
  Range kda_heads, kda_channels, mla_heads, dense_rows, shared_rows, vocab;
  size_t num_experts;
  int64_t first_expert, last_expert;
};

class ShardForRankTest : public ::testing::TestWithParam<ShardCase> {};

TEST_P(ShardForRankTest, MatchesTable) {
  const ShardCase& c = GetParam();
  absl::StatusOr<RankShard> l = ShardForRank(Config(c.config), c.shard);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->kda_heads, c.kda_heads);
  EXPECT_EQ(l->kda_channels, c.kda_channels);
  EXPECT_EQ(l->mla_heads, c.mla_heads);
  EXPECT_EQ(l->dense_rows, c.dense_rows);
  EXPECT_EQ(l->shared_rows, c.shared_rows);
  EXPECT_EQ(l->vocab, c.vocab);
  ASSERT_EQ(l->experts.size(), c.num_experts);
  EXPECT_EQ(l->experts.front(), c.first_expert);
  EXPECT_EQ(l->experts.back(), c.last_expert);
}

INSTANTIATE_TEST_SUITE_P(Table, ShardForRankTest,
                         ::testing::Values(ShardCase{"k3",
                                                     {0, 1},
                                                     {0, 96},
                                                     {0, 12288},
                                                     {0, 96},
                                                     {0, 33792},
                                                     {0, 6144},
                                                     {0, 163840},
                                                     896,
                                                     0,
                                                     895},
                                           ShardCase{"k3",
                                                     {3, 8},
                                                     {36, 48},
                                                     {4608, 6144},
                                                     {36, 48},
                                                     {12672, 16896},
                                                     {2304, 3072},
                                                     {61440, 81920},
                                                     112,
                                                     3,
                                                     891},
                                           ShardCase{"k3",
                                                     {7, 8},
                                                     {84, 96},
                                                     {10752, 12288},
                                                     {84, 96},
                                                     {29568, 33792},
                                                     {5376, 6144},
                                                     {143360, 163840},
                                                     112,
                                                     7,
                                                     895},
                                           ShardCase{"k3",
                                                     {1, 2},
                                                     {48, 96},
                                                     {6144, 12288},
                                                     {48, 96},
                                                     {16896, 33792},
                                                     {3072, 6144},
                                                     {81920, 163840},
                                                     448,
                                                     1,
                                                     895},
                                           ShardCase{"tiny",
                                                     {2, 4},
                                                     {2, 3},
                                                     {32, 48},
                                                     {2, 3},
                                                     {64, 96},
                                                     {64, 96},
                                                     {81920, 122880},
                                                     4,
                                                     2,
                                                     14}));

// Over every rank of a group: blocks tile each dimension exactly once, and
// every expert has exactly one owner.
TEST(ShardForRankTest, RanksPartitionEveryDimension) {
  for (const std::string name : {"k3", "mid", "tiny"}) {
    const ShardDims config = Config(name);
    for (int size : {1, 2, 4, 8}) {
      if (!CheckTpSize(config, size).ok()) continue;
      std::vector<int> expert_owners(config.num_experts, 0);
      int64_t next_head = 0, next_vocab = 0, next_dense = 0;
      for (int r = 0; r < size; ++r) {
        absl::StatusOr<RankShard> l = ShardForRank(config, {r, size});
        ASSERT_TRUE(l.ok()) << l.status();
        EXPECT_EQ(l->kda_heads.begin, next_head) << name << " " << size;
        EXPECT_EQ(l->kda_heads.size(), config.kda_heads / size);
        next_head = l->kda_heads.end;
        EXPECT_EQ(l->vocab.begin, next_vocab);
        next_vocab = l->vocab.end;
        EXPECT_EQ(l->dense_rows.begin, next_dense);
        next_dense = l->dense_rows.end;
        EXPECT_EQ(l->experts.size(), config.num_experts / size);
        for (int64_t e : l->experts) {
          ++expert_owners[e];
          EXPECT_EQ(ExpertOwner(e, size), r);
        }
      }
      EXPECT_EQ(next_head, config.kda_heads);
      EXPECT_EQ(next_vocab, config.vocab_size);
      EXPECT_EQ(next_dense, config.dense_rows);
      for (int count : expert_owners) EXPECT_EQ(count, 1);
    }
  }
}

TEST(ShardForRankTest, RefusesRankOutsideGroupAndBadSize) {
  const ShardDims k3 = Config("k3");
  EXPECT_EQ(ShardForRank(k3, {8, 8}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShardForRank(k3, {-1, 8}).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::Status s = ShardForRank(k3, {0, 3}).status();
  EXPECT_THAT(std::string(s.message()), HasSubstr("vocab_size = 163840"));
}

struct RelayoutCase {
  int prefill_tp, decode_tp;
  std::vector<KdaStateMove> moves;  // on K3's 96 KDA heads
};

class RelayoutTest : public ::testing::TestWithParam<RelayoutCase> {};

TEST_P(RelayoutTest, MatchesTable) {
  const RelayoutCase& c = GetParam();
  absl::StatusOr<std::vector<KdaStateMove>> moves =
      PlanKdaStateRelayout(Config("k3"), c.prefill_tp, c.decode_tp);
  ASSERT_TRUE(moves.ok()) << moves.status();
  EXPECT_EQ(*moves, c.moves);
}

INSTANTIATE_TEST_SUITE_P(
    Table, RelayoutTest,
    ::testing::Values(
        RelayoutCase{1, 1, {{0, 0, {0, 96}}}},
        RelayoutCase{2, 2, {{0, 0, {0, 48}}, {1, 1, {48, 96}}}},
        // Prefill TP1 → decode TP4: every decode rank reads from rank 0.
        RelayoutCase{
            1,
            4,
            {{0, 0, {0, 24}}, {0, 1, {24, 48}}, {0, 2, {48, 72}}, {0, 3, {72, 96}}}},
        // Prefill TP8 → decode TP2: each decode rank gathers four blocks.
        RelayoutCase{8,
                     2,
                     {{0, 0, {0, 12}},
                      {1, 0, {12, 24}},
                      {2, 0, {24, 36}},
                      {3, 0, {36, 48}},
                      {4, 1, {48, 60}},
                      {5, 1, {60, 72}},
                      {6, 1, {72, 84}},
                      {7, 1, {84, 96}}}},
        // Prefill TP2 → decode TP4: each prefill block feeds two ranks.
        RelayoutCase{
            2,
            4,
            {{0, 0, {0, 24}}, {0, 1, {24, 48}}, {1, 2, {48, 72}}, {1, 3, {72, 96}}}}));

// For every pair of valid sizes: each decode rank's moves tile its block in
// order, and each move lies inside its source's block.
TEST(RelayoutTest, MovesTileEveryDecodeBlock) {
  const ShardDims k3 = Config("k3");
  const int64_t heads = k3.kda_heads;
  for (int p : {1, 2, 4, 8, 16}) {
    for (int d : {1, 2, 4, 8, 16}) {
      absl::StatusOr<std::vector<KdaStateMove>> moves = PlanKdaStateRelayout(k3, p, d);
      ASSERT_TRUE(moves.ok()) << moves.status();
      size_t i = 0;
      for (int dst = 0; dst < d; ++dst) {
        const Range want = EvenBlock(heads, {dst, d});
        int64_t next = want.begin;
        while (i < moves->size() && (*moves)[i].dst == dst) {
          const KdaStateMove& m = (*moves)[i++];
          EXPECT_EQ(m.heads.begin, next) << p << "->" << d;
          EXPECT_GT(m.heads.size(), 0);
          const Range have = EvenBlock(heads, {m.src, p});
          EXPECT_GE(m.heads.begin, have.begin);
          EXPECT_LE(m.heads.end, have.end);
          next = m.heads.end;
        }
        EXPECT_EQ(next, want.end) << p << "->" << d << " dst " << dst;
      }
      EXPECT_EQ(i, moves->size());
      // Moves per decode rank: max(1, p / d) when the sizes nest.
      EXPECT_EQ(moves->size(), static_cast<size_t>(std::max(p, d)));
    }
  }
}

TEST(RelayoutTest, RefusesSizesThatDoNotDivideNamingWhichSide) {
  absl::Status s = PlanKdaStateRelayout(Config("k3"), 3, 8).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("prefill"));
  s = PlanKdaStateRelayout(Config("tiny"), 2, 8).status();
  EXPECT_THAT(std::string(s.message()), HasSubstr("decode"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("num_heads = 4"));
}

TEST(MlaLatentSourcesTest, SpreadsDecodeRanksOverPrefillRanks) {
  EXPECT_EQ(MlaLatentSources(1, 4), (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(MlaLatentSources(2, 4), (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(MlaLatentSources(8, 2), (std::vector<int>{0, 1}));
  EXPECT_TRUE(MlaLatentSources(0, 4).empty());
}

}  // namespace
}  // namespace tandem::parallel
