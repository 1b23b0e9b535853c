// The per-sequence token history that presence, frequency and repetition
// penalties read: which tokens the prompt holds, and how often each token has
// been generated. Kept incrementally by whoever owns the sequence.
#ifndef TANDEM_ENGINE_SAMPLING_PENALTY_STATE_H_
#define TANDEM_ENGINE_SAMPLING_PENALTY_STATE_H_

#include <cstdint>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/types/span.h"

namespace tandem::engine {

class PenaltyState {
 public:
  // Prompt tokens count only for the repetition penalty (as in HF/vLLM).
  void AddPromptTokens(absl::Span<const int32_t> tokens);
  void AddOutputToken(int32_t token);
  void AddOutputTokens(absl::Span<const int32_t> tokens);
  // Forget `token` once from the output counts (speculative rollback).
  void RemoveOutputToken(int32_t token);

  // Distinct prompt tokens.
  const absl::flat_hash_set<int32_t>& prompt_tokens() const { return prompt_tokens_; }
  // Generated token -> occurrences (> 0).
  const absl::flat_hash_map<int32_t, int32_t>& output_counts() const {
    return output_counts_;
  }
  int64_t num_output_tokens() const { return num_output_tokens_; }

 private:
  absl::flat_hash_set<int32_t> prompt_tokens_;
  absl::flat_hash_map<int32_t, int32_t> output_counts_;
  int64_t num_output_tokens_ = 0;
};

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_SAMPLING_PENALTY_STATE_H_
