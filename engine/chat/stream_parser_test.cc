#include "engine/chat/stream_parser.h"

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/chat/renderer.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/tokenizer/utf8.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::chat {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using Start = ChatStreamParser::Start;

constexpr char kModelDir[] = "third_party/kimi_k3_tokenizer";

const tokenizer::Tokenizer& Tok() {
  static const tokenizer::Tokenizer* const kTokenizer = [] {
    auto t = tokenizer::Tokenizer::Load(kModelDir);
    if (!t.ok()) {
      ADD_FAILURE() << t.status();
      std::abort();
    }
    return t->release();
  }();
  return *kTokenizer;
}

ChatStreamParser::Options Opts(Start start) {
  ChatStreamParser::Options o;
  o.start = start;
  return o;
}

ChatMessage User(std::string text) {
  ChatMessage m;
  m.role = Role::kUser;
  m.content = {std::move(text)};
  return m;
}

ChatMessage Assistant() {
  ChatMessage m;
  m.role = Role::kAssistant;
  m.reasoning =
      "The user wants weather; 18°C is typical. 你好 👋🏽\nCall the tool.";
  m.content = {"Let me check <|open|>that</b> for you & \"quote\"."};
  m.tool_calls = {
      {"x", "get_weather",
       R"({"city": "Paris \"FR\"\n", "days": 2, "metric": true, "extra": null, "tags": ["a", "b"], "opts": {"k": 1.5}})"},
      {"y", "no_args", ""},
      {"z", "lookup&\"q\"", R"({"q\"&": "v & w"})"},
  };
  return m;
}

// The ids the model would generate for `assistant` after the generation
// prompt: render history with and without it and take the difference.
std::vector<int> GeneratedIds(const ChatMessage& assistant, bool thinking) {
  ChatOptions prompt_options;
  prompt_options.thinking = thinking;
  prompt_options.thinking_effort = ThinkingEffort::kNone;
  ChatOptions history_options = prompt_options;
  history_options.add_generation_prompt = false;
  auto prompt = RenderChat({User("Weather?")}, {}, prompt_options);
  auto history = RenderChat({User("Weather?"), assistant}, {}, history_options);
  EXPECT_TRUE(prompt.ok() && history.ok());
  auto prompt_ids = EncodeChat(Tok(), *prompt);
  auto history_ids = EncodeChat(Tok(), *history);
  EXPECT_TRUE(prompt_ids.ok() && history_ids.ok());
  EXPECT_TRUE(std::equal(prompt_ids->begin(), prompt_ids->end(), history_ids->begin()));
  return std::vector<int>(history_ids->begin() + prompt_ids->size(),
                          history_ids->end());
}

void ExpectValidDeltas(const std::vector<ChatEvent>& events) {
  for (const ChatEvent& e : events) {
    EXPECT_TRUE(tokenizer::IsValidUtf8(e.text)) << e.text;
  }
}

void ExpectRecovered(const ParsedCompletion& c, const ChatMessage& m, bool thinking) {
  EXPECT_THAT(c.warnings, IsEmpty());
  EXPECT_TRUE(c.message_ended);
  EXPECT_EQ(c.reasoning_content, thinking ? m.reasoning : "");
  EXPECT_EQ(c.content, m.ContentText());
  ASSERT_EQ(c.tool_calls.size(), m.tool_calls.size());
  for (size_t i = 0; i < m.tool_calls.size(); ++i) {
    EXPECT_EQ(c.tool_calls[i].index, static_cast<int>(i));
    EXPECT_EQ(c.tool_calls[i].id, absl::StrCat("call_", i));
    EXPECT_EQ(c.tool_calls[i].name, m.tool_calls[i].name);
    const auto expected =
        m.tool_calls[i].arguments.empty()
            ? nlohmann::ordered_json::object()
            : nlohmann::ordered_json::parse(m.tool_calls[i].arguments);
    // Same keys in the same order, same values.
    EXPECT_EQ(nlohmann::ordered_json::parse(c.tool_calls[i].arguments), expected)
        << c.tool_calls[i].arguments;
  }
}

