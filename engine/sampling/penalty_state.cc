#include "engine/sampling/penalty_state.h"

namespace tandem::engine {

void PenaltyState::AddPromptTokens(absl::Span<const int32_t> tokens) {
  prompt_tokens_.insert(tokens.begin(), tokens.end());
}

void PenaltyState::AddOutputToken(int32_t token) {
  ++output_counts_[token];
  ++num_output_tokens_;
}

void PenaltyState::AddOutputTokens(absl::Span<const int32_t> tokens) {
  for (int32_t t : tokens) AddOutputToken(t);
}

void PenaltyState::RemoveOutputToken(int32_t token) {
  auto it = output_counts_.find(token);
  if (it == output_counts_.end()) return;
  if (--it->second == 0) output_counts_.erase(it);
  --num_output_tokens_;
}

}  // namespace tandem::engine
