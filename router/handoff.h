// The prefill -> decode hand-off of Generate requests over gRPC: thin glue that
// runs each request's Placement (placement.h has its states) with callback-API
// client calls (no thread blocks on a worker).
//
//   Handoff::Start(request, sink)
//     → HandoffCall: Placement::Start()
//     → each action becomes a call: Reserve / Prefill / Release (unary),
//       Decode / Generate (a RelayReactor relays the worker's stream into the
//       sink, stamping request id, TTFT and usage)
//     → each call's end goes back in as an event (grpc::Status → absl::Status)
//     → Finish(status): on_finish(status), sink->Close(status)
//   sink cancelled → Placement::Cancel() → TryCancel of the call in flight
//     (QUEUED: Remove from the queue)
//   Queue (no decode worker with room) → AdmissionQueue::Push (decode lane)
//     → Wake (CapacityMayHaveFreed) or Expire (a 20 ms ticker) → OnQueueEnd
//
// Handoff itself is shared by every request: the worker stubs (one channel per
// address), the PlacementLedger and the AdmissionQueue (with its expiry ticker).
#ifndef TANDEM_ROUTER_HANDOFF_H_
#define TANDEM_ROUTER_HANDOFF_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "proto/router.pb.h"
#include "proto/worker.grpc.pb.h"
#include "router/admission_queue.h"
#include "router/handoff_metrics.h"
#include "router/placement.h"
#include "router/placement_ledger.h"
#include "router/worker_registry.h"
#include "rpc/channel_users.h"
#include "rpc/response_sink.h"

namespace tandem::router {

class Handoff {
 public:
  // Not owned; must outlive the object. `clock` times deadlines, TTFT and the
  // request's latency (its Now() must be wall-clock time for gRPC deadlines).
  Handoff(WorkerRegistry* registry, HandoffMetrics* metrics, HandoffOptions options,
          Clock* clock = Clock::Real());
  // Every request must have finished: the router waits for that
  // (WaitCallsEnded) after its server's Shutdown. This waits once more (up to
  // kCallsEndWithin, unless an earlier WaitCallsEnded gave up) until no call
  // object holds a worker channel, stops the ticker, then drops the stubs and
  // the channels here, not on a gRPC thread (rpc/channel_users.h); channels
  // still held past the bound are logged and kept for the process's life.
  ~Handoff();
  static constexpr absl::Duration kCallsEndWithin = absl::Seconds(10);
  // Waits until no hand-off call is left; false if `timeout` passed first. A
  // request's calls end soon after its client's call is cancelled (a server's
  // Shutdown cancels what is still running once its grace period is over); a
  // reset fan-out's calls end by --admin_rpc_timeout_s. The router calls it
  // after its server's Shutdown, while the services whose callbacks the calls
  // run are still alive.
  bool WaitCallsEnded(absl::Duration timeout) {
    const bool ended = channel_users_.WaitIdle(timeout);
    if (!ended) gave_up_.store(true, std::memory_order_relaxed);
    return ended;
  }

  // Capacity may have freed (a request finished, a decode worker reported free
  // slots): wakes up to `decode_slots` requests waiting for a decode worker.
  void CapacityMayHaveFreed(int decode_slots);
  // Shared with RouterService (the in-flight lane) and RegistryService.
  AdmissionQueue* queue() { return &queue_; }

  // Runs `request` (validated; prompt_token_ids set; seed set when sampling),
  // writing to `stream` (its producer reference passes to the call) until
  // `deadline`. `on_finish(status)` runs once at the end (metrics, bookkeeping).
  void Start(tandem::v1::GenerateRequest request, rpc::ResponseSink* stream,
             absl::Time deadline, absl::Time started,
             std::function<void(const absl::Status&)> on_finish);

  // For HandoffCall.
  tandem::v1::PrefillWorker::StubInterface* PrefillStub(const std::string& address);
  tandem::v1::DecodeWorker::StubInterface* DecodeStub(const std::string& address);
  PlacementDeps deps() {
    return {.registry = registry_,
            .ledger = &ledger_,
            .metrics = metrics_,
            .clock = clock_,
            .prefill_router = &prefill_router_};
  }
  HandoffMetrics* metrics() { return metrics_; }
  // The prefill choice and the per-worker prefix index (fed by the Registry
  // service from the workers' reports).
  PrefillRouter* prefill_router() { return &prefill_router_; }
  Clock* clock() { return clock_; }
  const HandoffOptions& options() const { return options_; }
  // Counts an object that holds a worker channel through a ClientContext
  // (make it its first member).
  rpc::ChannelUsers::Use UseChannels() const { return channel_users_.Enter(); }
  // Credentials of the channels to workers (mTLS from --tls_*:
  // common/tls/tls_flags.h); insecure unless set. Set before the first request.
  void SetWorkerCredentials(std::shared_ptr<grpc::ChannelCredentials> credentials);

 private:
  std::shared_ptr<grpc::Channel> ChannelLocked(const std::string& address)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  WorkerRegistry* const registry_;  // not owned
  HandoffMetrics* const metrics_;   // not owned
  const HandoffOptions options_;
  Clock* const clock_;  // not owned
  PlacementLedger ledger_;
  PrefillRouter prefill_router_;  // options_.routing_policy
  AdmissionQueue queue_;
  absl::Mutex tick_mu_;
  bool stop_ ABSL_GUARDED_BY(tick_mu_) = false;
  std::thread ticker_;  // Expire()s the queue every 20 ms
  const rpc::ChannelUsers channel_users_;
  std::atomic<bool> gave_up_{false};  // a WaitCallsEnded timed out
  absl::Mutex mu_;
  std::shared_ptr<grpc::ChannelCredentials> worker_credentials_ ABSL_GUARDED_BY(mu_) =
      grpc::InsecureChannelCredentials();
  absl::flat_hash_map<std::string, std::shared_ptr<grpc::Channel>> channels_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::unique_ptr<tandem::v1::PrefillWorker::Stub>>
      prefill_stubs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::unique_ptr<tandem::v1::DecodeWorker::Stub>>
      decode_stubs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::router

#endif  // TANDEM_ROUTER_HANDOFF_H_
