#include "metrics/names.h"

#include <string>

#include "gtest/gtest.h"

namespace tandem::metrics {
namespace {

TEST(NamesTest, MetricNames) {
  for (const char* ok :
       {"a", "_", ":", "tandem_requests_total", "job:rate5m", "A9_:z", "__internal"}) {
    EXPECT_TRUE(ValidateMetricName(ok).ok()) << ok;
  }
  for (const char* bad : {"", "9abc", "a-b", "a b", "a.b", "é", "a{b}", "x\n"}) {
    absl::Status s = ValidateMetricName(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(NamesTest, LabelNames) {
  for (const char* ok : {"a", "_", "_a", "route", "le", "A_9"}) {
    EXPECT_TRUE(ValidateLabelName(ok).ok()) << ok;
  }
  for (const char* bad : {"", "__name__", "__x", "9a", "a:b", "a-b", "a b", "ü"}) {
    EXPECT_EQ(ValidateLabelName(bad).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_NE(ValidateLabelName("__x").message().find("reserved"), std::string::npos);
}

TEST(NamesTest, Utf8) {
  EXPECT_TRUE(IsValidUtf8(""));
  EXPECT_TRUE(IsValidUtf8("plain ascii \"quoted\" \\ \n"));
  EXPECT_TRUE(IsValidUtf8("caf\xc3\xa9"));               // é
  EXPECT_TRUE(IsValidUtf8("\xe6\x97\xa5\xe6\x9c\xac"));  // 日本
  EXPECT_TRUE(IsValidUtf8("\xf0\x9f\x98\x80"));          // U+1F600
  EXPECT_FALSE(IsValidUtf8("\xc3"));                     // truncated
  EXPECT_FALSE(IsValidUtf8("\xe6\x97"));                 // truncated
  EXPECT_FALSE(IsValidUtf8("\x80"));                     // lone continuation
  EXPECT_FALSE(IsValidUtf8("\xc0\xaf"));                 // overlong '/'
  EXPECT_FALSE(IsValidUtf8("\xed\xa0\x80"));             // surrogate U+D800
  EXPECT_FALSE(IsValidUtf8("\xf4\x90\x80\x80"));         // > U+10FFFF
  EXPECT_FALSE(IsValidUtf8("\xff"));
}

TEST(NamesTest, LabelSets) {
  EXPECT_TRUE(ValidateLabels({}, MetricType::kCounter).ok());
  EXPECT_TRUE(
      ValidateLabels({{"a", "x"}, {"b", "q\"\\\n\xc3\xa9"}}, MetricType::kCounter)
          .ok());
  EXPECT_TRUE(ValidateLabels({{"le", "1"}}, MetricType::kGauge).ok());
  EXPECT_FALSE(ValidateLabels({{"le", "1"}}, MetricType::kHistogram).ok());
  EXPECT_FALSE(ValidateLabels({{"a", "x"}, {"a", "y"}}, MetricType::kGauge).ok());
  EXPECT_FALSE(ValidateLabels({{"a-b", "x"}}, MetricType::kGauge).ok());
  EXPECT_FALSE(ValidateLabels({{"__a", "x"}}, MetricType::kGauge).ok());
  EXPECT_FALSE(ValidateLabels({{"a", "\xff"}}, MetricType::kGauge).ok());
}

}  // namespace
}  // namespace tandem::metrics
