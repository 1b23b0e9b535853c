#include "metrics/text_parse.h"

#include <cmath>
#include <limits>
#include <string>

#include "gtest/gtest.h"
#include "metrics/buckets.h"
#include "metrics/registry.h"
#include "metrics/text_format.h"

namespace tandem::metrics {
namespace {

using LabelMap = std::map<std::string, std::string>;
constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(TextParseTest, ParsesSamplesLabelsCommentsAndTimestamps) {
  const std::string text =
      "# HELP a_total Help with \\\\ and \\n escapes.\n"
      "# TYPE a_total counter\n"
      "# just a comment\n"
      "\n"
      "a_total{x=\"1\",y=\"q\\\"\\\\\\n\"} 12.5\n"
      "a_total 3 1700000000000\n"
      "  b_bytes { z = \"v\" , } -Inf\n"
      "c:d\t+Inf\n"
      "e NaN\n"
      "f 1e-3 -5\n";
  absl::StatusOr<ParsedText> parsed = ParseText(text);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->samples.size(), 6u);
  EXPECT_EQ(parsed->help.at("a_total"), "Help with \\ and \n escapes.");
  EXPECT_EQ(parsed->type.at("a_total"), "counter");

  const ParsedSample& s0 = parsed->samples[0];
  EXPECT_EQ(s0.name, "a_total");
  EXPECT_EQ(s0.labels, (LabelMap{{"x", "1"}, {"y", "q\"\\\n"}}));
  EXPECT_EQ(s0.value, 12.5);
  EXPECT_FALSE(s0.timestamp_ms.has_value());

