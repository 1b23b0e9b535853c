#include "router/router_service.h"

#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/status.h"

namespace tandem::router {
namespace {

// A stream that ends at once with `status`.
class FinishedWriter : public grpc::ServerWriteReactor<tandem::v1::GenerateResponse> {
 public:
  explicit FinishedWriter(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

template <typename T>
T* OrDie(absl::StatusOr<T*> s) {
  // Metric names here are constants: an error is a programming mistake.
  if (!s.ok()) {
    TLOG(ERROR, "bad router metric definition").Kv("status", s.status());
    std::abort();
  }
  return *s;
}

}  // namespace

RouterMetrics::RouterMetrics(metrics::Registry* registry)
    : requests(OrDie(registry->AddCounter(
          "tandem_router_requests_total",
          "Generate requests by outcome (ok, invalid, unavailable, unimplemented)."))),
      registrations(OrDie(registry->AddCounter(
          "tandem_router_registrations_total",
          "Worker registrations by role and result (ok, rejected)."))),
      workers(OrDie(registry->AddGauge("tandem_router_workers",
                                       "Live registered workers by role."))) {
  // Children exist from the start, so every series is scraped (at 0) before the
  // first event and rate() works from the first scrape.
  for (const char* outcome : {"ok", "invalid", "unavailable", "unimplemented"}) {
    requests->Add({{"outcome", outcome}});
  }
  for (const char* role : {"prefill", "decode"}) workers->Add({{"role", role}});
}

RouterService::RouterService(ServedModel model, WorkerRegistry* registry,
                             RouterMetrics* metrics)
    : model_(std::move(model)),
      limits_{.vocab_size = model_.info.vocab_size(),
              .max_context_tokens = model_.info.max_context_tokens()},
      registry_(registry),
      metrics_(metrics) {}

grpc::ServerWriteReactor<tandem::v1::GenerateResponse>* RouterService::Generate(
    grpc::CallbackServerContext* context, const tandem::v1::GenerateRequest* request) {
  absl::Status status = ValidateGenerateRequest(*request, limits_);
  if (status.ok() && !request->model().empty() &&
      request->model() != model_.info.id()) {
    status = NotFound("model '", request->model(), "' is not served here; served: '",
                      model_.info.id(), "'");
  }
  const char* outcome = "invalid";
  if (status.ok()) {
    if (registry_->Live(tandem::v1::WORKER_ROLE_DECODE).empty()) {
      status = Unavailable(
          "no decode workers registered with this router; the request was not started");
      outcome = "unavailable";
    } else {
      status = Unimplemented(
          "the prefill -> decode hand-off is not built yet in this version of Tandem");
      outcome = "unimplemented";
    }
  }
  metrics_->requests->Add({{"outcome", outcome}}).Increment();
  TLOG(INFO, "generate refused")
      .Kv("request_id", request->request_id())
      .Kv("peer", context->peer())
      .Kv("status", status);
  return new FinishedWriter(ToGrpcStatus(status));
}

grpc::ServerUnaryReactor* RouterService::ListModels(
    grpc::CallbackServerContext* context, const tandem::v1::ListModelsRequest*,
    tandem::v1::ListModelsResponse* response) {
  *response->add_models() = model_.info;
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

RegistryService::RegistryService(WorkerRegistry* registry, RouterMetrics* metrics,
                                 std::string model_fingerprint,
                                 absl::Duration heartbeat_interval)
    : registry_(registry),
      metrics_(metrics),
      model_fingerprint_(std::move(model_fingerprint)),
      heartbeat_interval_(heartbeat_interval) {}

grpc::ServerUnaryReactor* RegistryService::Register(
    grpc::CallbackServerContext* context, const tandem::v1::RegisterRequest* request,
    tandem::v1::RegisterResponse* response) {
  absl::Status status;
  if (request->model_fingerprint() != model_fingerprint_) {
    status =
        FailedPrecondition("worker ", request->worker_id(),
                           " serves model fingerprint '", request->model_fingerprint(),
                           "' but this router serves '", model_fingerprint_, "'");
  } else {
    status = registry_->Register(*request);
  }
  const std::string role = tandem::v1::WorkerRole_Name(request->role());
  metrics_->registrations
      ->Add({{"role", role}, {"result", status.ok() ? "ok" : "rejected"}})
      .Increment();
  TLOG(INFO, "worker registration")
      .Kv("worker_id", request->worker_id())
      .Kv("role", role)
      .Kv("address", request->grpc_address())
      .Kv("status", status);
  if (status.ok()) {
    response->set_heartbeat_interval_ms(
        static_cast<int32_t>(absl::ToInt64Milliseconds(heartbeat_interval_)));
    UpdateWorkerGauges();
  }
  auto* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* RegistryService::Heartbeat(
    grpc::CallbackServerContext* context, const tandem::v1::HeartbeatRequest* request,
    tandem::v1::HeartbeatResponse* response) {
  response->set_known(registry_->Heartbeat(request->worker_id(), request->load()));
  UpdateWorkerGauges();
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

void RegistryService::UpdateWorkerGauges() {
  metrics_->workers->Add({{"role", "prefill"}})
      .Set(registry_->Live(tandem::v1::WORKER_ROLE_PREFILL).size());
  metrics_->workers->Add({{"role", "decode"}})
      .Set(registry_->Live(tandem::v1::WORKER_ROLE_DECODE).size());
}

}  // namespace tandem::router
