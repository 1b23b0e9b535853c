// Placement: one Generate request's prefill -> decode hand-off as data. No RPC
// types inside: events come in as absl::Status, actions go out ("reserve on W",
// "prefill on P", ...), and the RPC glue (handoff.cc) turns each action into a
// call and feeds its end back as the next event.
//
//   START ──colocate?──────────────────────────────────> COLOCATED ──> FINISHED
//     │  (uncached < colocate_below_tokens, min_tokens > 0,   Colocate(W):
//     │   no room after the prompt, no prefill worker)        prefill + decode
//     │  uncached = prompt - the deepest match among the      on one worker
//     │  decode workers' reported caches; W = that worker     (W with the match
//     │  when it has room                                      first)
//     v
//   RESERVING  Reserve(W), W = the decode worker with the most free cache
//     │  RESOURCE_EXHAUSTED / UNAVAILABLE ──> Reserve(next W); none left:
//     │    one was full (or skipped for lack of room) ──> QUEUED; else
//     │    FINISHED(UNAVAILABLE): a cluster that is down is not waited for
//     │  QUEUED  Queue: the glue waits in the AdmissionQueue (decode lane)
//     │    OnQueueEnd(OK) (capacity may have freed) ──> RESERVING (or
//     │      COLOCATED, whichever found no room) with every worker untried
//     │    OnQueueEnd(RESOURCE_EXHAUSTED: queue full or queue timeout,
//     │      DEADLINE_EXCEEDED) ──> FINISHED(it)
//     │  OK, no prefill worker left ──> RELEASING ──> COLOCATED (fallback)
//     v
//   Decode-side sharing (docs/prefix_caching.md, "Rolling upgrades"): the
//     Reserve carries the prompt's ids (share_held_prefix) only while a prefill
//     worker that registered writes_after_held_prefix is available; a
//     reservation that shares rows is prefilled only by such a worker (none
//     left: RELEASING(W) ──> RESERVING again, sharing nothing).
//   PREFILLING  Prefill(P) with W's target, P = the least-loaded prefill worker
//     │  UNAVAILABLE (P lost) ──> RELEASING(W) ──> RESERVING again, P excluded
//     │    (at most max_prefill_attempts; then Release(W), FINISHED(UNAVAILABLE))
//     │  other error ──> Release(W), FINISHED(that error)
//     v
//   DECODING  Decode(W) (first token from Prefill), the glue relays the stream
//     │  UNAVAILABLE ──> W removed, FINISHED(UNAVAILABLE naming W)
//     v
//   FINISHED(status)  exactly one Finish action; later events are ignored
//
//   A Reserve that ends CANCELLED or DEADLINE_EXCEEDED may have reserved
//     anyway: Release(W) (fire and forget), then FINISHED.
//   Cancel() in any state: CancelCall (the call in flight ends CANCELLED; its
//     end then Releases an unused reservation) → FINISHED(CANCELLED); in
//     RELEASING (no call to cancel) FINISHED(CANCELLED) at once; in QUEUED
//     Dequeue (frees its place) and FINISHED(CANCELLED) at once.
//   Deadline (injected clock): Prefill, Decode and Colocate carry the
//     request's; Reserve the earlier of it and now + rpc_timeout; Release
//     now + rpc_timeout (it frees, whatever the request's deadline). A call
//     about to start after the request's deadline → Release of an unused
//     reservation, FINISHED(DEADLINE_EXCEEDED).
//   FINISHED observes tandem_router_request_duration_seconds once (every outcome).
//
// While a request holds a reservation or runs a prefill, the worker is in the
// PlacementLedger (until its next load report covers it); when its decode (or
// colocated) stream ends OK the ledger credits the room it left until that
// worker's next report (PlacementLedger::Finished). Not thread-safe: the
// glue steps one Placement from one thread at a time.
#ifndef TANDEM_ROUTER_PLACEMENT_H_
#define TANDEM_ROUTER_PLACEMENT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "router/admission_queue.h"
#include "router/handoff_metrics.h"
#include "router/placement_ledger.h"
#include "router/prefix_routing.h"
#include "router/worker_registry.h"

