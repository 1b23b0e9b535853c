#include "gateway/request_parser.h"

#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "gateway/api_error.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::gateway {
namespace {

constexpr char kMsgs[] = R"("messages":[{"role":"user","content":"hi"}])";

std::string Chat(const std::string& extra) {
  return std::string("{\"model\":\"m\",") + kMsgs + (extra.empty() ? "" : ",") + extra +
         "}";
}

TEST(ChatRequestTest, MinimalDefaults) {
  auto r = ParseChatCompletionRequest(Chat(""));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->fields.model, "m");
  EXPECT_EQ(r->fields.n, 1);
  EXPECT_FALSE(r->fields.temperature.has_value());
  EXPECT_FALSE(r->fields.max_tokens.has_value());
  EXPECT_FALSE(r->fields.stream);
  EXPECT_EQ(r->fields.priority, 0);
  EXPECT_EQ(r->fields.cache_salt, "");
  ASSERT_EQ(r->messages.size(), 1u);
  EXPECT_EQ(r->messages[0].ContentText(), "hi");
  EXPECT_TRUE(r->options.thinking);
}

TEST(ChatRequestTest, AllFields) {
  auto r = ParseChatCompletionRequest(Chat(
      R"("temperature":0.7,"top_p":0.9,"n":3,"max_tokens":10,"max_completion_tokens":20,)"
      R"("stop":["a","b"],"seed":-1,"presence_penalty":1.5,"frequency_penalty":-2,)"
      R"("logprobs":true,"top_logprobs":5,"stream":true,)"
      R"("stream_options":{"include_usage":true},"user":"u1","priority":-5,)"
      R"("cache_salt":"tenant-7",)"
      R"("tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}],)"
      R"("tool_choice":{"type":"function","function":{"name":"f"}},)"
      R"("chat_template_kwargs":{"thinking":false})"));
  ASSERT_TRUE(r.ok()) << r.status();
  const GenerationFields& f = r->fields;
  EXPECT_DOUBLE_EQ(*f.temperature, 0.7);
  EXPECT_DOUBLE_EQ(*f.top_p, 0.9);
  EXPECT_EQ(f.n, 3);
  EXPECT_EQ(*f.max_tokens, 20);  // max_completion_tokens wins
  EXPECT_EQ(f.stop, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(*f.seed, static_cast<uint64_t>(-1));
  EXPECT_DOUBLE_EQ(f.presence_penalty, 1.5);
  EXPECT_DOUBLE_EQ(f.frequency_penalty, -2);
  EXPECT_TRUE(f.logprobs);
  EXPECT_EQ(f.top_logprobs, 5);
  EXPECT_TRUE(f.stream);
  EXPECT_TRUE(f.include_usage);
  EXPECT_EQ(f.user, "u1");
  EXPECT_EQ(f.priority, -5);  // vLLM's priority scheduling: lower first
  EXPECT_EQ(f.cache_salt, "tenant-7");
  ASSERT_EQ(r->tools.size(), 1u);
  EXPECT_EQ(r->options.tool_choice, chat::ToolChoice::kNamed);
  EXPECT_FALSE(r->options.thinking);
}

TEST(ChatRequestTest, MultiPartTextContent) {
  auto r = ParseChatCompletionRequest(
      R"({"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->messages[0].ContentText(), "ab");
}

TEST(ChatRequestTest, StopAsString) {
  auto r = ParseChatCompletionRequest(Chat(R"("stop":"END")"));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->fields.stop, std::vector<std::string>{"END"});
}

TEST(ChatRequestTest, NullMeansAbsent) {
  auto r = ParseChatCompletionRequest(
      Chat(R"("temperature":null,"stop":null,"n":null,"tools":null,"seed":null)"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->fields.temperature.has_value());
  EXPECT_EQ(r->fields.n, 1);
}

struct BadCase {
  std::string body;
  std::string param;  // expected OpenAI param ("" for none)
};

class BadChatRequestTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadChatRequestTest, RejectedNamingParam) {
  auto r = ParseChatCompletionRequest(GetParam().body);
  ASSERT_FALSE(r.ok()) << GetParam().body;
  ApiError e = BadRequest(std::string(r.status().message()),
                          ParamFromMessage(r.status().message()));
  EXPECT_EQ(e.param, GetParam().param) << r.status();
}

