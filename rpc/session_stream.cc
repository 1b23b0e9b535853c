#include "rpc/session_stream.h"

#include <deque>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "rpc/response_stream.h"

namespace tandem::rpc {
namespace {

class SessionSink;

}  // namespace

struct SessionStream::Core {
  absl::Mutex mu;
  SessionStream* reactor ABSL_GUARDED_BY(mu);  // null after OnDone
  absl::flat_hash_map<uint64_t, std::shared_ptr<SessionSink>> live ABSL_GUARDED_BY(mu);
  tandem::v1::SessionResponse outbox ABSL_GUARDED_BY(mu);  // the open batch
  size_t outbox_bytes ABSL_GUARDED_BY(mu) = 0;             // about, of `outbox`
  // Batches closed at kMaxBatchBytes, waiting for their write (in order,
  // before `outbox`): no message grows past what a client may receive.
  std::deque<tandem::v1::SessionResponse> full ABSL_GUARDED_BY(mu);
  tandem::v1::SessionResponse writing ABSL_GUARDED_BY(mu);  // the write in flight
  uint64_t batch ABSL_GUARDED_BY(mu) = 0;                   // number of the open batch
  bool write_in_flight ABSL_GUARDED_BY(mu) = false;
  bool reads_done ABSL_GUARDED_BY(mu) = false;
  bool cancelled ABSL_GUARDED_BY(mu) = false;
  bool finished ABSL_GUARDED_BY(mu) = false;
  SessionStream::Stats stats ABSL_GUARDED_BY(mu);
  std::function<void(int64_t)> on_write ABSL_GUARDED_BY(mu);

  // Starts the next write or the Finish, as the state allows.
  void PumpLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Queues the end event of `id`.
  void EndLocked(uint64_t id, const grpc::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    tandem::v1::SessionEvent* e = AddEventLocked(64 + status.error_message().size());
    e->set_stream_id(id);
    e->mutable_end()->set_code(static_cast<int32_t>(status.error_code()));
    e->mutable_end()->set_message(status.error_message());
  }
  // A new event of about `bytes` in the open batch, closing it first when it
  // would pass kMaxBatchBytes.
  tandem::v1::SessionEvent* AddEventLocked(size_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    constexpr size_t kMaxBatchBytes = 1 << 20;  // gRPC's default limit is 4 MiB
    if (outbox.events_size() > 0 && outbox_bytes + bytes > kMaxBatchBytes) {
      full.push_back(std::move(outbox));
      outbox.Clear();
      outbox_bytes = 0;
      ++batch;  // what sinks remember of the old one is void
    }
    outbox_bytes += bytes;
    return outbox.add_events();
  }
  // Marks the session cancelled; returns the live requests' cancel hooks (to
  // run outside the lock).
  std::vector<std::function<void()>> CancelAllLocked()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
};

namespace {

// One request of a session. References: the session's (in Core::live, until
// its end is queued or the session is cancelled) and the producer's (self_,
// until Close).
class SessionSink final : public ResponseSink {
 public:
  SessionSink(std::shared_ptr<SessionStream::Core> core, uint64_t id)
      : core_(std::move(core)), id_(id) {}

  void Bind(std::shared_ptr<SessionSink> self) { self_ = std::move(self); }

  void SetOnCancel(std::function<void()> on_cancel) override {
    {
      absl::MutexLock l(&core_->mu);
      if (!cancelled_) {
        on_cancel_ = std::move(on_cancel);
        return;
      }
    }
    if (on_cancel) on_cancel();
  }

  void Push(tandem::v1::GenerateResponse message) override {
    SessionStream::Core& c = *core_;
    absl::MutexLock l(&c.mu);
    if (closed_ || cancelled_ || c.cancelled || c.finished) return;
    const size_t bytes = message.ByteSizeLong();  // once: it walks the message
    if (pending_batch_ == c.batch && pending_index_ >= 0 &&
        pending_index_ < c.outbox.events_size()) {
      tandem::v1::SessionEvent* e = c.outbox.mutable_events(pending_index_);
      if (e->stream_id() == id_ && e->has_response() &&
          CoalesceResponse(e->mutable_response(), &message)) {
        ++c.stats.coalesced;
        c.outbox_bytes += bytes;
        return;
      }
    }
    tandem::v1::SessionEvent* e = c.AddEventLocked(16 + bytes);
    e->set_stream_id(id_);
    *e->mutable_response() = std::move(message);
    pending_index_ = c.outbox.events_size() - 1;
    pending_batch_ = c.batch;
    c.PumpLocked();
  }

  void Close(const grpc::Status& status) override {
    std::shared_ptr<SessionSink> keep;  // released last, outside the lock
    {
      SessionStream::Core& c = *core_;
      absl::MutexLock l(&c.mu);
      if (closed_) return;
      closed_ = true;
      auto it = c.live.find(id_);
      if (it != c.live.end() && it->second.get() == this) {
        if (!c.cancelled && !c.finished) c.EndLocked(id_, status);
        c.live.erase(it);
      }
      c.PumpLocked();
      keep = std::move(self_);
    }
  }

  bool cancelled() const override {
    absl::MutexLock l(&core_->mu);
    return cancelled_ || core_->cancelled;
  }

