#include "gateway/router_session.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"

namespace tandem::gateway {

// What the pool, its sessions and their calls share; outlives the pool while
// any of them is alive.
struct SessionPoolCore {
  absl::Mutex mu;
  std::vector<std::shared_ptr<RouterSession>> sessions ABSL_GUARDED_BY(mu);
  size_t next_session ABSL_GUARDED_BY(mu) = 0;
  uint64_t next_stream_id ABSL_GUARDED_BY(mu) = 1;
  // Calls aborted (cancelled, past their deadline) whose on_done the reaper
  // runs; a call may be aborted from inside its own on_response.
  std::vector<std::shared_ptr<SessionCall>> to_finish ABSL_GUARDED_BY(mu);
  bool stopping ABSL_GUARDED_BY(mu) = false;
  bool pool_gone ABSL_GUARDED_BY(mu) = false;  // ~SessionPool is done with `ended`
  int live_sessions ABSL_GUARDED_BY(mu) = 0;   // started, OnDone not yet run
  // Sessions whose OnDone ran, handed over by OnDone so that they (their
  // ClientContext, its call and its grpc::Channel reference, maybe the last)
  // are destroyed off gRPC's threads: by the reaper, or by ~SessionPool after
  // the sessions ended. Destroyed at the end of their own OnDone instead, a
  // session could outlive ~SessionPool (live_sessions is 0 by then) and drop
  // the channel on a gRPC thread after the RouterClient, the server, even
  // grpc_shutdown were gone (ref_counted.h "prior > 0" in
  // grpc_cq_internal_unref).
  std::vector<std::shared_ptr<RouterSession>> ended ABSL_GUARDED_BY(mu);
  // Counts the sessions alive (a session that a caller's call keeps past the
  // pool included), for the channel's owner.
  rpc::ChannelUsers users;
  std::atomic<int64_t> sessions_opened{0};
  std::atomic<int64_t> messages_received{0};
  std::atomic<int64_t> events_received{0};
  // The same, exported (null without a registry).
  metrics::Counter* opened_counter = nullptr;
  metrics::Counter* messages_counter = nullptr;
  metrics::Counter* events_counter = nullptr;

  // Defined after SessionCall.
  void ScheduleFinish(std::shared_ptr<SessionCall> call);
};

// One request on a session.
class SessionCall final : public GenerateCall,
                          public std::enable_shared_from_this<SessionCall> {
 public:
  SessionCall(std::shared_ptr<SessionPoolCore> core, uint64_t id, absl::Time deadline,
              RouterClient::StreamCallbacks callbacks)
      : core_(std::move(core)),
        id_(id),
        deadline_(deadline),
        callbacks_(std::move(callbacks)) {}

  uint64_t id() const { return id_; }
  absl::Time deadline() const { return deadline_; }
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }
  // When Abort ran (InfiniteFuture before).
  absl::Time aborted_at() const {
    const int64_t ns = aborted_at_ns_.load(std::memory_order_acquire);
    return ns == 0 ? absl::InfiniteFuture() : absl::FromUnixNanos(ns);
  }
  void set_session(std::shared_ptr<RouterSession> session) {
    session_ = std::move(session);
  }

  void Cancel() override {
    Abort(grpc::Status(grpc::StatusCode::CANCELLED, "the gateway cancelled the call"));
  }

  // Tells the router (when the call is on a session) and schedules on_done
  // with `status` on the reaper thread; idempotent.
  void Abort(const grpc::Status& status);

  // A router event for this call (gRPC thread).
  void Deliver(const tandem::v1::SessionEvent& event) {
    absl::MutexLock l(&cb_mu_);
    if (done_) return;
    if (aborted()) {
      // Its output was cut where it was aborted: whatever the router ends it
      // with, it ends with the abort's status (never OK with tokens missing).
      if (event.has_end()) FinishLocked(AbortStatus());
      return;
    }
    if (event.has_end()) {
      FinishLocked(grpc::Status(static_cast<grpc::StatusCode>(event.end().code()),
                                event.end().message()));
      return;
    }
    callbacks_.on_response(event.response());
  }

