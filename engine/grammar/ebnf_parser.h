// EBNF grammars in llama.cpp's GBNF style to a Grammar.
//
//   root   ::= "{" ws pair ("," ws pair)* "}"   # comments
//   pair   ::= [a-z]+ ws ":" ws value
//   value  ::= "true" | [0-9]{1,3} | ( "x" | "y" )?
//
// Supported: `name ::= body` rules (names [A-Za-z0-9_-]), string literals
// with escapes (\n \r \t \\ \" \' \xHH \uHHHH \UHHHHHHHH), code point classes
// `[...]`/`[^...]` with ranges and the same escapes, `.` (any code point),
// groups, alternation, `* + ? {m} {m,} {m,n}`, rule references (recursion
// allowed, left recursion rejected). A rule named `root` is required.
#ifndef TANDEM_ENGINE_GRAMMAR_EBNF_PARSER_H_
#define TANDEM_ENGINE_GRAMMAR_EBNF_PARSER_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/grammar/expr.h"

namespace tandem::grammar {

absl::StatusOr<Grammar> ParseEbnf(absl::string_view text, int max_depth = 64);

}  // namespace tandem::grammar

#endif  // TANDEM_ENGINE_GRAMMAR_EBNF_PARSER_H_
