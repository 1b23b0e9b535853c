#include "router/handoff_metrics.h"

#include <vector>

#include "metrics/buckets.h"

namespace tandem::router {

using metrics::OrDie;

HandoffMetrics::HandoffMetrics(metrics::Registry* r) : queue(r) {
  const std::vector<double> buckets = *metrics::ExponentialBuckets(0.0005, 2, 18);
  retries =
      OrDie(r->AddCounter("tandem_router_retries_total",
                          "Hand-off retries by reason (prefill_unavailable, "
                          "decode_full, decode_unavailable, colocated_fallback)."));
  paths = OrDie(r->AddCounter("tandem_router_paths_total",
                              "Requests by path (disaggregated, colocated)."));
  ttft = &OrDie(r->AddHistogram("tandem_router_time_to_first_token_seconds",
                                "From Generate arrival to the first token relayed.",
                                buckets))
              ->Add({});
  latency =
      &OrDie(r->AddHistogram("tandem_router_request_duration_seconds",
                             "End-to-end latency of admitted Generate requests, from "
                             "arrival to their end (every outcome).",
                             buckets))
           ->Add({});
  transfer_seconds =
      &OrDie(r->AddHistogram("tandem_router_transfer_seconds",
                             "KV/state transfer time reported by prefill.", buckets))
           ->Add({});
  // Children exist from the start, so every series is scraped (at 0).
  for (const char* reason : {"prefill_unavailable", "decode_full", "decode_unavailable",
                             "colocated_fallback"}) {
    retries->Add({{"reason", reason}});
  }
  for (const char* p : {"disaggregated", "colocated"}) paths->Add({{"path", p}});
}

}  // namespace tandem::router
