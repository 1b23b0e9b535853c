// Regular expressions (an ECMAScript subset, as JSON Schema `pattern` uses)
// to an Expr over UTF-8 code points.
//
// Supported: literals (UTF-8), `.`, classes `[...]`/`[^...]` with ranges,
// escapes \d \D \w \W \s \S \n \r \t \f \v \0 \xHH \uHHHH \u{H...} and
// escaped punctuation, groups `(...)`, `(?:...)`, `(?<name>...)`,
// alternation `|`, quantifiers `* + ? {m} {m,} {m,n}` (lazy `?` suffix
// accepted: it does not change the language), `^` at the start and `$` at the
// end. Anything else (lookaround, backreferences, \b, \p{...}, inline flags,
// anchors inside the pattern) is InvalidArgument naming the feature.
#ifndef TANDEM_ENGINE_GRAMMAR_REGEX_PARSER_H_
#define TANDEM_ENGINE_GRAMMAR_REGEX_PARSER_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/grammar/expr.h"

namespace tandem::grammar {

struct RegexOptions {
  int max_depth = 64;
  // Largest m or n in {m,n}.
  int max_repeat = 1000;
  // Every character class and literal is intersected with this set (empty:
  // all code points). JSON strings use it to keep characters that would need
  // escaping out of `pattern` strings.
  CodepointRanges universe;
};

struct ParsedRegex {
  ExprPtr expr;
  bool anchored_start = false;  // pattern began with ^
  bool anchored_end = false;    // pattern ended with $
};

absl::StatusOr<ParsedRegex> ParseRegex(absl::string_view pattern,
                                       const RegexOptions& options);

// Decodes one UTF-8 code point at s[*i]; false on invalid UTF-8.
bool DecodeUtf8(absl::string_view s, size_t* i, uint32_t* cp);

}  // namespace tandem::grammar

#endif  // TANDEM_ENGINE_GRAMMAR_REGEX_PARSER_H_
