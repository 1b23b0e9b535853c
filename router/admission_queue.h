// AdmissionQueue: where a Generate request waits for capacity instead of being
// refused (vLLM and SGLang queue too). Pure logic, no RPC types, injected clock.
//
//   Push(lane, priority, deadline, place, on_end)
//     full (max_queued)             → RESOURCE_EXHAUSTED "queue_full" at once
//     else waits; order: lower priority first, then first come first served
//   Wake(lane, n)  capacity may have freed (a request finished, a load report
//                  with free slots): the first n of `lane` leave, on_end(OK)
//   Expire()       entries past their expiry leave: on_end(DEADLINE_EXCEEDED)
//                  when the request's own deadline passed, else
//                  on_end(RESOURCE_EXHAUSTED "queue_timeout")
//   Remove(ticket) a cancel: leaves at once, no on_end (the caller finishes it)
//
// Expiry = min(request deadline, first Push + timeout). A request that is woken,
// finds no room after all and is pushed again with the same QueuePlace keeps
// its place in line and its expiry. Lanes keep two kinds of waiter apart (the
// router's in-flight limit, a decode worker's room) so that a wake reaches one
// that the freed capacity can serve. on_end runs outside the queue's lock, on
// the thread that called Wake or Expire. Thread-safe.
#ifndef TANDEM_ROUTER_ADMISSION_QUEUE_H_
#define TANDEM_ROUTER_ADMISSION_QUEUE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <tuple>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "metrics/registry.h"

namespace tandem::router {

struct AdmissionQueueMetrics {
  // Registers the families on `registry` (not owned; must outlive this).
  explicit AdmissionQueueMetrics(metrics::Registry* registry);
  metrics::Gauge* depth;                          // requests waiting now
  metrics::Histogram* wait_seconds;               // each wait, every outcome
  metrics::Family<metrics::Counter>* rejections;  // queue_full | queue_timeout
};

struct AdmissionQueueOptions {
  int32_t max_queued_requests = 4096;  // 0: nothing waits (refused at once)
  absl::Duration queue_timeout = absl::Seconds(300);
};

// A request's place in line, kept by the caller across its waits.
struct QueuePlace {
  uint64_t seq = 0;  // 0: never queued
  absl::Time expires;
  absl::Time first_queued;
};

class AdmissionQueue {
 public:
  enum class Lane { kInFlight, kDecode };
  using OnEnd = std::function<void(const absl::Status&)>;

  // Not owned; must outlive the queue.
  AdmissionQueue(Clock* clock, AdmissionQueueMetrics* metrics,
                 AdmissionQueueOptions options);

  // Queues a request; returns its ticket, or RESOURCE_EXHAUSTED when the queue
  // is full (or the status on_end would get when `place` has already expired).
  // on_end is never called from inside Push.
  absl::StatusOr<uint64_t> Push(Lane lane, int32_t priority, absl::Time deadline,
                                QueuePlace* place, OnEnd on_end);
  // Wakes the first `n` waiters of `lane`; returns how many. Called again from
  // a woken waiter's on_end (on the same thread), the nested wake runs after the
  // outer one's, in a loop (no recursion) and returns 0.
  int Wake(Lane lane, int n);
  // Ends every waiter past its expiry; returns how many.
  int Expire();
  // Removes a waiter without calling its on_end; false if it already left.
  bool Remove(uint64_t ticket);

  size_t depth();
  const AdmissionQueueOptions& options() const { return options_; }

 private:
  // (priority, seq): lower priority first, then arrival.
  using Key = std::tuple<int32_t, uint64_t>;
  struct Entry {
    OnEnd on_end;
    absl::Time deadline;  // the request's
    absl::Time expires;
    absl::Time queued;  // this wait's start
  };

  // Wake's work: takes the first `n` of `lane` and runs their on_end.
  int WakeNow(Lane lane, int n);
  // Takes `key` out of `lane` (and its ticket), observing its wait.
  Entry TakeLocked(Lane lane, const Key& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SetDepthLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Clock* const clock_;                    // not owned
  AdmissionQueueMetrics* const metrics_;  // not owned
  const AdmissionQueueOptions options_;

  absl::Mutex mu_;
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<Key, Entry> lanes_[2] ABSL_GUARDED_BY(mu_);
  // ticket (= seq) → where it waits.
  absl::flat_hash_map<uint64_t, std::pair<Lane, Key>> tickets_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::router

#endif  // TANDEM_ROUTER_ADMISSION_QUEUE_H_
