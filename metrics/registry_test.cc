#include "metrics/registry.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "metrics/buckets.h"

namespace tandem::metrics {
namespace {

TEST(RegistryTest, SameNameSameTypeReturnsExistingFamily) {
  Registry registry;
  auto a = registry.AddCounter("requests_total", "Requests.");
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = registry.AddCounter("requests_total", "Other help.");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(*a, *b);
  EXPECT_EQ((*b)->help(), "Requests.");  // first help wins

  auto h1 = registry.AddHistogram("latency_seconds", "Latency.", {0.1, 1});
  auto h2 = registry.AddHistogram("latency_seconds", "Latency.", {0.1, 1});
  ASSERT_TRUE(h1.ok() && h2.ok());
  EXPECT_EQ(*h1, *h2);
  EXPECT_EQ((*h1)->buckets(), (std::vector<double>{0.1, 1}));
  EXPECT_EQ(registry.Collect().size(), 2u);
}

TEST(RegistryTest, ConflictingRegistrationsAreErrors) {
  Registry registry;
  ASSERT_TRUE(registry.AddCounter("x_total", "").ok());
  EXPECT_EQ(registry.AddGauge("x_total", "").status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry.AddHistogram("x_total", "", {1}).status().code(),
            absl::StatusCode::kAlreadyExists);

  ASSERT_TRUE(registry.AddHistogram("h_seconds", "", {1, 2}).ok());
  absl::Status different = registry.AddHistogram("h_seconds", "", {1, 3}).status();
  EXPECT_EQ(different.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_NE(different.message().find("buckets"), std::string::npos) << different;
  EXPECT_EQ(registry.AddCounter("h_seconds", "").status().code(),
            absl::StatusCode::kAlreadyExists);

  // Names that collide with a histogram's series, either way round.
  EXPECT_EQ(registry.AddGauge("h_seconds_count", "").status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry.AddCounter("h_seconds_bucket", "").status().code(),
            absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(registry.AddGauge("g_sum", "").ok());
  EXPECT_EQ(registry.AddHistogram("g", "", {1}).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry.Collect().size(), 3u);
}

TEST(RegistryTest, InvalidNamesAndBucketsAreErrors) {
  Registry registry;
  for (const char* bad : {"", "1abc", "with-dash", "with space", "ünï"}) {
    EXPECT_EQ(registry.AddCounter(bad, "").status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
    EXPECT_EQ(registry.AddGauge(bad, "").status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
    EXPECT_EQ(registry.AddHistogram(bad, "", {1}).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_EQ(registry.AddHistogram("h", "", {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.AddHistogram("h", "", {2, 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.AddHistogram("h", "", {1, 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(registry.Collect().empty());
}

TEST(RegistryTest, CollectInRegistrationOrderWithValues) {
  Registry registry;
  auto* gauge = *registry.AddGauge("b_bytes", "B.");
  auto* counter = *registry.AddCounter("a_total", "A.");
  auto* hist = *registry.AddHistogram("c_seconds", "C.", *LinearBuckets(1, 1, 3));
  auto* empty = *registry.AddCounter("d_total", "D.");
  (void)empty;
  gauge->Add({}).Set(42);
  counter->Add({{"k", "v"}}).Increment(3);
  hist->Add({}).Observe(2);
  hist->Add({}).Observe(10);

  std::vector<FamilySnapshot> s = registry.Collect();
  ASSERT_EQ(s.size(), 4u);
  EXPECT_EQ(s[0].name, "b_bytes");
  EXPECT_EQ(s[0].type, MetricType::kGauge);
  EXPECT_EQ(s[0].metrics.at(0).value, 42.0);
  EXPECT_EQ(s[1].name, "a_total");
  EXPECT_EQ(s[1].metrics.at(0).labels, (Labels{{"k", "v"}}));
  EXPECT_EQ(s[1].metrics.at(0).value, 3.0);
  EXPECT_EQ(s[2].name, "c_seconds");
  EXPECT_EQ(s[2].type, MetricType::kHistogram);
  const MetricSnapshot& h = s[2].metrics.at(0);
  ASSERT_EQ(h.buckets.size(), 4u);
  EXPECT_EQ(h.buckets[0].cumulative_count, 0u);
  EXPECT_EQ(h.buckets[1].cumulative_count, 1u);
  EXPECT_EQ(h.buckets[2].cumulative_count, 1u);
  EXPECT_EQ(h.buckets[3].cumulative_count, 2u);
  EXPECT_EQ(h.sum, 12.0);
  EXPECT_EQ(h.count, 2u);
  EXPECT_EQ(s[3].name, "d_total");
  EXPECT_TRUE(s[3].metrics.empty());
}

TEST(RegistryTest, ConcurrentRegistrationGivesOneFamilyPerName) {
  Registry registry;
  constexpr int kThreads = 8;
  std::vector<Family<Counter>*> got(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        auto f = registry.AddCounter(absl::StrCat("c", i, "_total"), "");
        ASSERT_TRUE(f.ok());
        (*f)->Add({}).Increment();
        if (i == 0) got[t] = *f;
      }
      registry.Collect();
    });
  }
  for (auto& t : threads) t.join();
  for (int t = 1; t < kThreads; ++t) EXPECT_EQ(got[t], got[0]);
  std::vector<FamilySnapshot> s = registry.Collect();
  ASSERT_EQ(s.size(), 50u);
  for (const FamilySnapshot& f : s) EXPECT_EQ(f.metrics.at(0).value, kThreads);
}

}  // namespace
}  // namespace tandem::metrics
