#include "bench/trace_tokens.h"

#include <algorithm>

#include "gtest/gtest.h"

namespace tandem::bench {
namespace {

TraceScale Scale(double f, int64_t max_out = 0) {
  auto s = MakeTraceScale(f, max_out, 100, 60000);
  EXPECT_TRUE(s.ok()) << s.status();
  return *s;
}

TEST(TraceTokensTest, ScaleFactors) {
  EXPECT_EQ(Scale(0.125).block_tokens, 64);
  EXPECT_EQ(Scale(1).block_tokens, 512);
  EXPECT_EQ(Scale(0.25).block_tokens, 128);
  EXPECT_FALSE(MakeTraceScale(0, 0, 100, 200).ok());
  EXPECT_FALSE(MakeTraceScale(-1, 0, 100, 200).ok());
  EXPECT_FALSE(MakeTraceScale(0.0001, 0, 100, 200).ok());  // < 1 token per block
  EXPECT_FALSE(MakeTraceScale(1, -1, 100, 200).ok());
  EXPECT_FALSE(MakeTraceScale(1, 0, 200, 100).ok());
}

TEST(TraceTokensTest, LengthsKeepTheBlockStructure) {
  const TraceScale s = Scale(0.125);
  auto len = [&](int64_t n) {
    TraceRecord r;
    r.input_length = n;
    return ScaledInputLength(r, s);
  };
  EXPECT_EQ(len(512), 64);
  EXPECT_EQ(len(1024), 128);
  EXPECT_EQ(len(513), 65);        // a 1-token tail is still a token
  EXPECT_EQ(len(1000), 64 + 61);  // 488 × 64 / 512 = 61
  EXPECT_EQ(len(1), 1);
  TraceRecord r;
  r.output_length = 500;
  EXPECT_EQ(ScaledOutputLength(r, s), 63);  // round(62.5)
  EXPECT_EQ(ScaledOutputLength(r, Scale(0.125, 32)), 32);
  r.output_length = 1;
  EXPECT_EQ(ScaledOutputLength(r, s), 1);
}

TEST(TraceTokensTest, EqualIdsGiveEqualTokens) {
  const TraceScale s = Scale(0.125);
  TraceRecord a{0, 1024, 1, {5, 6}};
  TraceRecord b{0, 1536, 1, {5, 6, 7}};
  TraceRecord c{0, 1024, 1, {5, 8}};
  const auto ta = TraceTokens(a, s), tb = TraceTokens(b, s), tc = TraceTokens(c, s);
  ASSERT_EQ(ta.size(), 128u);
  ASSERT_EQ(tb.size(), 192u);
  EXPECT_TRUE(std::equal(ta.begin(), ta.end(), tb.begin()));
  EXPECT_TRUE(std::equal(ta.begin(), ta.begin() + 64, tc.begin()));
  // A different id gives a different block (all 64 equal by chance: impossible).
  EXPECT_FALSE(std::equal(ta.begin() + 64, ta.end(), tc.begin() + 64));
  // Deterministic, in range.
  EXPECT_EQ(TraceTokens(a, s), ta);
  for (int32_t t : tb) {
    EXPECT_GE(t, 100);
    EXPECT_LE(t, 60000);
  }
  // Block tokens do not depend on the block's position.
  TraceRecord d{0, 512, 1, {6}};
  const auto td = TraceTokens(d, s);
  EXPECT_TRUE(std::equal(td.begin(), td.end(), ta.begin() + 64));
}

TEST(TraceTokensTest, PartialTailIsAPrefixOfTheBlock) {
  const TraceScale s = Scale(0.125);
  TraceRecord full{0, 1024, 1, {1, 2}};
  TraceRecord part{0, 700, 1, {1, 2}};  // 188 tokens of block 2: 24 scaled
  const auto tf = TraceTokens(full, s), tp = TraceTokens(part, s);
  ASSERT_EQ(tp.size(), 64u + 24u);
  EXPECT_TRUE(std::equal(tp.begin(), tp.end(), tf.begin()));
}

}  // namespace
}  // namespace tandem::bench
