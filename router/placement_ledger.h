// What the router has placed on each worker that the worker's load reports do
// not show yet. Pair selection adds it to the reported load (InFlightMap).
//
//   Place(worker, request, tokens)  records it with the worker's report count
//   Unplace(worker_id, request)     forgets it (idempotent)
//   Finished(worker, request, tokens, reports_at_start)  the request, started on
//                                   `worker` when it had sent reports_at_start
//                                   reports, ended (its stream ended OK):
//                                   forgets its placement and, when a report
//                                   since counted it, credits its slot and
//                                   tokens back until the next report (which no
//                                   longer has it)
//   Snapshot(live)                  the placements minus the credits of `live`
//                                   workers; those a newer report already
//                                   covers are dropped for good (counting them
//                                   too would count every running request twice)
//
// A placement made while a worker had sent N reports is in its load from report
// N + 1 on; so is a request's end. Without the credit the router would learn of
// the room a finished request left only at the worker's next heartbeat, and a
// request queued for that room would wait for it. Thread-safe.
#ifndef TANDEM_ROUTER_PLACEMENT_LEDGER_H_
#define TANDEM_ROUTER_PLACEMENT_LEDGER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "router/pair_selection.h"
#include "router/worker_registry.h"

namespace tandem::router {

class PlacementLedger {
 public:
  // Records request `request_id` (of `tokens` tokens) on `worker`.
  void Place(const WorkerRecord& worker, const std::string& request_id, int64_t tokens);
  // Forgets `request_id` on `worker_id`; nothing happens when it is not there.
  void Unplace(const std::string& worker_id, const std::string& request_id);
  // Request `request_id` (of `tokens` prompt tokens) ended on `worker` (a record
  // as of now: its report count); it started there when the worker had sent
  // `reports_at_start` reports (reserved or colocated then).
  void Finished(const WorkerRecord& worker, const std::string& request_id,
                int64_t tokens, uint64_t reports_at_start);
  // Placements minus credits on `live` workers not yet covered by their load
  // reports (requests and tokens may be negative: room the reports do not show).
  InFlightMap Snapshot(const std::vector<WorkerRecord>& live);

 private:
  struct Entry {
    std::string request_id;
    uint64_t reports_at_placement = 0;  // WorkerRecord::reports when placed
    int64_t tokens = 0;
    bool credit = false;  // a finished request's room, not a placement
  };
  absl::Mutex mu_;
  // By worker id.
  absl::flat_hash_map<std::string, std::vector<Entry>> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::router

#endif  // TANDEM_ROUTER_PLACEMENT_LEDGER_H_
