// The router's record of live workers: registration, heartbeats with load, expiry.
// Pure logic with an injected clock; the gRPC Registry service is a thin layer on it.
//
//   Register(worker) ──> record{role, addresses, layout, load, last_seen}
//   Heartbeat(id, load) ──> last_seen = now (unknown id → false: "register again")
//   Live(role) ──> records seen within the timeout (older ones are dropped)
#ifndef TANDEM_ROUTER_WORKER_REGISTRY_H_
#define TANDEM_ROUTER_WORKER_REGISTRY_H_

#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "proto/worker.pb.h"

namespace tandem::router {

struct WorkerRecord {
  tandem::v1::RegisterRequest registration;
  tandem::v1::WorkerLoad load;
  absl::Time registered_at;
  absl::Time last_seen;
  // Load reports received (registration + heartbeats). A placement the router made
  // while this was N is reflected in the load from report N + 1 on.
  uint64_t reports = 0;
};

class WorkerRegistry {
 public:
  // `clock` is not owned. Workers not heard from for `timeout` are dropped.
  WorkerRegistry(Clock* clock, absl::Duration timeout);

  // Validates and records a worker (replacing a record with the same id). Refuses a
  // worker whose model fingerprint differs from the already registered ones, so
  // prefill and decode workers with different weights are never paired, and
  // (FAILED_PRECONDITION naming both sizes) a worker whose TP size differs from
  // a live worker of the other role (the KV hand-off moves rank r to rank r).
  absl::Status Register(const tandem::v1::RegisterRequest& request);
  // Updates load and liveness; false when the id is unknown (expired or never seen).
  bool Heartbeat(const std::string& worker_id, const tandem::v1::WorkerLoad& load);
  // Removes a worker (e.g. after its RPCs fail); false when unknown.
  bool Remove(const std::string& worker_id);
  // Live workers of `role`, sorted by id; drops expired records first.
  std::vector<WorkerRecord> Live(tandem::v1::WorkerRole role);
  // The live workers of `role` that take new requests: Live() less the draining
  // ones (load.draining: a worker shutting down finishes its requests, gets none).
  std::vector<WorkerRecord> Available(tandem::v1::WorkerRole role);
  size_t size();

 private:
  void ExpireLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Clock* const clock_;  // not owned
  const absl::Duration timeout_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, WorkerRecord> workers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::router

#endif  // TANDEM_ROUTER_WORKER_REGISTRY_H_
