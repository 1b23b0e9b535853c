#include "router/request_validation.h"

#include <cmath>

#include "common/ids.h"
#include "common/status.h"

namespace tandem::router {
namespace {

absl::Status InRange(const char* field, double v, double lo, double hi) {
  if (!std::isfinite(v) || v < lo || v > hi) {
    return InvalidArgument(field, " must be in [", lo, ", ", hi, "], got ", v);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateGenerateRequest(const tandem::v1::GenerateRequest& r,
                                     const ModelLimits& limits) {
  if (!r.request_id().empty() && !IsValidId(r.request_id())) {
    return InvalidArgument(
        "request_id must be 1-128 characters of [A-Za-z0-9._:-], got '",
        r.request_id().substr(0, 140), "'");
  }
  int64_t prompt_tokens = 0;
  switch (r.prompt_case()) {
    case tandem::v1::GenerateRequest::kPromptTokenIds: {
      const auto& ids = r.prompt_token_ids().ids();
      if (ids.empty()) return InvalidArgument("prompt_token_ids is empty");
      for (int i = 0; i < ids.size(); ++i) {
        if (ids[i] < 0 || ids[i] >= limits.vocab_size) {
          return InvalidArgument("prompt_token_ids[", i, "] = ", ids[i],
                                 " is outside the vocabulary [0, ", limits.vocab_size,
                                 ")");
        }
      }
      prompt_tokens = ids.size();
      break;
    }
    case tandem::v1::GenerateRequest::kPromptText:
      if (r.prompt_text().empty()) return InvalidArgument("prompt_text is empty");
      break;
    case tandem::v1::GenerateRequest::PROMPT_NOT_SET:
      return InvalidArgument("one of prompt_token_ids or prompt_text must be set");
  }
  if (prompt_tokens > limits.max_context_tokens) {
    return InvalidArgument("the prompt has ", prompt_tokens,
                           " tokens, more than the model's context of ",
                           limits.max_context_tokens, " tokens");
  }
  // Images (the gateway located their <|media_pad|> runs; the prefill worker
  // decodes them again and checks grid, token count and hash).
  if (r.images_size() > kMaxImages) {
    return InvalidArgument(r.images_size(), " images, more than ", kMaxImages);
  }
  int64_t image_end = 0;
  for (int i = 0; i < r.images_size(); ++i) {
    const tandem::v1::ImageInput& im = r.images(i);
    if (r.prompt_case() != tandem::v1::GenerateRequest::kPromptTokenIds) {
      return InvalidArgument("images need prompt_token_ids (their placeholders)");
    }
    if (im.data().empty()) return InvalidArgument("images[", i, "].data is empty");
    if (im.num_tokens() <= 0) {
      return InvalidArgument("images[", i, "].num_tokens must be > 0, got ",
                             im.num_tokens());
    }
    if (im.placeholder_start() < image_end ||
        im.placeholder_start() + im.num_tokens() > prompt_tokens) {
      return InvalidArgument("images[", i, "]: placeholders [", im.placeholder_start(),
                             ", ", im.placeholder_start() + im.num_tokens(),
                             ") are not inside the prompt of ", prompt_tokens,
                             " tokens after the previous image's (ending at ",
                             image_end, ")");
    }
    image_end = im.placeholder_start() + im.num_tokens();
  }
  if (r.images_size() > 0 && r.stop().min_tokens() > 0) {
    return InvalidArgument(
        "stop.min_tokens with images is not supported (an image prompt is prefilled "
        "on a prefill worker, which samples the first token without stop rules)");
  }
  const auto& s = r.sampling();
  TANDEM_RETURN_IF_ERROR(InRange("sampling.temperature", s.temperature(), 0, 2));
  TANDEM_RETURN_IF_ERROR(InRange("sampling.top_p", s.top_p(), 0, 1));
  TANDEM_RETURN_IF_ERROR(InRange("sampling.min_p", s.min_p(), 0, 1));
  TANDEM_RETURN_IF_ERROR(
      InRange("sampling.presence_penalty", s.presence_penalty(), -2, 2));
  TANDEM_RETURN_IF_ERROR(
      InRange("sampling.frequency_penalty", s.frequency_penalty(), -2, 2));
  TANDEM_RETURN_IF_ERROR(
      InRange("sampling.repetition_penalty", s.repetition_penalty(), 0, 10));
  if (s.top_k() < 0)
    return InvalidArgument("sampling.top_k must be >= 0, got ", s.top_k());
  for (const auto& [id, bias] : s.logit_bias()) {
    if (id < 0 || id >= limits.vocab_size) {
      return InvalidArgument("sampling.logit_bias: token id ", id,
                             " is outside the vocabulary [0, ", limits.vocab_size, ")");
    }
    if (!std::isfinite(bias) || bias < -kMaxLogitBias || bias > kMaxLogitBias) {
      return InvalidArgument("sampling.logit_bias: the bias of token ", id,
                             " must be in [-100, 100], got ", bias);
    }
  }
  if (s.has_prompt_logprobs() &&
      (s.prompt_logprobs() < 0 || s.prompt_logprobs() > kMaxTopLogprobs)) {
    return InvalidArgument("sampling.prompt_logprobs must be in [0, ", kMaxTopLogprobs,
                           "], got ", s.prompt_logprobs());
  }
  if (s.has_prompt_logprobs() && prompt_tokens > 1) {
    const int64_t per =
        kPromptScoreBytes + kPromptAlternativeBytes * s.prompt_logprobs();
    if ((prompt_tokens - 1) * per > kMaxPromptScoreBytes) {
      return InvalidArgument(
          "sampling.prompt_logprobs: the scores of a ", prompt_tokens,
          "-token prompt with ", s.prompt_logprobs(), " alternatives would take about ",
          ((prompt_tokens - 1) * per) >> 20, " MiB, more than the ",
          kMaxPromptScoreBytes >> 10,
          " KiB one message carries between the workers; "
          "score at most ",
          kMaxPromptScoreBytes / per + 1,
          " prompt tokens with that many alternatives, or ask fewer");
    }
  }
  if (s.top_logprobs() < 0 || s.top_logprobs() > kMaxTopLogprobs) {
    return InvalidArgument("sampling.top_logprobs must be in [0, ", kMaxTopLogprobs,
                           "], got ", s.top_logprobs());
  }
  const auto& stop = r.stop();
  if (stop.max_tokens() < 0) {
    return InvalidArgument("stop.max_tokens must be >= 0, got ", stop.max_tokens());
  }
  if (stop.min_tokens() < 0) {
    return InvalidArgument("stop.min_tokens must be >= 0, got ", stop.min_tokens());
  }
  if (stop.max_tokens() > 0 && stop.min_tokens() > stop.max_tokens()) {
    return InvalidArgument("stop.min_tokens (", stop.min_tokens(),
                           ") exceeds stop.max_tokens (", stop.max_tokens(), ")");
  }
  if (prompt_tokens > 0 &&
      prompt_tokens + stop.max_tokens() > limits.max_context_tokens) {
    return InvalidArgument("prompt (", prompt_tokens, " tokens) + max_tokens (",
                           stop.max_tokens(), ") exceeds the model's context of ",
                           limits.max_context_tokens, " tokens");
  }
  if (stop.stop_strings_size() > kMaxStopStrings) {
    return InvalidArgument("at most ", kMaxStopStrings, " stop strings, got ",
                           stop.stop_strings_size());
  }
  for (int i = 0; i < stop.stop_strings_size(); ++i) {
    const std::string& str = stop.stop_strings(i);
    if (str.empty() || str.size() > kMaxStopStringBytes) {
      return InvalidArgument("stop.stop_strings[", i, "] must be 1-",
                             kMaxStopStringBytes, " bytes, got ", str.size());
    }
  }
  if (stop.stop_token_ids_size() > kMaxStopTokenIds) {
    return InvalidArgument("at most ", kMaxStopTokenIds, " stop token ids, got ",
                           stop.stop_token_ids_size());
  }
  for (int i = 0; i < stop.stop_token_ids_size(); ++i) {
    int id = stop.stop_token_ids(i);
    if (id < 0 || id >= limits.vocab_size) {
      return InvalidArgument("stop.stop_token_ids[", i, "] = ", id,
                             " is outside the vocabulary [0, ", limits.vocab_size, ")");
    }
  }
  if (r.deadline_unix_ms() < 0) {
    return InvalidArgument("deadline_unix_ms must be >= 0, got ", r.deadline_unix_ms());
  }
  return absl::OkStatus();
}

}  // namespace tandem::router
