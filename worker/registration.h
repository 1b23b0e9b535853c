// RegistrationClient: keeps a worker registered with the router's Registry.
//
//   thread: Register(request + current load) ──ok──> every heartbeat_interval:
//             Heartbeat(load) ──known=false──> Register again
//           any RPC error → retry after the interval (every RPC has a deadline)
//           Register refused with FAILED_PRECONDITION (a configuration the
//           router will never accept: other weights, another TP size) →
//           on_refused(status), the thread ends (the worker exits loudly)
//           health() checked before every RPC: once it fails the thread ends
//           (no more heartbeats, never registers again: a router that dropped
//           the worker keeps it dropped)
//
// The load comes from a callback, called on the client's thread.
//
// Prefix-cache reports (cache-aware routing), when `prefix_events` is set
// (prefix caching on): the engine's events are drained every
// kPrefixReportInterval into a PrefixEventLog; pending events go at once in
// an early heartbeat (so the router sees a stored prefix within about
// kPrefixReportInterval + one RPC, not a heartbeat interval: 1 s by default),
// registration carries the full snapshot, and a heartbeat answered
// resync_prefix_index registers again (prefix_event_log.h).
#ifndef TANDEM_WORKER_REGISTRATION_H_
#define TANDEM_WORKER_REGISTRATION_H_

#include <grpcpp/security/credentials.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/cache/prefix_events.h"
#include "proto/worker.grpc.pb.h"
#include "worker/prefix_event_log.h"

namespace tandem::worker {

// Drains the engine's prefix events (EngineLoop::TakePrefixEvents).
using PrefixEventSource = std::function<std::vector<engine::PrefixEvent>()>;

// How often pending prefix events are looked for and sent.
inline constexpr absl::Duration kPrefixReportInterval = absl::Milliseconds(50);

class RegistrationClient {
 public:
  // Starts registering with `router_address` at once.
  RegistrationClient(std::string router_address, tandem::v1::RegisterRequest request,
                     std::function<tandem::v1::WorkerLoad()> load,
                     absl::Duration rpc_timeout = absl::Seconds(2),
                     std::function<void(const std::string&)> on_refused = nullptr,
                     std::function<absl::Status()> health = nullptr,
                     std::shared_ptr<grpc::ChannelCredentials> credentials =
                         grpc::InsecureChannelCredentials(),
                     PrefixEventSource prefix_events = nullptr);
  ~RegistrationClient();  // Stop()
  // Stops registering and heartbeating (bounded by one RPC deadline); the
  // router forgets the worker at its heartbeat timeout. Idempotent.
  void Stop();
  // Sends the next heartbeat (or registration) now instead of after the
  // interval: a change the router must see at once (draining).
  void Nudge();

  // Registered and the last heartbeat was acknowledged.
  bool registered() const;
  int64_t registrations() const;
  // Heartbeats sent (periodic and early).
  int64_t heartbeats() const;

 private:
  void Run();
  void DrainPrefixEvents();

  const tandem::v1::RegisterRequest request_;
  const std::function<tandem::v1::WorkerLoad()> load_;
  const absl::Duration rpc_timeout_;
  const std::function<void(const std::string&)> on_refused_;
  const std::function<absl::Status()> health_;
  const PrefixEventSource prefix_events_;
  std::unique_ptr<PrefixEventLog> prefix_log_;  // Run's thread only; null: none
  std::unique_ptr<tandem::v1::Registry::Stub> stub_;
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool nudged_ ABSL_GUARDED_BY(mu_) = false;
  bool registered_ ABSL_GUARDED_BY(mu_) = false;
  int64_t registrations_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t heartbeats_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_REGISTRATION_H_
