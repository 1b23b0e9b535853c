#include "gateway/choice_decoder.h"

#include "absl/container/flat_hash_set.h"
#include "engine/tokenizer/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::gateway {
namespace {

using tandem::v1::GenerateResponse;

class ChoiceDecoderTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto t = tokenizer::Tokenizer::Load("third_party/kimi_k3_tokenizer");
    ASSERT_TRUE(t.ok()) << t.status();
    tokenizer_ = t->release();
  }

  // `text` with structure spellings as their ids.
  std::vector<int> Ids(const std::string& text) {
    const absl::flat_hash_set<std::string> specials = {
        "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[EOS]"};
    auto ids = tokenizer_->EncodeWithSpecial(text, specials);
    EXPECT_TRUE(ids.ok());
    return *ids;
  }

  // Feeds one id per message; the last carries `reason`. Returns the deltas
  // concatenated.
  ChoiceDelta Run(ChoiceDecoder& d, const std::vector<int>& ids,
                  tandem::v1::FinishReason reason = tandem::v1::FINISH_REASON_STOP,
                  bool logprobs = false) {
    ChoiceDelta all;
    for (size_t i = 0; i < ids.size(); ++i) {
      GenerateResponse r;
      r.add_token_ids(ids[i]);
      if (logprobs) {
        auto* lp = r.add_logprobs();
        lp->set_token_id(ids[i]);
        lp->set_logprob(-1.0f * i);
        auto* top = lp->add_top();
        top->set_token_id(ids[i]);
        top->set_logprob(-1.0f * i);
      }
      if (i + 1 == ids.size()) r.set_finish_reason(reason);
      ChoiceDelta delta;
      EXPECT_TRUE(d.Add(r, &delta).ok());
      Append(delta, &all);
      if (d.done()) break;
    }
    ChoiceDelta tail;
    d.Finish(&tail);
    Append(tail, &all);
    return all;
  }

  static void Append(const ChoiceDelta& d, ChoiceDelta* all) {
    all->reasoning += d.reasoning;
    all->content += d.content;
    all->tool_calls.insert(all->tool_calls.end(), d.tool_calls.begin(),
                           d.tool_calls.end());
    all->logprobs.insert(all->logprobs.end(), d.logprobs.begin(), d.logprobs.end());
  }

  static tokenizer::Tokenizer* tokenizer_;
};

tokenizer::Tokenizer* ChoiceDecoderTest::tokenizer_ = nullptr;

TEST_F(ChoiceDecoderTest, CompletionTextSkipsEos) {
  ChoiceDecoder d(tokenizer_, {.chat = false});
  const std::vector<int> ids = Ids(" Hello world, café![EOS]");
  ChoiceDelta all = Run(d, ids);
  EXPECT_EQ(all.content, " Hello world, café!");
  EXPECT_EQ(d.content(), all.content);
  EXPECT_EQ(d.finish_reason(), "stop");
  EXPECT_EQ(d.completion_tokens(), static_cast<int>(ids.size()));
}

