#include "engine/tokenizer/jsonl_tools.h"

#include <sstream>
#include <string>

#include "gtest/gtest.h"

namespace tandem::tokenizer {
namespace {

const Tokenizer& K3() {
  static const Tokenizer* const tok = [] {
    auto t = Tokenizer::Load("third_party/kimi_k3_tokenizer");
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? t->release() : nullptr;
  }();
  return *tok;
}

TEST(JsonlToolsTest, TokenizeLines) {
  bool ok = false;
  EXPECT_EQ(TokenizeJsonLine(K3(), R"({"text": "Hello, world! 你好，世界！"})", &ok),
            R"({"ids":[19180,11,2695,0,220,33845,378,2243,856]})");
  EXPECT_TRUE(ok);
  EXPECT_EQ(TokenizeJsonLine(K3(), R"({"text": ""})", &ok), R"({"ids":[]})");
  const std::string bad = TokenizeJsonLine(K3(), R"({"text": 5})", &ok);
  EXPECT_FALSE(ok);
  EXPECT_EQ(bad.rfind(R"({"error":)", 0), 0u) << bad;
}

TEST(JsonlToolsTest, StreamContinuesAfterBadLines) {
  std::istringstream in("{\"text\": \"a\"}\nnot json\n{\"text\": \"b\"}\r\n");
  std::ostringstream out;
  EXPECT_EQ(RunTokenizeJsonl(K3(), in, out), 1);
  const std::string a = std::to_string(*K3().TokenId("a"));
  const std::string b = std::to_string(*K3().TokenId("b"));
  const std::string s = out.str();
  EXPECT_EQ(s.substr(0, s.find('\n')), "{\"ids\":[" + a + "]}");
  EXPECT_NE(s.find("\n{\"error\":"), std::string::npos);
  EXPECT_EQ(s.substr(s.rfind('\n', s.size() - 2) + 1), "{\"ids\":[" + b + "]}\n");
}

TEST(JsonlToolsTest, DetokenizeLines) {
  bool ok = false;
  EXPECT_EQ(DetokenizeJsonLine(K3(), R"({"ids": [19180, 11, 163587]})", &ok),
            R"({"text":"Hello,<|open|>"})");
  EXPECT_TRUE(ok);
  // A lone lead byte is replaced for JSON.
  const std::string e4 = std::to_string(*K3().TokenId("\xE4"));
  EXPECT_EQ(DetokenizeJsonLine(K3(), "{\"ids\": [" + e4 + "]}", &ok),
            "{\"text\":\"\xEF\xBF\xBD\"}");
  EXPECT_TRUE(ok);
  for (const char* bad : {R"({"ids": [163840]})", R"({"ids": [-1]})",
                          R"({"ids": ["x"]})", R"({"ids": 3})", "[]", ""}) {
    const std::string out = DetokenizeJsonLine(K3(), bad, &ok);
    EXPECT_FALSE(ok) << bad;
    EXPECT_EQ(out.rfind(R"({"error":)", 0), 0u) << out;
  }
  std::istringstream in("{\"ids\": [19180]}\n{\"ids\": [163840]}\n");
  std::ostringstream out;
  EXPECT_EQ(RunDetokenizeJsonl(K3(), in, out), 1);
  EXPECT_EQ(out.str().substr(0, out.str().find('\n')), R"({"text":"Hello"})");
}

}  // namespace
}  // namespace tandem::tokenizer
