#include "engine/chat/openai_parse.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::chat {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

nlohmann::json J(const char* text) { return nlohmann::json::parse(text); }

TEST(OpenAIParseTest, Messages) {
  auto messages = ParseOpenAIMessages(J(R"([
    {"role": "developer", "content": "rules"},
    {"role": "user", "name": "ann", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    {"role": "assistant", "content": null, "reasoning_content": "why",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"z\": 1, \"a\": 2}"}},
                    {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {"k": "v"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "r"},
    {"role": "assistant", "content": "x", "reasoning": "fallback"},
    {"role": "system", "content": "", "tools": [{"type": "function", "function": {"name": "late"}}]}
  ])"));
  ASSERT_TRUE(messages.ok()) << messages.status();
  ASSERT_EQ(messages->size(), 6u);
  EXPECT_EQ((*messages)[0].role, Role::kSystem);
  EXPECT_THAT((*messages)[0].content, ElementsAre("rules"));
  EXPECT_EQ((*messages)[1].name, "ann");
  EXPECT_THAT((*messages)[1].content, ElementsAre("a", "b"));
  const ChatMessage& a = (*messages)[2];
  EXPECT_TRUE(a.content.empty());
  EXPECT_EQ(a.reasoning, "why");
  ASSERT_EQ(a.tool_calls.size(), 2u);
  EXPECT_EQ(a.tool_calls[0].id, "c1");
  EXPECT_EQ(a.tool_calls[0].name, "f");
  EXPECT_EQ(a.tool_calls[0].arguments, "{\"z\": 1, \"a\": 2}");  // verbatim: order kept
  EXPECT_EQ(a.tool_calls[1].arguments, "{\"k\":\"v\"}");
  EXPECT_EQ((*messages)[3].tool_call_id, "c1");
  EXPECT_EQ((*messages)[4].reasoning, "fallback");
  ASSERT_EQ((*messages)[5].tools.size(), 1u);
  EXPECT_EQ((*messages)[5].tools[0].name, "late");
}

TEST(OpenAIParseTest, MessageErrorsNameTheField) {
  struct Case {
    const char* json;
    const char* where;
  } cases[] = {
      {R"({"role": "user"})", "messages: expected an array"},
      {R"([{"content": "x"}])", "messages[0].role: required"},
      {R"([{"role": "robot"}])", "messages[0].role: unknown role 'robot'"},
      {R"([{"role": "user", "content": 5}])", "messages[0].content: expected"},
      {R"([{"role": "user", "content": [{"type": "text"}]}])",
       "messages[0].content[0].text"},
      {R"([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}])",
       "messages[0].tool_calls[0].function.name: required"},
      {R"([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}])",
       "messages[0].tool_calls[0].function.arguments"},
      {R"([{"role": "user", "name": 7, "content": "x"}])",
       "messages[0].name: expected a string"},
  };
  for (const Case& c : cases) {
    auto r = ParseOpenAIMessages(J(c.json));
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.where));
  }
  auto audio = ParseOpenAIMessages(J(
      R"([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])"));
  EXPECT_EQ(audio.status().code(), absl::StatusCode::kUnimplemented);
}

TEST(OpenAIParseTest, ImageParts) {
  auto messages = ParseOpenAIMessages(J(R"([{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "text", "text": "compare"},
    {"type": "image_url", "image_url": {"url": "https://x.test/a.jpg", "detail": "low"}},
    {"type": "image", "image": "data:image/gif;base64,R0lG"},
    {"type": "text", "text": "!"}]}])"));
  ASSERT_TRUE(messages.ok()) << messages.status();
  const ChatMessage& m = (*messages)[0];
  EXPECT_THAT(m.content, ElementsAre("compare", "!"));
  ASSERT_EQ(m.images.size(), 3u);
  EXPECT_EQ(m.images[0].position, 0u);
  EXPECT_EQ(m.images[0].url, "data:image/png;base64,AAAA");
  EXPECT_EQ(m.images[0].detail, "auto");
  EXPECT_EQ(m.images[0].where, "messages[0].content[0]");
  EXPECT_EQ(m.images[1].position, 1u);
  EXPECT_EQ(m.images[1].detail, "low");
  EXPECT_EQ(m.images[2].position, 1u);
  EXPECT_EQ(m.images[2].where, "messages[0].content[3]");

  struct Case {
    const char* json;
    const char* where;
  };
  const Case cases[] = {
      {R"([{"role": "user", "content": [{"type": "image_url"}]}])",
       "messages[0].content[0].image_url: required"},
      {R"([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])",
       "messages[0].content[0].image_url.url: required"},
      {R"([{"role": "user", "content": [{"type": "image_url", "image_url": 3}]}])",
       "messages[0].content[0].image_url: expected an object"},
      {R"([{"role": "user", "content": [{"type": "image_url",
           "image_url": {"url": "u", "detail": "max"}}]}])",
       "messages[0].content[0].image_url.detail"},
      {R"([{"role": "assistant", "content": [{"type": "image_url",
           "image_url": {"url": "u"}}]}])",
       "messages[0].content[0]: image parts are accepted in user messages only"},
  };
  for (const Case& c : cases) {
    auto r = ParseOpenAIMessages(J(c.json));
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.where));
  }
}