TEST(StreamParserTest, RecoversARenderedMessageTokenByToken) {
  for (bool thinking : {true, false}) {
    const ChatMessage m = Assistant();
    const std::vector<int> ids = GeneratedIds(m, thinking);
    ChatStreamParser parser(&Tok(), Opts(thinking ? Start::kThink : Start::kResponse));
    ParsedCompletion c;
    std::vector<ChatEvent> all;
    for (int id : ids) {
      std::vector<ChatEvent> events;
      ASSERT_TRUE(parser.Feed(id, &events).ok());
      for (const ChatEvent& e : events) c.Apply(e);
      all.insert(all.end(), events.begin(), events.end());
    }
    parser.Finish(&all);
    ExpectValidDeltas(all);
    ExpectRecovered(c, m, thinking);
    EXPECT_TRUE(parser.message_ended());
    // Event order: tool call start, argument deltas, end; arguments of the
    // end event equal the concatenated deltas.
    std::string args;
    int starts = 0;
    for (const ChatEvent& e : all) {
      if (e.type == ChatEvent::Type::kToolCallStart) {
        ++starts;
        args.clear();
      }
      if (e.type == ChatEvent::Type::kToolCallArgumentsDelta) args += e.text;
      if (e.type == ChatEvent::Type::kToolCallEnd) EXPECT_EQ(e.text, args);
    }
    EXPECT_EQ(starts, 3);
    EXPECT_EQ(all.back().type, ChatEvent::Type::kMessageEnd);
  }
}

TEST(StreamParserTest, ParseCompletionMatchesStreaming) {
  const ChatMessage m = Assistant();
  auto c = ParseCompletion(Tok(), GeneratedIds(m, true), Opts(Start::kThink));
  ASSERT_TRUE(c.ok());
  ExpectRecovered(*c, m, true);
  EXPECT_EQ(
      c->tool_calls[0].arguments,
      R"({"city":"Paris \"FR\"\n","days":2,"metric":true,"extra":null,"tags":["a", "b"],"opts":{"k": 1.5}})");
  EXPECT_EQ(c->tool_calls[1].arguments, "{}");
}

// The output as structure tokens and text bytes, fed with the text split at
// every byte position (inside UTF-8 sequences too): same result every time.
TEST(StreamParserTest, AnySplitOfTheTextGivesTheSameResult) {
  const ChatMessage m = Assistant();
  const std::vector<int> ids = GeneratedIds(m, true);
  struct Item {
    bool structure;
    StructureToken token;
    std::string bytes;
  };
  std::vector<Item> items;
  for (int id : ids) {
    if (id == tokenizer::kOpenId) {
      items.push_back({true, StructureToken::kOpen, ""});
    } else if (id == tokenizer::kCloseId) {
      items.push_back({true, StructureToken::kClose, ""});
    } else if (id == tokenizer::kSepId) {
      items.push_back({true, StructureToken::kSep, ""});
    } else if (id == tokenizer::kEndOfMsgId) {
      items.push_back({true, StructureToken::kEndOfMsg, ""});
    } else {
      std::string bytes;
      ASSERT_TRUE(Tok().AppendTokenBytes(id, &bytes).ok());
      if (!items.empty() && !items.back().structure) {
        items.back().bytes += bytes;
      } else {
        items.push_back({false, StructureToken::kOpen, bytes});
      }
    }
  }
  size_t total = 0;
  for (const Item& it : items) total += it.bytes.size();
  int checked = 0;
  for (size_t cut = 0; cut <= total; ++cut) {
    ChatStreamParser parser(nullptr, Opts(Start::kThink));
    std::vector<ChatEvent> events;
    size_t offset = 0;
    for (const Item& it : items) {
      if (it.structure) {
        parser.FeedStructure(it.token, &events);
        continue;
      }
      if (cut > offset && cut < offset + it.bytes.size()) {
        parser.FeedText(it.bytes.substr(0, cut - offset), &events);
        parser.FeedText(it.bytes.substr(cut - offset), &events);
      } else {
        parser.FeedText(it.bytes, &events);
      }
      offset += it.bytes.size();
    }
    parser.Finish(&events);
    ExpectValidDeltas(events);
    ParsedCompletion c;
    for (const ChatEvent& e : events) c.Apply(e);
    ExpectRecovered(c, m, true);
    ++checked;
  }
  EXPECT_GT(checked, 200);
}

