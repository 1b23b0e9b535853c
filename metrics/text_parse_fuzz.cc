// libFuzzer harness for ParseText: no crash, leak or UB on any input, and every
// sample it accepts survives a round trip through the writer's escaping and
// value formatting (parse -> write one line -> parse gives the same sample).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "metrics/text_format.h"
#include "metrics/text_parse.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using tandem::metrics::EscapeLabelValue;
  using tandem::metrics::FormatValue;
  using tandem::metrics::ParsedSample;
  using tandem::metrics::ParsedText;
  using tandem::metrics::ParseText;

  const std::string input(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<ParsedText> parsed = ParseText(input);
  if (!parsed.ok()) return 0;
  for (const ParsedSample& sample : parsed->samples) {
    std::string line = sample.name;
    if (!sample.labels.empty()) {
      line += "{";
      bool first = true;
      for (const auto& [name, value] : sample.labels) {
        absl::StrAppend(&line, first ? "" : ",", name, "=\"", EscapeLabelValue(value),
                        "\"");
        first = false;
      }
      line += "}";
    }
    absl::StrAppend(&line, " ", FormatValue(sample.value), "\n");
    absl::StatusOr<ParsedText> again = ParseText(line);
    if (!again.ok() || again->samples.size() != 1) __builtin_trap();
    const ParsedSample& back = again->samples[0];
    if (back.name != sample.name || back.labels != sample.labels) __builtin_trap();
    const bool same_value = (std::isnan(back.value) && std::isnan(sample.value)) ||
                            back.value == sample.value;
    if (!same_value) __builtin_trap();
  }
  return 0;
}