  // Ends the call with `status` unless it has ended.
  void Finish(const grpc::Status& status) {
    absl::MutexLock l(&cb_mu_);
    FinishLocked(status);
  }
  void FinishAborted() { Finish(AbortStatus()); }
  bool on_session() const { return session_ != nullptr; }

 private:
  grpc::Status AbortStatus() {
    absl::MutexLock l(&abort_mu_);
    return abort_status_;
  }

  void FinishLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(cb_mu_) {
    if (done_) return;
    done_ = true;
    auto on_done = std::move(callbacks_.on_done);
    callbacks_ = {};  // drops what the callbacks captured
    on_done(status);
  }

  const std::shared_ptr<SessionPoolCore> core_;
  const uint64_t id_;
  const absl::Time deadline_;
  std::shared_ptr<RouterSession> session_;  // set before the call is shared
  std::atomic<bool> aborted_{false};
  std::atomic<int64_t> aborted_at_ns_{0};
  absl::Mutex abort_mu_;
  grpc::Status abort_status_ ABSL_GUARDED_BY(abort_mu_);
  absl::Mutex cb_mu_;  // held while a callback runs: they never overlap
  bool done_ ABSL_GUARDED_BY(cb_mu_) = false;
  RouterClient::StreamCallbacks callbacks_ ABSL_GUARDED_BY(cb_mu_);
};

