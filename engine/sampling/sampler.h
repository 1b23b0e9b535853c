// Chooses one sequence's next token from its fp32 logits row.
//
// Order of operations (as vLLM's sampler, README.md):
//   structured-output mask (tokens the grammar forbids) → suppress (stop
//   tokens before min_tokens) → logit_bias (added) → repetition penalty (prompt +
//   output) → frequency and presence penalties (output) → temperature →
//   top-k → top-p → min-p → draw (inverse CDF, counter-based uniform).
// Greedy (temperature 0) is the argmax after suppression, bias and penalties, ties
// going to the lowest token id.
//
// Reported logprobs are log-softmax of the logits AFTER suppression, logit_bias,
// penalties and temperature, BEFORE top-k/top-p/min-p truncation (for greedy: at
// temperature 1). So every alternative has a finite value and the numbers
// describe the distribution the truncation was cut from.
//
// Ranking ties everywhere (top-k, top-p prefix, alternatives) are broken by
// the lower token id first, so results are deterministic.
//
// Cost: one pass for max + log-sum-exp (chunked online softmax), one pass to
// gather candidates above a threshold, linear-time selection (nth_element)
// instead of sorting the vocabulary. Not thread-safe (holds scratch buffers):
// one Sampler per thread.
#ifndef TANDEM_ENGINE_SAMPLING_SAMPLER_H_
#define TANDEM_ENGINE_SAMPLING_SAMPLER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/sampling/penalty_state.h"
#include "engine/sampling/sampling_params.h"

namespace tandem::engine {

struct TopLogprob {
  int32_t token_id = 0;
  float logprob = 0.0f;
};

struct SampleResult {
  int32_t token_id = 0;
  // Filled when params.logprobs; otherwise 0.
  float logprob = 0.0f;
  // params.top_logprobs alternatives, most likely first.
  std::vector<TopLogprob> top;
  // ScoreToken: 1 + the number of tokens more likely than token_id. 0: not
  // computed (Sample).
  int32_t rank = 0;
};

struct SampleRequest {
  // One row, [vocab_size].
  absl::Span<const float> logits;
  const SamplingParams* params = nullptr;  // not owned
  const PenaltyState* history = nullptr;   // not owned; null = empty history
  // Tokens that may not be chosen (StopChecker::SuppressedTokens()).
  absl::Span<const int32_t> suppressed_tokens;
  // Structured output: bit i of word i / 32 set means token i may be chosen
  // (GrammarMatcher::FillNextTokenBitmask's layout); every other token is
  // masked out before anything else. Empty: no mask. A mask that leaves no
  // token (after suppression) is FailedPrecondition, never a silent choice.
  absl::Span<const uint32_t> allowed_bitmask;
  // 0-based index of the token being generated in the request's output. With
  // params.seed this alone fixes the random draw.
  int64_t position = 0;
};

// The raw model's view of one position (prompt logprobs): `token`'s log-softmax
// value in `logits` (no mask, bias, penalty or temperature; the sum in float64)
// and the `top_n` (0..20) most likely tokens, most likely first, ties to the
// lower id. InvalidArgument for NaN or +inf logits or a token outside the row.
absl::StatusOr<SampleResult> ScoreToken(absl::Span<const float> logits, int32_t token,
                                        int top_n);

class Sampler {
 public:
  explicit Sampler(int64_t vocab_size);

  int64_t vocab_size() const { return vocab_size_; }

  // Random sampling needs params.seed to be set (the router draws one when the
  // client gave none); greedy does not.
  absl::StatusOr<SampleResult> Sample(const SampleRequest& request);

  // The exact distribution Sample() draws from (after truncation and
  // renormalisation), dense [vocab_size]; greedy gives a one-hot row. Used
  // for speculative decoding (target and draft probabilities) and tests.
  absl::Status Distribution(const SampleRequest& request, std::vector<float>* probs);

 private:
  struct Candidate {
    float logit;
    int32_t id;
    float weight;  // exp(logit - max)
  };

  // Copies the row into x_, suppresses, penalises, scales by temperature, and
  // (when need_softmax) computes max_, sum_ and lse_ over x_.
  absl::Status Prepare(const SampleRequest& request, bool need_softmax);
  // Fills kept_ with the tokens that survive top-k/top-p/min-p, or sets
  // keep_all_ when nothing is truncated.
  void SelectKept(const SamplingParams& params);
  // Argmax over x_, lowest id on ties.
  int32_t ArgMax() const;
  // Whether token `id` with scaled logit x survives truncation: it ranks at or
  // above boundary_ (logit descending, then id ascending).
  bool Keeps(float x, int32_t id) const {
    return x > boundary_.logit || (x == boundary_.logit && id <= boundary_.id);
  }
  void TopN(int n, std::vector<TopLogprob>* out) const;

  int64_t vocab_size_;
  std::vector<float> x_;
  double max_ = 0.0;
  double sum_ = 0.0;  // sum exp(x - max_)
  double lse_ = 0.0;
  bool keep_all_ = true;
  // Candidates gathered by SelectKept (a superset of the kept tokens).
  std::vector<Candidate> kept_;
  // The lowest-ranked kept token; everything ranked above it is kept.
  struct {
    float logit;
    int32_t id;
  } boundary_ = {0.0f, 0};
  double kept_mass_ = 0.0;
};

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_SAMPLING_SAMPLER_H_
