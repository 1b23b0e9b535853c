// The hand-off's metrics (one set per router process, shared by every request).
#ifndef TANDEM_ROUTER_HANDOFF_METRICS_H_
#define TANDEM_ROUTER_HANDOFF_METRICS_H_

#include "metrics/registry.h"
#include "router/admission_queue.h"

namespace tandem::router {

struct HandoffMetrics {
  // Registers the families on `registry` (not owned; must outlive this).
  explicit HandoffMetrics(metrics::Registry* registry);
  metrics::Family<metrics::Counter>* retries;  // by reason
  metrics::Family<metrics::Counter>* paths;    // disaggregated | colocated
  metrics::Histogram* ttft;                    // arrival -> first token relayed
  metrics::Histogram* latency;                 // arrival -> end, once per request
  metrics::Histogram* transfer_seconds;        // as reported by prefill
  // Prefill-worker choices by policy and why: "cache" (the cache-aware cost
  // chose a worker holding part of the prompt), "balance" (the balance guard
  // chose the least loaded), "load" (no cached prefix counted: least load,
  // round robin, or a cache-aware choice with no match).
  metrics::Family<metrics::Counter>* prefill_choices;
  // The router's estimate of the prompt tokens the chosen prefill workers hold.
  metrics::Counter* estimated_hit_tokens;
  AdmissionQueueMetrics queue;  // the router's admission queue
};

}  // namespace tandem::router

#endif  // TANDEM_ROUTER_HANDOFF_METRICS_H_
