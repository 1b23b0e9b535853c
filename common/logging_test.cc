#include "common/logging.h"

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::log {
namespace {

TEST(LoggingTest, JsonLineParsesBackWithTypedFields) {
  std::string line = FormatEvent(Format::kJson, "prefill-0", Level::kWarning, "x.cc:1",
                                 "said \"hi\"\n",
                                 {{"request_id", "req-1"},
                                  {"bytes", "42"},
                                  {"odd",
                                   "a\x01"
                                   "b"}},
                                 {false, true, false});
  nlohmann::json j = nlohmann::json::parse(line);
  EXPECT_EQ(j["level"], "warning");
  EXPECT_EQ(j["proc"], "prefill-0");
  EXPECT_EQ(j["msg"], "said \"hi\"\n");
  EXPECT_EQ(j["request_id"], "req-1");
  EXPECT_EQ(j["bytes"], 42);
  EXPECT_EQ(j["odd"], std::string("a\x01"
                                  "b"));
  EXPECT_EQ(line.find('\n'), std::string::npos);
}

TEST(LoggingTest, TextLineQuotesValuesThatNeedIt) {
  std::string line =
      FormatEvent(Format::kText, "router", Level::kInfo, "r.cc:9", "picked",
                  {{"id", "req-1"}, {"why", "least load"}}, {false, false});
  EXPECT_NE(line.find(" I router r.cc:9] picked id=req-1 why=\"least load\""),
            std::string::npos)
      << line;
}

TEST(LoggingTest, LevelsAndFormatsParse) {
  Level l;
  Format f;
  EXPECT_TRUE(ParseLevel("warning", &l));
  EXPECT_EQ(l, Level::kWarning);
  EXPECT_FALSE(ParseLevel("loud", &l));
  EXPECT_TRUE(ParseFormat("json", &f));
  EXPECT_EQ(f, Format::kJson);
  EXPECT_FALSE(ParseFormat("xml", &f));
}

TEST(LoggingTest, MinLevelFilters) {
  Init({.process = "t", .format = Format::kText, .min_level = Level::kWarning});
  EXPECT_FALSE(Enabled(Level::kInfo));
  EXPECT_TRUE(Enabled(Level::kError));
  Init({.process = "t", .format = Format::kText, .min_level = Level::kDebug});
  EXPECT_TRUE(Enabled(Level::kDebug));
}

}  // namespace
}  // namespace tandem::log