// One GenerateSession call (a ClientBidiReactor). Owns itself from Start
// until OnDone; the pool and the calls on it hold references too.
class RouterSession final : public grpc::ClientBidiReactor<tandem::v1::SessionRequest,
                                                           tandem::v1::SessionResponse>,
                            public std::enable_shared_from_this<RouterSession> {
 public:
  explicit RouterSession(std::shared_ptr<SessionPoolCore> core)
      : use_(core->users.Enter()), core_(std::move(core)) {}

  // Binds and starts the call; what was submitted before goes out now.
  void Start(tandem::v1::Router::Stub* stub) {
    self_ = shared_from_this();
    stub->async()->GenerateSession(&context_, this);
    // Writes start from outside reactions (Submit, SendCancel on any thread):
    // the hold keeps the call (and OnDone) back until the read side has
    // failed and no write can start any more (OnReadDone(false)).
    AddHold();
    StartRead(&response_);
    StartCall();
    absl::MutexLock l(&mu_);
    started_ = true;
    PumpLocked();
  }

  bool dead() {
    absl::MutexLock l(&mu_);
    return dead_;
  }

  // Queues the start of `call`; false when the session has ended.
  bool Submit(const std::shared_ptr<SessionCall>& call,
              tandem::v1::GenerateRequest request) {
    absl::MutexLock l(&mu_);
    if (dead_) return false;
    call->set_session(shared_from_this());
    calls_.emplace(call->id(), call);
    const size_t bytes = request.ByteSizeLong();
    tandem::v1::SessionRequest* m = BatchLocked(bytes);
    tandem::v1::SessionStart* start = m->add_starts();
    start->set_stream_id(call->id());
    *start->mutable_request() = std::move(request);
    PumpLocked();
    return true;
  }

  void SendCancel(uint64_t id) {
    absl::MutexLock l(&mu_);
    if (dead_ || !calls_.contains(id)) return;
    BatchLocked(10)->add_cancels(id);
    PumpLocked();
  }

  // Aborts the calls past their deadline; forgets aborted calls whose end
  // never came (a router that lost them).
  void Sweep(absl::Time now) {
    std::vector<std::shared_ptr<SessionCall>> expired;
    {
      absl::MutexLock l(&mu_);
      for (auto it = calls_.begin(); it != calls_.end();) {
        SessionCall& c = *it->second;
        if (c.aborted() && now - c.aborted_at() > absl::Seconds(30)) {
          calls_.erase(it++);
          continue;
        }
        if (!c.aborted() && c.deadline() <= now) expired.push_back(it->second);
        ++it;
      }
    }
    for (auto& c : expired) {
      c->Abort(
          grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                       "the request's deadline passed before the router ended it"));
    }
  }

  void Shutdown() { context_.TryCancel(); }

  void OnWriteDone(bool ok) override {
    absl::MutexLock l(&mu_);
    write_in_flight_ = false;
    writing_.Clear();
    if (ok) PumpLocked();  // else the call is broken: OnDone follows
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the call is ending: no new write may start, then OnDone
      {
        absl::MutexLock l(&mu_);
        dead_ = true;
      }
      RemoveHold();
      return;
    }
    core_->messages_received.fetch_add(1, std::memory_order_relaxed);
    core_->events_received.fetch_add(response_.events_size(),
                                     std::memory_order_relaxed);
    if (core_->messages_counter != nullptr) {
      core_->messages_counter->Increment();
      core_->events_counter->Increment(static_cast<double>(response_.events_size()));
    }
    {
      absl::MutexLock l(&mu_);
      for (const tandem::v1::SessionEvent& e : response_.events()) {
        auto it = calls_.find(e.stream_id());
        if (it == calls_.end()) continue;  // aborted and forgotten, or unknown
        deliver_.emplace_back(it->second, &e);
        if (e.has_end()) calls_.erase(it);
      }
    }
    for (auto& [call, event] : deliver_) call->Deliver(*event);
    deliver_.clear();
    response_.Clear();
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override {
    absl::flat_hash_map<uint64_t, std::shared_ptr<SessionCall>> calls;
    {
      absl::MutexLock l(&mu_);
      dead_ = true;
      calls.swap(calls_);
      outbox_.clear();
    }
    const grpc::Status lost(
        grpc::StatusCode::UNAVAILABLE,
        absl::StrCat("the gateway's session with the router ended (",
                     status.error_code(), ": ", status.error_message(), ")"));
    bool stopping;
    {
      absl::MutexLock l(&core_->mu);
      stopping = core_->stopping;
    }
    if (!stopping) {
      TLOG(WARNING, "the gateway's session with the router ended")
          .Kv("status", static_cast<int>(status.error_code()))
          .Kv("message", status.error_message())
          .Kv("calls_failed", calls.size());
    }
    for (auto& [id, call] : calls) call->Finish(lost);
    calls.clear();
    // Last: the core may let ~SessionPool return and the reaper destroy this
    // session as soon as the lock is released (`core` keeps the mutex alive).
    const std::shared_ptr<SessionPoolCore> core = core_;
    std::shared_ptr<RouterSession> self;
    absl::MutexLock l(&core->mu);
    --core->live_sessions;
    if (!core->pool_gone) {
      core->ended.push_back(std::move(self_));
      return;
    }
    // Ended after ~SessionPool gave up waiting: nobody would empty `ended`.
    // Dropped here, on this gRPC thread, which is safe while the channel's
    // owner still holds the channel: it waits for this session (its Use).
    self = std::move(self_);
    // `self` goes after the lock (declared before it).
  }

 private:
  // The queued message a `bytes`-sized item goes into: the last one unless
  // that would pass kMaxBatchBytes (long prompts must not add up past the
  // router's message limit).
  tandem::v1::SessionRequest* BatchLocked(size_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    constexpr size_t kMaxBatchBytes = 1 << 20;
    if (outbox_.empty() || outbox_bytes_ + bytes > kMaxBatchBytes) {
      outbox_.emplace_back();
      outbox_bytes_ = 0;
    }
    outbox_bytes_ += bytes;
    return &outbox_.back();
  }

  void PumpLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!started_ || dead_ || write_in_flight_ || outbox_.empty()) return;
    writing_ = std::move(outbox_.front());
    outbox_.pop_front();
    if (outbox_.empty()) outbox_bytes_ = 0;
    write_in_flight_ = true;
    StartWrite(&writing_);
  }

  // First: destroyed after context_ (its channel reference).
  rpc::ChannelUsers::Use use_;
  const std::shared_ptr<SessionPoolCore> core_;
  grpc::ClientContext context_;
  std::shared_ptr<RouterSession> self_;   // until OnDone
  tandem::v1::SessionResponse response_;  // the read in flight
  // OnReadDone's scratch (one read at a time).
  std::vector<std::pair<std::shared_ptr<SessionCall>, const tandem::v1::SessionEvent*>>
      deliver_;
  absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<SessionCall>> calls_
      ABSL_GUARDED_BY(mu_);
  std::deque<tandem::v1::SessionRequest> outbox_ ABSL_GUARDED_BY(mu_);
  size_t outbox_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // of outbox_.back()
  tandem::v1::SessionRequest writing_ ABSL_GUARDED_BY(mu_);
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  bool dead_ ABSL_GUARDED_BY(mu_) = false;
};

