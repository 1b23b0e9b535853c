#include "engine/sampling/proto_convert.h"

#include <algorithm>

#include "common/status.h"

namespace tandem::engine {
namespace {

absl::StatusOr<StructuredOutputSpec> StructuredFromProto(
    const tandem::v1::StructuredOutput& so) {
  using K = StructuredOutputSpec::Kind;
  StructuredOutputSpec spec;
  switch (so.kind()) {
    case tandem::v1::StructuredOutput::KIND_JSON_OBJECT:
      spec.kind = K::kJsonObject;
      break;
    case tandem::v1::StructuredOutput::KIND_JSON_SCHEMA:
      spec.kind = K::kJsonSchema;
      break;
    case tandem::v1::StructuredOutput::KIND_REGEX:
      spec.kind = K::kRegex;
      break;
    case tandem::v1::StructuredOutput::KIND_CHOICE:
      spec.kind = K::kChoice;
      break;
    case tandem::v1::StructuredOutput::KIND_EBNF:
      spec.kind = K::kEbnf;
      break;
    case tandem::v1::StructuredOutput::KIND_TOOL_CALLS:
      spec.kind = K::kToolCalls;
      break;
    default:
      return InvalidArgument("structured_output.kind: unknown value ", so.kind());
  }
  spec.source = so.source();
  spec.choices.assign(so.choices().begin(), so.choices().end());
  spec.free_banned_token_ids.assign(so.free_banned_token_ids().begin(),
                                    so.free_banned_token_ids().end());
  if (so.has_free_until_token_id()) spec.free_until_token_id = so.free_until_token_id();
  spec.prefix_token_ids.assign(so.prefix_token_ids().begin(),
                               so.prefix_token_ids().end());
  if (so.has_terminator_token_id()) spec.terminator_token_id = so.terminator_token_id();
  spec.suffix_token_ids.assign(so.suffix_token_ids().begin(),
                               so.suffix_token_ids().end());
  return spec;
}

tandem::v1::StructuredOutput::Kind KindToProto(StructuredOutputSpec::Kind kind) {
  using K = StructuredOutputSpec::Kind;
  switch (kind) {
    case K::kJsonObject:
      return tandem::v1::StructuredOutput::KIND_JSON_OBJECT;
    case K::kJsonSchema:
      return tandem::v1::StructuredOutput::KIND_JSON_SCHEMA;
    case K::kRegex:
      return tandem::v1::StructuredOutput::KIND_REGEX;
    case K::kChoice:
      return tandem::v1::StructuredOutput::KIND_CHOICE;
    case K::kEbnf:
      return tandem::v1::StructuredOutput::KIND_EBNF;
    case K::kToolCalls:
      return tandem::v1::StructuredOutput::KIND_TOOL_CALLS;
  }
  return tandem::v1::StructuredOutput::KIND_UNSPECIFIED;
}

}  // namespace

absl::StatusOr<StructuredOutputSpec> StructuredOutputFromProto(
    const tandem::v1::StructuredOutput& so) {
  TANDEM_ASSIGN_OR_RETURN(StructuredOutputSpec spec, StructuredFromProto(so));
  TANDEM_RETURN_IF_ERROR(spec.Validate());
  return spec;
}

void StructuredOutputToProto(const StructuredOutputSpec& spec,
                             tandem::v1::StructuredOutput* so) {
  so->Clear();
  so->set_kind(KindToProto(spec.kind));
  so->set_source(spec.source);
  for (const std::string& c : spec.choices) so->add_choices(c);
  for (int32_t id : spec.free_banned_token_ids) so->add_free_banned_token_ids(id);
  if (spec.free_until_token_id >= 0)
    so->set_free_until_token_id(spec.free_until_token_id);
  for (int32_t id : spec.prefix_token_ids) so->add_prefix_token_ids(id);
  if (spec.terminator_token_id >= 0)
    so->set_terminator_token_id(spec.terminator_token_id);
  for (int32_t id : spec.suffix_token_ids) so->add_suffix_token_ids(id);
}

absl::StatusOr<SamplingParams> SamplingParamsFromProto(
    const tandem::v1::SamplingParams& sampling,
    const tandem::v1::StopConditions& stop) {
  SamplingParams p;
  p.temperature = sampling.temperature();
  p.top_p = sampling.top_p() == 0.0f ? 1.0f : sampling.top_p();
  p.top_k = sampling.top_k();
  p.min_p = sampling.min_p();
  if (sampling.has_seed()) p.seed = sampling.seed();
  p.presence_penalty = sampling.presence_penalty();
  p.frequency_penalty = sampling.frequency_penalty();
  p.repetition_penalty =
      sampling.repetition_penalty() == 0.0f ? 1.0f : sampling.repetition_penalty();
  p.logprobs = sampling.logprobs();
  p.top_logprobs = sampling.top_logprobs();
  // A proto map has no order: ascending ids, as SamplingParams keeps them.
  p.logit_bias.reserve(sampling.logit_bias_size());
  for (const auto& [id, bias] : sampling.logit_bias())
    p.logit_bias.push_back({id, bias});
  std::sort(
      p.logit_bias.begin(), p.logit_bias.end(),
      [](const TokenBias& a, const TokenBias& b) { return a.token_id < b.token_id; });
  if (sampling.has_prompt_logprobs()) p.prompt_logprobs = sampling.prompt_logprobs();
  p.max_tokens = stop.max_tokens();
  p.stop_token_ids.assign(stop.stop_token_ids().begin(), stop.stop_token_ids().end());
  p.stop_strings.assign(stop.stop_strings().begin(), stop.stop_strings().end());
  p.ignore_eos = stop.ignore_eos();
  p.min_tokens = stop.min_tokens();
  if (sampling.has_structured_output()) {
    TANDEM_ASSIGN_OR_RETURN(p.structured,
                            StructuredFromProto(sampling.structured_output()));
  }
  TANDEM_RETURN_IF_ERROR(p.Validate());
  return p;
}

void SamplingParamsToProto(const SamplingParams& p,
                           tandem::v1::SamplingParams* sampling,
                           tandem::v1::StopConditions* stop) {
  sampling->Clear();
  sampling->set_temperature(p.temperature);
  sampling->set_top_p(p.top_p);
  sampling->set_top_k(p.top_k);
  sampling->set_min_p(p.min_p);
  if (p.seed.has_value()) sampling->set_seed(*p.seed);
  sampling->set_presence_penalty(p.presence_penalty);
  sampling->set_frequency_penalty(p.frequency_penalty);
  sampling->set_repetition_penalty(p.repetition_penalty);
  sampling->set_logprobs(p.logprobs);
  sampling->set_top_logprobs(p.top_logprobs);
  for (const TokenBias& b : p.logit_bias) {
    (*sampling->mutable_logit_bias())[b.token_id] = b.bias;
  }
  if (p.prompt_logprobs >= 0) sampling->set_prompt_logprobs(p.prompt_logprobs);
  if (p.structured.has_value()) {
    StructuredOutputToProto(*p.structured, sampling->mutable_structured_output());
  }
  stop->Clear();
  stop->set_max_tokens(p.max_tokens);
  for (int32_t id : p.stop_token_ids) stop->add_stop_token_ids(id);
  for (const std::string& s : p.stop_strings) stop->add_stop_strings(s);
  stop->set_ignore_eos(p.ignore_eos);
  stop->set_min_tokens(p.min_tokens);
}

tandem::v1::FinishReason FinishReasonToProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone:
      return tandem::v1::FINISH_REASON_UNSPECIFIED;
    case FinishReason::kStop:
      return tandem::v1::FINISH_REASON_STOP;
    case FinishReason::kLength:
      return tandem::v1::FINISH_REASON_LENGTH;
    case FinishReason::kCancelled:
      return tandem::v1::FINISH_REASON_CANCELLED;
    case FinishReason::kError:
      return tandem::v1::FINISH_REASON_ERROR;
  }
  return tandem::v1::FINISH_REASON_ERROR;
}

FinishReason FinishReasonFromProto(tandem::v1::FinishReason reason) {
  switch (reason) {
    case tandem::v1::FINISH_REASON_UNSPECIFIED:
      return FinishReason::kNone;
    case tandem::v1::FINISH_REASON_STOP:
      return FinishReason::kStop;
    case tandem::v1::FINISH_REASON_LENGTH:
      return FinishReason::kLength;
    case tandem::v1::FINISH_REASON_CANCELLED:
      return FinishReason::kCancelled;
    default:
      return FinishReason::kError;
  }
}

void SampleResultToProto(const SampleResult& result, tandem::v1::TokenLogprob* out) {
  out->Clear();
  out->set_token_id(result.token_id);
  out->set_logprob(result.logprob);
  out->set_rank(result.rank);
  for (const TopLogprob& t : result.top) {
    tandem::v1::TopLogprob* e = out->add_top();
    e->set_token_id(t.token_id);
    e->set_logprob(t.logprob);
  }
}

}  // namespace tandem::engine
