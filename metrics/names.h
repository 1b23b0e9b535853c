// Validation of metric names, label names and label sets against the Prometheus
// data model:
//   metric name  [a-zA-Z_:][a-zA-Z0-9_:]*
//   label name   [a-zA-Z_][a-zA-Z0-9_]*, not starting with "__" (reserved)
//   label value  any valid UTF-8
// Conventions that are not rules (units in names, `_total` on counters) are
// checked by `promtool check metrics`, not here.
#ifndef TANDEM_METRICS_NAMES_H_
#define TANDEM_METRICS_NAMES_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "metrics/snapshot.h"

namespace tandem::metrics {

absl::Status ValidateMetricName(absl::string_view name);
absl::Status ValidateLabelName(absl::string_view name);
bool IsValidUtf8(absl::string_view s);

// Every name valid, no name twice, every value valid UTF-8; histograms may not
// use "le" (the exposition adds it to each bucket).
absl::Status ValidateLabels(const Labels& labels, MetricType type);

}  // namespace tandem::metrics

#endif  // TANDEM_METRICS_NAMES_H_