void SessionPoolCore::ScheduleFinish(std::shared_ptr<SessionCall> call) {
  {
    absl::MutexLock l(&mu);
    if (!stopping) {
      to_finish.push_back(std::move(call));
      return;
    }
  }
  // Stopping (no reaper any more): the sessions are being cancelled and their
  // OnDone ends every call on them; a call on none ends here. (Such a call is
  // aborted only by Generate, never from inside its own callbacks.)
  if (!call->on_session()) call->FinishAborted();
}

void SessionCall::Abort(const grpc::Status& status) {
  {
    absl::MutexLock l(&abort_mu_);
    if (aborted_.load(std::memory_order_relaxed)) return;
    abort_status_ = status;
    aborted_at_ns_.store(absl::ToUnixNanos(absl::Now()), std::memory_order_release);
    aborted_.store(true, std::memory_order_release);
  }
  if (session_ != nullptr) session_->SendCancel(id_);
  core_->ScheduleFinish(shared_from_this());
}

namespace {

metrics::Counter* SessionCounter(metrics::Registry* registry, const char* name,
                                 const char* help) {
  if (registry == nullptr) return nullptr;
  absl::StatusOr<metrics::Family<metrics::Counter>*> family =
      registry->AddCounter(name, help);
  // A second pool on the same registry shares the family.
  return family.ok() ? &(*family)->Add({}) : nullptr;
}

}  // namespace

SessionPool::SessionPool(tandem::v1::Router::Stub* stub, int sessions,
                         metrics::Registry* registry, rpc::ChannelUsers users)
    : stub_(stub), core_(std::make_shared<SessionPoolCore>()) {
  core_->users = std::move(users);
  core_->opened_counter =
      SessionCounter(registry, "tandem_gateway_router_sessions_opened_total",
                     "GenerateSession streams opened to the router (more than "
                     "--router_sessions: sessions were lost and replaced).");
  core_->messages_counter =
      SessionCounter(registry, "tandem_gateway_router_session_messages_total",
                     "Messages received on the router sessions.");
  core_->events_counter =
      SessionCounter(registry, "tandem_gateway_router_session_events_total",
                     "Events in them (request messages and ends); events / messages "
                     "is the batching factor.");
  if (core_->messages_counter == nullptr || core_->events_counter == nullptr) {
    core_->messages_counter = core_->events_counter = nullptr;
  }
  {
    absl::MutexLock l(&core_->mu);
    core_->sessions.resize(std::max(1, sessions));
  }
  reaper_ = std::thread([this] { ReaperLoop(); });
}

