#include "worker/worker_server.h"

#include <grpcpp/health_check_service_interface.h>

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
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
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
      .Kv("metrics_port", exposer.port());

  absl::Notification stop;
  std::thread refresher([&] {
    while (!stop.WaitForNotificationWithTimeout(options.refresh_period)) refresh();
  });
  std::unique_ptr<RegistrationClient> registration;
  if (!options.router.empty()) {
    tandem::v1::RegisterRequest req = options.registration;
    req.set_grpc_address(host + ":" + std::to_string(port));
    req.set_metrics_address(host + ":" + std::to_string(exposer.port()));
    registration = std::make_unique<RegistrationClient>(options.router, req, load);
  }

  int sig = WaitForTerminationSignal();
  TLOG(INFO, "shutting down").Kv("signal", sig);
  registration.reset();
  stop.Notify();
  refresher.join();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  exposer.Stop();
  return 0;
}

}  // namespace tandem::worker