INSTANTIATE_TEST_SUITE_P(
    Table, BadChatRequestTest,
    ::testing::Values(
        BadCase{"not json", ""}, BadCase{"[1,2]", ""}, BadCase{"{", ""},
        BadCase{std::string("{") + kMsgs + "}", "model"},
        BadCase{R"({"model":"m"})", "messages"},
        BadCase{R"({"model":"m","messages":[]})", "messages"},
        BadCase{R"({"model":"m","messages":"hi"})", "messages"},
        BadCase{R"({"model":5,"messages":[{"role":"user","content":"x"}]})", "model"},
        BadCase{R"({"model":"m","messages":[{"role":"robot","content":"x"}]})",
                "messages[0].role"},
        BadCase{R"({"model":"m","messages":[{"role":"user","content":5}]})",
                "messages[0].content"},
        BadCase{Chat(R"("temperature":"hot")"), "temperature"},
        BadCase{Chat(R"("temperature":2.5)"), "temperature"},
        BadCase{Chat(R"("temperature":-0.1)"), "temperature"},
        BadCase{Chat(R"("top_p":0)"), "top_p"},
        BadCase{Chat(R"("top_p":1.5)"), "top_p"}, BadCase{Chat(R"("n":0)"), "n"},
        BadCase{Chat(R"("n":129)"), "n"}, BadCase{Chat(R"("n":1.5)"), "n"},
        BadCase{Chat(R"("n":"2")"), "n"},
        BadCase{Chat(R"("max_tokens":0)"), "max_tokens"},
        BadCase{Chat(R"("max_completion_tokens":-3)"), "max_completion_tokens"},
        BadCase{Chat(R"("stop":5)"), "stop"}, BadCase{Chat(R"("stop":[1])"), "stop[0]"},
        BadCase{Chat(R"("stop":"")"), "stop"},
        BadCase{
            Chat(
                R"("stop":["1","2","3","4","5","6","7","8","9","10","11","12","13","14","15","16","17"])"),
            "stop"},
        BadCase{Chat(R"("seed":"x")"), "seed"}, BadCase{Chat(R"("seed":1e30)"), "seed"},
        BadCase{Chat(R"("presence_penalty":3)"), "presence_penalty"},
        BadCase{Chat(R"("frequency_penalty":-2.5)"), "frequency_penalty"},
        BadCase{Chat(R"("logprobs":1)"), "logprobs"},
        BadCase{Chat(R"("top_logprobs":3)"), "top_logprobs"},  // without logprobs
        BadCase{Chat(R"("logprobs":true,"top_logprobs":21)"), "top_logprobs"},
        BadCase{Chat(R"("stream":"yes")"), "stream"},
        BadCase{Chat(R"("stream_options":{"include_usage":true})"), "stream_options"},
        BadCase{Chat(R"("stream":true,"stream_options":{"include_usage":1})"),
                "stream_options.include_usage"},
        BadCase{Chat(R"("user":7)"), "user"},
        BadCase{Chat(R"("priority":"high")"), "priority"},
        BadCase{Chat(R"("priority":1.5)"), "priority"},
        BadCase{Chat(R"("cache_salt":7)"), "cache_salt"},
        BadCase{Chat(R"("cache_salt":"")"), "cache_salt"},
        BadCase{Chat(R"("tools":{})"), "tools"},
        BadCase{Chat(R"("tool_choice":"required")"), "tool_choice"},
        BadCase{Chat(R"("tool_choice":"sometimes")"), "tool_choice"},
        BadCase{
            Chat(
                R"("tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":{"type":"function","function":{"name":"g"}})"),
            "tool_choice"},
        BadCase{Chat(R"("reasoning_effort":"medium")"), "reasoning_effort"},
        BadCase{Chat(R"("logit_bias":[1,2])"), "logit_bias"},
        BadCase{Chat(R"("logit_bias":{"x":2})"), "logit_bias"},
        BadCase{Chat(R"("logit_bias":{"-4":2})"), "logit_bias"},
        BadCase{Chat(R"("logit_bias":{"99999999999":2})"), "logit_bias"},
        BadCase{Chat(R"("logit_bias":{"7":"2"})"), "logit_bias"},
        BadCase{Chat(R"("logit_bias":{"7":100.5})"), "logit_bias"},
        BadCase{Chat(R"("logit_bias":{"7":1,"07":2})"), "logit_bias"},
        BadCase{Chat(R"("functions":[{"name":"f"}])"), "functions"}));

