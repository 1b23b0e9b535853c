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
  // Prompt tokens the chosen workers hold by the router's prefix index (the
  // workers' reports, plus what it sent them and they have not reported yet):
  // cache-aware prefill choices and colocations decided by the uncached length.
  metrics::Counter* estimated_hit_tokens;
  // Prompt tokens whose MLA rows the chosen decode workers reported holding
  // (blocks-only announcements or usable prefixes): the rows the decode-side
  // prefix hit should keep off the wire (the workers' own count is
  // tandem_worker_prefix_cache_reserve_hit_tokens_total).
  metrics::Counter* estimated_decode_held_tokens;
  // Reported usable prefixes the index holds, per worker (0 once it is gone).
  metrics::Family<metrics::Gauge>* prefix_index_entries;
  // Resyncs the router asked of a worker, by why: gap (events missing),
  // epoch (another process, or unknown as a reporter), overflow (the index's
  // per-worker bound).
  metrics::Family<metrics::Counter>* prefix_resyncs;
  // Prefix events applied from the workers' reports (registration snapshots
  // included).
  metrics::Counter* prefix_events;
  AdmissionQueueMetrics queue;  // the router's admission queue
};

}  // namespace tandem::router

#endif  // TANDEM_ROUTER_HANDOFF_METRICS_H_