namespace tandem::router {

// The router's --colocate_below_tokens default (router_main.cc, so `./tandem
// up` and the deployments get it): a prompt whose uncached part is shorter than
// this is prefilled on the decode worker, as Dynamo's max_local_prefill_length
// (1000). The hand-off moves a sequence's whole KDA state whatever the prompt's
// length (about 449 MB at TP 1 for K3), so below about 1000 new tokens the
// decode worker's own chunked prefill is cheaper (docs/prefix_caching.md,
// "Routing"). HandoffOptions keeps 0 (always disaggregated) for library users.
inline constexpr int32_t kDefaultColocateBelowTokens = 1000;

struct HandoffOptions {
  // How the prefill worker is chosen (prefix_routing.h); the router's
  // --routing_policy defaults to cache_aware.
  RoutingPolicy routing_policy = RoutingPolicy::kLeastLoad;
  CacheAwareOptions cache_aware;
  // Prompts whose uncached part (the prompt less what the decode worker
  // holding most of it reported: prefix_routing.h) is shorter than this
  // prefill on that decode worker (DecodeWorker.Generate); 0: never for the
  // length. The router's --colocate_below_tokens (its default:
  // kDefaultColocateBelowTokens).
  int32_t colocate_below_tokens = 0;
  // Prefill attempts per request (the first plus retries on other workers).
  int max_prefill_attempts = 3;
  // Reserve / Release deadline.
  absl::Duration rpc_timeout = absl::Seconds(5);
  // Lease asked of the decode worker, at least (ReservationLeaseMs: a request
  // whose deadline is later asks for the time until it, so a long prefill does
  // not outlive its reservation).
  int32_t lease_ms = 30000;
  // Ask for state checksums (prefill computes, decode verifies).
  bool checksums = true;
  // The model's context (prompt + 1 must fit for the disaggregated path).
  int64_t max_context_tokens = 0;
  // Where requests wait for a decode worker with room (and for the router's
  // in-flight limit): --max_queued_requests, --queue_timeout_s.
  AdmissionQueueOptions queue;
};

// What Placement needs of the request.
struct PlacementRequest {
  std::string request_id;
  int32_t prompt_tokens = 0;
  int32_t min_tokens = 0;  // > 0: colocated (the decode worker enforces it)
  absl::Time deadline = absl::InfiniteFuture();
  absl::Time started;  // arrival, for the request's latency
  // RouterBlockHashes of the prompt (prefix_routing.h), for cache-aware routing
  // and the uncached length.
  std::vector<uint64_t> prefix_hashes;
  // The prompt has images: always disaggregated (the prefill worker runs the
  // vision tower; the decode worker gets the state and never needs them). A
  // decode-side hit only on a decode worker that registered
  // reserves_with_images.
  bool has_images = false;
};

// Shared by every request's Placement; not owned, must outlive it.
struct PlacementDeps {
  WorkerRegistry* registry;  // picks workers; lost ones are removed from it
  PlacementLedger* ledger;
  HandoffMetrics* metrics;
  Clock* clock;
  // The prefill choice by --routing_policy (prefix_routing.h); null: least
  // load (SelectPrefill).
  PrefillRouter* prefill_router = nullptr;
};

// The lease a reservation asks for: until the request's deadline (its prefill
// may take that long: minutes for a 64k-token prompt on a CPU, hours for 1M),
// at least `min_lease_ms`, at most what a proto int32 holds. The lease only
// frees memory the router forgot (it died, or lost the worker's answer); every
// other end is an explicit Release.
int32_t ReservationLeaseMs(absl::Time request_deadline, absl::Time now,
                           int32_t min_lease_ms);

class Placement {
 public:
  enum class State {
    kStart,
    kReserving,
    kPrefilling,
    kReleasing,  // waiting for a Release before reserving again or colocating
    kDecoding,
    kColocated,
    kQueued,  // waiting in the AdmissionQueue for a decode worker with room
    kFinished,
  };

