#include "metrics/family.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace tandem::metrics {

FamilyBase::FamilyBase(std::string name, std::string help, MetricType type,
                       std::vector<double> buckets)
    : name_(std::move(name)),
      help_(std::move(help)),
      type_(type),
      buckets_(std::move(buckets)) {}

FamilyBase::~FamilyBase() = default;

std::string FamilyBase::LabelKey(const Labels& labels) {
  std::vector<const std::pair<std::string, std::string>*> sorted;
  sorted.reserve(labels.size());
  for (const auto& label : labels) sorted.push_back(&label);
  std::sort(sorted.begin(), sorted.end(),
            [](const auto* a, const auto* b) { return a->first < b->first; });
  // Label names cannot contain '='; values are length-prefixed, so the key is
  // unambiguous whatever bytes the values hold.
  std::string key;
  for (const auto* label : sorted) {
    absl::StrAppend(&key, label->first, "=", label->second.size(), ":", label->second);
  }
  return key;
}

void FamilyBase::ReportInvalidLabels(const absl::Status& status) {
  if (reported_invalid_.exchange(true)) return;
  TLOG(ERROR, "invalid metric labels; using a detached metric that is not exported")
      .Kv("metric", name_)
      .Kv("error", status);
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

}  // namespace tandem::metrics
