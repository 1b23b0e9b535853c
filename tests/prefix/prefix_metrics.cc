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

double SettledPrefixHitTokens(ProcessCluster& c) {
  double last = -1;
  for (int i = 0; i < 20; ++i) {
    absl::SleepFor(absl::Milliseconds(600));
    const double h = PrefixHitTokens(c);
    if (h == last) return h;
    last = h;
  }
  return last;
}

}  // namespace tandem::testing
