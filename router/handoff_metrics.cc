#include "router/handoff_metrics.h"

#include <vector>

#include "metrics/buckets.h"

namespace tandem::router {

using metrics::OrDie;

HandoffMetrics::HandoffMetrics(metrics::Registry* r) : queue(r) {
  const std::vector<double> buckets = *metrics::ExponentialBuckets(0.0005, 2, 18);
  retries = OrDie(r->AddCounter("tandem_router_retries_total",
                                "Hand-off retries by reason (prefill_unavailable, "
                                "decode_full, decode_unavailable, colocated_fallback, "
                                "held_prefix_writer)."));
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
                           "Prompt tokens the chosen workers hold by the router's "
                           "prefix index (the workers' reports, plus prompts sent and "
                           "not yet reported): cache_aware prefill choices and "
                           "colocations by the uncached length."))
           ->Add({});
  estimated_decode_held_tokens =
      &OrDie(r->AddCounter("tandem_router_estimated_decode_held_tokens_total",
                           "Prompt tokens whose MLA rows the chosen decode workers "
                           "reported holding (a decode-side prefix hit keeps them off "
                           "the wire)."))
           ->Add({});
  prefix_index_entries =
      OrDie(r->AddGauge("tandem_router_prefix_index_entries",
                        "Usable prefixes the router's index holds per worker, as "
                        "the worker reported them."));
  prefix_resyncs =
      OrDie(r->AddCounter("tandem_router_prefix_resyncs_total",
                          "Prefix-index resyncs asked of workers, by reason (gap, "
                          "epoch, overflow)."));
  prefix_events = &OrDie(r->AddCounter("tandem_router_prefix_events_total",
                                       "Prefix-cache events applied from the "
                                       "workers' reports and registrations."))
                       ->Add({});
  for (const char* why : {"gap", "epoch", "overflow"}) {
    prefix_resyncs->Add({{"reason", why}});
  }
  // Children exist from the start, so every series is scraped (at 0).
  for (const char* reason : {"prefill_unavailable", "decode_full", "decode_unavailable",
                             "colocated_fallback", "held_prefix_writer"}) {
    retries->Add({{"reason", reason}});
  }
  for (const char* p : {"disaggregated", "colocated"}) paths->Add({{"path", p}});
}

}  // namespace tandem::router
