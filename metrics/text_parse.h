// A parser for the Prometheus text exposition format 0.0.4: reads what
// text_format.h writes (and what other exporters write) back into samples. Used by
// tests to check an exposition value by value, and by end-to-end tests to read
// /metrics of a running process.
//
//   TANDEM_ASSIGN_OR_RETURN(ParsedText parsed, ParseText(body));
//   absl::StatusOr<double> v = parsed.Value("tandem_requests_total", {{"route", "x"}});
//
// Strict about syntax (names, quoting, escapes, values); a malformed line gives
// an InvalidArgument error naming the line number. Comments other than HELP and
// TYPE are ignored. Depends on Abseil only (it is fuzzed with clang).
#ifndef TANDEM_METRICS_TEXT_PARSE_H_
#define TANDEM_METRICS_TEXT_PARSE_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::metrics {

struct ParsedSample {
  std::string name;                           // as written, e.g. "x_bucket"
  std::map<std::string, std::string> labels;  // unescaped values
  double value = 0;
  std::optional<int64_t> timestamp_ms;
};

struct ParsedText {
  std::vector<ParsedSample> samples;        // in input order
  std::map<std::string, std::string> help;  // family name -> unescaped help
  std::map<std::string, std::string> type;  // family name -> "counter", ...

  // The sample named `name` whose labels are exactly `labels`. NotFound if
  // there is none.
  absl::StatusOr<double> Value(
      absl::string_view name,
      const std::map<std::string, std::string>& labels = {}) const;
  // Every sample named `name`.
  std::vector<const ParsedSample*> Find(absl::string_view name) const;
};

absl::StatusOr<ParsedText> ParseText(absl::string_view text);

// Parses one sample value: a decimal or exponent float, or +Inf/-Inf/Inf/NaN
// (case-insensitive, as Prometheus accepts them).
std::optional<double> ParseValue(absl::string_view token);

}  // namespace tandem::metrics

#endif  // TANDEM_METRICS_TEXT_PARSE_H_
