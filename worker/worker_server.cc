#include "worker/worker_server.h"

#include <grpcpp/health_check_service_interface.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <thread>

#include "absl/synchronization/notification.h"
#include "common/logging.h"
#include "common/signals.h"
#include "metrics/http_exposer.h"
#include "worker/registration.h"

namespace tandem::worker {
namespace {

bool Idle(const tandem::v1::WorkerLoad& l) {
  return l.running_requests() == 0 && l.waiting_requests() == 0 &&
         l.queued_prefill_tokens() == 0;
}

// Reports draining, stops being ready, and waits (bounded by drain_timeout; a
// second SIGINT/SIGTERM ends it) until the worker's requests have finished.
void Drain(const WorkerServerOptions& options,
           const std::function<tandem::v1::WorkerLoad()>& load,
           std::atomic<bool>* draining, RegistrationClient* registration,
           grpc::Server* server) {
  draining->store(true);
  if (registration != nullptr) registration->Nudge();  // the router sees it now
  server->GetHealthCheckService()->SetServingStatus(false);
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + options.drain_timeout;
  tandem::v1::WorkerLoad l = load();
  int64_t busy = options.busy ? options.busy() : 0;
  TLOG(INFO, "draining: no new requests; waiting for those in flight")
      .Kv("worker_id", options.registration.worker_id())
      .Kv("running", l.running_requests())
      .Kv("waiting", l.waiting_requests())
      .Kv("other", busy)
      .Kv("timeout_s", absl::ToDoubleSeconds(options.drain_timeout));
  // A later signal: stop waiting (sigwait in a thread; the main thread polls).
  auto again = std::make_shared<std::atomic<bool>>(false);
  std::thread second([again] {
    WaitForTerminationSignal();
    again->store(true);
  });
  second.detach();  // ends with the process if no second signal comes
  while (!(Idle(l) && busy == 0) && absl::Now() < deadline && !again->load()) {
    absl::SleepFor(absl::Milliseconds(20));
    l = load();
    busy = options.busy ? options.busy() : 0;
  }
  const bool drained = Idle(l) && busy == 0;
  ::tandem::log::Event(drained ? TANDEM_LOG_LEVEL_INFO : TANDEM_LOG_LEVEL_WARNING,
                       __FILE__, __LINE__,
                       drained ? "drained" : "drain ended with requests in flight")
      .Kv("worker_id", options.registration.worker_id())
      .Kv("seconds", absl::ToDoubleSeconds(absl::Now() - start))
      .Kv("running", l.running_requests())
      .Kv("waiting", l.waiting_requests())
      .Kv("other", busy)
      .Kv("cause", drained ? "idle" : (again->load() ? "second signal" : "timeout"));
}

}  // namespace

int ServeWorker(const WorkerServerOptions& options, grpc::Service* service,
                metrics::Registry* registry,
                std::function<tandem::v1::WorkerLoad()> load,
                std::function<void()> refresh) {
  metrics::HttpExposer exposer({.host = options.host, .port = options.metrics_port},
                               {registry});
  if (absl::Status s = exposer.Start(); !s.ok()) {
    TLOG(ERROR, "cannot serve /metrics").Kv("status", s);
    return 1;
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  const std::string address = options.host + ":" + std::to_string(options.port);
  builder.AddListeningPort(address, options.server_credentials, &port);
  // A second worker on a taken port fails to bind instead of sharing it
  // (gRPC's default SO_REUSEPORT).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    TLOG(ERROR, "cannot listen").Kv("address", address);
    return 1;
  }
  const std::string host =
      options.advertise_host.empty() ? options.host : options.advertise_host;
  TLOG(INFO, "worker serving")
      .Kv("worker_id", options.registration.worker_id())
      .Kv("grpc_port", port)
      .Kv("metrics_port", exposer.port())
      .Kv("mtls", options.mtls);

  std::atomic<bool> refused{false};
  std::atomic<bool> draining{false};
  // Every load report says whether the worker is draining.
  auto reported_load = [&load, &draining] {
    tandem::v1::WorkerLoad l = load();
    l.set_draining(draining.load());
    return l;
  };
  std::unique_ptr<RegistrationClient> registration;
  if (!options.router.empty()) {
    tandem::v1::RegisterRequest req = options.registration;
    req.set_grpc_address(host + ":" + std::to_string(port));
    req.set_metrics_address(host + ":" + std::to_string(exposer.port()));
    registration = std::make_unique<RegistrationClient>(
        options.router, req, reported_load, absl::Seconds(2),
        [&refused](const std::string& why) {
          refused.store(true);
          TLOG(ERROR, "registration refused by the router; exiting").Kv("status", why);
          kill(getpid(), SIGTERM);  // WaitForTerminationSignal below returns
        },
        options.health, options.router_credentials, options.prefix_events);
  }
  absl::Notification stop;
  std::thread refresher([&] {
    bool unhealthy = false;
    while (!stop.WaitForNotificationWithTimeout(options.refresh_period)) {
      refresh();
      if (unhealthy || !options.health) continue;
      const absl::Status h = options.health();
      if (h.ok()) continue;
      unhealthy = true;
      TLOG(ERROR, "worker unhealthy: no longer taking work")
          .Kv("worker_id", options.registration.worker_id())
          .Kv("status", h);
      server->GetHealthCheckService()->SetServingStatus(false);
      if (registration != nullptr) registration->Stop();
    }
  });

  int sig = WaitForTerminationSignal();
  if (!refused.load())
    Drain(options, load, &draining, registration.get(), server.get());
  TLOG(INFO, "shutting down").Kv("signal", sig);
  stop.Notify();
  refresher.join();
  registration.reset();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  exposer.Stop();
  return refused.load() ? 1 : 0;
}

}  // namespace tandem::worker
