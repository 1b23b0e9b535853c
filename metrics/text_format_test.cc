#include "metrics/text_format.h"

#include <cmath>
#include <limits>
#include <random>
#include <string>

#include "gtest/gtest.h"
#include "metrics/registry.h"
#include "metrics/text_parse.h"

namespace tandem::metrics {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(TextFormatTest, ContentType) {
  EXPECT_EQ(kTextContentType, "text/plain; version=0.0.4; charset=utf-8");
}

TEST(TextFormatTest, FormatValue) {
  EXPECT_EQ(FormatValue(0), "0");
  EXPECT_EQ(FormatValue(1), "1");
  EXPECT_EQ(FormatValue(-42), "-42");
  EXPECT_EQ(FormatValue(1e6), "1000000");
  EXPECT_EQ(FormatValue(123456789012345), "123456789012345");
  EXPECT_EQ(FormatValue(0.1), "0.1");
  EXPECT_EQ(FormatValue(0.25), "0.25");
  EXPECT_EQ(FormatValue(-2.5), "-2.5");
  EXPECT_EQ(FormatValue(1e-5), "1e-05");
  EXPECT_EQ(FormatValue(1.5e300), "1.5e+300");
  EXPECT_EQ(FormatValue(kInf), "+Inf");
  EXPECT_EQ(FormatValue(-kInf), "-Inf");
  EXPECT_EQ(FormatValue(std::nan("")), "NaN");
  EXPECT_EQ(FormatValue(0.1 + 0.2), "0.30000000000000004");
}

TEST(TextFormatTest, FormatValueRoundTrips) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> exponent(-300, 300);
  std::uniform_real_distribution<double> mantissa(-10, 10);
  for (int i = 0; i < 20000; ++i) {
    const double v = mantissa(rng) * std::pow(10.0, exponent(rng));
    std::optional<double> back = ParseValue(FormatValue(v));
    ASSERT_TRUE(back.has_value()) << FormatValue(v);
    ASSERT_EQ(*back, v) << FormatValue(v);
  }
  for (double v :
       {0.0, 1.0, 1e15, 1e15 + 1, 9007199254740993.0, 5e-324,
        std::numeric_limits<double>::max(), -std::numeric_limits<double>::min()}) {
    std::optional<double> back = ParseValue(FormatValue(v));
    ASSERT_TRUE(back.has_value()) << FormatValue(v);
    EXPECT_EQ(*back, v) << FormatValue(v);
  }
}

TEST(TextFormatTest, Escaping) {
  EXPECT_EQ(EscapeHelp("a\\b\nc\"d"), "a\\\\b\\nc\"d");
  EXPECT_EQ(EscapeLabelValue("a\\b\nc\"d"), "a\\\\b\\nc\\\"d");
  EXPECT_EQ(EscapeLabelValue("caf\xc3\xa9"), "caf\xc3\xa9");  // UTF-8 passes through
}

TEST(TextFormatTest, ExactExposition) {
  Registry registry;
  auto* requests = *registry.AddCounter("tandem_requests_total",
                                        "Requests \\ received.\nPer route.");
  auto* depth = *registry.AddGauge("tandem_queue_depth", "Queue \"depth\".");
  auto* latency =
      *registry.AddHistogram("tandem_latency_seconds", "Latency.", {0.125, 0.5, 1});
  (void)*registry.AddGauge("tandem_unused", "Never given a child: not exported.");

  requests->Add({{"route", "pre\"fill"}, {"path", "C:\\dir\nnext"}}).Increment(3);
  requests->Add({}).Increment(0.5);
  depth->Add({{"pool", "caf\xc3\xa9"}}).Set(-2);
  Histogram& h = latency->Add({{"stage", "decode"}});
  // Binary-exact values, so the sum is exact: 3.4375. 0.125 and 1 lie on bounds.
  for (double v : {0.0625, 0.125, 0.25, 1.0, 2.0}) h.Observe(v);

  EXPECT_EQ(SerializeText(registry.Collect()),
            "# HELP tandem_requests_total Requests \\\\ received.\\nPer route.\n"
            "# TYPE tandem_requests_total counter\n"
            "tandem_requests_total{route=\"pre\\\"fill\",path=\"C:\\\\dir\\nnext\"} 3\n"
            "tandem_requests_total 0.5\n"
            "# HELP tandem_queue_depth Queue \"depth\".\n"
            "# TYPE tandem_queue_depth gauge\n"
            "tandem_queue_depth{pool=\"caf\xc3\xa9\"} -2\n"
            "# HELP tandem_latency_seconds Latency.\n"
            "# TYPE tandem_latency_seconds histogram\n"
            "tandem_latency_seconds_bucket{stage=\"decode\",le=\"0.125\"} 2\n"
            "tandem_latency_seconds_bucket{stage=\"decode\",le=\"0.5\"} 3\n"
            "tandem_latency_seconds_bucket{stage=\"decode\",le=\"1\"} 4\n"
            "tandem_latency_seconds_bucket{stage=\"decode\",le=\"+Inf\"} 5\n"
            "tandem_latency_seconds_sum{stage=\"decode\"} 3.4375\n"
            "tandem_latency_seconds_count{stage=\"decode\"} 5\n");
}

TEST(TextFormatTest, HistogramWithoutLabels) {
  Registry registry;
  auto* h = *registry.AddHistogram("x_seconds", "", {1, 2.5});
  h->Add({}).Observe(2.5);
  EXPECT_EQ(SerializeText(registry.Collect()),
            "# HELP x_seconds \n"
            "# TYPE x_seconds histogram\n"
            "x_seconds_bucket{le=\"1\"} 0\n"
            "x_seconds_bucket{le=\"2.5\"} 1\n"
            "x_seconds_bucket{le=\"+Inf\"} 1\n"
            "x_seconds_sum 2.5\n"
            "x_seconds_count 1\n");
}

TEST(TextFormatTest, EmptyRegistryIsEmptyText) {
  Registry registry;
  EXPECT_EQ(SerializeText(registry.Collect()), "");
}

}  // namespace
}  // namespace tandem::metrics