  EXPECT_EQ(parsed->samples[1].timestamp_ms, 1700000000000);
  EXPECT_EQ(*parsed->Value("a_total"), 3.0);
  EXPECT_EQ(*parsed->Value("b_bytes", {{"z", "v"}}), -kInf);
  EXPECT_EQ(*parsed->Value("c:d"), kInf);
  EXPECT_TRUE(std::isnan(*parsed->Value("e")));
  EXPECT_EQ(*parsed->Value("f"), 0.001);
  EXPECT_EQ(parsed->samples[5].timestamp_ms, -5);
  EXPECT_EQ(parsed->Find("a_total").size(), 2u);
  EXPECT_EQ(parsed->Value("a_total", {{"x", "2"}}).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(TextParseTest, ParseValue) {
  EXPECT_EQ(ParseValue("0"), 0.0);
  EXPECT_EQ(ParseValue("-1.5"), -1.5);
  EXPECT_EQ(ParseValue("+2"), 2.0);
  EXPECT_EQ(ParseValue(".5"), 0.5);
  EXPECT_EQ(ParseValue("1E3"), 1000.0);
  EXPECT_EQ(ParseValue("+Inf"), kInf);
  EXPECT_EQ(ParseValue("-inf"), -kInf);
  EXPECT_EQ(ParseValue("Inf"), kInf);
  EXPECT_TRUE(std::isnan(*ParseValue("nan")));
  for (const char* bad : {"", "+", "-", "--1", "+-1", "1x", "abc", "0x10", "1,5", "1e",
                          "Infinit", " 1", "1e999"}) {
    EXPECT_FALSE(ParseValue(bad).has_value()) << bad;
  }
}

TEST(TextParseTest, MalformedInputGivesLineNumberedErrors) {
  struct Case {
    const char* text;
    const char* needle;  // expected in the message
  };
  const Case cases[] = {
      {"a 1\nb\n", "line 2"},
      {"a{x=\"1\" 2\n", "line 1"},
      {"a{x=\"1} 2\n", "unterminated"},
      {"a{x=1} 2\n", "'\"'"},
      {"a{x=\"\\t\"} 2\n", "invalid escape"},
      {"a{x=\"1\",x=\"2\"} 2\n", "twice"},
      {"a{1x=\"1\"} 2\n", "label name"},
      {"a{x\"1\"} 2\n", "'='"},
      {"a{x=\"1\"}2\n", "blank"},
      {"a one\n", "invalid value"},
      {"a 1 2 3\n", "trailing"},
      {"a 1 1.5\n", "timestamp"},
      {"9a 1\n", "metric name"},
      {"a-b 1\n", "blank"},
      {"# TYPE a countr\n", "unknown metric type"},
      {"# TYPE a counter\n# TYPE a gauge\n", "line 2"},
      {"# HELP a x\n# HELP a y\n", "second HELP"},
      {"# TYPE 1a counter\n", "metric name"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<ParsedText> parsed = ParseText(c.text);
    ASSERT_FALSE(parsed.ok()) << c.text;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_NE(parsed.status().message().find(c.needle), std::string::npos)
        << c.text << " -> " << parsed.status();
  }
}

// Everything a registry holds, serialised and parsed back, matches the registry.
TEST(TextParseTest, ExpositionParsesBackToRegistryValues) {
  Registry registry;
  auto* requests =
      *registry.AddCounter("tandem_requests_total", "Requests.\nSecond line");
  auto* memory = *registry.AddGauge("tandem_memory_bytes", "Memory \\ bytes.");
  auto* latency = *registry.AddHistogram("tandem_latency_seconds", "Latency.",
                                         *ExponentialBuckets(0.001, 4, 6));
  const std::string tricky = "quote\" backslash\\ newline\n brace} comma, caf\xc3\xa9";
  requests->Add({{"route", "prefill"}, {"code", "200"}}).Increment(41);
  requests->Add({{"route", tricky}}).Increment(0.1);
  requests->Add({}).Increment(1e20);
  memory->Add({{"pool", "kv"}}).Set(-1.0 / 3);
  memory->Add({{"pool", "nan"}}).Set(std::nan(""));
  memory->Add({{"pool", "inf"}}).Set(-kInf);
  Histogram& h = latency->Add({{"stage", tricky}});
  for (int i = 0; i < 100; ++i) h.Observe(i * 0.0013);

  const std::vector<FamilySnapshot> families = registry.Collect();
  absl::StatusOr<ParsedText> parsed = ParseText(SerializeText(families));
  ASSERT_TRUE(parsed.ok()) << parsed.status();

  size_t expected_samples = 0;
  for (const FamilySnapshot& family : families) {
    EXPECT_EQ(parsed->help.at(family.name), family.help);
    EXPECT_EQ(parsed->type.at(family.name), MetricTypeName(family.type));
    for (const MetricSnapshot& m : family.metrics) {
      LabelMap labels(m.labels.begin(), m.labels.end());
      if (family.type != MetricType::kHistogram) {
        ++expected_samples;
        absl::StatusOr<double> v = parsed->Value(family.name, labels);
        ASSERT_TRUE(v.ok()) << v.status();
        if (std::isnan(m.value)) {
          EXPECT_TRUE(std::isnan(*v));
        } else {
          EXPECT_EQ(*v, m.value) << family.name;
        }
        continue;
      }
      expected_samples += m.buckets.size() + 2;
      for (const BucketSnapshot& b : m.buckets) {
        LabelMap with_le = labels;
        with_le["le"] = FormatValue(b.upper_bound);
        absl::StatusOr<double> v = parsed->Value(family.name + "_bucket", with_le);
        ASSERT_TRUE(v.ok()) << v.status();
        EXPECT_EQ(*v, static_cast<double>(b.cumulative_count));
        EXPECT_EQ(*ParseValue(with_le["le"]), b.upper_bound);
      }
      EXPECT_EQ(*parsed->Value(family.name + "_sum", labels), m.sum);
      EXPECT_EQ(*parsed->Value(family.name + "_count", labels), 100.0);
    }
  }
  EXPECT_EQ(parsed->samples.size(), expected_samples);
  // Spot-check against known values, not just against the snapshot.
  EXPECT_EQ(*parsed->Value("tandem_requests_total", {{"route", tricky}}), 0.1);
  EXPECT_EQ(*parsed->Value("tandem_latency_seconds_bucket",
                           {{"stage", tricky}, {"le", "0.001"}}),
            1.0);  // only 0
  EXPECT_EQ(*parsed->Value("tandem_latency_seconds_bucket",
                           {{"stage", tricky}, {"le", "+Inf"}}),
            100.0);
}

}  // namespace
}  // namespace tandem::metrics
