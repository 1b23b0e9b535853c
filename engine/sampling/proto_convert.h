// Converters between the engine's plain sampling structs and the wire messages
// in proto/common.proto. Kept out of the sampler so the hot path never links
// protobuf.
#ifndef TANDEM_ENGINE_SAMPLING_PROTO_CONVERT_H_
#define TANDEM_ENGINE_SAMPLING_PROTO_CONVERT_H_

#include "absl/status/statusor.h"
#include "engine/sampling/sampler.h"
#include "engine/sampling/sampling_params.h"
#include "engine/sampling/stop_checker.h"
#include "proto/common.pb.h"

namespace tandem::engine {

// Maps the proto's "0 disables" conventions (top_p 0 -> 1, repetition_penalty
// 0 -> 1) and validates the result.
absl::StatusOr<SamplingParams> SamplingParamsFromProto(
    const tandem::v1::SamplingParams& sampling, const tandem::v1::StopConditions& stop);

void SamplingParamsToProto(const SamplingParams& params,
                           tandem::v1::SamplingParams* sampling,
                           tandem::v1::StopConditions* stop);

// The constraint alone (the router validates it before compiling).
absl::StatusOr<StructuredOutputSpec> StructuredOutputFromProto(
    const tandem::v1::StructuredOutput& so);
void StructuredOutputToProto(const StructuredOutputSpec& spec,
                             tandem::v1::StructuredOutput* so);

tandem::v1::FinishReason FinishReasonToProto(FinishReason reason);
FinishReason FinishReasonFromProto(tandem::v1::FinishReason reason);

void SampleResultToProto(const SampleResult& result, tandem::v1::TokenLogprob* out);

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_SAMPLING_PROTO_CONVERT_H_
