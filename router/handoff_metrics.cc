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
  prefill_choices =
      OrDie(r->AddCounter("tandem_router_prefill_choices_total",
                          "Prefill-worker choices by routing policy and reason (cache: "
                          "a cached prefix decided; balance: the balance guard; load: "
                          "no cached prefix counted)."));
  estimated_hit_tokens =
      &OrDie(r->AddCounter("tandem_router_estimated_prefix_hit_tokens_total",
                           "The router's estimate of prompt tokens the chosen prefill "
                           "workers hold (cache_aware routing)."))
           ->Add({});
  // Children exist from the start, so every series is scraped (at 0).
  for (const char* reason : {"prefill_unavailable", "decode_full", "decode_unavailable",
                             "colocated_fallback"}) {
    retries->Add({{"reason", reason}});
  }
  for (const char* p : {"disaggregated", "colocated"}) paths->Add({{"path", p}});
}

}  // namespace tandem::router
