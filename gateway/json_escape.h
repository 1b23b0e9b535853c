// Appends a string as a JSON string literal, byte for byte what nlohmann's
// dump(-1, ' ', /*ensure_ascii=*/false, error_handler_t::replace) writes for
// it: the hot path of the streamed chunks builds its JSON from pre-rendered
// pieces and this, instead of a json object per token.
//
//   std::string out = "{\"text\":";
//   AppendJsonString(&out, delta);   // "\"a\\nb\""
//
// DumpJson is that dump itself, for the JSON objects the gateway writes whole.
#ifndef TANDEM_GATEWAY_JSON_ESCAPE_H_
#define TANDEM_GATEWAY_JSON_ESCAPE_H_

#include <string>

#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace tandem::gateway {

// Quotes and escapes `s` (", \, control characters; other bytes as they are)
// onto `out`. Invalid UTF-8 is replaced with U+FFFD exactly as nlohmann does
// (that rare case goes through nlohmann itself).
void AppendJsonString(std::string* out, absl::string_view s);

// `j` as compact text, not ASCII-escaped, invalid UTF-8 replaced with U+FFFD.
std::string DumpJson(const nlohmann::json& j);

}  // namespace tandem::gateway

#endif  // TANDEM_GATEWAY_JSON_ESCAPE_H_
