#include "engine/speculative/ngram_proposer.h"

#include <algorithm>
#include <memory>

#include "common/status.h"

namespace tandem::speculative {

absl::Status NgramOptions::Validate() const {
  if (min_n < 1) return InvalidArgument("ngram min_n must be >= 1, got ", min_n);
  if (max_n < min_n) {
    return InvalidArgument("ngram max_n (", max_n, ") must be >= min_n (", min_n, ")");
  }
  if (window < 0) return InvalidArgument("ngram window must be >= 0, got ", window);
  return absl::OkStatus();
}

std::vector<int32_t> NgramLookup(absl::Span<const int32_t> tokens,
                                 const NgramOptions& options, int32_t k) {
  std::vector<int32_t> out;
  const int64_t len = static_cast<int64_t>(tokens.size());
  if (k <= 0 || len < 2) return out;
  const int64_t lo =
      options.window > 0 ? std::max<int64_t>(0, len - options.window) : 0;
  for (int64_t n = std::min<int64_t>(options.max_n, len - 1); n >= options.min_n; --n) {
    const int32_t* suffix = tokens.data() + len - n;
    // Occurrences start at i in [lo, len - n - 1]: strictly before the suffix.
    for (int64_t i = len - n - 1; i >= lo; --i) {
      if (!std::equal(suffix, suffix + n, tokens.data() + i)) continue;
      const int64_t from = i + n;
      const int64_t to = std::min<int64_t>(len, from + k);
      out.assign(tokens.begin() + from, tokens.begin() + to);
      return out;
    }
  }
  return out;
}

absl::StatusOr<std::unique_ptr<NgramProposer>> NgramProposer::Create(
    const NgramOptions& options) {
  TANDEM_RETURN_IF_ERROR(options.Validate());
  return std::unique_ptr<NgramProposer>(new NgramProposer(options));
}

absl::Status NgramProposer::Propose(absl::Span<const ProposeRequest> requests,
                                    std::vector<Proposal>* proposals) {
  proposals->assign(requests.size(), Proposal{});
  for (size_t i = 0; i < requests.size(); ++i) {
    (*proposals)[i].tokens =
        NgramLookup(requests[i].tokens, options_, requests[i].max_drafts);
  }
  return absl::OkStatus();
}

}  // namespace tandem::speculative
