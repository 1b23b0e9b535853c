// The router's gRPC services: the client-facing Router and the workers' Registry.
//
//   Generate(request)
//     → ValidateGenerateRequest            INVALID_ARGUMENT on bad input
//     → prompt_text tokenised (the model's tokenizer), length re-checked
//     → no live decode worker               UNAVAILABLE (not queued)
//     → in-flight limit reached: waits in the AdmissionQueue (in-flight lane,
//       woken when a request finishes); RESOURCE_EXHAUSTED only when the queue
//       is full or --queue_timeout_s passes; cancel / deadline end it at once
//     → seed drawn when sampling without one; deadline = min(gRPC deadline,
//       deadline_unix_ms, now + request_timeout)
//     → Handoff::Start (handoff.h: Reserve → Prefill → Decode, or colocated),
//       relaying the stream                 START → ... → FINISH
//   GenerateSession → many Generates on one stream (rpc/session_stream.h);
//     each start runs exactly as a Generate call (the request's own deadline)
//   ListModels → the served model (from config.json)
//   ResetPrefixCache → every live worker's ResetPrefixCache at once (prefill
//     and decode), each with min(the call's deadline, admin_rpc_timeout); the
//     answer lists the workers reset and those that failed or timed out
//     (UNAVAILABLE when no worker is live)
//   Register / Heartbeat → WorkerRegistry; a decode worker's report with free
//     slots wakes that many requests queued for a decode worker; the prefix
//     snapshot (Register) and events (Heartbeat) go to the Handoff's
//     PrefillRouter index (prefix_routing.h), which answers the heartbeat
//     with the events acknowledged or "resync" (register again)
#ifndef TANDEM_ROUTER_ROUTER_SERVICE_H_
#define TANDEM_ROUTER_ROUTER_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/ids.h"
#include "engine/model/served_model.h"
#include "engine/tokenizer/tokenizer.h"
#include "metrics/registry.h"
#include "proto/router.grpc.pb.h"
#include "proto/worker.grpc.pb.h"
#include "router/handoff.h"
#include "router/request_validation.h"
#include "router/structured_output_check.h"
#include "router/worker_registry.h"
#include "rpc/response_sink.h"

namespace tandem::router {

struct RouterMetrics {
  explicit RouterMetrics(metrics::Registry* registry);
  metrics::Family<metrics::Counter>* requests;       // by outcome
  metrics::Gauge* in_flight;                         // Generate calls running
  metrics::Histogram* latency;                       // end to end, every outcome
  metrics::Family<metrics::Counter>* registrations;  // by role and result
  metrics::Family<metrics::Gauge>* workers;          // live workers by role
  metrics::Gauge* sessions;                          // open GenerateSession calls
  metrics::Counter* session_writes;                  // messages written on them
  metrics::Counter* session_events;                  // events in those messages
};

struct RouterServiceOptions {
  // Generate calls running at once; more wait in the admission queue.
  int32_t max_in_flight = 256;
  // Deadline of a request that carries none.
  absl::Duration request_timeout = absl::Seconds(600);
  // Deadline of each worker RPC of an admin call (ResetPrefixCache).
  absl::Duration admin_rpc_timeout = absl::Seconds(10);
};

class RouterService final : public tandem::v1::Router::CallbackService {
 public:
  // Not owned, must outlive the service: registry, metrics, handoff, tokenizer
  // (may be null: prompt_text is then refused).
  RouterService(model::ServedModel model, WorkerRegistry* registry,
                RouterMetrics* metrics, Handoff* handoff,
                RouterServiceOptions options = {},
                const tokenizer::Tokenizer* tokenizer = nullptr);

  grpc::ServerWriteReactor<tandem::v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context,
      const tandem::v1::GenerateRequest* request) override;
  grpc::ServerBidiReactor<tandem::v1::SessionRequest, tandem::v1::SessionResponse>*
  GenerateSession(grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* ListModels(
      grpc::CallbackServerContext* context,
      const tandem::v1::ListModelsRequest* request,
      tandem::v1::ListModelsResponse* response) override;
  grpc::ServerUnaryReactor* ResetPrefixCache(
      grpc::CallbackServerContext* context,
      const tandem::v1::ResetPrefixCacheRequest* request,
      tandem::v1::ResetPrefixCacheResponse* response) override;

 private:
  // Validates `request` and prepares it for the hand-off (prompt_text
  // tokenised, request id and seed filled in), or says why it is refused.
  absl::StatusOr<tandem::v1::GenerateRequest> Admit(
      const tandem::v1::GenerateRequest& request);
  // Admits `request` and starts its hand-off writing to `sink`, or Closes the
  // sink with the refusal.
  void Run(const tandem::v1::GenerateRequest& request, rpc::ResponseSink* sink,
           absl::Time grpc_deadline, const std::string& peer);
  // Counts a finished request by outcome.
  void Done(const absl::Status& status, absl::Time started);
  // Takes an in-flight place if one is free.
  bool TryClaim();
  // Starts the hand-off of an admitted request holding an in-flight place.
  void StartHandoff(tandem::v1::GenerateRequest req, rpc::ResponseSink* sink,
                    absl::Time deadline, absl::Time started);
  struct Waiter;
  // Queues `w` in the in-flight lane (again: it keeps its place), or ends it.
  void Wait(std::shared_ptr<Waiter> w);

  // The model's limits, with the context shrunk to the smallest limit of the live
  // workers (a worker may accept less than the model's max_position_embeddings).
  ModelLimits Limits() const;

  const model::ServedModel model_;
  const ModelLimits limits_;
  WorkerRegistry* const registry_;  // not owned
  RouterMetrics* const metrics_;    // not owned
  Handoff* const handoff_;          // not owned
  const RouterServiceOptions options_;
  const tokenizer::Tokenizer* const tokenizer_;  // not owned; may be null
  StructuredOutputCheck structured_check_;
  std::atomic<int32_t> in_flight_{0};
  IdGenerator ids_;
};

class RegistryService final : public tandem::v1::Registry::CallbackService {
 public:
  // Not owned; must outlive the service.
  // `handoff` (may be null) hears of decode workers' free slots.
  RegistryService(WorkerRegistry* registry, RouterMetrics* metrics,
                  std::string model_fingerprint, absl::Duration heartbeat_interval,
                  Handoff* handoff = nullptr);

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* context,
                                     const tandem::v1::RegisterRequest* request,
                                     tandem::v1::RegisterResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const tandem::v1::HeartbeatRequest* request,
                                      tandem::v1::HeartbeatResponse* response) override;

 private:
  void UpdateWorkerGauges();
  // tandem_router_prefix_index_entries of every worker; drops workers no
  // longer live from the index (at registrations: a heartbeat sets its own
  // worker's series only).
  void UpdatePrefixGauges();

  WorkerRegistry* const registry_;  // not owned
  RouterMetrics* const metrics_;    // not owned
  absl::Mutex gauge_mu_;
  absl::flat_hash_set<std::string> indexed_ ABSL_GUARDED_BY(gauge_mu_);
  const std::string model_fingerprint_;
  const absl::Duration heartbeat_interval_;
  Handoff* const handoff_;  // not owned; may be null
};

}  // namespace tandem::router

#endif  // TANDEM_ROUTER_ROUTER_SERVICE_H_
