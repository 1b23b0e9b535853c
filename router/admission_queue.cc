#include "router/admission_queue.h"

#include <deque>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "metrics/buckets.h"

namespace tandem::router {

using metrics::OrDie;

AdmissionQueueMetrics::AdmissionQueueMetrics(metrics::Registry* r)
    : depth(&OrDie(r->AddGauge("tandem_router_queue_depth",
                               "Generate requests waiting in the router's admission "
                               "queue for capacity."))
                 ->Add({})),
      wait_seconds(
          &OrDie(r->AddHistogram("tandem_router_queue_seconds",
                                 "Time a request waited in the admission queue (each "
                                 "wait, every outcome).",
                                 *metrics::ExponentialBuckets(0.001, 2, 20)))
               ->Add({})),
      rejections(OrDie(r->AddCounter(
          "tandem_router_rejections_total",
          "Requests refused RESOURCE_EXHAUSTED by the admission queue, by reason "
          "(queue_full, queue_timeout)."))) {
  for (const char* reason : {"queue_full", "queue_timeout"}) {
    rejections->Add({{"reason", reason}});
  }
}

AdmissionQueue::AdmissionQueue(Clock* clock, AdmissionQueueMetrics* metrics,
                               AdmissionQueueOptions options)
    : clock_(clock), metrics_(metrics), options_(options) {}

absl::StatusOr<uint64_t> AdmissionQueue::Push(Lane lane, int32_t priority,
                                              absl::Time deadline, QueuePlace* place,
                                              OnEnd on_end) {
  absl::MutexLock l(&mu_);
  const absl::Time now = clock_->Now();
  if (place->seq != 0 && now >= place->expires) {
    if (now >= deadline) {
      return absl::DeadlineExceededError("the request's deadline passed in the queue");
    }
    metrics_->rejections->Add({{"reason", "queue_timeout"}}).Increment();
    return absl::ResourceExhaustedError(
        absl::StrCat("no capacity freed within the queue timeout (",
                     absl::FormatDuration(options_.queue_timeout), "); retry later"));
  }
  // The cap is for arrivals: a request back in line after a wake (place->seq set)
  // keeps its place even if a newcomer took the room it left.
  if (place->seq == 0 &&
      static_cast<int64_t>(tickets_.size()) >= options_.max_queued_requests) {
    metrics_->rejections->Add({{"reason", "queue_full"}}).Increment();
    return absl::ResourceExhaustedError(
        absl::StrCat("the router's queue is full (", options_.max_queued_requests,
                     " requests waiting, --max_queued_requests); retry later"));
  }
  if (place->seq == 0) {
    place->seq = next_seq_++;
    place->first_queued = now;
    place->expires = std::min(deadline, now + options_.queue_timeout);
  }
  const Key key{priority, place->seq};
  lanes_[static_cast<int>(lane)][key] = Entry{.on_end = std::move(on_end),
                                              .deadline = deadline,
                                              .expires = place->expires,
                                              .queued = now};
  tickets_[place->seq] = {lane, key};
  SetDepthLocked();
  return place->seq;
}

AdmissionQueue::Entry AdmissionQueue::TakeLocked(Lane lane, const Key& key) {
  auto& entries = lanes_[static_cast<int>(lane)];
  // Before the erase: `key` may be the entry's own (a caller's iterator).
  const uint64_t seq = std::get<1>(key);
  auto it = entries.find(key);
  Entry e = std::move(it->second);
  entries.erase(it);
  tickets_.erase(seq);
  metrics_->wait_seconds->Observe(absl::ToDoubleSeconds(clock_->Now() - e.queued));
  SetDepthLocked();
  return e;
}

void AdmissionQueue::SetDepthLocked() {
  metrics_->depth->Set(static_cast<double>(tickets_.size()));
}

int AdmissionQueue::Wake(Lane lane, int n) {
  // A woken request may finish on this very stack (no worker alive, say) and
  // wake the next from its on_end: such nested wakes are queued for the
  // outermost call on this thread, which runs them in a loop, so a deep queue
  // drains iteratively instead of recursing once per waiter.
  struct Nested {
    AdmissionQueue* queue;
    Lane lane;
    int n;
  };
  thread_local bool waking = false;
  thread_local std::deque<Nested> nested;
  if (waking) {
    nested.push_back({this, lane, n});
    return 0;
  }
  waking = true;
  const int woken = WakeNow(lane, n);
  while (!nested.empty()) {
    const Nested next = nested.front();
    nested.pop_front();
    next.queue->WakeNow(next.lane, next.n);
  }
  waking = false;
  return woken;
}

int AdmissionQueue::WakeNow(Lane lane, int n) {
  std::vector<OnEnd> woken;
  {
    absl::MutexLock l(&mu_);
    auto& entries = lanes_[static_cast<int>(lane)];
    while (n-- > 0 && !entries.empty()) {
      woken.push_back(TakeLocked(lane, entries.begin()->first).on_end);
    }
  }
  for (OnEnd& f : woken) f(absl::OkStatus());
  return static_cast<int>(woken.size());
}

int AdmissionQueue::Expire() {
  std::vector<std::pair<OnEnd, absl::Status>> ended;
  {
    absl::MutexLock l(&mu_);
    const absl::Time now = clock_->Now();
    for (Lane lane : {Lane::kInFlight, Lane::kDecode}) {
      std::vector<Key> due;
      for (const auto& [key, e] : lanes_[static_cast<int>(lane)]) {
        if (now >= e.expires) due.push_back(key);
      }
      for (const Key& key : due) {
        Entry e = TakeLocked(lane, key);
        absl::Status s;
        if (now >= e.deadline) {
          s = absl::DeadlineExceededError(
              "the request's deadline passed while it waited in the router's queue");
        } else {
          metrics_->rejections->Add({{"reason", "queue_timeout"}}).Increment();
          s = absl::ResourceExhaustedError(
              absl::StrCat("no capacity freed within the queue timeout (",
                           absl::FormatDuration(options_.queue_timeout),
                           ", --queue_timeout_s); retry later"));
        }
        ended.emplace_back(std::move(e.on_end), std::move(s));
      }
    }
  }
  for (auto& [f, s] : ended) f(s);
  return static_cast<int>(ended.size());
}

bool AdmissionQueue::Remove(uint64_t ticket) {
  OnEnd dropped;  // destroyed outside the lock (it may own the request)
  absl::MutexLock l(&mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) return false;
  const auto [lane, key] = it->second;
  dropped = TakeLocked(lane, key).on_end;
  return true;
}

size_t AdmissionQueue::depth() {
  absl::MutexLock l(&mu_);
  return tickets_.size();
}

}  // namespace tandem::router
