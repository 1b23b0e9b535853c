// Tool calls (kToolCalls; the gateway's tool_choice "required" with several
// tools): one or more calls, each one of the declared alternatives, then the
// end of the whole. The source is JSON:
//
//   {"calls": [{"begin": TEXT, "parameters": SCHEMA, "end": TEXT}, ...],
//    "end": TEXT, "max_calls": N}
//
// Call n (1-based) of alternative i is begin_i + arguments + end_i, where the
// arguments are a JSON value valid against parameters_i (a JSON Schema; absent,
// null, {} or {"type": "object"} alone: any JSON object) and "{index}" in
// begin_i / end_i reads n. After each call: another (up to max_calls, default
// 8, at most 64) or the final `end`. In TEXT the structure tokens are written
// by their spelling (<|open|>, <|sep|>, <|close|>: kStructureTokenNames) and
// read as those tokens (StructureTokenBytes); everything else is literal text.
//
// K3 (gateway/structured_output.cc): begin `<|open|>call tool="NAME"
// index="{index}"<|sep|><|open|>json type="object"<|sep|>`, end
// `<|close|>json<|sep|><|close|>call<|sep|>`, final end `<|close|>tools<|sep|>
// <|close|>message<|sep|>`.
#ifndef TANDEM_ENGINE_GRAMMAR_TOOL_CALLS_H_
#define TANDEM_ENGINE_GRAMMAR_TOOL_CALLS_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/grammar/compile_limits.h"
#include "engine/grammar/expr.h"

namespace tandem::grammar {

inline constexpr int kDefaultMaxToolCalls = 8;
inline constexpr int kMaxToolCalls = 64;

absl::StatusOr<Grammar> ToolCallsToGrammar(absl::string_view source_json,
                                           const CompileLimits& limits);

// TEXT with the structure tokens' spellings replaced by their bytes and
// "{index}" by `index` (exposed for tests).
std::string ToolCallText(absl::string_view text, int index);

}  // namespace tandem::grammar

#endif  // TANDEM_ENGINE_GRAMMAR_TOOL_CALLS_H_
