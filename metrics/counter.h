// A monotonically increasing value (requests served, tokens generated, bytes sent).
// Lock-free: Increment is one atomic add, cheap enough for per-token hot paths.
// Obtain one from Family<Counter>::Add(); the family owns it.
#ifndef TANDEM_METRICS_COUNTER_H_
#define TANDEM_METRICS_COUNTER_H_

#include <atomic>
#include <cassert>

#include "metrics/snapshot.h"

namespace tandem::metrics {

class Counter {
 public:
  static constexpr MetricType kType = MetricType::kCounter;

  Counter() = default;
  Counter(const Counter&) = delete;
  Counter& operator=(const Counter&) = delete;

  void Increment() { Increment(1.0); }
  // `delta` must be >= 0 (a counter never goes down). A negative or NaN delta is
  // a programming error: it fails an assert in debug builds and is ignored in
  // optimised (NDEBUG) builds, leaving the value unchanged.
  void Increment(double delta) {
    if (!(delta >= 0.0)) {
      assert(false && "Counter::Increment: delta must be >= 0");
      return;
    }
    value_.fetch_add(delta, std::memory_order_relaxed);
  }

  double Value() const { return value_.load(std::memory_order_relaxed); }

  // Fills `out->value`; labels are the family's business.
  void Collect(MetricSnapshot* out) const;

 private:
  std::atomic<double> value_{0.0};
};

}  // namespace tandem::metrics

#endif  // TANDEM_METRICS_COUNTER_H_
