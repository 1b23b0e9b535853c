// A distribution in fixed buckets (latencies, batch sizes). The upper bounds are
// fixed when the family is created (Registry::AddHistogram), strictly increasing,
// with +Inf implicit. A bucket counts observations v <= bound ("le" is inclusive).
//
// Observe() is a binary search over the bounds plus two atomic adds (the bucket's
// counter and the sum); no lock. Counts are stored per bucket and made cumulative
// only in Collect(). `count` is derived from the buckets, so a snapshot's
// _count always equals its +Inf bucket; under concurrent Observe() the _sum may
// lag or lead the counts by the observations in flight.
#ifndef TANDEM_METRICS_HISTOGRAM_H_
#define TANDEM_METRICS_HISTOGRAM_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "metrics/snapshot.h"

namespace tandem::metrics {

class Histogram {
 public:
  static constexpr MetricType kType = MetricType::kHistogram;

  // `bounds` must satisfy ValidateBuckets() (buckets.h); the Registry checks it.
  explicit Histogram(std::vector<double> bounds);
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  // NaN is counted in the +Inf bucket only (and makes the sum NaN).
  void Observe(double value);

  // Total observations and their sum.
  uint64_t Count() const;
  double Sum() const { return sum_.load(std::memory_order_relaxed); }
  const std::vector<double>& bounds() const { return bounds_; }

  // Fills `out->buckets` (cumulative, bounds then +Inf), `out->sum`, `out->count`.
  void Collect(MetricSnapshot* out) const;

 private:
  const std::vector<double> bounds_;
  // bounds_.size() + 1 non-cumulative counts; the last one is the +Inf bucket.
  const std::unique_ptr<std::atomic<uint64_t>[]> counts_;
  std::atomic<double> sum_{0.0};
};

}  // namespace tandem::metrics

#endif  // TANDEM_METRICS_HISTOGRAM_H_
