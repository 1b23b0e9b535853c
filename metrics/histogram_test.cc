#include "metrics/histogram.h"

#include <cmath>
#include <limits>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::metrics {
namespace {

std::vector<uint64_t> Cumulative(const Histogram& h) {
  MetricSnapshot s;
  h.Collect(&s);
  std::vector<uint64_t> out;
  for (const BucketSnapshot& b : s.buckets) out.push_back(b.cumulative_count);
  return out;
}

TEST(HistogramTest, EmptyHistogram) {
  Histogram h({1, 2});
  MetricSnapshot s;
  h.Collect(&s);
  ASSERT_EQ(s.buckets.size(), 3u);
  EXPECT_EQ(s.buckets[0].upper_bound, 1.0);
  EXPECT_EQ(s.buckets[1].upper_bound, 2.0);
  EXPECT_EQ(s.buckets[2].upper_bound, std::numeric_limits<double>::infinity());
  EXPECT_EQ(s.count, 0u);
  EXPECT_EQ(s.sum, 0.0);
  EXPECT_EQ(Cumulative(h), (std::vector<uint64_t>{0, 0, 0}));
}

TEST(HistogramTest, KnownObservationsIncludingValuesOnBounds) {
  Histogram h({0.1, 0.5, 1, 5});
  // 0.1 and 1 lie exactly on bounds: `le` is inclusive, so they count there.
  for (double v : {0.05, 0.1, 0.3, 0.5, 1.0, 1.0000001, 4.0, 5.0, 7.0, 1e9, -3.0}) {
    h.Observe(v);
  }
  // <=0.1: 0.05, 0.1, -3                     -> 3
  // <=0.5: + 0.3, 0.5                        -> 5
  // <=1:   + 1.0                             -> 6
  // <=5:   + 1.0000001, 4, 5                 -> 9
  // +Inf:  + 7, 1e9                          -> 11
  EXPECT_EQ(Cumulative(h), (std::vector<uint64_t>{3, 5, 6, 9, 11}));
  MetricSnapshot s;
  h.Collect(&s);
  EXPECT_EQ(s.count, 11u);
  EXPECT_EQ(h.Count(), 11u);
  const double expected_sum =
      0.05 + 0.1 + 0.3 + 0.5 + 1.0 + 1.0000001 + 4.0 + 5.0 + 7.0 + 1e9 + -3.0;
  EXPECT_DOUBLE_EQ(s.sum, expected_sum);
  EXPECT_DOUBLE_EQ(h.Sum(), expected_sum);
}

TEST(HistogramTest, InfinityAndNanGoToTheInfBucket) {
  Histogram h({1});
  h.Observe(std::numeric_limits<double>::infinity());
  EXPECT_EQ(Cumulative(h), (std::vector<uint64_t>{0, 1}));
  h.Observe(-std::numeric_limits<double>::infinity());
  EXPECT_EQ(Cumulative(h), (std::vector<uint64_t>{1, 2}));
  h.Observe(std::nan(""));
  EXPECT_EQ(Cumulative(h), (std::vector<uint64_t>{1, 3}));
  EXPECT_TRUE(std::isnan(h.Sum()));
}

TEST(HistogramTest, ConcurrentObservationsAreNotLost) {
  constexpr int kThreads = 8;
  constexpr int kPerThread = 50000;
  Histogram h({1, 2, 3});
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&h, t] {
      // Thread t observes the integer t % 4 + 1 (1, 2, 3 or 4), so every
      // bucket and the sum are known exactly (sums of small integers are exact).
      for (int i = 0; i < kPerThread; ++i) h.Observe(t % 4 + 1);
    });
  }
  for (auto& t : threads) t.join();
  // Two threads per value.
  const uint64_t per_value = 2ull * kPerThread;
  EXPECT_EQ(Cumulative(h), (std::vector<uint64_t>{per_value, 2 * per_value,
                                                  3 * per_value, 4 * per_value}));
  EXPECT_EQ(h.Sum(), static_cast<double>(per_value) * (1 + 2 + 3 + 4));
}

}  // namespace
}  // namespace tandem::metrics
