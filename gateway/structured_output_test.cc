#include "gateway/structured_output.h"

#include <memory>
#include <string>
#include <vector>

#include "engine/chat/stream_parser.h"
#include "engine/tokenizer/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::gateway {
namespace {

using ::testing::HasSubstr;
using Proto = tandem::v1::StructuredOutput;

constexpr char kModelDir[] = "third_party/kimi_k3_tokenizer";

class StructuredOutputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto t = tokenizer::Tokenizer::Load(kModelDir);
    ASSERT_TRUE(t.ok()) << t.status();
    tok_ = std::move(*t).release();
  }
  static ChatCompletionRequest Chat(const std::string& extra) {
    auto r = ParseChatCompletionRequest(
        R"({"model":"m","messages":[{"role":"user","content":"hi"}])" +
        (extra.empty() ? "" : "," + extra) + "}");
    EXPECT_TRUE(r.ok()) << r.status();
    return *std::move(r);
  }
  static std::vector<int> Enc(const std::string& text) {
    auto ids = tok_->Encode(text);
    EXPECT_TRUE(ids.ok());
    return *ids;
  }
  // What the model writes under `p`: the free reasoning (thinking on), the
  // forced prefix, `body` (the grammar's text), the terminator, the suffix.
  static std::vector<int> Output(const Proto& p, const std::string& reasoning,
                                 const std::string& body) {
    std::vector<int> ids;
    if (p.has_free_until_token_id()) {
      for (int id : Enc(reasoning)) ids.push_back(id);
      ids.push_back(p.free_until_token_id());
    }
    ids.insert(ids.end(), p.prefix_token_ids().begin(), p.prefix_token_ids().end());
    for (int id : Enc(body)) ids.push_back(id);
    if (p.has_terminator_token_id()) ids.push_back(p.terminator_token_id());
    ids.insert(ids.end(), p.suffix_token_ids().begin(), p.suffix_token_ids().end());
    return ids;
  }
  static chat::ParsedCompletion Parse(const ChatCompletionRequest& r,
                                      const std::vector<int>& ids) {
    chat::ChatStreamParser::Options o;
    o.start = chat::ChatStreamParser::StartFor(r.options);
    auto parsed = chat::ParseCompletion(*tok_, ids, o);
    EXPECT_TRUE(parsed.ok()) << parsed.status();
    return *std::move(parsed);
  }
  static tokenizer::Tokenizer* tok_;
};
tokenizer::Tokenizer* StructuredOutputTest::tok_ = nullptr;

TEST_F(StructuredOutputTest, ResponseBodyRoundTripsThinkingOnAndOff) {
  const std::string body = R"({"name": "Ada", "n": [1, 2]})";
  for (bool thinking : {false, true}) {
    ChatCompletionRequest r = Chat(absl::StrCat(
        R"("thinking":)", thinking ? "true" : "false",
        R"(,"response_format":{"type":"json_schema","json_schema":{"name":"x","strict":true,)"
        R"("schema":{"type":"object"}}})"));
    auto p = ChatConstraint(r, *tok_);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(p->has_value());
    EXPECT_EQ((*p)->kind(), Proto::KIND_JSON_SCHEMA);
    EXPECT_EQ((*p)->source(), R"({"type":"object"})");
    EXPECT_EQ((*p)->has_free_until_token_id(), thinking);
    EXPECT_EQ((*p)->terminator_token_id(), tokenizer::kCloseId);
    ASSERT_GT((*p)->suffix_token_ids_size(), 0);
    EXPECT_EQ((*p)->suffix_token_ids((*p)->suffix_token_ids_size() - 1),
              tokenizer::kEndOfMsgId);
    chat::ParsedCompletion c = Parse(r, Output(**p, "let me think", body));
    EXPECT_EQ(c.content, body);
    EXPECT_EQ(c.reasoning_content, thinking ? "let me think" : "");
    EXPECT_TRUE(c.tool_calls.empty());
    EXPECT_TRUE(c.message_ended);
    EXPECT_THAT(c.warnings, ::testing::IsEmpty());
    if (thinking) {
      // Reasoning cannot end the message or open an element.
      EXPECT_THAT((*p)->free_banned_token_ids(),
                  ::testing::IsSupersetOf({tokenizer::kEosId, tokenizer::kEndOfMsgId,
                                           tokenizer::kOpenId, tokenizer::kSepId}));
    }
  }
}

