// Plain-data snapshot of a Registry: what Registry::Collect() returns and what the
// text exposition (text_format.h) serialises. No locks, no atomics: safe to copy,
// compare and hand to another thread.
#ifndef TANDEM_METRICS_SNAPSHOT_H_
#define TANDEM_METRICS_SNAPSHOT_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace tandem::metrics {

enum class MetricType { kCounter, kGauge, kHistogram };

// "counter", "gauge", "histogram": the word used on `# TYPE` lines.
absl::string_view MetricTypeName(MetricType type);

// A label set, kept in the order the caller gave it (that is the exposition order).
using Labels = std::vector<std::pair<std::string, std::string>>;

struct BucketSnapshot {
  double upper_bound = 0;         // the `le` value; the last bucket is +Inf
  uint64_t cumulative_count = 0;  // observations <= upper_bound
};

// One labelled child of a family.
struct MetricSnapshot {
  Labels labels;
  double value = 0;                     // counter and gauge
  std::vector<BucketSnapshot> buckets;  // histogram: every bound plus +Inf, cumulative
  double sum = 0;                       // histogram
  uint64_t count = 0;  // histogram; equals buckets.back().cumulative_count
};

struct FamilySnapshot {
  std::string name;
  std::string help;
  MetricType type = MetricType::kCounter;
  std::vector<MetricSnapshot> metrics;  // in the order the label sets were first added
};

}  // namespace tandem::metrics

#endif  // TANDEM_METRICS_SNAPSHOT_H_
