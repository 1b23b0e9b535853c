// Per-request sampling and stop options as plain C++ (no proto types on the hot
// path). proto_convert.h maps them to and from tandem.v1.SamplingParams and
// tandem.v1.StopConditions.
#ifndef TANDEM_ENGINE_SAMPLING_SAMPLING_PARAMS_H_
#define TANDEM_ENGINE_SAMPLING_SAMPLING_PARAMS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/splitmix.h"

namespace tandem::grammar {
class CompiledGrammar;
}  // namespace tandem::grammar

namespace tandem::engine {

// Temperatures below this are treated as greedy (argmax), as vLLM does.
inline constexpr float kGreedyTemperature = 1e-5f;
// Most alternatives a request may ask for per token (the OpenAI limit).
inline constexpr int kMaxTopLogprobs = 20;
// Limits on stop strings (bounded hold-back and matching cost).
inline constexpr int kMaxStopStrings = 16;
inline constexpr int kMaxStopStringBytes = 256;
// Limits on a structured-output constraint's text (the compiler has its own
// budget on the automaton it builds).
inline constexpr int64_t kMaxConstraintSourceBytes = 1 << 20;
inline constexpr int kMaxConstraintChoices = 4096;
inline constexpr int kMaxConstraintFramingTokens = 256;
// OpenAI's range for a logit_bias value.
inline constexpr float kMaxLogitBias = 100.0f;

// One entry of a request's logit_bias.
struct TokenBias {
  int32_t token_id = 0;
  float bias = 0.0f;
  bool operator==(const TokenBias& o) const {
    return token_id == o.token_id && bias == o.bias;
  }
};

// A constraint on the output (proto StructuredOutput; structured_output.h runs
// it). The output is: a free run (when free_until_token_id >= 0: any token but
// free_banned_token_ids until free_until_token_id is sampled), the forced
// prefix_token_ids, text the grammar accepts, then either one of the model's
// stop tokens (terminator_token_id < 0) or terminator_token_id followed by the
// forced suffix_token_ids.
struct StructuredOutputSpec {
  // kToolCalls: source is engine/grammar/tool_calls.h's JSON.
  enum class Kind { kJsonObject, kJsonSchema, kRegex, kChoice, kEbnf, kToolCalls };
  Kind kind = Kind::kJsonObject;
  std::string source;  // schema JSON, regex, or EBNF
  std::vector<std::string> choices;
  std::vector<int32_t> free_banned_token_ids;
  int32_t free_until_token_id = -1;
  std::vector<int32_t> prefix_token_ids;
  int32_t terminator_token_id = -1;
  std::vector<int32_t> suffix_token_ids;
  // The spec compiled ahead of admission by Engine::CompileConstraint (the
  // worker's compile thread, worker::EngineLoop), so that the engine thread
  // does not stop every running request for a compile; null: the engine
  // compiles at admission. Never on the wire.
  std::shared_ptr<const grammar::CompiledGrammar> compiled;

  // Names the field: "structured_output.source: ...".
  absl::Status Validate() const;
  absl::Status ValidateForVocab(int64_t vocab_size) const;
};
absl::string_view StructuredOutputKindName(StructuredOutputSpec::Kind kind);

struct SamplingParams {
  // 0 (or < kGreedyTemperature) means greedy. Range [0, 2].
  float temperature = 0.0f;
  // Nucleus: keep the smallest prefix (most likely first) with mass >= top_p.
  // 1 disables. Range (0, 1].
  float top_p = 1.0f;
  // Keep the top_k most likely tokens; 0 disables.
  int32_t top_k = 0;
  // Drop tokens with probability < min_p * (probability of the most likely);
  // 0 disables. Range [0, 1].
  float min_p = 0.0f;
  // The request's random stream. Unset: the caller must draw one before
  // sampling (the router does, and reports it back).
  std::optional<uint64_t> seed;
  // OpenAI penalties over OUTPUT tokens: presence subtracted once per distinct
  // generated token, frequency subtracted per occurrence. Range [-2, 2].
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  // CTRL-style penalty over prompt and output tokens: positive logits are
  // divided by it, negative ones multiplied. 1 disables. Range (0, 10].
  float repetition_penalty = 1.0f;
  // Report the chosen token's logprob, and top_logprobs alternatives (0..20).
  bool logprobs = false;
  int32_t top_logprobs = 0;
  // OpenAI logit_bias: added to each listed token's logit after the mask and
  // the suppression, before the penalties and the temperature (sampler.h).
  // Token ids strictly ascending (distinct), values in [-100, 100].
  std::vector<TokenBias> logit_bias;
  // vLLM's prompt_logprobs: -1 none; else every prompt token after the first is
  // scored under the raw model (ScoreToken) with this many alternatives
  // (0..20), returned with the first output token.
  int32_t prompt_logprobs = -1;

  // Stop conditions.
  // Extra token ids that end generation (the model's EOS ids are added by the
  // StopChecker unless ignore_eos).
  std::vector<int32_t> stop_token_ids;
  // Strings that end generation; output is cut before the first match.
  std::vector<std::string> stop_strings;
  // Maximum generated tokens; 0 = up to the context limit.
  int32_t max_tokens = 0;
  // Stop tokens and stop strings do not end generation before this many
  // tokens; stop tokens are also masked out of sampling until then.
  int32_t min_tokens = 0;
  // Keep generating through the model's EOS tokens.
  bool ignore_eos = false;

  // Structured output: every token is sampled under the constraint's mask.
  // Clients may not combine it with ignore_eos or min_tokens (the gateway and
  // the router refuse them); the prefill worker sets ignore_eos for its one
  // token, which the constraint allows.
  std::optional<StructuredOutputSpec> structured;

  bool IsGreedy() const { return temperature < kGreedyTemperature; }
  bool HasPenalties() const {
    return presence_penalty != 0.0f || frequency_penalty != 0.0f ||
           repetition_penalty != 1.0f;
  }

  // Checks every range above; the message names the field and the value.
  absl::Status Validate() const;
  // Validate() plus token ids (stop_token_ids) inside [0, vocab_size).
  absl::Status ValidateForVocab(int64_t vocab_size) const;
};

// Seed derivation, one rule for every process: a request that samples without a
// seed gets a fresh random one (reported back to the client, so that the request
// can be replayed exactly); a greedy request keeps none.
uint64_t FreshSeed();
// Sets params->seed to FreshSeed() when it samples and has no seed.
void EnsureSeed(SamplingParams* params);
// The same from a deterministic stream (an engine created with a fixed seed gives
// the same seeds to the same sequence of requests).
void EnsureSeed(SamplingParams* params, SplitMix64* seeds);

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_SAMPLING_SAMPLING_PARAMS_H_