TEST(OpenAIParseTest, Tools) {
  auto tools = ParseOpenAITools(J(R"([{"type": "function", "function": {"name": "f",
      "description": "d", "parameters": {"type": "object"}}}])"));
  ASSERT_TRUE(tools.ok());
  ASSERT_EQ(tools->size(), 1u);
  EXPECT_EQ((*tools)[0].name, "f");
  EXPECT_EQ((*tools)[0].description, "d");
  EXPECT_EQ((*tools)[0].parameters, J(R"({"type": "object"})"));
  EXPECT_EQ((*tools)[0].ToJson()["function"]["name"], "f");
  EXPECT_TRUE(ParseOpenAITools(nlohmann::json()).ok());
  EXPECT_THAT(
      std::string(ParseOpenAITools(J(R"([{"type": "function", "function": {}}])"))
                      .status()
                      .message()),
      HasSubstr("tools[0].function.name: required"));
  EXPECT_FALSE(ParseOpenAITools(J(R"([{"type": "retrieval"}])")).ok());
}

TEST(OpenAIParseTest, Options) {
  auto defaults = ParseOpenAIChatOptions(J("{}"));
  ASSERT_TRUE(defaults.ok());
  EXPECT_TRUE(defaults->thinking);
  EXPECT_EQ(defaults->thinking_effort, ThinkingEffort::kMax);
  EXPECT_TRUE(defaults->add_generation_prompt);
  EXPECT_EQ(defaults->tool_choice, ToolChoice::kAuto);

  auto o =
      ParseOpenAIChatOptions(J(R"({"reasoning_effort": "low", "tool_choice": "required",
      "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}},
      "chat_template_kwargs": {"add_generation_prompt": false}})"));
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->thinking_effort, ThinkingEffort::kLow);
  EXPECT_EQ(o->tool_choice, ToolChoice::kRequired);
  EXPECT_EQ(o->response_format, ResponseFormat::kJsonSchema);
  EXPECT_EQ(o->response_schema, J(R"({"type": "object"})"));
  EXPECT_FALSE(o->add_generation_prompt);

  auto minimal = ParseOpenAIChatOptions(J(R"({"reasoning_effort": "minimal"})"));
  ASSERT_TRUE(minimal.ok());
  EXPECT_FALSE(minimal->thinking);

  auto kw = ParseOpenAIChatOptions(J(
      R"({"thinking": true, "chat_template_kwargs": {"thinking": false, "thinking_effort": "high"}})"));
  ASSERT_TRUE(kw.ok());
  EXPECT_FALSE(kw->thinking);  // chat_template_kwargs wins
  EXPECT_EQ(kw->thinking_effort, ThinkingEffort::kHigh);

  auto named = ParseOpenAIChatOptions(
      J(R"({"tool_choice": {"type": "function", "function": {"name": "f"}}})"));
  ASSERT_TRUE(named.ok());
  EXPECT_EQ(named->tool_choice, ToolChoice::kNamed);
  EXPECT_EQ(named->tool_choice_name, "f");

  EXPECT_FALSE(ParseOpenAIChatOptions(J(R"({"reasoning_effort": "medium"})")).ok());
  EXPECT_FALSE(ParseOpenAIChatOptions(J(R"({"tool_choice": "sometimes"})")).ok());
  EXPECT_FALSE(
      ParseOpenAIChatOptions(J(R"({"response_format": {"type": "yaml"}})")).ok());
  EXPECT_FALSE(ParseOpenAIChatOptions(J(R"({"thinking": "yes"})")).ok());
  EXPECT_FALSE(ParseOpenAIChatOptions(J("[]")).ok());
}

}  // namespace
}  // namespace tandem::chat
