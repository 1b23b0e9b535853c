// The process shell shared by prefill_main and decode_main: a gRPC server (the
// worker's service + grpc.health.v1), /metrics, registration and heartbeats with
// the router, a periodic refresh of the metrics, and a clean stop on SIGINT or
// SIGTERM (call BlockTerminationSignals() first thing in main).
//
//   start: listen (port 0: any) → /metrics → log "worker serving" → register
//   run:   every refresh_period: refresh() (gauges); heartbeats carry load()
//   stop:  signal → deregister thread stopped → server Shutdown (5 s grace)
#ifndef TANDEM_WORKER_WORKER_SERVER_H_
#define TANDEM_WORKER_WORKER_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "engine/cache/prefix_events.h"
#include "metrics/registry.h"
#include "proto/worker.pb.h"

namespace tandem::worker {

struct WorkerServerOptions {
  std::string host = "127.0.0.1";
  // Host the router should dial (default: host).
  std::string advertise_host;
  int port = 0;
  int metrics_port = 0;
  std::string router;  // empty: no registration
  tandem::v1::RegisterRequest
      registration;  // id, role, model, layout (addresses filled)
  absl::Duration refresh_period = absl::Milliseconds(500);
  // Polled every refresh_period when set: once it returns an error (e.g. a
  // tensor-parallel rank died) the worker stops taking work for good: the
  // health service answers NOT_SERVING, registration and heartbeats stop (the
  // router forgets the worker at its heartbeat timeout, or at once when an RPC
  // to it fails UNAVAILABLE). The process keeps running until signalled.
  std::function<absl::Status()> health;
  // Credentials of the gRPC server and of the channel to the router (mTLS from
  // --tls_*: common/tls/tls_flags.h); insecure by default.
  std::shared_ptr<grpc::ServerCredentials> server_credentials =
      grpc::InsecureServerCredentials();
  std::shared_ptr<grpc::ChannelCredentials> router_credentials =
      grpc::InsecureChannelCredentials();
  bool mtls = false;  // the credentials above are mTLS (logged)
  // Graceful termination (SIGTERM, as Kubernetes sends it): the worker reports
  // itself draining (the router places nothing new on it), answers NOT_SERVING,
  // and waits up to `drain_timeout` for its requests to finish (the load's
  // running, waiting and queued counts at zero, and `busy`, when set, at zero:
  // work the load does not show, e.g. a decode worker's reservations), then
  // shuts the server down. A second signal ends the wait at once.
  absl::Duration drain_timeout = absl::Seconds(60);
  std::function<int64_t()> busy;
  // Set when prefix caching is on: the engine's prefix events
  // (EngineLoop::TakePrefixEvents), reported to the router for cache-aware
  // routing (registration.h).
  std::function<std::vector<engine::PrefixEvent>()> prefix_events;
};

// Blocks until SIGINT/SIGTERM, drains (WorkerServerOptions::drain_timeout);
// returns the process exit code: 0, or 1 when the
// router refused the registration (FAILED_PRECONDITION: other weights, another
// TP size), which also ends the process at once.
int ServeWorker(const WorkerServerOptions& options, grpc::Service* service,
                metrics::Registry* registry,
                std::function<tandem::v1::WorkerLoad()> load,
                std::function<void()> refresh);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_WORKER_SERVER_H_
