// Speculative-decoding verification (Leviathan et al. 2023; Chen et al. 2023):
// accept drafted token d_j with probability min(1, p_j(d_j) / q_j(d_j)); on the
// first rejection emit a token from norm(max(0, p_j - q_j)) and stop; if all k
// drafts are accepted emit a bonus token from p_k. The emitted tokens are then
// distributed exactly as sampling from the target p alone.
//
// Randomness is the request's counter-based stream (counter_rng.h): the draft at
// output position first_position + j uses (seed, that position, kSpecAccept)
// and (.., kSpecResidual); the bonus token uses (seed, position, kSample), the
// same draw plain sampling would use there.
#ifndef TANDEM_ENGINE_SAMPLING_REJECTION_SAMPLER_H_
#define TANDEM_ENGINE_SAMPLING_REJECTION_SAMPLER_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace tandem::engine {

struct SpecVerifyResult {
  // Drafted tokens accepted (0..k); they are emitted first.
  int32_t num_accepted = 0;
  // Then this one: the correction at the first rejection, or the bonus token
  // when all were accepted. Total emitted = num_accepted + 1.
  int32_t next_token = 0;
};

// target_probs: (k + 1) rows of vocab_size (row j is the target distribution
// at the drafted position j; row k follows the last draft); draft_probs: k rows;
// draft_tokens: k ids. Rows are the final sampling distributions
// (Sampler::Distribution). Pure function.
absl::StatusOr<SpecVerifyResult> RejectionSample(absl::Span<const float> target_probs,
                                                 absl::Span<const float> draft_probs,
                                                 absl::Span<const int32_t> draft_tokens,
                                                 int64_t vocab_size, uint64_t seed,
                                                 int64_t first_position);

// Greedy verification: accept while the draft equals the target's argmax;
// target_argmax holds k + 1 ids.
absl::StatusOr<SpecVerifyResult> GreedyVerify(absl::Span<const int32_t> target_argmax,
                                              absl::Span<const int32_t> draft_tokens);

// Inverse-CDF draw from an unnormalised non-negative row (ids in order); -1
// when the row has no mass. Exposed for tests.
int32_t DrawFromWeights(absl::Span<const float> weights, double u);

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_SAMPLING_REJECTION_SAMPLER_H_
