#include "gateway/structured_output.h"

#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "engine/chat/stream_parser.h"
#include "engine/grammar/grammar.h"
#include "engine/grammar/testing_validator.h"
#include "engine/sampling/structured_output.h"
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

// tool_choice "required" with several tools: the constraint (run by the
// engine's OutputConstraint over the real K3 vocabulary, tokens picked at
// random among those its masks allow) always writes one or more calls that
// the stream parser reads back, each naming a declared tool, with the right
// index, and arguments that parse and validate (an independent validator)
// against that tool's parameters.
TEST_F(StructuredOutputTest, RequiredWithSeveralToolsConstrainsEveryCall) {
  const nlohmann::json schemas = nlohmann::json::parse(R"({
    "get_weather": {"type":"object","properties":{"city":{"type":"string","maxLength":6},
                    "unit":{"enum":["c","f"]}},"required":["city","unit"],
                    "additionalProperties":false},
    "add": {"type":"object","properties":{"a":{"type":"integer","minimum":0,"maximum":99},
            "b":{"type":"integer","minimum":-5,"maximum":5}},"required":["a","b"]},
    "o\"dd&name": {}})");
  std::string tools = R"("tools":[)";
  bool first = true;
  for (const auto& [name, schema] : schemas.items()) {
    if (!first) tools += ",";
    first = false;
    nlohmann::json fn = {{"name", name}};
    if (!schema.empty()) fn["parameters"] = schema;
    tools += nlohmann::json({{"type", "function"}, {"function", fn}}).dump();
  }
  tools += "]";
  // The engine's side: the grammar vocabulary and compiler a worker builds.
  const auto stop_ids = tok_->stop_ids();
  const std::vector<int32_t> stops(stop_ids.begin(), stop_ids.end());
  auto vocab = grammar::TokenVocabulary::FromTokenizer(*tok_, stops);
  ASSERT_TRUE(vocab.ok()) << vocab.status();
  grammar::GrammarCompiler compiler(*vocab);
  std::mt19937_64 rng(7);
  // One-byte tokens that close strings, containers and numbers.
  std::vector<bool> closer(tok_->vocab_size(), false);
  for (int32_t id = 0; id < tokenizer::kNumBaseTokens; ++id) {
    auto b = tok_->IdToken(id);
    closer[id] = b.ok() && b->size() == 1 && absl::StrContains("\"}],0135", *b);
  }
  std::set<std::string> names_seen;
  int multi = 0;
  for (int trial = 0; trial < 12; ++trial) {
    SCOPED_TRACE(trial);
    const bool thinking = trial % 3 == 2;
    // parallel_tool_calls false: exactly one call.
    const bool parallel = trial % 4 != 3;
    ChatCompletionRequest r = Chat(tools + R"(,"tool_choice":"required","thinking":)" +
                                   (thinking ? "true" : "false") +
                                   (parallel ? "" : R"(,"parallel_tool_calls":false)"));
    EXPECT_EQ(r.parallel_tool_calls, parallel);
    auto p = ChatConstraint(r, *tok_);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(p->has_value());
    const Proto& proto = **p;
    EXPECT_EQ(proto.kind(), Proto::KIND_TOOL_CALLS);
    EXPECT_EQ(proto.terminator_token_id(), tokenizer::kEndOfMsgId);
    EXPECT_EQ(proto.suffix_token_ids_size(), 0);
    engine::StructuredOutputSpec spec;
    spec.kind = engine::StructuredOutputSpec::Kind::kToolCalls;
    spec.source = proto.source();
    spec.free_banned_token_ids.assign(proto.free_banned_token_ids().begin(),
                                      proto.free_banned_token_ids().end());
    if (proto.has_free_until_token_id())
      spec.free_until_token_id = proto.free_until_token_id();
    spec.prefix_token_ids.assign(proto.prefix_token_ids().begin(),
                                 proto.prefix_token_ids().end());
    spec.terminator_token_id = proto.terminator_token_id();
    auto g = compiler.Compile(engine::GrammarSpecOf(spec));
    ASSERT_TRUE(g.ok()) << g.status();
    auto c = engine::OutputConstraint::Create(*g, spec, stops, (*vocab)->size(),
                                              tok_->vocab_size(), 1);
    ASSERT_TRUE(c.ok()) << c.status();
    // A walk that mostly takes short closing tokens (so strings and numbers
    // end) and otherwise any allowed token (between calls: another call or
    // the end, evenly).
    std::vector<uint32_t> mask((*c)->mask_words());
    std::vector<int> ids;
    for (int step = 0; step < 4000 && !(*c)->Done(); ++step) {
      (*c)->FillNextTokenBitmask(absl::MakeSpan(mask));
      std::vector<int32_t> allowed, closers;
      for (int32_t id = 0; id < tok_->vocab_size(); ++id) {
        if (!((mask[id >> 5] >> (id & 31)) & 1u)) continue;
        allowed.push_back(id);
        if (closer[id]) closers.push_back(id);
      }
      ASSERT_FALSE(allowed.empty()) << "step " << step;
      const std::vector<int32_t>& pool =
          !closers.empty() && rng() % 4 != 0 ? closers : allowed;
      int32_t t = pool[rng() % pool.size()];
      // The reasoning ends after a few tokens.
      if ((*c)->phase() == engine::OutputConstraint::Phase::kFree && step >= 3) {
        t = proto.free_until_token_id();
      }
      ASSERT_TRUE((*c)->Accept(t).ok());
      ids.push_back(t);
    }
    ASSERT_TRUE((*c)->Done()) << "no end within 4000 tokens";
    EXPECT_EQ(ids.back(), tokenizer::kEndOfMsgId);
    chat::ParsedCompletion parsed = Parse(r, ids);
    EXPECT_TRUE(parsed.message_ended);
    EXPECT_EQ(parsed.content, "");
    EXPECT_THAT(parsed.warnings, ::testing::IsEmpty());
    ASSERT_GE(parsed.tool_calls.size(), 1u);
    EXPECT_LE(parsed.tool_calls.size(), static_cast<size_t>(kMaxRequiredToolCalls));
    if (!parallel) EXPECT_EQ(parsed.tool_calls.size(), 1u);
    if (parsed.tool_calls.size() > 1) ++multi;
    for (const auto& call : parsed.tool_calls) {
      ASSERT_TRUE(schemas.contains(call.name)) << call.name;
      names_seen.insert(call.name);
      nlohmann::json args = nlohmann::json::parse(call.arguments, nullptr, false);
      ASSERT_FALSE(args.is_discarded()) << call.arguments;
      EXPECT_TRUE(args.is_object()) << call.arguments;
      EXPECT_EQ(grammar::testing::Validate(schemas[call.name], args), "")
          << call.name << " " << call.arguments;
    }
  }
  // The walks chose among the tools and made several calls at times.
  EXPECT_GE(names_seen.size(), 2u);
  EXPECT_GT(multi, 0);
}

TEST_F(StructuredOutputTest, RefusedCombinations) {
  const std::string two = R"("tools":[{"type":"function","function":{"name":"a"}},)"
                          R"({"type":"function","function":{"name":"b"}}])";
  auto required = ChatConstraint(
      Chat(two + R"(,"tool_choice":"required","guided_regex":"x+")"), *tok_);
  EXPECT_EQ(required.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(required.status().message(), HasSubstr("guided_regex"));
  // A name the tool-calls grammar would read as markup.
  auto markup = ChatConstraint(
      Chat(R"("tool_choice":"required","tools":[{"type":"function","function":)"
           R"({"name":"a<|sep|>"}},{"type":"function","function":{"name":"b"}}])"),
      *tok_);
  EXPECT_EQ(markup.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(markup.status().message(), HasSubstr("tools[0].function.name"));
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
