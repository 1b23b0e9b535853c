// Streaming detokenisation: feed ids one at a time and get the text to send
// now. A UTF-8 sequence split across tokens is held back until it completes,
// so every delta is valid UTF-8; a sequence that can no longer complete
// becomes U+FFFD (maximal-subpart rule, as Python's errors="replace"). Hence the
// concatenated deltas equal ReplaceInvalidUtf8(Decode(ids)), which is
// Decode(ids) itself whenever that is valid UTF-8.
//
//   Add(id) → pending bytes += token bytes → emit the decided prefix
//   Flush() → emit the rest, an unfinished tail as U+FFFD
#ifndef TANDEM_ENGINE_TOKENIZER_INCREMENTAL_DETOKENIZER_H_
#define TANDEM_ENGINE_TOKENIZER_INCREMENTAL_DETOKENIZER_H_

#include <string>

#include "absl/status/statusor.h"
#include "engine/tokenizer/tokenizer.h"

namespace tandem::tokenizer {

class IncrementalDetokenizer {
 public:
  struct Options {
    // Leave out ids for which Tokenizer::IsSpecial() holds.
    bool skip_special_tokens = false;
  };

  // `tokenizer` is not owned and must outlive this object.
  explicit IncrementalDetokenizer(const Tokenizer* tokenizer)
      : IncrementalDetokenizer(tokenizer, Options()) {}
  IncrementalDetokenizer(const Tokenizer* tokenizer, Options options)
      : tokenizer_(tokenizer), options_(options) {}

  // The text that `id` completes (possibly empty). InvalidArgument for an id
  // outside the vocabulary (the state is unchanged then).
  absl::StatusOr<std::string> Add(int id);
  // The held-back tail (U+FFFD for each unfinished sequence); resets the state.
  std::string Flush();
  // Bytes held back, waiting for the rest of a character (0..3).
  size_t pending_bytes() const { return pending_.size(); }

 private:
  const Tokenizer* tokenizer_;  // not owned
  Options options_;
  std::string pending_;
};

}  // namespace tandem::tokenizer

#endif  // TANDEM_ENGINE_TOKENIZER_INCREMENTAL_DETOKENIZER_H_
