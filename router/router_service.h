// The router's gRPC services: the client-facing Router and the workers' Registry.
//
//   Generate(request)
//     → ValidateGenerateRequest            INVALID_ARGUMENT on bad input
//     → pick a decode worker from WorkerRegistry
//                                          UNAVAILABLE when none is registered
//     → hand-off (Reserve → Prefill → Decode) — not built yet: UNIMPLEMENTED
//   ListModels → the served model (from config.json)
//   Register / Heartbeat → WorkerRegistry
//
// Every RPC finishes inline (no RPC lifecycle beyond START → FINISH yet).
#ifndef TANDEM_ROUTER_ROUTER_SERVICE_H_
#define TANDEM_ROUTER_ROUTER_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include "metrics/registry.h"
#include "proto/router.grpc.pb.h"
#include "proto/worker.grpc.pb.h"
#include "router/model_info.h"
#include "router/request_validation.h"
#include "router/worker_registry.h"

namespace tandem::router {

struct RouterMetrics {
  explicit RouterMetrics(metrics::Registry* registry);
  metrics::Family<metrics::Counter>* requests;       // by outcome
  metrics::Family<metrics::Counter>* registrations;  // by role and result
  metrics::Family<metrics::Gauge>* workers;          // live workers by role
};

class RouterService final : public tandem::v1::Router::CallbackService {
 public:
  // `registry` and `metrics` are not owned and must outlive the service.
  RouterService(ServedModel model, WorkerRegistry* registry, RouterMetrics* metrics);

  grpc::ServerWriteReactor<tandem::v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context,
      const tandem::v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* ListModels(
      grpc::CallbackServerContext* context,
      const tandem::v1::ListModelsRequest* request,
      tandem::v1::ListModelsResponse* response) override;

 private:
  const ServedModel model_;
  const ModelLimits limits_;
  WorkerRegistry* const registry_;  // not owned
  RouterMetrics* const metrics_;    // not owned
};

class RegistryService final : public tandem::v1::Registry::CallbackService {
 public:
  // Not owned; must outlive the service.
  RegistryService(WorkerRegistry* registry, RouterMetrics* metrics,
                  std::string model_fingerprint, absl::Duration heartbeat_interval);

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* context,
                                     const tandem::v1::RegisterRequest* request,
                                     tandem::v1::RegisterResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context,
                                      const tandem::v1::HeartbeatRequest* request,
                                      tandem::v1::HeartbeatResponse* response) override;

 private:
  void UpdateWorkerGauges();

  WorkerRegistry* const registry_;  // not owned
  RouterMetrics* const metrics_;    // not owned
  const std::string model_fingerprint_;
  const absl::Duration heartbeat_interval_;
};

}  // namespace tandem::router

#endif  // TANDEM_ROUTER_ROUTER_SERVICE_H_
