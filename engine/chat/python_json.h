// JSON text exactly as Python's json.dumps(value, ensure_ascii=False) writes
// it, which is what the K3 reference renderer (encoding_k3.py) feeds the
// model: tool declarations and schemas compact (separators (",", ":")),
// non-string tool-call argument values with the default separators
// (", ", ": "). Object keys keep the order of the json value (nlohmann::json
// sorts them, which is the reference's deep_sort_dict; ordered_json keeps
// insertion order, which is what the reference does for arguments).
// Floats are written as Python's repr (shortest round trip, "1.0", "1e-05",
// "1e+16"); non-ASCII text is written raw; control characters as \u00XX.
#ifndef TANDEM_ENGINE_CHAT_PYTHON_JSON_H_
#define TANDEM_ENGINE_CHAT_PYTHON_JSON_H_

#include <string>

#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace tandem::chat {

enum class JsonSeparators {
  kCompact,  // "," and ":"
  kPython,   // ", " and ": " (json.dumps default)
};

// Appends `s` (valid UTF-8) as a quoted JSON string.
void AppendJsonString(absl::string_view s, std::string* out);
// Python's repr(float).
std::string PythonFloatRepr(double value);

std::string PythonJsonDumps(const nlohmann::json& value, JsonSeparators separators);
std::string PythonJsonDumps(const nlohmann::ordered_json& value,
                            JsonSeparators separators);

}  // namespace tandem::chat

#endif  // TANDEM_ENGINE_CHAT_PYTHON_JSON_H_
