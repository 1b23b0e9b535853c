#include "bench/trace_ideal.h"

#include "gtest/gtest.h"

namespace tandem::bench {
namespace {

TraceScale Scale(double f) {
  auto s = MakeTraceScale(f, 0, 100, 60000);
  EXPECT_TRUE(s.ok());
  return *s;
}

// A: [1,2] 1024; B: [1,2,3] 1536; C: A again; D: [1,9] 600; E: [5] 100.
const std::vector<TraceRecord> kTrace = {{0, 1024, 1, {1, 2}},
                                         {1, 1536, 1, {1, 2, 3}},
                                         {2, 1024, 1, {1, 2}},
                                         {3, 600, 1, {1, 9}},
                                         {4, 100, 1, {5}}};

TEST(TraceIdealTest, KnownValuesScaled) {
  // 64-token blocks: lengths 128, 192, 128, 75, 13.
  const IdealHits h = ComputeIdealHits(kTrace, Scale(0.125));
  // A: nothing before. B: A's 128 tokens. C: all 128 cached but the last token is
  // computed: 127 rounds down to 64. D: block 1 only (64; 74 usable). E: new.
  EXPECT_EQ(h.per_request_hits, (std::vector<int64_t>{0, 128, 64, 64, 0}));
  EXPECT_EQ(h.queried_tokens, 128 + 192 + 128 + 75 + 13);
  EXPECT_EQ(h.hit_tokens, 256);
  EXPECT_DOUBLE_EQ(h.hit_rate(), 256.0 / 536);
}

TEST(TraceIdealTest, KnownValuesFullLength) {
  const IdealHits h = ComputeIdealHits(kTrace, Scale(1));
  // C: 1023 -> 960 on the 64-token grid; D: block 1's 512.
  EXPECT_EQ(h.per_request_hits, (std::vector<int64_t>{0, 1024, 960, 512, 0}));
  EXPECT_EQ(h.queried_tokens, 1024 + 1536 + 1024 + 600 + 100);
}

TEST(TraceIdealTest, APartialBlockSharesOnlyItsTokens) {
  // F has 32 tokens of block 7; G all 64: they share 32, under one 64-token chunk.
  const std::vector<TraceRecord> t = {
      {0, 256, 1, {7}}, {1, 512, 1, {7}}, {2, 512, 1, {7}}};
  EXPECT_EQ(ComputeIdealHits(t, Scale(0.125)).per_request_hits,
            (std::vector<int64_t>{0, 0, 0}));  // the third: 63 usable -> 0
  EXPECT_EQ(ComputeIdealHits(t, Scale(0.125), /*chunk_tokens=*/16).per_request_hits,
            (std::vector<int64_t>{0, 32, 48}));
}

TEST(TraceIdealTest, ADifferentFirstBlockSharesNothing) {
  const std::vector<TraceRecord> t = {{0, 1024, 1, {1, 2}}, {1, 1024, 1, {3, 2}}};
  EXPECT_EQ(ComputeIdealHits(t, Scale(0.125)).hit_tokens, 0);
}

TEST(TraceIdealTest, EmptyTrace) {
  const IdealHits h = ComputeIdealHits({}, Scale(0.125));
  EXPECT_EQ(h.queried_tokens, 0);
  EXPECT_EQ(h.hit_rate(), 0);
}

}  // namespace
}  // namespace tandem::bench
