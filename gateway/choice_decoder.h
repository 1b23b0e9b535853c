// One choice of an OpenAI response, built from the token stream of one router
// Generate call:
//
//   chat:        ids → ChatStreamParser (engine/chat) → reasoning / content /
//                tool-call events → stop strings on content → Delta
//   completions: ids → IncrementalDetokenizer (specials skipped) → stop
//                strings → Delta (text)
//
// Each Add() returns what to send now (streaming deltas) and accumulates the
// whole choice (for non-streaming responses). Not thread-safe: one stream's
// messages arrive in order, the caller serialises.
//
// Multi-token messages (a speculative step, or tokens the router coalesced
// behind a slow write) give multi-token deltas, as vLLM's do: one delta per
// message, its text the concatenation of the tokens' text and its logprobs one
// entry per token, in order. A message is split into several deltas only where
// one chunk could not say it in order: at a change between reasoning, content
// and tool-call output, and between different tool calls. The finish reason
// (and usage) never share a delta: the caller sends them after the last one.
#ifndef TANDEM_GATEWAY_CHOICE_DECODER_H_
#define TANDEM_GATEWAY_CHOICE_DECODER_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/chat/stream_parser.h"
#include "engine/tokenizer/incremental_detokenizer.h"
#include "engine/tokenizer/tokenizer.h"
#include "gateway/stop_matcher.h"
#include "proto/router.pb.h"

namespace tandem::gateway {

// A generated token's log-probability, with its alternatives.
struct LogprobEntry {
  std::string token;  // the token's bytes (may be a partial UTF-8 sequence)
  float logprob = 0;
  std::vector<std::pair<std::string, float>> top;  // token bytes, logprob
};

struct ToolCallDelta {
  int index = 0;
  std::string id;         // set on the first delta of a call
  std::string name;       // set on the first delta of a call
  std::string arguments;  // a piece of the JSON arguments
};

struct ChoiceDelta {
  std::string reasoning;
  std::string content;  // chat content or completion text
  std::vector<ToolCallDelta> tool_calls;
  std::vector<LogprobEntry> logprobs;

  bool empty() const {
    return reasoning.empty() && content.empty() && tool_calls.empty() &&
           logprobs.empty();
  }
};

struct ParsedToolCallOut {
  std::string id;
  std::string name;
  std::string arguments;
};

class ChoiceDecoder {
 public:
  struct Options {
    bool chat = true;
    chat::ChatStreamParser::Start start = chat::ChatStreamParser::Start::kThink;
    std::string tool_call_id_prefix = "call_";
    std::vector<std::string> stop;
    bool logprobs = false;
    // At most this many tool calls (0: no limit): the choice ends, finish
    // reason "tool_calls", where the next one would start (OpenAI's
    // parallel_tool_calls: false is 1).
    int max_tool_calls = 0;
  };

  // `tokenizer` is not owned and must outlive the decoder.
  ChoiceDecoder(const tokenizer::Tokenizer* tokenizer, Options options);

  // One router message: appends its deltas (none, one, or more at the
  // boundaries above) to `deltas`. InvalidArgument for token ids outside the
  // vocabulary. A stop string that matches ends the choice at that token: the
  // message's later tokens are neither shown nor counted, and further
  // messages are ignored (done() is true: the caller cancels the router call).
  // A message with FINISH_REASON_ERROR (the worker's engine ended the request
  // with an error, e.g. a structured-output constraint that could not go on)
  // has its tokens decoded, then ends the choice: Internal naming the failure,
  // failed() and done() are true (the caller answers with a server error, as
  // for a failed router call: there is no OpenAI finish_reason for it).
  absl::Status Add(const tandem::v1::GenerateResponse& response,
                   std::vector<ChoiceDelta>* deltas);
  // The same, every delta merged into `delta` (for callers that only
  // accumulate).
  absl::Status Add(const tandem::v1::GenerateResponse& response, ChoiceDelta* delta);
  // The stream ended normally: flushes held text (appending deltas as Add
  // does); sets the finish reason from the last message (stop | length |
  // tool_calls).
  void Finish(std::vector<ChoiceDelta>* deltas);
  void Finish(ChoiceDelta* delta);
  // Ends the choice with `finish_reason` and nothing decoded from now on (a
  // score-only completion: its router output is not shown).
  void EndWithoutOutput(std::string finish_reason) {
    done_ = true;
    finish_reason_ = std::move(finish_reason);
  }

  bool done() const { return done_; }
  // The choice ended with FINISH_REASON_ERROR (see Add).
  bool failed() const { return failed_; }
  // "stop", "length" or "tool_calls"; empty until done() (and when failed()).
  const std::string& finish_reason() const { return finish_reason_; }
  int completion_tokens() const { return completion_tokens_; }

  // The whole choice so far.
  const std::string& reasoning() const { return reasoning_; }
  const std::string& content() const { return content_; }
  const std::vector<ParsedToolCallOut>& tool_calls() const { return tool_calls_; }
  const std::vector<LogprobEntry>& logprobs() const { return logprobs_; }
  const std::vector<std::string>& warnings() const { return warnings_; }

 private:
  void AddText(std::string text, bool content, std::vector<ChoiceDelta>* deltas);
  void Apply(const chat::ChatEvent& event, std::vector<ChoiceDelta>* deltas);
  // The delta that output of `kind` goes into: the last one, or a new one
  // when the last already holds output of another kind (or another call).
  enum class Kind { kReasoning, kContent, kToolCall };
  ChoiceDelta* DeltaFor(Kind kind, int tool_index, std::vector<ChoiceDelta>* deltas);
  LogprobEntry MakeLogprob(const tandem::v1::TokenLogprob& lp) const;
  bool OverToolLimit(const chat::ChatEvent& e) const {
    return options_.max_tool_calls > 0 && e.tool_index >= options_.max_tool_calls;
  }

  const tokenizer::Tokenizer* tokenizer_;  // not owned
  const Options options_;
  std::optional<chat::ChatStreamParser> parser_;                  // chat
  std::optional<tokenizer::IncrementalDetokenizer> detokenizer_;  // completions
  std::vector<chat::ChatEvent> events_;                           // reused
  StopMatcher stop_;
  bool done_ = false;
  bool tool_call_limit_hit_ = false;  // done_ at Options::max_tool_calls
  bool failed_ = false;
  std::string finish_reason_;
  tandem::v1::FinishReason last_reason_ = tandem::v1::FINISH_REASON_UNSPECIFIED;
  int completion_tokens_ = 0;
  int64_t outputs_ = 0;  // visible output events so far (text, tool calls)

  std::string reasoning_;
  std::string content_;
  std::vector<ParsedToolCallOut> tool_calls_;
  std::vector<LogprobEntry> logprobs_;
  std::vector<std::string> warnings_;
};

}  // namespace tandem::gateway

#endif  // TANDEM_GATEWAY_CHOICE_DECODER_H_