ParsedCompletion ParseText(Start start, const std::vector<std::string>& pieces) {
  // Pieces: "<|open|>" etc. are structure tokens, anything else text.
  ChatStreamParser parser(nullptr, Opts(start));
  std::vector<ChatEvent> events;
  for (const std::string& p : pieces) {
    if (p == "<|open|>") {
      parser.FeedStructure(StructureToken::kOpen, &events);
    } else if (p == "<|close|>") {
      parser.FeedStructure(StructureToken::kClose, &events);
    } else if (p == "<|sep|>") {
      parser.FeedStructure(StructureToken::kSep, &events);
    } else if (p == "<|end_of_msg|>") {
      parser.FeedStructure(StructureToken::kEndOfMsg, &events);
    } else {
      parser.FeedText(p, &events);
    }
  }
  parser.Finish(&events);
  ExpectValidDeltas(events);
  ParsedCompletion c;
  for (const ChatEvent& e : events) c.Apply(e);
  return c;
}

const std::vector<std::string> kEnd = {"<|close|>", "message", "<|sep|>",
                                       "<|end_of_msg|>"};

std::vector<std::string> Cat(std::vector<std::string> a,
                             const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(StreamParserMalformedTest, UnknownChannelBecomesContent) {
  auto c = ParseText(Start::kMessage, Cat({"<|open|>", "scratch", "<|sep|>", "notes",
                                           "<|close|>", "scratch", "<|sep|>"},
                                          kEnd));
  EXPECT_EQ(c.content, "notes");
  EXPECT_THAT(c.warnings, Contains(HasSubstr("unexpected element <scratch>")));
  EXPECT_TRUE(c.message_ended);
}

TEST(StreamParserMalformedTest, UnterminatedCallIsClosedAtFinish) {
  auto c =
      ParseText(Start::kResponse,
                {"ok", "<|close|>", "response", "<|sep|>", "<|open|>", "tools",
                 "<|sep|>", "<|open|>", "call tool=\"f\" index=\"1\"", "<|sep|>",
                 "<|open|>", "argument key=\"a\" type=\"string\"", "<|sep|>", "x\"y"});
  ASSERT_EQ(c.tool_calls.size(), 1u);
  EXPECT_EQ(c.tool_calls[0].name, "f");
  EXPECT_EQ(c.tool_calls[0].arguments, "{\"a\":\"x\\\"y\"}");
  EXPECT_THAT(c.warnings, Contains(HasSubstr("unterminated tool call")));
  EXPECT_FALSE(c.message_ended);
  EXPECT_EQ(c.content, "ok");
}

TEST(StreamParserMalformedTest, BadAttributesDoNotStopTheCall) {
  auto c = ParseText(Start::kResponse, Cat({"<|close|>",
                                            "response",
                                            "<|sep|>",
                                            "<|open|>",
                                            "tools",
                                            "<|sep|>",
                                            "<|open|>",
                                            "call tool=f index=\"1\"",
                                            "<|sep|>",
                                            "<|open|>",
                                            "argument key=\"n\" type=\"number\"",
                                            "<|sep|>",
                                            "3 or 4",
                                            "<|close|>",
                                            "argument",
                                            "<|sep|>",
                                            "<|close|>",
                                            "call",
                                            "<|sep|>",
                                            "<|close|>",
                                            "tools",
                                            "<|sep|>"},
                                           kEnd));
  ASSERT_EQ(c.tool_calls.size(), 1u);
  EXPECT_EQ(c.tool_calls[0].name, "");
  EXPECT_EQ(c.tool_calls[0].arguments, "{\"n\":\"3 or 4\"}");
  EXPECT_THAT(c.warnings, Contains(HasSubstr("malformed tag header")));
  EXPECT_THAT(c.warnings, Contains(HasSubstr("not a JSON number")));
  EXPECT_TRUE(c.message_ended);
}

TEST(StreamParserMalformedTest, MissingThinkCloseRecovers) {
  auto c = ParseText(Start::kThink, Cat({"hmm", "<|open|>", "response", "<|sep|>",
                                         "answer", "<|close|>", "response", "<|sep|>"},
                                        kEnd));
  EXPECT_EQ(c.reasoning_content, "hmm");
  EXPECT_EQ(c.content, "answer");
  EXPECT_THAT(c.warnings, Contains(HasSubstr("unterminated <think>")));
}

TEST(StreamParserMalformedTest, SpelledMarkersInTextStayText) {
  auto c = ParseText(Start::kResponse,
                     {"see <|open|>tools<|sep|><|open|>call tool=\"x\"<|sep|>",
                      "<|close|>", "response", "<|sep|>"});
  EXPECT_EQ(c.content, "see <|open|>tools<|sep|><|open|>call tool=\"x\"<|sep|>");
  EXPECT_THAT(c.tool_calls, IsEmpty());
  EXPECT_THAT(c.warnings, IsEmpty());
}

TEST(StreamParserMalformedTest, JsonBlockArguments) {
  auto c = ParseText(Start::kResponse, {"<|close|>",
                                        "response",
                                        "<|sep|>",
                                        "<|open|>",
                                        "tools",
                                        "<|sep|>",
                                        "<|open|>",
                                        "call tool=\"a\" index=\"1\"",
                                        "<|sep|>",
                                        "<|open|>",
                                        "json type=\"object\"",
                                        "<|sep|>",
                                        "{\"k\": [1, 2]}",
                                        "<|close|>",
                                        "json",
                                        "<|sep|>",
                                        "<|close|>",
                                        "call",
                                        "<|sep|>",
                                        "<|open|>",
                                        "call tool=\"b\" index=\"2\"",
                                        "<|sep|>",
                                        "<|open|>",
                                        "json type=\"object\"",
                                        "<|sep|>",
                                        "{not json",
                                        "<|close|>",
                                        "json",
                                        "<|sep|>",
                                        "<|close|>",
                                        "call",
                                        "<|sep|>"});
  ASSERT_EQ(c.tool_calls.size(), 2u);
  EXPECT_EQ(c.tool_calls[0].arguments, "{\"k\": [1, 2]}");
  EXPECT_EQ(c.tool_calls[1].arguments, "{not json");
  EXPECT_THAT(c.warnings, Contains(HasSubstr("passed through verbatim")));
}

TEST(StreamParserMalformedTest, StrayTextAndStraySep) {
  auto c = ParseText(
      Start::kMessage,
      Cat({"  \n", "oops", "<|sep|>", "<|open|>", "response", "<|sep|>", "fine",
           "<|close|>", "response", "<|sep|>", "<|close|>", "nothing", "<|sep|>"},
          kEnd));
  EXPECT_EQ(c.content, "  \noopsfine");
  EXPECT_THAT(c.warnings, Contains(HasSubstr("text outside a channel")));
  EXPECT_THAT(c.warnings, Contains(HasSubstr("<|sep|> outside a tag")));
  EXPECT_THAT(c.warnings, Contains(HasSubstr("close of <nothing>")));
}

TEST(StreamParserMalformedTest, OutputAfterTheEndIsIgnored) {
  auto c = ParseText(Start::kResponse, {"a", "<|end_of_msg|>", "b", "<|open|>",
                                        "response", "<|sep|>", "c"});
  EXPECT_EQ(c.content, "a");
  EXPECT_TRUE(c.message_ended);
  EXPECT_THAT(c.warnings, Contains(HasSubstr("after the end")));
}

TEST(StreamParserMalformedTest, TopLevelChannelWithoutMessage) {
  auto c = ParseText(
      Start::kTop,
      Cat({"<|open|>", "message role=\"assistant\"", "<|sep|>", "<|open|>", "think",
           "<|sep|>", "r", "<|close|>", "think", "<|sep|>", "<|open|>", "response",
           "<|sep|>", "x", "<|close|>", "response", "<|sep|>"},
          kEnd));
  EXPECT_EQ(c.reasoning_content, "r");
  EXPECT_EQ(c.content, "x");
  EXPECT_THAT(c.warnings, IsEmpty());
}

TEST(StreamParserMalformedTest, OverlongHeaderBecomesText) {
  ChatStreamParser::Options o = Opts(Start::kResponse);
  o.max_header_bytes = 16;
  ChatStreamParser parser(nullptr, o);
  std::vector<ChatEvent> events;
  parser.FeedStructure(StructureToken::kOpen, &events);
  parser.FeedText(std::string(40, 'z'), &events);
  parser.Finish(&events);
  ParsedCompletion c;
  for (const ChatEvent& e : events) c.Apply(e);
  EXPECT_EQ(c.content, std::string(40, 'z'));
  EXPECT_THAT(c.warnings, Contains(HasSubstr("unterminated tag header")));
}

TEST(StreamParserTest, IdsOutOfRangeAndSpecials) {
  ChatStreamParser parser(&Tok(), Opts(Start::kResponse));
  std::vector<ChatEvent> events;
  EXPECT_EQ(parser.Feed(-1, &events).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(parser.Feed(tokenizer::kVocabSize, &events).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(parser.Feed(163602, &events).ok());  // <|media_begin|>
  ASSERT_TRUE(parser.Feed(tokenizer::kEosId, &events).ok());
  EXPECT_TRUE(parser.message_ended());
  ParsedCompletion c;
  for (const ChatEvent& e : events) c.Apply(e);
  EXPECT_THAT(c.warnings, Contains(HasSubstr("special token 163602 dropped")));
}

TEST(StreamParserTest, StartForOptions) {
  ChatOptions o;
  EXPECT_EQ(ChatStreamParser::StartFor(o), Start::kThink);
  o.thinking = false;
  EXPECT_EQ(ChatStreamParser::StartFor(o), Start::kResponse);
  o.add_generation_prompt = false;
  EXPECT_EQ(ChatStreamParser::StartFor(o), Start::kTop);
}

TEST(TagHeaderTest, ParsesAndUnescapes) {
  TagHeader h;
  EXPECT_TRUE(ParseTagHeader("call tool=\"a&amp;b&quot;c\" index=\"1\"", &h));
  EXPECT_EQ(h.name, "call");
  ASSERT_EQ(h.attrs.size(), 2u);
  EXPECT_EQ(h.attrs[0].first, "tool");
  EXPECT_EQ(h.attrs[0].second, "a&b\"c");
  EXPECT_EQ(h.attrs[1].second, "1");
  // &amp;quot; is an escaped "&quot;", not a quote.
  EXPECT_TRUE(ParseTagHeader("x k=\"&amp;quot;\"", &h));
  EXPECT_EQ(h.attrs[0].second, "&quot;");
  EXPECT_FALSE(ParseTagHeader("call tool=f", &h));
  EXPECT_FALSE(ParseTagHeader("call tool=\"unterminated", &h));
  EXPECT_EQ(h.attrs[0].second, "unterminated");
  EXPECT_FALSE(ParseTagHeader("", &h));
}

// Random structure/text sequences (seeded): the parser never fails, every
// delta is valid UTF-8, and every tool call's arguments (typed children only)
// are a JSON object.
TEST(StreamParserFuzzTest, RandomSequencesKeepInvariants) {
  std::mt19937 rng(12345);
  const std::vector<std::string> headers = {"message role=\"assistant\"",
                                            "think",
                                            "response",
                                            "tools",
                                            "call tool=\"f\" index=\"1\"",
                                            "call",
                                            "argument key=\"k\" type=\"string\"",
                                            "argument key=\"n\" type=\"number\"",
                                            "argument key=\"o\" type=\"object\"",
                                            "argument type=\"bogus\"",
                                            "weird",
                                            "",
                                            "call tool=\"",
                                            "message",
                                            "think",
                                            "response",
                                            "tools",
                                            "call",
                                            "argument"};
  const std::vector<std::string> texts = {
      "a",    "\"", "\\",       "\n", "12",   "{\"x\":1}", "\xE4\xBD",
      "\xA0", "é",  "<|open|>", " ",  "\xFF", "true"};
  for (int round = 0; round < 3000; ++round) {
    ChatStreamParser parser(nullptr, Opts(static_cast<Start>(rng() % 4)));
    std::vector<ChatEvent> events;
    const int n = 1 + rng() % 40;
    for (int i = 0; i < n; ++i) {
      switch (rng() % 6) {
        case 0:
          parser.FeedStructure(StructureToken::kOpen, &events);
          parser.FeedText(headers[rng() % headers.size()], &events);
          if (rng() % 8 != 0) parser.FeedStructure(StructureToken::kSep, &events);
          break;
        case 1:
          parser.FeedStructure(StructureToken::kClose, &events);
          parser.FeedText(headers[rng() % headers.size()], &events);
          if (rng() % 8 != 0) parser.FeedStructure(StructureToken::kSep, &events);
          break;
        case 2:
          parser.FeedStructure(
              rng() % 10 == 0 ? StructureToken::kEndOfMsg : StructureToken::kSep,
              &events);
          break;
        default:
          parser.FeedText(texts[rng() % texts.size()], &events);
      }
    }
    parser.Finish(&events);
    for (const ChatEvent& e : events) {
      ASSERT_TRUE(tokenizer::IsValidUtf8(e.text)) << round;
      ASSERT_TRUE(tokenizer::IsValidUtf8(e.tool_name)) << round;
      if (e.type == ChatEvent::Type::kToolCallEnd) {
        auto parsed = nlohmann::json::parse(e.text, nullptr, false);
        ASSERT_FALSE(parsed.is_discarded()) << "round " << round << ": " << e.text;
        ASSERT_TRUE(parsed.is_object()) << e.text;
      }
    }
  }
}

}  // namespace
}  // namespace tandem::chat
