#include "tests/prefix/prefix_metrics.h"

#include "absl/time/clock.h"

namespace tandem::testing {

double PrefixHitTokens(ProcessCluster& c) {
  double total = 0;
  for (int port : {c.prefill_metrics(), c.decode_metrics()}) {
    auto v = Metric(port, "tandem_worker_prefix_cache_hit_tokens_total", {});
    if (v.ok()) total += *v;
  }
  return total;
}

namespace {

// `read()` once two readings 600 ms apart (the workers' update period is
// 500 ms) agree; at most 20 readings.
template <typename Read>
double Settled(Read read) {
  double last = -1;
  for (int i = 0; i < 20; ++i) {
    absl::SleepFor(absl::Milliseconds(600));
    const double v = read();
    if (v == last) return v;
    last = v;
  }
  return last;
}

}  // namespace

double SettledPrefixHitTokens(ProcessCluster& c) {
  return Settled([&] { return PrefixHitTokens(c); });
}

double SettledMetric(int port, const std::string& name) {
  return Settled([&] {
    auto v = Metric(port, name, {});
    return v.ok() ? *v : -1.0;
  });
}

}  // namespace tandem::testing
