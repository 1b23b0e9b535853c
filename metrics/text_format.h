// Serialises a registry snapshot in the Prometheus text exposition format 0.0.4:
//
//   # HELP tandem_requests_total Requests received.
//   # TYPE tandem_requests_total counter
//   tandem_requests_total{route="prefill"} 12
//   # HELP tandem_ttft_seconds Time to first token.
//   # TYPE tandem_ttft_seconds histogram
//   tandem_ttft_seconds_bucket{le="0.1"} 3
//   tandem_ttft_seconds_bucket{le="+Inf"} 4
//   tandem_ttft_seconds_sum 0.52
//   tandem_ttft_seconds_count 4
//
// Labels appear in the order they were added, `le` last. Families with no
// children are left out (nothing to sample). Values are written so that they
// parse back to the same double: integers in plain digits, others in the
// shortest form that round-trips, and +Inf, -Inf, NaN.
#ifndef TANDEM_METRICS_TEXT_FORMAT_H_
#define TANDEM_METRICS_TEXT_FORMAT_H_

#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "metrics/snapshot.h"

namespace tandem::metrics {

// The Content-Type of a text exposition.
inline constexpr absl::string_view kTextContentType =
    "text/plain; version=0.0.4; charset=utf-8";

std::string SerializeText(const std::vector<FamilySnapshot>& families);
void AppendText(const std::vector<FamilySnapshot>& families, std::string* out);

// Exposed for tests and for the parser's tests.
std::string FormatValue(double value);
// HELP text: `\` -> `\\`, newline -> `\n`.
std::string EscapeHelp(absl::string_view help);
// Label value: `\` -> `\\`, `"` -> `\"`, newline -> `\n`.
std::string EscapeLabelValue(absl::string_view value);

}  // namespace tandem::metrics

#endif  // TANDEM_METRICS_TEXT_FORMAT_H_