TEST(ChatRequestTest, LogitBiasMapsTokenIdsToBiases) {
  auto r = ParseChatCompletionRequest(
      R"({"model":"m","messages":[{"role":"user","content":"hi"}],)"
      R"("logit_bias":{"50256":-100,"7":2.5,"0":100}})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->fields.logit_bias,
            (std::map<int, double>{{0, 100.0}, {7, 2.5}, {50256, -100.0}}));
  auto c =
      ParseCompletionRequest(R"({"model":"m","prompt":"a","logit_bias":{"3":-1}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->fields.logit_bias, (std::map<int, double>{{3, -1.0}}));
  auto empty = ParseCompletionRequest(R"({"model":"m","prompt":"a","logit_bias":{}})");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(empty->fields.logit_bias.empty());
  // The messages say what is wrong with which entry.
  const std::pair<const char*, const char*> bad[] = {
      {R"({"x":2})", "the key 'x' is not a token id"},
      {R"({"7":"2"})", "the bias of token 7 must be a number, got string"},
      {R"({"7":-100.5})", "the bias of token 7 must be in [-100, 100], got -100.5"},
      {R"({"7":1,"07":2})", "token id 7 is given more than once"},
  };
  for (const auto& [bias, message] : bad) {
    auto b = ParseCompletionRequest(
        absl::StrCat(R"({"model":"m","prompt":"a","logit_bias":)", bias, "}"));
    EXPECT_THAT(b.status().message(), ::testing::HasSubstr(message)) << bias;
  }
}

TEST(CompletionRequestTest, PromptForms) {
  auto text = ParseCompletionRequest(R"({"model":"m","prompt":"hello"})");
  ASSERT_TRUE(text.ok()) << text.status();
  ASSERT_EQ(text->prompts.size(), 1u);
  EXPECT_EQ(std::get<std::string>(text->prompts[0]), "hello");

  auto ids = ParseCompletionRequest(R"({"model":"m","prompt":[1,2,3],"logprobs":2})");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(std::get<std::vector<int>>(ids->prompts[0]), (std::vector<int>{1, 2, 3}));
  EXPECT_TRUE(ids->fields.logprobs);
  EXPECT_EQ(ids->fields.top_logprobs, 2);

  auto batch = ParseCompletionRequest(R"({"model":"m","prompt":["a",[4,5]],"n":2})");
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_EQ(batch->prompts.size(), 2u);
  EXPECT_EQ(std::get<std::vector<int>>(batch->prompts[1]), (std::vector<int>{4, 5}));
  EXPECT_EQ(batch->fields.n, 2);
}

TEST(CompletionRequestTest, Rejections) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"model":"m"})", "prompt"},
      {R"({"model":"m","prompt":[]})", "prompt"},
      {R"({"model":"m","prompt":[-1]})", "prompt[0]"},
      {R"({"model":"m","prompt":[1,"a"]})", "prompt[1]"},
      {R"({"model":"m","prompt":[[]]})", "prompt[0]"},
      {R"({"model":"m","prompt":[{}]})", "prompt[0]"},
      {R"({"model":"m","prompt":5})", "prompt"},
      {R"({"model":"m","prompt":"x","echo":1})", "echo"},
      {R"({"model":"m","prompt":"x","prompt_logprobs":21})", "prompt_logprobs"},
      {R"({"model":"m","prompt":"x","suffix":"y"})", "suffix"},
      {R"({"model":"m","prompt":"x","best_of":3})", "best_of"},
      {R"({"model":"m","prompt":"x","logprobs":21})", "logprobs"},
      {R"({"model":"m","prompt":"x","logprobs":true})", "logprobs"},
      {R"({"model":"m","prompt":["a","b"],"n":100})", "n"},
  };
  for (const auto& [body, param] : cases) {
    auto r = ParseCompletionRequest(body);
    ASSERT_FALSE(r.ok()) << body;
    EXPECT_EQ(ParamFromMessage(r.status().message()), param) << r.status();
  }
}

TEST(ChoiceSeedTest, FirstIsSeedOthersDistinct) {
  EXPECT_EQ(ChoiceSeed(42, 0), 42u);
  std::set<uint64_t> seen;
  for (int i = 0; i < 128; ++i) seen.insert(ChoiceSeed(42, i));
  EXPECT_EQ(seen.size(), 128u);
  EXPECT_EQ(ChoiceSeed(42, 5), ChoiceSeed(42, 5));
  EXPECT_NE(ChoiceSeed(42, 5), ChoiceSeed(43, 5));
}

}  // namespace
}  // namespace tandem::gateway