SessionPool::~SessionPool() {
  std::vector<std::shared_ptr<RouterSession>> sessions;
  {
    absl::MutexLock l(&core_->mu);
    core_->stopping = true;
    sessions = core_->sessions;
  }
  reaper_.join();
  for (auto& s : sessions) {
    if (s != nullptr) s->Shutdown();
  }
  sessions.clear();
  std::vector<std::shared_ptr<RouterSession>> ended;
  {
    absl::MutexLock l(&core_->mu);
    auto all_done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu) {
      return core_->live_sessions == 0;
    };
    core_->mu.AwaitWithTimeout(absl::Condition(&all_done), absl::Seconds(5));
    sessions.swap(core_->sessions);  // they hold the core: break the cycle
    ended.swap(core_->ended);
    core_->pool_gone = true;
  }
  // The sessions are destroyed here, on this thread, before the stub and the
  // channel they were made from (see SessionPoolCore::ended).
  sessions.clear();
  ended.clear();
}

std::shared_ptr<GenerateCall> SessionPool::Generate(
    tandem::v1::GenerateRequest request, absl::Time deadline,
    RouterClient::StreamCallbacks callbacks) {
  std::shared_ptr<SessionCall> call;
  std::shared_ptr<RouterSession> session;
  bool start = false;
  {
    // One critical section with the destructor's: a session made here is
    // one the destructor shuts down.
    absl::MutexLock l(&core_->mu);
    call = std::make_shared<SessionCall>(core_, core_->next_stream_id++, deadline,
                                         std::move(callbacks));
    if (!core_->stopping) {
      // Round robin over the slots; a slot whose session ended gets a new one.
      std::shared_ptr<RouterSession>& slot =
          core_->sessions[core_->next_session++ % core_->sessions.size()];
      if (slot == nullptr || slot->dead()) {
        slot = std::make_shared<RouterSession>(core_);
        ++core_->live_sessions;
        core_->sessions_opened.fetch_add(1, std::memory_order_relaxed);
        if (core_->opened_counter != nullptr) core_->opened_counter->Increment();
        start = true;
      }
      session = slot;
    }
  }
  if (session == nullptr) {  // stopping, and no reaper any more: end it here
    call->Finish(
        grpc::Status(grpc::StatusCode::UNAVAILABLE, "the gateway is stopping"));
    return call;
  }
  if (start) session->Start(stub_);
  if (!session->Submit(call, std::move(request))) {
    // The session ended between the pick and the submit.
    call->Abort(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                             "the gateway's session with the router ended"));
  }
  return call;
}

SessionPool::Stats SessionPool::stats() const {
  return {.sessions_opened = core_->sessions_opened.load(),
          .messages_received = core_->messages_received.load(),
          .events_received = core_->events_received.load()};
}

void SessionPool::ReaperLoop() {
  constexpr absl::Duration kSweepEvery = absl::Milliseconds(50);
  absl::Time next_sweep = absl::Now() + kSweepEvery;
  for (;;) {
    std::vector<std::shared_ptr<SessionCall>> finish;
    std::vector<std::shared_ptr<RouterSession>> sweep;
    std::vector<std::shared_ptr<RouterSession>> ended;
    {
      absl::MutexLock l(&core_->mu);
      auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu) {
        return core_->stopping || !core_->to_finish.empty();
      };
      core_->mu.AwaitWithDeadline(absl::Condition(&wake), next_sweep);
      if (core_->stopping) break;
      finish.swap(core_->to_finish);
      ended.swap(core_->ended);
      if (absl::Now() >= next_sweep) {
        for (auto& s : core_->sessions) {
          if (s != nullptr) sweep.push_back(s);
        }
      }
    }
    for (auto& call : finish) call->FinishAborted();
    ended.clear();  // sessions whose OnDone ran: destroyed here, not on gRPC's threads
    if (!sweep.empty()) {
      const absl::Time now = absl::Now();
      for (auto& s : sweep) s->Sweep(now);
      next_sweep = now + kSweepEvery;
    }
  }
  // Stopping: what was scheduled still ends (the sessions' OnDone ends the
  // rest).
  std::vector<std::shared_ptr<SessionCall>> finish;
  {
    absl::MutexLock l(&core_->mu);
    finish.swap(core_->to_finish);
  }
  for (auto& call : finish) call->FinishAborted();
}

}  // namespace tandem::gateway
