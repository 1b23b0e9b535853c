#include "metrics/gauge.h"

#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::metrics {
namespace {

TEST(GaugeTest, SetIncrementDecrement) {
  Gauge g;
  EXPECT_EQ(g.Value(), 0.0);
  g.Set(10);
  EXPECT_EQ(g.Value(), 10.0);
  g.Increment();
  g.Increment(4.5);
  EXPECT_EQ(g.Value(), 15.5);
  g.Decrement();
  g.Decrement(20);
  EXPECT_EQ(g.Value(), -5.5);  // gauges may go negative
  g.Set(2);
  EXPECT_EQ(g.Value(), 2.0);
  MetricSnapshot s;
  g.Collect(&s);
  EXPECT_EQ(s.value, 2.0);
}

TEST(GaugeTest, ConcurrentIncrementsAndDecrements) {
  constexpr int kThreads = 8;
  constexpr int kPerThread = 50000;
  Gauge up;
  Gauge balanced;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        up.Increment();
        if (t % 2 == 0) {
          balanced.Increment(3);
        } else {
          balanced.Decrement(3);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(up.Value(), static_cast<double>(kThreads) * kPerThread);
  EXPECT_EQ(balanced.Value(), 0.0);
}

}  // namespace
}  // namespace tandem::metrics