  // Marks the request cancelled; returns its hook (run it outside the lock).
  std::function<void()> CancelLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_->mu) {
    if (cancelled_) return nullptr;
    cancelled_ = true;
    std::function<void()> hook = std::move(on_cancel_);
    on_cancel_ = nullptr;
    return hook;
  }

 private:
  const std::shared_ptr<SessionStream::Core> core_;
  const uint64_t id_;
  std::shared_ptr<SessionSink> self_;
  // Guarded by core_->mu.
  std::function<void()> on_cancel_;
  bool cancelled_ = false;
  bool closed_ = false;
  int pending_index_ = -1;      // this request's last event in the outbox...
  uint64_t pending_batch_ = 0;  // ...when the outbox is still this batch
};

}  // namespace

void SessionStream::Core::PumpLocked() {
  if (finished || reactor == nullptr || write_in_flight) return;
  if (cancelled) {
    finished = true;
    outbox.Clear();
    full.clear();
    reactor->Finish(
        grpc::Status(grpc::StatusCode::CANCELLED, "the session was cancelled"));
    return;
  }
  // The oldest batch first: a full one, else the open one.
  if (!full.empty() || outbox.events_size() > 0) {
    if (!full.empty()) {
      writing = std::move(full.front());
      full.pop_front();
    } else {
      writing.Clear();
      writing.Swap(&outbox);  // the outbox keeps the cleared events' memory
      outbox_bytes = 0;
      ++batch;
    }
    ++stats.writes;
    stats.events += writing.events_size();
    write_in_flight = true;
    if (on_write) on_write(writing.events_size());
    reactor->StartWrite(&writing);
    return;
  }
  if (reads_done && live.empty()) {
    finished = true;
    reactor->Finish(grpc::Status::OK);
  }
}

std::vector<std::function<void()>> SessionStream::Core::CancelAllLocked() {
  std::vector<std::function<void()>> hooks;
  cancelled = true;
  reads_done = true;
  for (auto& [id, sink] : live) {
    if (auto hook = sink->CancelLocked()) hooks.push_back(std::move(hook));
  }
  live.clear();  // the producers still hold their references until Close
  return hooks;
}

SessionStream::SessionStream(StartFn start, Hooks hooks)
    : start_(std::move(start)),
      hooks_(std::move(hooks)),
      core_(std::make_shared<Core>()) {
  {
    absl::MutexLock l(&core_->mu);
    core_->reactor = this;
    core_->on_write = hooks_.on_write;
  }
  StartRead(&request_);
}

void SessionStream::OnReadDone(bool ok) {
  if (!ok) {  // the client half-closed (or the call broke: OnCancel follows)
    absl::MutexLock l(&core_->mu);
    core_->reads_done = true;
    core_->PumpLocked();
    return;
  }
  for (tandem::v1::SessionStart& start : *request_.mutable_starts()) {
    std::shared_ptr<SessionSink> sink;
    {
      absl::MutexLock l(&core_->mu);
      if (core_->cancelled || core_->finished) break;
      ++core_->stats.started;
      if (core_->live.contains(start.stream_id())) {
        core_->EndLocked(
            start.stream_id(),
            grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                         absl::StrCat("stream id ", start.stream_id(),
                                      " is already running on this session")));
        core_->PumpLocked();
        continue;
      }
      sink = std::make_shared<SessionSink>(core_, start.stream_id());
      sink->Bind(sink);
      core_->live.emplace(start.stream_id(), sink);
    }
    start_(std::move(*start.mutable_request()), sink.get());
  }
  for (uint64_t id : request_.cancels()) {
    std::function<void()> hook;
    {
      absl::MutexLock l(&core_->mu);
      auto it = core_->live.find(id);
      if (it == core_->live.end()) continue;  // finished already, or unknown
      hook = it->second->CancelLocked();
    }
    if (hook) hook();
  }
  request_.Clear();
  {
    absl::MutexLock l(&core_->mu);
    if (core_->cancelled || core_->finished) return;  // no more reads wanted
  }
  StartRead(&request_);
}

void SessionStream::OnWriteDone(bool ok) {
  std::vector<std::function<void()>> hooks;
  {
    absl::MutexLock l(&core_->mu);
    core_->write_in_flight = false;
    if (!ok) hooks = core_->CancelAllLocked();  // the client is gone
    core_->PumpLocked();
  }
  for (auto& hook : hooks) hook();
}

void SessionStream::OnCancel() {
  std::vector<std::function<void()>> hooks;
  {
    absl::MutexLock l(&core_->mu);
    hooks = core_->CancelAllLocked();
    core_->PumpLocked();
  }
  for (auto& hook : hooks) hook();
}

void SessionStream::OnDone() {
  Stats stats;
  std::vector<std::function<void()>> hooks;
  {
    absl::MutexLock l(&core_->mu);
    core_->reactor = nullptr;
    // Finish(OK) needs every request ended, and a cancelled session has
    // cancelled them all; this only matters if gRPC ends the call by itself.
    if (!core_->live.empty()) hooks = core_->CancelAllLocked();
    stats = core_->stats;
  }
  for (auto& hook : hooks) hook();
  if (hooks_.on_done) hooks_.on_done(stats);
  delete this;
}

}  // namespace tandem::rpc