  struct Action {
    enum class Kind {
      kReserve,     // DecodeWorker.Reserve on `worker`; then OnReserved
      kPrefill,     // PrefillWorker.Prefill on `worker` (the target from Reserve)
      kRelease,     // DecodeWorker.Release on `worker`; OnReleased if `await`
      kDecode,      // DecodeWorker.Decode on `worker`; relay; then OnStreamDone
      kColocate,    // DecodeWorker.Generate on `worker`; relay; then OnStreamDone
      kCancelCall,  // cancel the call in flight (its end still comes as an event)
      kQueue,       // wait for capacity until `deadline`; then OnQueueEnd
      kDequeue,     // leave the queue (no OnQueueEnd follows)
      kFinish,      // close the request with `status`
    };
    Kind kind;
    WorkerRecord worker;  // the worker called (not for kCancelCall, kFinish)
    absl::Time deadline;  // of that call
    bool await = false;   // kRelease: the next step waits for its end
    // kReserve: the decode worker may share the prompt's cached blocks
    // (ReserveRequest.share_held_prefix, with the prompt's ids): a prefill
    // worker that registered writes_after_held_prefix is available, and only
    // such a worker is chosen for a reservation that shares (Prefill).
    bool share_held_prefix = false;
    // kReserve: the prompt has images and the decode worker registered
    // reserves_with_images: the Reserve carries their spans and hashes
    // (ReserveRequest.images, without the bytes).
    bool send_images = false;
    absl::Status status;  // kFinish
  };
  using Actions = std::vector<Action>;

  Placement(PlacementDeps deps, const HandoffOptions& options,
            PlacementRequest request);

  // Events. Each returns the actions to run now, in order.
  Actions Start();
  Actions Cancel();  // the client went away
  // `held_tokens`: the reservation's KvTarget.cached_prefix_tokens (rows the
  // decode worker shares, which the prefill worker must not write).
  Actions OnReserved(const absl::Status& status, int64_t held_tokens = 0);
  Actions OnPrefilled(const absl::Status& status);
  Actions OnReleased(const absl::Status& status);    // an awaited Release ended
  Actions OnStreamDone(const absl::Status& status);  // Decode or Colocate ended
  // The wait of kQueue ended: OK when capacity may have freed, else why not.
  Actions OnQueueEnd(const absl::Status& status);

  State state() const { return state_; }
  bool cancelled() const { return cancelled_; }
  int prefill_attempts() const { return prefill_attempts_; }
  // The decode / prefill worker of the latest call to one.
  const WorkerRecord& decode_worker() const { return decode_; }
  const WorkerRecord& prefill_worker() const { return prefill_; }
  const PlacementRequest& request() const { return request_; }

 private:
  // What follows an awaited Release.
  enum class AfterRelease { kReserve, kColocate };

  bool Expired() const;
  Actions Reserve();
  // Whether `decode` may share cached blocks of this prompt: always for text,
  // for a prompt with images only when it registered reserves_with_images.
  bool MayShareWith(const WorkerRecord& decode) const;
  Actions Prefill();
  Actions Colocate();
  Actions Decode();
  // No decode worker took the request: QUEUED (`then` again once woken) when
  // one is full, else FINISHED(UNAVAILABLE).
  Actions NoDecodeWorker(AfterRelease then);
  // Release of the reservation on decode_ (fire and forget), then Finish.
  Actions ReleaseAndFinish(absl::Status status);
  // Release of the reservation on decode_, then `next` once it has ended.
  Actions ReleaseThen(AfterRelease next);
  Action ReleaseAction(bool await);
  Actions Finish(absl::Status status);
  Actions Expire(bool holds_reservation);
  Action Call(Action::Kind kind, const WorkerRecord& worker, absl::Time deadline);

  const PlacementDeps deps_;
  const HandoffOptions options_;
  const PlacementRequest request_;

  State state_ = State::kStart;
  bool cancelled_ = false;
  bool decode_full_ = false;  // a decode worker refused with RESOURCE_EXHAUSTED
  int prefill_attempts_ = 0;
  AfterRelease after_release_ = AfterRelease::kReserve;
  AfterRelease after_queue_ = AfterRelease::kReserve;
  absl::flat_hash_set<std::string> tried_decode_, tried_prefill_;
  WorkerRecord decode_, prefill_;
  // The decode worker whose reported cache left the prompt's uncached part
  // below colocate_below_tokens (Start); Colocate tries it first.
  std::string preferred_decode_;
  // The reservation's shared rows (OnReserved): only a prefill worker that
  // writes after them may prefill it.
  int64_t held_tokens_ = 0;
  // No such worker was left for a sharing reservation: reserve again without
  // sharing.
  bool no_sharing_ = false;
};

const char* PlacementStateName(Placement::State state);

}  // namespace tandem::router

#endif  // TANDEM_ROUTER_PLACEMENT_H_
