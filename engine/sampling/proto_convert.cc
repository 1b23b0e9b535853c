#include "engine/sampling/proto_convert.h"

#include "common/status.h"

namespace tandem::engine {

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
  p.max_tokens = stop.max_tokens();
  p.stop_token_ids.assign(stop.stop_token_ids().begin(), stop.stop_token_ids().end());
  p.stop_strings.assign(stop.stop_strings().begin(), stop.stop_strings().end());
  p.ignore_eos = stop.ignore_eos();
  p.min_tokens = stop.min_tokens();
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
  for (const TopLogprob& t : result.top) {
    tandem::v1::TopLogprob* e = out->add_top();
    e->set_token_id(t.token_id);
    e->set_logprob(t.logprob);
  }
}

}  // namespace tandem::engine
