// Parsing and validation of OpenAI request bodies (POST /v1/chat/completions,
// POST /v1/completions) into plain structs. Every error is InvalidArgument
// (or Unimplemented for a feature Tandem refuses) with a message of the form
// "param: what is wrong", which api_error.h turns into a 400 naming `param`.
// Nothing here throws, whatever the input; no I/O, no tokenizer (fuzzed by
// request_parser_fuzz.cc).
#ifndef TANDEM_GATEWAY_REQUEST_PARSER_H_
#define TANDEM_GATEWAY_REQUEST_PARSER_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/chat/chat_types.h"

namespace tandem::gateway {

inline constexpr int kMaxN = 128;
inline constexpr int kMaxStopStrings = 16;
inline constexpr int kMaxTopLogprobs = 20;

// A structured-output constraint asked for by one of: response_format
// (json_object, json_schema), structured_outputs {json, regex, choice,
// grammar, json_object}, or vLLM's older guided_json / guided_regex /
// guided_choice / guided_grammar. At most one per request.
struct StructuredOutputRequest {
  enum class Kind { kJsonObject, kJsonSchema, kRegex, kChoice, kEbnf };
  Kind kind = Kind::kJsonObject;
  std::string source;  // the schema as compact JSON, the regex, the grammar
  std::vector<std::string> choices;
  std::string param;  // the request field it came from, for errors
};

// The fields chat and completions share: sampling and stopping.
struct GenerationFields {
  std::string model;
  std::optional<double> temperature;  // [0, 2]
  std::optional<double> top_p;        // (0, 1]
  int n = 1;                          // [1, kMaxN]
  // >= 1 (max_completion_tokens wins); 0 only for completions with echo: the
  // prompt scored, nothing generated (ScoreOnly()).
  std::optional<int> max_tokens;
  std::vector<std::string> stop;  // at most kMaxStopStrings
  std::optional<uint64_t> seed;
  double presence_penalty = 0;   // [-2, 2]
  double frequency_penalty = 0;  // [-2, 2]
  bool logprobs = false;
  int top_logprobs = 0;  // [0, kMaxTopLogprobs]
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  std::string user;
  // token id → bias in [-100, 100] (ids checked against the vocabulary by the
  // router).
  std::map<int, double> logit_bias;
  // vLLM-style extensions.
  std::optional<int> top_k;                  // >= 0 (-1 means disabled, as in vLLM)
  std::optional<double> min_p;               // [0, 1]
  std::optional<double> repetition_penalty;  // (0, 2]
  bool ignore_eos = false;
  int min_tokens = 0;
  std::vector<int> stop_token_ids;
  // vLLM's priority scheduling: lower waits less in the router's queue.
  int priority = 0;
  // vLLM's prompt_logprobs: score every prompt token (0..20 alternatives);
  // returned as `prompt_logprobs` (per choice for completions, top level for
  // chat; not with chat streaming).
  std::optional<int> prompt_logprobs;
  // Completions' echo: the prompt goes before each choice's text (and, with
  // logprobs, its tokens before the choice's: the first with a null logprob).
  bool echo = false;
  // vLLM's `cache_salt`: the prefix-cache namespace (a tenant's); non-empty
  // when given.
  std::string cache_salt;
  // Structured output (constrained decoding).
  std::optional<StructuredOutputRequest> structured;

  // Completions' `echo` with `max_tokens: 0` (vLLM's echo without generation):
  // the prompt (with its logprobs when asked) and no generated text.
  bool ScoreOnly() const { return echo && max_tokens && *max_tokens == 0; }
};

struct ChatCompletionRequest {
  GenerationFields fields;
  std::vector<chat::ChatMessage> messages;  // at least one
  std::vector<chat::ToolDeclaration> tools;
  chat::ChatOptions options;  // thinking, tool_choice, response_format
  // OpenAI's parallel_tool_calls: false allows at most one tool call (the
  // first; generation ends where a second would start, and tool_choice
  // "required" is constrained to one call).
  bool parallel_tool_calls = true;
};

// A prompt: text, or token ids.
using Prompt = std::variant<std::string, std::vector<int>>;

struct CompletionRequest {
  GenerationFields fields;
  std::vector<Prompt> prompts;  // a batch: choices are prompt-major
};

absl::StatusOr<ChatCompletionRequest> ParseChatCompletionRequest(
    absl::string_view body);
absl::StatusOr<CompletionRequest> ParseCompletionRequest(absl::string_view body);

// vLLM's POST /tokenize: a `prompt` (text, encoded as /v1/completions encodes
// it) or chat `messages` (rendered and encoded as /v1/chat/completions does,
// with `tools`, the chat options and `add_generation_prompt`, default true,
// which may also be false here). `model` is optional.
struct TokenizeRequest {
  std::string model;  // empty: the served model
  bool chat = false;
  std::string prompt;
  std::vector<chat::ChatMessage> messages;
  std::vector<chat::ToolDeclaration> tools;
  chat::ChatOptions options;
  bool return_token_strs = false;
};
absl::StatusOr<TokenizeRequest> ParseTokenizeRequest(absl::string_view body);

// vLLM's POST /detokenize: `tokens` (ids) back to text, special tokens kept.
struct DetokenizeRequest {
  std::string model;  // empty: the served model
  std::vector<int> tokens;
};
absl::StatusOr<DetokenizeRequest> ParseDetokenizeRequest(absl::string_view body);

// The seed of choice `index` of a request with seed `seed`: choice 0 uses the
// seed itself (so n=1 and n>1 agree on the first choice), others a well-mixed
// derivation (SplitMix64 of seed + index x golden ratio: distinct for
// distinct indices >= 1).
uint64_t ChoiceSeed(uint64_t seed, int index);

}  // namespace tandem::gateway

#endif  // TANDEM_GATEWAY_REQUEST_PARSER_H_
