// The draft side of speculative decoding: something that guesses the next
// tokens of a sequence cheaply, so the target model can verify 1 + k tokens in
// one forward pass instead of generating them one step at a time.
//
//   Engine::Step
//     → Proposer::Propose(decode sequences)      k drafts each (maybe fewer)
//     → ModelRunner::Forward([last, d_1..d_k])   one batched target forward
//     → GreedyVerify / RejectionSample            a accepted + 1 next token
//     → Proposer::OnAccepted(id, a, next)         the proposer syncs its state
//   request ends (finish, abort, preemption) → Proposer::Release(id)
//
// Implementations: NgramProposer (prompt lookup in the sequence's own history,
// deterministic; here), engine::DraftModelProposer (a smaller model of the same
// architecture and tokenizer with its own cache; engine/runtime, since it runs a
// ModelRunner). This package includes nothing from engine/runtime.
#ifndef TANDEM_ENGINE_SPECULATIVE_PROPOSER_H_
#define TANDEM_ENGINE_SPECULATIVE_PROPOSER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/sampling/penalty_state.h"
#include "engine/sampling/sampling_params.h"

namespace tandem::speculative {

// One sequence asking for drafts.
struct ProposeRequest {
  int64_t id = 0;
  // Every committed token: prompt, then generated (the last one is the newest
  // token, whose successor the first draft guesses).
  absl::Span<const int32_t> tokens;
  int64_t num_prompt_tokens = 0;
  // At most this many drafts (>= 1).
  int32_t max_drafts = 1;
  // How the target samples this sequence; draft models draw their drafts the
  // same way (temperature, truncation, penalties, seed). Not owned.
  const engine::SamplingParams* params = nullptr;
  // The committed output's penalty history (null: none). Not owned.
  const engine::PenaltyState* history = nullptr;
  // Stop ids masked out while fewer than params->min_tokens tokens exist.
  absl::Span<const int32_t> suppressed_tokens;
};

// The drafts for one sequence.
struct Proposal {
  // 0 .. max_drafts tokens (0: nothing worth verifying).
  std::vector<int32_t> tokens;
  // For random sampling with a draft model: tokens.size() rows of vocab_size,
  // row j the distribution draft j was drawn from (rejection sampling needs it).
  // Empty: the drafts are deterministic (their distribution is one-hot).
  std::vector<float> probs;
};

class Proposer {
 public:
  virtual ~Proposer() = default;

  // Fills one proposal per request, in order. Errors are internal failures
  // (a proposer that cannot draft for a sequence proposes nothing instead).
  virtual absl::Status Propose(absl::Span<const ProposeRequest> requests,
                               std::vector<Proposal>* proposals) = 0;

  // After verification of the last proposal for `id`: its first num_accepted
  // drafts were kept and next_token follows them. Proposers with state roll
  // it back to the accepted prefix.
  virtual void OnAccepted(int64_t id, int32_t num_accepted, int32_t next_token) = 0;

  // The sequence ended (or was preempted): free what the proposer holds for it.
  virtual void Release(int64_t id) = 0;

  virtual absl::string_view name() const = 0;
};

}  // namespace tandem::speculative

#endif  // TANDEM_ENGINE_SPECULATIVE_PROPOSER_H_
