#include "engine/sampling/sampling_params.h"

#include <cmath>

#include "absl/random/random.h"
#include "common/status.h"

namespace tandem::engine {
namespace {

absl::Status CheckRange(const char* name, float value, float lo, float hi) {
  if (!std::isfinite(value) || value < lo || value > hi) {
    return InvalidArgument(name, " must be in [", lo, ", ", hi, "], got ", value);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SamplingParams::Validate() const {
  TANDEM_RETURN_IF_ERROR(CheckRange("temperature", temperature, 0.0f, 2.0f));
  if (!std::isfinite(top_p) || top_p <= 0.0f || top_p > 1.0f) {
    return InvalidArgument("top_p must be in (0, 1], got ", top_p);
  }
  if (top_k < 0) return InvalidArgument("top_k must be >= 0, got ", top_k);
  TANDEM_RETURN_IF_ERROR(CheckRange("min_p", min_p, 0.0f, 1.0f));
  TANDEM_RETURN_IF_ERROR(CheckRange("presence_penalty", presence_penalty, -2.0f, 2.0f));
  TANDEM_RETURN_IF_ERROR(
      CheckRange("frequency_penalty", frequency_penalty, -2.0f, 2.0f));
  if (!std::isfinite(repetition_penalty) || repetition_penalty <= 0.0f ||
      repetition_penalty > 10.0f) {
    return InvalidArgument("repetition_penalty must be in (0, 10], got ",
                           repetition_penalty);
  }
  if (top_logprobs < 0 || top_logprobs > kMaxTopLogprobs) {
    return InvalidArgument("top_logprobs must be in [0, ", kMaxTopLogprobs, "], got ",
                           top_logprobs);
  }
  if (top_logprobs > 0 && !logprobs) {
    return InvalidArgument("top_logprobs = ", top_logprobs,
                           " requires logprobs = true");
  }
  if (prompt_logprobs < -1 || prompt_logprobs > kMaxTopLogprobs) {
    return InvalidArgument("prompt_logprobs must be in [0, ", kMaxTopLogprobs,
                           "] (or -1: none), got ", prompt_logprobs);
  }
  if (max_tokens < 0) {
    return InvalidArgument("max_tokens must be >= 0, got ", max_tokens);
  }
  if (min_tokens < 0) {
    return InvalidArgument("min_tokens must be >= 0, got ", min_tokens);
  }
  if (max_tokens > 0 && min_tokens > max_tokens) {
    return InvalidArgument("min_tokens (", min_tokens, ") must not exceed max_tokens (",
                           max_tokens, ")");
  }
  if (stop_strings.size() > kMaxStopStrings) {
    return InvalidArgument("at most ", kMaxStopStrings,
                           " stop strings are allowed, got ", stop_strings.size());
  }
  for (const std::string& s : stop_strings) {
    if (s.empty()) return InvalidArgument("stop strings must not be empty");
    if (s.size() > kMaxStopStringBytes) {
      return InvalidArgument("a stop string may be at most ", kMaxStopStringBytes,
                             " bytes, got ", s.size());
    }
  }
  for (int32_t id : stop_token_ids) {
    if (id < 0) return InvalidArgument("stop token id must be >= 0, got ", id);
  }
  for (size_t i = 0; i < logit_bias.size(); ++i) {
    const TokenBias& b = logit_bias[i];
    if (b.token_id < 0) {
      return InvalidArgument("logit_bias: token id must be >= 0, got ", b.token_id);
    }
    if (i > 0 && b.token_id <= logit_bias[i - 1].token_id) {
      return InvalidArgument("logit_bias: token ids must be distinct and ascending (",
                             logit_bias[i - 1].token_id, " then ", b.token_id, ")");
    }
    if (!std::isfinite(b.bias) || b.bias < -kMaxLogitBias || b.bias > kMaxLogitBias) {
      return InvalidArgument("logit_bias: the bias of token ", b.token_id,
                             " must be in [", -kMaxLogitBias, ", ", kMaxLogitBias,
                             "], got ", b.bias);
    }
  }
  if (structured.has_value()) TANDEM_RETURN_IF_ERROR(structured->Validate());
  return absl::OkStatus();
}

absl::string_view StructuredOutputKindName(StructuredOutputSpec::Kind kind) {
  switch (kind) {
    case StructuredOutputSpec::Kind::kJsonObject:
      return "json_object";
    case StructuredOutputSpec::Kind::kJsonSchema:
      return "json_schema";
    case StructuredOutputSpec::Kind::kRegex:
      return "regex";
    case StructuredOutputSpec::Kind::kChoice:
      return "choice";
    case StructuredOutputSpec::Kind::kEbnf:
      return "grammar";
    case StructuredOutputSpec::Kind::kToolCalls:
      return "tool_calls";
  }
  return "unknown";
}

absl::Status StructuredOutputSpec::Validate() const {
  if (static_cast<int64_t>(source.size()) > kMaxConstraintSourceBytes) {
    return InvalidArgument("structured_output.source: at most ",
                           kMaxConstraintSourceBytes, " bytes, got ", source.size());
  }
  switch (kind) {
    case Kind::kJsonObject:
      break;
    case Kind::kJsonSchema:
    case Kind::kRegex:
    case Kind::kEbnf:
    case Kind::kToolCalls:
      if (source.empty()) {
        return InvalidArgument("structured_output.source: a ",
                               StructuredOutputKindName(kind), " must not be empty");
      }
      break;
    case Kind::kChoice: {
      if (choices.empty()) {
        return InvalidArgument("structured_output.choices: at least one is required");
      }
      if (static_cast<int>(choices.size()) > kMaxConstraintChoices) {
        return InvalidArgument("structured_output.choices: at most ",
                               kMaxConstraintChoices, ", got ", choices.size());
      }
      int64_t bytes = 0;
      for (const std::string& c : choices) bytes += c.size();
      if (bytes > kMaxConstraintSourceBytes) {
        return InvalidArgument("structured_output.choices: at most ",
                               kMaxConstraintSourceBytes, " bytes in all");
      }
      break;
    }
  }
  auto check_ids = [](const char* field, absl::Span<const int32_t> ids) {
    if (static_cast<int>(ids.size()) > kMaxConstraintFramingTokens) {
      return InvalidArgument("structured_output.", field, ": at most ",
                             kMaxConstraintFramingTokens, " tokens, got ", ids.size());
    }
    for (int32_t id : ids) {
      if (id < 0)
        return InvalidArgument("structured_output.", field, ": token id ", id);
    }
    return absl::OkStatus();
  };
  TANDEM_RETURN_IF_ERROR(check_ids("free_banned_token_ids", free_banned_token_ids));
  TANDEM_RETURN_IF_ERROR(check_ids("prefix_token_ids", prefix_token_ids));
  TANDEM_RETURN_IF_ERROR(check_ids("suffix_token_ids", suffix_token_ids));
  if (free_until_token_id < -1) {
    return InvalidArgument("structured_output.free_until_token_id: token id ",
                           free_until_token_id);
  }
  if (terminator_token_id < -1) {
    return InvalidArgument("structured_output.terminator_token_id: token id ",
                           terminator_token_id);
  }
  if (terminator_token_id < 0 && !suffix_token_ids.empty()) {
    return InvalidArgument(
        "structured_output.suffix_token_ids: needs a terminator_token_id");
  }
  return absl::OkStatus();
}

absl::Status StructuredOutputSpec::ValidateForVocab(int64_t vocab_size) const {
  TANDEM_RETURN_IF_ERROR(Validate());
  auto in_vocab = [&](int32_t id) {
    if (id >= vocab_size) {
      return InvalidArgument("structured_output: token id ", id,
                             " is outside the vocabulary of ", vocab_size, " tokens");
    }
    return absl::OkStatus();
  };
  for (int32_t id : free_banned_token_ids) TANDEM_RETURN_IF_ERROR(in_vocab(id));
  for (int32_t id : prefix_token_ids) TANDEM_RETURN_IF_ERROR(in_vocab(id));
  for (int32_t id : suffix_token_ids) TANDEM_RETURN_IF_ERROR(in_vocab(id));
  TANDEM_RETURN_IF_ERROR(in_vocab(free_until_token_id));
  TANDEM_RETURN_IF_ERROR(in_vocab(terminator_token_id));
  return absl::OkStatus();
}

absl::Status SamplingParams::ValidateForVocab(int64_t vocab_size) const {
  TANDEM_RETURN_IF_ERROR(Validate());
  for (int32_t id : stop_token_ids) {
    if (id >= vocab_size) {
      return InvalidArgument("stop token id ", id, " is outside the vocabulary of ",
                             vocab_size, " tokens");
    }
  }
  if (!logit_bias.empty() && logit_bias.back().token_id >= vocab_size) {
    return InvalidArgument("logit_bias: token id ", logit_bias.back().token_id,
                           " is outside the vocabulary of ", vocab_size, " tokens");
  }
  if (structured.has_value()) {
    TANDEM_RETURN_IF_ERROR(structured->ValidateForVocab(vocab_size));
  }
  return absl::OkStatus();
}

uint64_t FreshSeed() {
  absl::BitGen gen;
  return absl::Uniform<uint64_t>(gen);
}

void EnsureSeed(SamplingParams* params) {
  if (!params->IsGreedy() && !params->seed.has_value()) params->seed = FreshSeed();
}

void EnsureSeed(SamplingParams* params, SplitMix64* seeds) {
  if (!params->IsGreedy() && !params->seed.has_value()) params->seed = seeds->Next();
}

}  // namespace tandem::engine
