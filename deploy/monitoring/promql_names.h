// The series names a PromQL expression reads, with the label matchers written on
// each and the function that directly consumes it, so that a test can check a
// dashboard's or a rules file's expressions against what the processes export:
//
//   histogram_quantile(0.99, sum by (le) (rate(x_bucket{a="1"}[5m])))
//     -> {name "x_bucket", function "rate", matcher_labels {"a"}}
//
// A lexer, not a full parser: it skips string literals, label matchers
// `{...}`, range/subquery selectors `[...]`, the label lists after by / without /
// on / ignoring / group_left / group_right, numbers and durations, and treats an
// identifier followed by `(` as a function or aggregation. Every other
// identifier is a series name (metric or recording rule). Enough for the
// expressions Grafana and Prometheus rules are written in; unbalanced brackets
// or an unterminated string are an error.
#ifndef TANDEM_DEPLOY_MONITORING_PROMQL_NAMES_H_
#define TANDEM_DEPLOY_MONITORING_PROMQL_NAMES_H_

#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::monitoring {

struct SeriesRef {
  std::string name;
  // The innermost named function or aggregation around the selector ("" at top
  // level); plain parentheses are transparent.
  std::string function;
  // Label names used in the selector's matchers, e.g. {"outcome"}.
  std::set<std::string> matcher_labels;

  bool operator==(const SeriesRef&) const = default;
};

absl::StatusOr<std::vector<SeriesRef>> SeriesRefs(absl::string_view expr);

}  // namespace tandem::monitoring

#endif  // TANDEM_DEPLOY_MONITORING_PROMQL_NAMES_H_