TEST_F(ChoiceDecoderTest, LengthFinish) {
  ChoiceDecoder d(tokenizer_, {.chat = false});
  Run(d, Ids(" one two"), tandem::v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(d.finish_reason(), "length");
  EXPECT_EQ(d.content(), " one two");
}

TEST_F(ChoiceDecoderTest, StopStringCutsAndEndsEarly) {
  ChoiceDecoder d(tokenizer_, {.chat = false, .stop = {"fox"}});
  const std::vector<int> ids = Ids(" The quick brown fox jumps over[EOS]");
  ChoiceDelta all = Run(d, ids);
  EXPECT_EQ(all.content, " The quick brown ");
  EXPECT_EQ(d.content(), " The quick brown ");
  EXPECT_TRUE(d.done());
  EXPECT_EQ(d.finish_reason(), "stop");
  // Counted up to the token that completed the match, not beyond.
  EXPECT_LT(d.completion_tokens(), static_cast<int>(ids.size()));
  EXPECT_EQ(d.completion_tokens(),
            static_cast<int>(Ids(" The quick brown fox").size()));
}

TEST_F(ChoiceDecoderTest, ChatThinkingSplitsReasoningAndContent) {
  ChoiceDecoder d(tokenizer_,
                  {.chat = true, .start = chat::ChatStreamParser::Start::kThink});
  ChoiceDelta all =
      Run(d, Ids("I should greet.<|close|>think<|sep|><|open|>response<|sep|>Hi there!"
                 "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"));
  EXPECT_EQ(all.reasoning, "I should greet.");
  EXPECT_EQ(all.content, "Hi there!");
  EXPECT_EQ(d.reasoning(), "I should greet.");
  EXPECT_EQ(d.content(), "Hi there!");
  EXPECT_TRUE(d.tool_calls().empty());
  EXPECT_EQ(d.finish_reason(), "stop");
}

TEST_F(ChoiceDecoderTest, ChatWithoutThinking) {
  ChoiceDecoder d(tokenizer_,
                  {.chat = true, .start = chat::ChatStreamParser::Start::kResponse});
  Run(d,
      Ids("Plain answer<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"));
  EXPECT_EQ(d.reasoning(), "");
  EXPECT_EQ(d.content(), "Plain answer");
}

TEST_F(ChoiceDecoderTest, ChatToolCallWholeAndStreamed) {
  ChoiceDecoder d(tokenizer_, {.chat = true,
                               .start = chat::ChatStreamParser::Start::kResponse,
                               .tool_call_id_prefix = "call_x_"});
  ChoiceDelta all = Run(d, Ids("<|close|>response<|sep|><|open|>tools<|sep|>"
                               "<|open|>call tool=\"get_weather\" index=\"1\"<|sep|>"
                               "<|open|>argument key=\"city\" "
                               "type=\"string\"<|sep|>Paris<|close|>argument<|sep|>"
                               "<|open|>argument key=\"days\" "
                               "type=\"number\"<|sep|>3<|close|>argument<|sep|>"
                               "<|close|>call<|sep|><|close|>tools<|sep|><|close|>"
                               "message<|sep|><|end_of_msg|>"));
  ASSERT_EQ(d.tool_calls().size(), 1u);
  EXPECT_EQ(d.tool_calls()[0].name, "get_weather");
  EXPECT_EQ(d.tool_calls()[0].id, "call_x_0");
  EXPECT_EQ(nlohmann::json::parse(d.tool_calls()[0].arguments),
            nlohmann::json({{"city", "Paris"}, {"days", 3}}));
  EXPECT_EQ(d.finish_reason(), "tool_calls");
  // The streamed pieces: a first delta with id and name, then arguments that
  // concatenate to the whole.
  ASSERT_FALSE(all.tool_calls.empty());
  EXPECT_EQ(all.tool_calls[0].id, "call_x_0");
  EXPECT_EQ(all.tool_calls[0].name, "get_weather");
  std::string args;
  for (const auto& t : all.tool_calls) {
    EXPECT_EQ(t.index, 0);
    args += t.arguments;
  }
  EXPECT_EQ(args, d.tool_calls()[0].arguments);
}

// parallel_tool_calls false (max_tool_calls 1): the first call whole, the
// choice ends "tool_calls" where the second starts, and nothing of it shows;
// without the limit both calls come through.
TEST_F(ChoiceDecoderTest, ToolCallLimitEndsTheChoiceAtTheNextCall) {
  const std::vector<int> ids =
      Ids("<|close|>response<|sep|><|open|>tools<|sep|>"
          "<|open|>call tool=\"get_weather\" index=\"1\"<|sep|>"
          "<|open|>argument key=\"city\" type=\"string\"<|sep|>Paris"
          "<|close|>argument<|sep|><|close|>call<|sep|>"
          "<|open|>call tool=\"get_time\" index=\"2\"<|sep|>"
          "<|open|>argument key=\"zone\" type=\"string\"<|sep|>CET"
          "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
          "<|close|>message<|sep|><|end_of_msg|>");
  ChoiceDecoder both(tokenizer_,
                     {.chat = true, .start = chat::ChatStreamParser::Start::kResponse});
  Run(both, ids);
  ASSERT_EQ(both.tool_calls().size(), 2u);
  EXPECT_EQ(both.tool_calls()[1].name, "get_time");

  ChoiceDecoder one(tokenizer_, {.chat = true,
                                 .start = chat::ChatStreamParser::Start::kResponse,
                                 .max_tool_calls = 1});
  ChoiceDelta all = Run(one, ids);
  EXPECT_TRUE(one.done());
  ASSERT_EQ(one.tool_calls().size(), 1u);
  EXPECT_EQ(one.tool_calls()[0].name, "get_weather");
  EXPECT_EQ(nlohmann::json::parse(one.tool_calls()[0].arguments),
            nlohmann::json({{"city", "Paris"}}));
  EXPECT_EQ(one.finish_reason(), "tool_calls");
  for (const auto& t : all.tool_calls) EXPECT_EQ(t.index, 0) << t.name;
  // It stopped reading at the second call's start: fewer tokens counted.
  EXPECT_LT(one.completion_tokens(), both.completion_tokens());
}

TEST_F(ChoiceDecoderTest, LogprobsOnePerToken) {
  ChoiceDecoder d(tokenizer_, {.chat = false, .logprobs = true});
  const std::vector<int> ids = Ids(" a b c");
  ChoiceDelta all = Run(d, ids, tandem::v1::FINISH_REASON_LENGTH, /*logprobs=*/true);
  ASSERT_EQ(d.logprobs().size(), ids.size());
  ASSERT_EQ(all.logprobs.size(), ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(d.logprobs()[i].token, *tokenizer_->IdToken(ids[i]));
    EXPECT_FLOAT_EQ(d.logprobs()[i].logprob, -1.0f * i);
    ASSERT_EQ(d.logprobs()[i].top.size(), 1u);
  }
}

TEST_F(ChoiceDecoderTest, IdOutsideVocabularyIsAnError) {
  ChoiceDecoder d(tokenizer_, {.chat = false});
  GenerateResponse r;
  r.add_token_ids(tokenizer::kVocabSize + 5);
  ChoiceDelta delta;
  EXPECT_EQ(d.Add(r, &delta).code(), absl::StatusCode::kInvalidArgument);
}

// FINISH_REASON_ERROR (the engine ended the request, e.g. a constraint that
// could not go on): the message's tokens are decoded, then the choice fails
// with Internal (a server error for the client), never a normal finish.
TEST_F(ChoiceDecoderTest, FinishReasonErrorFailsTheChoice) {
  for (const bool chat : {false, true}) {
    SCOPED_TRACE(chat);
    ChoiceDecoder d(tokenizer_,
                    {.chat = chat, .start = chat::ChatStreamParser::Start::kResponse});
    const std::vector<int> ids = Ids("{\"a\": 1");
    GenerateResponse first;
    first.add_token_ids(ids[0]);
    ChoiceDelta delta;
    ASSERT_TRUE(d.Add(first, &delta).ok());
    EXPECT_FALSE(d.failed());
    GenerateResponse last;
    for (size_t i = 1; i < ids.size(); ++i) last.add_token_ids(ids[i]);
    last.set_finish_reason(tandem::v1::FINISH_REASON_ERROR);
    absl::Status s = d.Add(last, &delta);
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
    EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("generation failed"));
    EXPECT_TRUE(d.failed());
    EXPECT_TRUE(d.done());
    EXPECT_EQ(d.finish_reason(), "");
    EXPECT_EQ(d.completion_tokens(), static_cast<int>(ids.size()));
    // Nothing after it counts; Finish does not turn it into "stop".
    GenerateResponse more;
    more.add_token_ids(ids[0]);
    EXPECT_TRUE(d.Add(more, &delta).ok());
    d.Finish(&delta);
    EXPECT_EQ(d.finish_reason(), "");
    EXPECT_EQ(d.completion_tokens(), static_cast<int>(ids.size()));
  }
  // A normal finish never fails.
  ChoiceDecoder ok(tokenizer_, {.chat = false});
  Run(ok, Ids("abc[EOS]"));
  EXPECT_FALSE(ok.failed());
  EXPECT_EQ(ok.finish_reason(), "stop");
}

}  // namespace
}  // namespace tandem::gateway
