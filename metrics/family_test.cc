#include "metrics/family.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace tandem::metrics {
namespace {

Family<Counter> MakeCounterFamily() {
  return Family<Counter>("requests_total", "Requests.", {},
                         [] { return std::make_unique<Counter>(); });
}

TEST(FamilyTest, SameLabelsGiveSameMetricInAnyOrder) {
  Family<Counter> family = MakeCounterFamily();
  Counter& a = family.Add({{"route", "prefill"}, {"code", "200"}});
  Counter& b = family.Add({{"code", "200"}, {"route", "prefill"}});
  Counter& c = family.Add({{"route", "decode"}, {"code", "200"}});
  EXPECT_EQ(&a, &b);
  EXPECT_NE(&a, &c);
  a.Increment(2);
  b.Increment(3);
  EXPECT_EQ(a.Value(), 5.0);
  EXPECT_EQ(c.Value(), 0.0);
  EXPECT_EQ(family.size(), 2u);
  EXPECT_EQ(family.name(), "requests_total");
  EXPECT_EQ(family.help(), "Requests.");
  EXPECT_EQ(family.type(), MetricType::kCounter);
}

TEST(FamilyTest, LabelKeyIsUnambiguous) {
  Family<Counter> family = MakeCounterFamily();
  // Values that would collide under naive concatenation.
  Counter& a = family.Add({{"a", "1,b=2"}});
  Counter& b = family.Add({{"a", "1"}, {"b", "2"}});
  Counter& c = family.Add({});
  Counter& d = family.Add({{"a", ""}});
  EXPECT_NE(&a, &b);
  EXPECT_NE(&c, &d);
  EXPECT_EQ(family.size(), 4u);
}

TEST(FamilyTest, ReferencesStayValidAsFamilyGrows) {
  Family<Counter> family = MakeCounterFamily();
  Counter& first = family.Add({{"i", "0"}});
  first.Increment();
  for (int i = 1; i < 2000; ++i) family.Add({{"i", absl::StrCat(i)}}).Increment(i);
  first.Increment();
  EXPECT_EQ(&family.Add({{"i", "0"}}), &first);
  EXPECT_EQ(first.Value(), 2.0);
  EXPECT_EQ(family.Add({{"i", "1999"}}).Value(), 1999.0);
}

TEST(FamilyTest, CollectKeepsFirstAddOrderAndLabelOrder) {
  Family<Gauge> family("queue_depth", "Depth.", {},
                       [] { return std::make_unique<Gauge>(); });
  family.Add({{"z", "1"}, {"a", "2"}}).Set(1);
  family.Add({{"m", "x"}}).Set(2);
  family.Add({{"a", "2"}, {"z", "1"}}).Increment();  // same child as the first
  FamilySnapshot s = family.Collect();
  EXPECT_EQ(s.name, "queue_depth");
  EXPECT_EQ(s.help, "Depth.");
  EXPECT_EQ(s.type, MetricType::kGauge);
  ASSERT_EQ(s.metrics.size(), 2u);
  EXPECT_EQ(s.metrics[0].labels, (Labels{{"z", "1"}, {"a", "2"}}));
  EXPECT_EQ(s.metrics[0].value, 2.0);
  EXPECT_EQ(s.metrics[1].labels, (Labels{{"m", "x"}}));
  EXPECT_EQ(s.metrics[1].value, 2.0);
}

TEST(FamilyTest, InvalidLabelsAreErrorsNotCrashes) {
  Family<Histogram> family("latency_seconds", "Latency.", {1, 2}, [] {
    return std::make_unique<Histogram>(std::vector<double>{1, 2});
  });
  for (const Labels& bad : std::vector<Labels>{{{"le", "1"}},
                                               {{"__name__", "x"}},
                                               {{"bad-name", "x"}},
                                               {{"a", "1"}, {"a", "2"}},
                                               {{"a", "\xfe"}}}) {
    absl::StatusOr<Histogram*> child = family.TryAdd(bad);
    EXPECT_EQ(child.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(child.status().message().find("latency_seconds"), std::string::npos);
  }
  // Add() on invalid labels hands back a detached histogram that is usable but
  // never exported.
  Histogram& detached = family.Add({{"le", "5"}});
  detached.Observe(1);
  EXPECT_EQ(&family.Add({{"__x", "1"}}), &detached);
  EXPECT_EQ(family.size(), 0u);
  EXPECT_TRUE(family.Collect().metrics.empty());

  absl::StatusOr<Histogram*> good = family.TryAdd({{"route", "a"}});
  ASSERT_TRUE(good.ok());
  (*good)->Observe(1.5);
  FamilySnapshot s = family.Collect();
  ASSERT_EQ(s.metrics.size(), 1u);
  EXPECT_EQ(s.metrics[0].count, 1u);
  EXPECT_EQ(s.metrics[0].buckets.size(), 3u);
  EXPECT_EQ(s.metrics[0].buckets[1].cumulative_count, 1u);
}

TEST(FamilyTest, ConcurrentAddAndIncrement) {
  Family<Counter> family = MakeCounterFamily();
  constexpr int kThreads = 8;
  constexpr int kPerThread = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&family, t] {
      for (int i = 0; i < kPerThread; ++i) {
        family.Add({{"shard", absl::StrCat(i % 4)}}).Increment();
        if (i % 1000 == 0) family.Collect();  // collecting while others add
      }
      family.Add({{"thread", absl::StrCat(t)}}).Increment();
    });
  }
  for (auto& t : threads) t.join();
  FamilySnapshot s = family.Collect();
  ASSERT_EQ(s.metrics.size(), 4u + kThreads);
  double total = 0;
  for (const MetricSnapshot& m : s.metrics) total += m.value;
  EXPECT_EQ(total, static_cast<double>(kThreads) * kPerThread + kThreads);
  EXPECT_EQ(family.Add({{"shard", "0"}}).Value(), kThreads * kPerThread / 4.0);
}

}  // namespace
}  // namespace tandem::metrics
