// Checks a client's GenerateRequest before any work is done, so bad input gets one
// clear INVALID_ARGUMENT naming the field and the value.
#ifndef TANDEM_ROUTER_REQUEST_VALIDATION_H_
#define TANDEM_ROUTER_REQUEST_VALIDATION_H_

#include <cstdint>

#include "absl/status/status.h"
#include "proto/router.pb.h"

namespace tandem::router {

struct ModelLimits {
  int64_t vocab_size = 0;
  int64_t max_context_tokens = 0;
};

// Limits on client-provided lists, so one request cannot make the router allocate
// without bound.
inline constexpr int kMaxStopStrings = 16;
inline constexpr int kMaxImages = 64;
inline constexpr int kMaxStopStringBytes = 1024;
inline constexpr int kMaxStopTokenIds = 64;
inline constexpr int kMaxTopLogprobs = 20;
// OpenAI's range of a logit_bias value (engine::kMaxLogitBias).
inline constexpr float kMaxLogitBias = 100.0f;
// Prompt logprobs travel in one gRPC message between the workers and the
// router (gRPC's 4 MiB default): the scores of a prompt may take this much,
// estimated at kPromptScoreBytes + kPromptAlternativeBytes * alternatives per
// token (a TokenLogprob and its TopLogprobs on the wire, rounded up).
inline constexpr int64_t kMaxPromptScoreBytes = int64_t{7} << 19;  // 3.5 MiB
inline constexpr int64_t kPromptScoreBytes = 16;
inline constexpr int64_t kPromptAlternativeBytes = 12;

absl::Status ValidateGenerateRequest(const tandem::v1::GenerateRequest& request,
                                     const ModelLimits& limits);

}  // namespace tandem::router

#endif  // TANDEM_ROUTER_REQUEST_VALIDATION_H_
