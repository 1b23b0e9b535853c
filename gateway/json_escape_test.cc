#include "gateway/json_escape.h"

#include <random>
#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::gateway {
namespace {

std::string Reference(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', false,
                                nlohmann::json::error_handler_t::replace);
}

std::string Escaped(const std::string& s) {
  std::string out;
  AppendJsonString(&out, s);
  return out;
}

TEST(JsonEscapeTest, KnownValues) {
  EXPECT_EQ(Escaped(""), "\"\"");
  EXPECT_EQ(Escaped(" la"), "\" la\"");
  EXPECT_EQ(Escaped("a\"b\\c/d"), "\"a\\\"b\\\\c/d\"");
  EXPECT_EQ(Escaped("\n\r\t\b\f"), "\"\\n\\r\\t\\b\\f\"");
  EXPECT_EQ(Escaped(std::string("\x01\x1f\x7f", 3)), "\"\\u0001\\u001f\x7f\"");
  EXPECT_EQ(Escaped("h\xC3\xA9llo \xE2\x82\xAC \xF0\x9F\x98\x80"),
            "\"h\xC3\xA9llo \xE2\x82\xAC \xF0\x9F\x98\x80\"");
}

TEST(JsonEscapeTest, AppendsToWhatIsThere) {
  std::string out = "{\"text\":";
  AppendJsonString(&out, "x\ny");
  EXPECT_EQ(out, "{\"text\":\"x\\ny\"");
}

TEST(JsonEscapeTest, InvalidUtf8MatchesNlohmann) {
  for (const std::string& s :
       {std::string("\xC3"), std::string("ab\xFF"), std::string("\xE2\x82"),
        std::string("\xC0\x80"), std::string("\xED\xA0\x80"),
        std::string("\xF4\x90\x80\x80"), std::string("ok\x80ok")}) {
    EXPECT_EQ(Escaped(s), Reference(s)) << s;
  }
}

TEST(JsonEscapeTest, RandomBytesMatchNlohmann) {
  std::mt19937 rng(7);
  const std::string alphabet = std::string("ab \"\\/\n\r\t\x01\x1f\x7f", 12) +
                               "\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\xFF\x80\xED\xA0";
  for (int i = 0; i < 20000; ++i) {
    std::string s;
    const int n = static_cast<int>(rng() % 12);
    for (int j = 0; j < n; ++j) s += alphabet[rng() % alphabet.size()];
    ASSERT_EQ(Escaped(s), Reference(s)) << i;
  }
}

}  // namespace
}  // namespace tandem::gateway
