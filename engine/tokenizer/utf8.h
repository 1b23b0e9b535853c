// Strict UTF-8 (Unicode 15, table 3-7) helpers shared by the pre-tokeniser, the
// detokenisers and the JSON command-line tools.
#ifndef TANDEM_ENGINE_TOKENIZER_UTF8_H_
#define TANDEM_ENGINE_TOKENIZER_UTF8_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace tandem::tokenizer {

// Result of reading one sequence at the front of a byte range.
struct Utf8Step {
  enum Kind {
    kValid,       // `length` bytes form code point `code_point`
    kIncomplete,  // the range ends inside a sequence that may still be valid
    kInvalid,     // `length` bytes (a maximal ill-formed subpart, >= 1) are invalid
  };
  Kind kind;
  int length;
  char32_t code_point;
};

// Reads the sequence starting at s[0] (s must be non-empty).
Utf8Step ReadUtf8(absl::string_view s);

// True if `s` is entirely well-formed UTF-8.
bool IsValidUtf8(absl::string_view s);

// Replaces every maximal ill-formed subpart with U+FFFD (the Unicode "maximal
// subpart" practice, which is what Python's errors="replace" does). A trailing
// incomplete sequence is replaced too.
std::string ReplaceInvalidUtf8(absl::string_view s);

// Appends the UTF-8 encoding of `cp` (must be a scalar value).
void AppendUtf8(char32_t cp, std::string* out);

inline constexpr absl::string_view kReplacementChar = "\xEF\xBF\xBD";

}  // namespace tandem::tokenizer

#endif  // TANDEM_ENGINE_TOKENIZER_UTF8_H_
