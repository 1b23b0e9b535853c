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
  std::unique_ptr<RegistrationClient> registration;
  if (!options.router.empty()) {
    tandem::v1::RegisterRequest req = options.registration;
    req.set_grpc_address(host + ":" + std::to_string(port));
    req.set_metrics_address(host + ":" + std::to_string(exposer.port()));
    registration = std::make_unique<RegistrationClient>(
        options.router, req, load, absl::Seconds(2),
        [&refused](const std::string& why) {
          refused.store(true);
          TLOG(ERROR, "registration refused by the router; exiting").Kv("status", why);
          kill(getpid(), SIGTERM);  // WaitForTerminationSignal below returns
        },
        options.health, options.router_credentials);
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
  TLOG(INFO, "shutting down").Kv("signal", sig);
  stop.Notify();
  refresher.join();
  registration.reset();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  exposer.Stop();
  return refused.load() ? 1 : 0;
}

}  // namespace tandem::worker
