// A value that goes up and down (queue depth, KV blocks in use, bytes resident).
// Lock-free: every operation is one atomic store or compare-exchange loop.
// Obtain one from Family<Gauge>::Add(); the family owns it.
#ifndef TANDEM_METRICS_GAUGE_H_
#define TANDEM_METRICS_GAUGE_H_

#include <atomic>

#include "metrics/snapshot.h"

namespace tandem::metrics {

class Gauge {
 public:
  static constexpr MetricType kType = MetricType::kGauge;

  Gauge() = default;
  Gauge(const Gauge&) = delete;
  Gauge& operator=(const Gauge&) = delete;

  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Increment(double delta = 1.0) {
    value_.fetch_add(delta, std::memory_order_relaxed);
  }
  void Decrement(double delta = 1.0) {
    value_.fetch_sub(delta, std::memory_order_relaxed);
  }
  double Value() const { return value_.load(std::memory_order_relaxed); }

  void Collect(MetricSnapshot* out) const;

 private:
  std::atomic<double> value_{0.0};
};

}  // namespace tandem::metrics

#endif  // TANDEM_METRICS_GAUGE_H_
