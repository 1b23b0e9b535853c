#include "metrics/counter.h"

#include <cmath>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::metrics {
namespace {

TEST(CounterTest, StartsAtZeroAndAdds) {
  Counter c;
  EXPECT_EQ(c.Value(), 0.0);
  c.Increment();
  EXPECT_EQ(c.Value(), 1.0);
  c.Increment(2.5);
  EXPECT_EQ(c.Value(), 3.5);
  c.Increment(0.0);
  EXPECT_EQ(c.Value(), 3.5);
}

TEST(CounterTest, NegativeAndNanIncrementsAreRejected) {
  Counter c;
  c.Increment(5);
  // Debug builds assert; optimised builds ignore the call. Either way the value
  // must not move.
  EXPECT_DEBUG_DEATH(c.Increment(-1.0), "delta must be >= 0");
  EXPECT_EQ(c.Value(), 5.0);
  EXPECT_DEBUG_DEATH(c.Increment(std::nan("")), "delta must be >= 0");
  EXPECT_EQ(c.Value(), 5.0);
}

TEST(CounterTest, CollectWritesValue) {
  Counter c;
  c.Increment(7);
  MetricSnapshot s;
  c.Collect(&s);
  EXPECT_EQ(s.value, 7.0);
  EXPECT_TRUE(s.buckets.empty());
}

TEST(CounterTest, ConcurrentIncrementsAreNotLost) {
  constexpr int kThreads = 8;
  constexpr int kPerThread = 100000;
  Counter c;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&c] {
      for (int i = 0; i < kPerThread; ++i) c.Increment();
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(c.Value(), static_cast<double>(kThreads) * kPerThread);
}

}  // namespace
}  // namespace tandem::metrics
