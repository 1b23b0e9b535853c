// JSON Schema (draft 2020-12 subset) and JSON object mode to a Grammar.
// The supported subset and the whitespace policy are in README.md; every
// keyword outside it is InvalidArgument naming the keyword.
#ifndef TANDEM_ENGINE_GRAMMAR_JSON_SCHEMA_H_
#define TANDEM_ENGINE_GRAMMAR_JSON_SCHEMA_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/grammar/compile_limits.h"
#include "engine/grammar/expr.h"

namespace tandem::grammar {

// Largest number of integer digits generated for an unbounded number side
// (and of fraction digits): values stay below 10^15 in magnitude.
inline constexpr int kMaxJsonIntegerDigits = 15;

absl::StatusOr<Grammar> JsonSchemaToGrammar(absl::string_view schema_json,
                                            const CompileLimits& limits);
// Any JSON object (OpenAI `response_format: {"type": "json_object"}`).
Grammar JsonObjectGrammar(const CompileLimits& limits);

// The decimal integers in [lo, hi] (no leading zeros, "-" for negatives);
// exposed for tests.
ExprPtr IntegerRange(int64_t lo, int64_t hi);

}  // namespace tandem::grammar

#endif  // TANDEM_ENGINE_GRAMMAR_JSON_SCHEMA_H_
