#include "metrics/histogram.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

namespace tandem::metrics {

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)),
      counts_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    counts_[i].store(0, std::memory_order_relaxed);
  }
}

void Histogram::Observe(double value) {
  size_t index = bounds_.size();  // +Inf
  if (!std::isnan(value)) {
    // First bound >= value: `le` is inclusive.
    index = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  }
  counts_[index].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(value, std::memory_order_relaxed);
}

uint64_t Histogram::Count() const {
  uint64_t total = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    total += counts_[i].load(std::memory_order_relaxed);
  }
  return total;
}

void Histogram::Collect(MetricSnapshot* out) const {
  out->buckets.clear();
  out->buckets.reserve(bounds_.size() + 1);
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += counts_[i].load(std::memory_order_relaxed);
    const double bound =
        i < bounds_.size() ? bounds_[i] : std::numeric_limits<double>::infinity();
    out->buckets.push_back(BucketSnapshot{bound, cumulative});
  }
  out->count = cumulative;
  out->sum = Sum();
}

}  // namespace tandem::metrics