namespace tandem::gateway {
namespace {

TEST(StructuredOutputParseTest, EveryFormOnChatAndCompletions) {
  using K = StructuredOutputRequest::Kind;
  struct Case {
    std::string field;
    K kind;
    std::string source;
    std::vector<std::string> choices;
  };
  const std::vector<Case> cases = {
      {R"("response_format":{"type":"json_object"})", K::kJsonObject, "", {}},
      {R"("response_format":{"type":"json_schema","json_schema":{"name":"n","strict":true,"schema":{"type":"string"}}})",
       K::kJsonSchema,
       R"({"type":"string"})",
       {}},
      {R"("structured_outputs":{"json":{"type":"integer"}})",
       K::kJsonSchema,
       R"({"type":"integer"})",
       {}},
      {R"("structured_outputs":{"json":"{\"type\": \"integer\"}"})",
       K::kJsonSchema,
       R"({"type":"integer"})",
       {}},
      {R"("structured_outputs":{"regex":"[a-z]+"})", K::kRegex, "[a-z]+", {}},
      {R"("structured_outputs":{"choice":["x","y"]})", K::kChoice, "", {"x", "y"}},
      {R"("structured_outputs":{"grammar":"root ::= \"a\""})",
       K::kEbnf,
       R"(root ::= "a")",
       {}},
      {R"("structured_outputs":{"json_object":true})", K::kJsonObject, "", {}},
      {R"("guided_json":{"type":"boolean"})",
       K::kJsonSchema,
       R"({"type":"boolean"})",
       {}},
      {R"("guided_regex":"\\d+")", K::kRegex, "\\d+", {}},
      {R"("guided_choice":["a"])", K::kChoice, "", {"a"}},
      {R"("guided_grammar":"root ::= \"b\"")", K::kEbnf, R"(root ::= "b")", {}},
  };
  for (const Case& c : cases) {
    for (bool chat : {true, false}) {
      const std::string body =
          chat ? std::string(
                     R"({"model":"m","messages":[{"role":"user","content":"hi"}],)") +
                     c.field + "}"
               : std::string(R"({"model":"m","prompt":"p",)") + c.field + "}";
      absl::StatusOr<GenerationFields> f =
          chat ? [&]() -> absl::StatusOr<GenerationFields> {
        auto r = ParseChatCompletionRequest(body);
        if (!r.ok()) return r.status();
        return r->fields;
      }()
          : [&]() -> absl::StatusOr<GenerationFields> {
              auto r = ParseCompletionRequest(body);
              if (!r.ok()) return r.status();
              return r->fields;
            }();
      ASSERT_TRUE(f.ok()) << c.field << ": " << f.status();
      ASSERT_TRUE(f->structured.has_value()) << c.field;
      EXPECT_EQ(f->structured->kind, c.kind) << c.field;
      EXPECT_EQ(f->structured->source, c.source) << c.field;
      EXPECT_EQ(f->structured->choices, c.choices) << c.field;
    }
  }
  auto text = ParseCompletionRequest(
      R"({"model":"m","prompt":"p","response_format":{"type":"text"}})");
  ASSERT_TRUE(text.ok());
  EXPECT_FALSE(text->fields.structured.has_value());
}

TEST(StructuredOutputParseTest, BadFormsNameTheField) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"("guided_regex":"a","guided_choice":["b"])", "guided_choice"},
      {R"("response_format":{"type":"json_object"},"guided_json":{})", "guided_json"},
      {R"("response_format":{"type":"json_schema"})", "response_format.json_schema"},
      {R"("response_format":{"type":"json_schema","json_schema":{"name":"n"}})",
       "response_format.json_schema.schema"},
      {R"("response_format":{"type":"json_schema","json_schema":{"schema":{},"strict":"yes"}})",
       "strict"},
      {R"("structured_outputs":{"regex":""})", "structured_outputs.regex"},
      {R"("structured_outputs":{"choice":[]})", "structured_outputs.choice"},
      {R"("structured_outputs":{"choice":[1]})", "structured_outputs.choice[0]"},
      {R"("structured_outputs":{"json":"not json"})", "structured_outputs.json"},
      {R"("structured_outputs":{"colour":"red"})", "structured_outputs.colour"},
      {R"("structured_outputs":{"structural_tag":"x"})", "structural_tag"},
      {R"("structured_outputs":"json")", "structured_outputs"},
      {R"("guided_json":[1])", "guided_json"},
      {R"("guided_regex":"a","ignore_eos":true)", "ignore_eos"},
      {R"("guided_regex":"a","min_tokens":3)", "min_tokens"},
  };
  for (const auto& [field, param] : bad) {
    auto r = ParseCompletionRequest(R"({"model":"m","prompt":"p",)" + field + "}");
    ASSERT_FALSE(r.ok()) << field;
    EXPECT_NE(std::string(r.status().message()).find(param), std::string::npos)
        << field << " -> " << r.status();
  }
}

}  // namespace
}  // namespace tandem::gateway