TEST_F(StructuredOutputTest, ForcedToolCallArgumentsRoundTrip) {
  const std::string tools =
      R"("tools":[{"type":"function","function":{"name":"get_weather","parameters":)"
      R"({"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}},)"
      R"({"type":"function","function":{"name":"o\"dd&name","parameters":{}}}])";
  const std::string args = R"({"city": "Paris <|close|> \"quoted\""})";
  for (bool thinking : {false, true}) {
    for (const char* name : {"get_weather", "o\\\"dd&name"}) {
      ChatCompletionRequest r = Chat(absl::StrCat(
          tools, R"(,"thinking":)", thinking ? "true" : "false",
          R"(,"tool_choice":{"type":"function","function":{"name":")", name, R"("}})"));
      auto p = ChatConstraint(r, *tok_);
      ASSERT_TRUE(p.ok()) << p.status();
      ASSERT_TRUE(p->has_value());
      const std::string expected_name = r.options.tool_choice_name;
      if (expected_name == "get_weather") {
        EXPECT_EQ((*p)->kind(), Proto::KIND_JSON_SCHEMA);
        EXPECT_EQ(nlohmann::json::parse((*p)->source()),
                  nlohmann::json::parse(R"({"type":"object","properties":{"city":)"
                                        R"({"type":"string"}},"required":["city"]})"));
      } else {
        EXPECT_EQ((*p)->kind(), Proto::KIND_JSON_OBJECT);  // empty parameters
      }
      chat::ParsedCompletion c = Parse(r, Output(**p, "hmm", args));
      ASSERT_EQ(c.tool_calls.size(), 1u);
      EXPECT_EQ(c.tool_calls[0].name, expected_name);
      EXPECT_EQ(c.tool_calls[0].arguments, args);  // verbatim: what the grammar made
      EXPECT_EQ(c.content, "");
      EXPECT_TRUE(c.message_ended);
      EXPECT_THAT(c.warnings, ::testing::IsEmpty());
    }
  }
  // "required" with one tool is that tool.
  ChatCompletionRequest one =
      Chat(R"("thinking":false,"tool_choice":"required","tools":[{"type":"function",)"
           R"("function":{"name":"f","parameters":{"type":"object"}}}])");
  auto p = ChatConstraint(one, *tok_);
  ASSERT_TRUE(p.ok() && p->has_value());
  chat::ParsedCompletion c = Parse(one, Output(**p, "", "{}"));
  ASSERT_EQ(c.tool_calls.size(), 1u);
  EXPECT_EQ(c.tool_calls[0].name, "f");
  EXPECT_EQ(c.tool_calls[0].arguments, "{}");
}

TEST_F(StructuredOutputTest, RefusedCombinations) {
  const std::string two = R"("tools":[{"type":"function","function":{"name":"a"}},)"
                          R"({"type":"function","function":{"name":"b"}}])";
  auto required = ChatConstraint(Chat(two + R"(,"tool_choice":"required")"), *tok_);
  EXPECT_EQ(required.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(required.status().message(), HasSubstr("tool_choice"));
  auto both = ChatConstraint(
      Chat(two + R"(,"tool_choice":{"type":"function","function":{"name":"a"}},)"
                 R"("guided_regex":"x+")"),
      *tok_);
  EXPECT_EQ(both.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(both.status().message(), HasSubstr("guided_regex"));
  // auto and none: no constraint.
  auto none = ChatConstraint(Chat(two + R"(,"tool_choice":"auto")"), *tok_);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
}

TEST_F(StructuredOutputTest, CompletionsCarryTheGrammarAlone) {
  auto r = ParseCompletionRequest(
      R"({"model":"m","prompt":"x","structured_outputs":{"choice":["a","b"]}})");
  ASSERT_TRUE(r.ok()) << r.status();
  auto p = CompletionConstraint(r->fields);
  ASSERT_TRUE(p.ok() && p->has_value());
  EXPECT_EQ((*p)->kind(), Proto::KIND_CHOICE);
  EXPECT_THAT((*p)->choices(), ::testing::ElementsAre("a", "b"));
  EXPECT_FALSE((*p)->has_terminator_token_id());
  EXPECT_EQ((*p)->prefix_token_ids_size(), 0);
}

}  // namespace
}  // namespace tandem::gateway
