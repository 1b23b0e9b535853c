// Prompt lookup (n-gram) drafting: the last n tokens of a sequence are looked up
// earlier in its own history (prompt and output), and the tokens that followed
// that occurrence are proposed. n goes from max_n down to min_n; for one n the
// most recent earlier occurrence wins. Pure and deterministic; no model, no
// state between steps. It pays off on repetitive text (code edits, quoting the
// prompt, lists, loops).
#ifndef TANDEM_ENGINE_SPECULATIVE_NGRAM_PROPOSER_H_
#define TANDEM_ENGINE_SPECULATIVE_NGRAM_PROPOSER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/speculative/proposer.h"

namespace tandem::speculative {

struct NgramOptions {
  int32_t min_n = 1;  // shortest suffix to match (>= 1)
  int32_t max_n = 4;  // longest suffix to match (>= min_n)
  // Search only the last `window` tokens (0: the whole history). Bounds the
  // cost per step at long contexts.
  int64_t window = 0;

  absl::Status Validate() const;
};

// The continuation (at most k tokens) of the most recent earlier occurrence of
// the longest matching suffix of `tokens` (lengths max_n .. min_n); empty when
// nothing matches. The continuation may run into the suffix itself (periodic
// text continues its period) but never past the end of `tokens`.
std::vector<int32_t> NgramLookup(absl::Span<const int32_t> tokens,
                                 const NgramOptions& options, int32_t k);

class NgramProposer : public Proposer {
 public:
  static absl::StatusOr<std::unique_ptr<NgramProposer>> Create(
      const NgramOptions& options);

  absl::Status Propose(absl::Span<const ProposeRequest> requests,
                       std::vector<Proposal>* proposals) override;
  void OnAccepted(int64_t, int32_t, int32_t) override {}  // stateless
  void Release(int64_t) override {}
  absl::string_view name() const override { return "ngram"; }

 private:
  explicit NgramProposer(const NgramOptions& options) : options_(options) {}
  NgramOptions options_;
};

}  // namespace tandem::speculative

#endif  // TANDEM_ENGINE_SPECULATIVE_NGRAM_PROPOSER_H_
