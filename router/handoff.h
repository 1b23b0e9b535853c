// The prefill -> decode hand-off of one Generate request, driven by gRPC
// callback-API client calls (no thread blocks on a worker).
//
// States of a request (GenerateCall in handoff.cc):
//   START ──colocate?──> COLOCATED: DecodeWorker.Generate, relay the stream ──> FINISH
//     │  (prompt < --colocate_below_tokens, min_tokens > 0, no room after the
//     │   prompt, or no prefill worker registered)
//     └─> RESERVING: DecodeWorker.Reserve on the decode worker with the most free
//           cache  ── RESOURCE_EXHAUSTED / UNAVAILABLE → next decode worker
//                     (none left → RESOURCE_EXHAUSTED / UNAVAILABLE)
//         → PREFILLING: PrefillWorker.Prefill on the least-loaded prefill worker
//           ── UNAVAILABLE (worker lost) → RELEASING (DecodeWorker.Release) →
//              RESERVING again with that prefill worker excluded (at most
//              --max_prefill_attempts); no prefill worker left → COLOCATED on a
//              decode worker
//         → DECODING: DecodeWorker.Decode (first token from Prefill, checksums),
//           relay the stream; decode worker lost → UNAVAILABLE naming it
//         → FINISH (the last message carries usage with the router's TTFT/total)
//   client cancel (any state) → TryCancel of the call in flight (the worker
//     aborts and frees) + Release of an unused reservation → CANCELLED
// Every downstream call carries a deadline (the request's, or rpc_timeout for
// Reserve/Release).
#ifndef TANDEM_ROUTER_HANDOFF_H_
#define TANDEM_ROUTER_HANDOFF_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "metrics/registry.h"
#include "proto/router.pb.h"
#include "proto/worker.grpc.pb.h"
#include "router/pair_selection.h"
#include "router/worker_registry.h"
#include "rpc/response_sink.h"

namespace tandem::router {

struct HandoffOptions {
  // Prompts shorter than this prefill on the decode worker (DecodeWorker.Generate).
  int32_t colocate_below_tokens = 0;
  // Prefill attempts per request (the first plus retries on other workers).
  int max_prefill_attempts = 3;
  // Reserve / Release deadline.
  absl::Duration rpc_timeout = absl::Seconds(5);
  // Lease asked of the decode worker.
  int32_t lease_ms = 30000;
  // Ask for state checksums (prefill computes, decode verifies).
  bool checksums = true;
  // The model's context (prompt + 1 must fit for the disaggregated path).
  int64_t max_context_tokens = 0;
};

struct HandoffMetrics {
  explicit HandoffMetrics(metrics::Registry* registry);
  metrics::Family<metrics::Counter>* retries;  // by reason
  metrics::Family<metrics::Counter>* paths;    // disaggregated | colocated
  metrics::Histogram* ttft;
  metrics::Histogram* latency;
  metrics::Histogram* transfer_seconds;
};

// Shared by every request: worker stubs (one channel per address), and what the
// router has placed on each worker that the worker's load reports cannot show yet
// (pair selection adds it to the reported load). A placement counts until the
// worker's next report: that report includes it, so counting it too would count
// every running request twice.
class Handoff {
 public:
  // Not owned; must outlive the object.
  Handoff(WorkerRegistry* registry, HandoffMetrics* metrics, HandoffOptions options);

  // Runs `request` (validated; prompt_token_ids set; seed set when sampling),
  // writing to `stream` (its producer reference passes to the call) until
  // `deadline`. `on_finish(status)` runs once at the end (metrics, bookkeeping).
  void Start(tandem::v1::GenerateRequest request, rpc::ResponseSink* stream,
             absl::Time deadline, absl::Time started,
             std::function<void(const absl::Status&)> on_finish);

  // For GenerateCall.
  tandem::v1::PrefillWorker::StubInterface* PrefillStub(const std::string& address);
  tandem::v1::DecodeWorker::StubInterface* DecodeStub(const std::string& address);
  // Placements on `live` workers not yet covered by their load reports.
  InFlightMap InFlightSnapshot(const std::vector<WorkerRecord>& live);
  // Records / forgets request `request_id` (of `tokens` tokens) on `worker`.
  // Unplace is idempotent.
  void Place(const WorkerRecord& worker, const std::string& request_id, int64_t tokens);
  void Unplace(const std::string& worker_id, const std::string& request_id);
  WorkerRegistry* registry() { return registry_; }
  HandoffMetrics* metrics() { return metrics_; }
  const HandoffOptions& options() const { return options_; }

 private:
  WorkerRegistry* const registry_;  // not owned
  HandoffMetrics* const metrics_;   // not owned
  const HandoffOptions options_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<grpc::Channel>> channels_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::unique_ptr<tandem::v1::PrefillWorker::Stub>>
      prefill_stubs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::unique_ptr<tandem::v1::DecodeWorker::Stub>>
      decode_stubs_ ABSL_GUARDED_BY(mu_);
  struct Placement {
    std::string request_id;
    uint64_t reports_at_placement = 0;  // WorkerRecord::reports when placed
    int64_t tokens = 0;
  };
  absl::flat_hash_map<std::string, std::vector<Placement>> placements_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::router

#endif  // TANDEM_ROUTER_HANDOFF_H_
