#include "engine/sampling/rejection_sampler.h"

#include <algorithm>
#include <vector>

#include "common/status.h"
#include "engine/sampling/counter_rng.h"

namespace tandem::engine {

int32_t DrawFromWeights(absl::Span<const float> weights, double u) {
  double total = 0.0;
  for (float w : weights) total += std::max(w, 0.0f);
  if (!(total > 0.0)) return -1;
  const double target = u * total;
  double acc = 0.0;
  int32_t last = -1;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (!(weights[i] > 0.0f)) continue;
    last = static_cast<int32_t>(i);
    acc += weights[i];
    if (acc > target) return last;
  }
  return last;
}

absl::StatusOr<SpecVerifyResult> RejectionSample(absl::Span<const float> target_probs,
                                                 absl::Span<const float> draft_probs,
                                                 absl::Span<const int32_t> draft_tokens,
                                                 int64_t vocab_size, uint64_t seed,
                                                 int64_t first_position) {
  const int64_t k = static_cast<int64_t>(draft_tokens.size());
  if (vocab_size <= 0) return InvalidArgument("vocab_size must be > 0");
  if (static_cast<int64_t>(target_probs.size()) != (k + 1) * vocab_size) {
    return InvalidArgument("target_probs must hold ", k + 1, " rows of ", vocab_size,
                           ", got ", target_probs.size(), " values");
  }
  if (static_cast<int64_t>(draft_probs.size()) != k * vocab_size) {
    return InvalidArgument("draft_probs must hold ", k, " rows of ", vocab_size,
                           ", got ", draft_probs.size(), " values");
  }
  SpecVerifyResult result;
  for (int64_t j = 0; j < k; ++j) {
    const int32_t d = draft_tokens[j];
    if (d < 0 || d >= vocab_size) {
      return InvalidArgument("draft token ", d, " outside the vocabulary of ",
                             vocab_size);
    }
    const absl::Span<const float> p = target_probs.subspan(j * vocab_size, vocab_size);
    const absl::Span<const float> q = draft_probs.subspan(j * vocab_size, vocab_size);
    const int64_t position = first_position + j;
    const double u = CounterUniform(seed, position, RngStream::kSpecAccept);
    // Accept when u < p/q, i.e. u * q < p (q = 0 accepts any p > 0).
    if (u * static_cast<double>(q[d]) < static_cast<double>(p[d])) {
      ++result.num_accepted;
      continue;
    }
    std::vector<float> residual(static_cast<size_t>(vocab_size));
    for (int64_t i = 0; i < vocab_size; ++i) {
      residual[i] = std::max(0.0f, p[i] - q[i]);
    }
    const double r = CounterUniform(seed, position, RngStream::kSpecResidual);
    int32_t token = DrawFromWeights(residual, r);
    // p == q up to rounding leaves no residual: p itself is then exact.
    if (token < 0) token = DrawFromWeights(p, r);
    if (token < 0) return InvalidArgument("target row ", j, " has no mass");
    result.next_token = token;
    return result;
  }
  const int32_t bonus =
      DrawFromWeights(target_probs.subspan(k * vocab_size, vocab_size),
                      CounterUniform(seed, first_position + k, RngStream::kSample));
  if (bonus < 0) return InvalidArgument("target row ", k, " has no mass");
  result.next_token = bonus;
  return result;
}

absl::StatusOr<SpecVerifyResult> GreedyVerify(absl::Span<const int32_t> target_argmax,
                                              absl::Span<const int32_t> draft_tokens) {
  if (target_argmax.size() != draft_tokens.size() + 1) {
    return InvalidArgument("target_argmax must hold k + 1 = ", draft_tokens.size() + 1,
                           " ids, got ", target_argmax.size());
  }
  SpecVerifyResult result;
  size_t j = 0;
  while (j < draft_tokens.size() && draft_tokens[j] == target_argmax[j]) ++j;
  result.num_accepted = static_cast<int32_t>(j);
  result.next_token = target_argmax[j];
  return result;
}

}  // namespace tandem::engine
