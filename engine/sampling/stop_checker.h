// Decides when a sequence stops and which text may be streamed.
//
// Per generated token, in this order:
//   1. stop token (params.stop_token_ids plus the model's EOS ids unless
//      ignore_eos): ends with kStop; the token's own text is not emitted.
//   2. stop strings over the incrementally detokenized text: the earliest match
//      (it may span any number of deltas) ends with kStop; the text before it
//      is emitted, the stop string and anything after it are dropped.
//   3. max_tokens / the context room: ends with kLength, all held text emitted.
// Neither 1 nor 2 ends a sequence before min_tokens tokens were generated (as
// vLLM); SuppressedTokens() lists the stop ids to mask out of sampling until
// then so the model cannot pick them.
//
// Hold-back: while not finished, text whose tail could be the start of a stop
// string is kept until the next delta disambiguates it, so a stream never
// emits bytes that later turn out to belong to a stop string. Stop strings are
// valid UTF-8, so a held suffix always starts on a character boundary.
#ifndef TANDEM_ENGINE_SAMPLING_STOP_CHECKER_H_
#define TANDEM_ENGINE_SAMPLING_STOP_CHECKER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/sampling/sampling_params.h"

namespace tandem::engine {

// Mirrors tandem.v1.FinishReason.
enum class FinishReason {
  kNone = 0,       // still running
  kStop = 1,       // stop token or stop string
  kLength = 2,     // max_tokens or the context limit
  kCancelled = 3,  // cancelled by the client
  kError = 4,
};

struct StopUpdate {
  // Text that may be streamed now (possibly empty).
  std::string text;
  FinishReason finish = FinishReason::kNone;
  // With kStop: the stop token, or the index into params.stop_strings.
  int32_t stop_token = -1;
  int stop_string_index = -1;
};

class StopChecker {
 public:
  // context_room: how many tokens the sequence may still generate before the
  // context limit (<= 0: no limit besides max_tokens).
  StopChecker(const SamplingParams& params, absl::Span<const int32_t> eos_token_ids,
              int64_t context_room);

  // Feeds one generated token and the text it added (may be empty, e.g. for an
  // incomplete UTF-8 sequence). After a finishing update, further calls return
  // the same finish reason and no text.
  StopUpdate Append(int32_t token_id, absl::string_view text_delta);

  // Releases any held-back text (e.g. on cancellation) and marks finished.
  std::string Flush(FinishReason reason = FinishReason::kCancelled);

  // Stop ids to mask out of sampling while fewer than min_tokens were
  // generated; empty afterwards.
  absl::Span<const int32_t> SuppressedTokens() const;

  int64_t num_generated() const { return num_generated_; }
  FinishReason finish_reason() const { return finish_; }
  bool finished() const { return finish_ != FinishReason::kNone; }
  // Effective limit on generated tokens (0 = none).
  int64_t max_new_tokens() const { return max_new_tokens_; }
  // Bytes currently held back.
  size_t held_bytes() const { return pending_.size(); }

 private:
  // Length of the longest suffix of pending_ that is a proper prefix of a stop
  // string.
  size_t HoldLength() const;

  std::vector<int32_t> stop_ids_;  // sorted, unique
  absl::flat_hash_set<int32_t> stop_id_set_;
  std::vector<std::string> stop_strings_;
  int64_t min_tokens_ = 0;
  int64_t max_new_tokens_ = 0;
  int64_t num_generated_ = 0;
  std::string pending_;
  FinishReason finish_ = FinishReason::kNone;
};

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_SAMPLING_STOP_CHECKER_H_
