#include "kvtransfer/agent_core.h"

#include <algorithm>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "kvtransfer/segment_check.h"

namespace tandem::kvtransfer {
namespace {

// `status` with `what` in front of its message.
absl::Status Annotate(const absl::Status& status, absl::string_view what) {
  return absl::Status(status.code(), absl::StrCat(what, ": ", status.message()));
}

}  // namespace

uint64_t RandomAgentId() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ 1;
}

AgentCore::AgentCore(std::unique_ptr<Backend> backend)
    : agent_id_(RandomAgentId()),
      backend_(std::move(backend)),
      limits_(backend_->Limits()) {
  backend_->Start(this, agent_id_);
  progress_ = std::thread([this] { ProgressLoop(); });
}

AgentCore::~AgentCore() {
  backend_->Detach();
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  backend_->Wake();
  progress_.join();
  absl::MutexLock l(&mu_);
  // Close every connection (forced where busy or failed): pending operations
  // complete with errors; then the backend releases keys, memory and itself.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  for (auto& [id, p] : peers_) {
    backend_->ClosePeerLocked(id, p.error.ok() && PeerIdleLocked(id), /*wait=*/true,
                              deadline);
  }
  for (auto& [id, p] : peers_) backend_->ForgetPeerLocked(id);
  peers_.clear();
  for (auto& [id, r] : regions_) backend_->DeregisterMemoryLocked(id);
  regions_.clear();
  backend_->ShutdownLocked(deadline);
  backend_.reset();
}

absl::StatusOr<RegionId> AgentCore::RegisterMemory(void* base, size_t len,
                                                   MemoryKind kind) {
  if (base == nullptr || len == 0) {
    return absl::InvalidArgumentError("RegisterMemory: null base or empty region");
  }
  absl::MutexLock l(&mu_);
  const RegionId id = next_region_;
  auto rkey = backend_->RegisterMemoryLocked(id, base, len, kind);
  if (!rkey.ok()) return rkey.status();
  ++next_region_;
  regions_[id] = Region{base, len, *std::move(rkey), kind};
  return id;
}

absl::StatusOr<Allocation> AgentCore::AllocateMemory(size_t len) {
  if (len == 0) return absl::InvalidArgumentError("AllocateMemory: empty region");
  RegionId id = 0;
  Backend::Allocated a;
  {
    absl::MutexLock l(&mu_);
    id = next_region_;
    auto r = backend_->AllocateMemoryLocked(id, len);
    if (!r.ok()) return r.status();
    ++next_region_;
    a = *std::move(r);
  }
  // Cleared before anyone can name it (it is in no descriptor yet), and without
  // the agent lock (gigabytes take a while).
  if (!a.zeroed) std::memset(a.base, 0, len);
  absl::MutexLock l(&mu_);
  regions_[id] = Region{a.base, len, std::move(a.rkey), MemoryKind::Host()};
  return Allocation{id, a.base};
}

absl::Status AgentCore::DeregisterMemory(RegionId region) {
  absl::MutexLock l(&mu_);
  auto it = regions_.find(region);
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat("region ", region, " is not registered"));
  }
  for (const auto& [id, b] : batches_) {
    if (b->ended) continue;
    for (const Segment& s : b->segments) {
      if (s.local_region == region) {
        return absl::FailedPreconditionError(
            absl::StrCat("region ", region, " is used by in-flight batch ", id));
      }
    }
  }
  backend_->DeregisterMemoryLocked(region);
  regions_.erase(it);
  return absl::OkStatus();
}

size_t AgentCore::NumRegisteredRegions() const {
  absl::MutexLock l(&mu_);
  return regions_.size();
}

size_t AgentCore::NumBatchesForTesting() const {
  absl::MutexLock l(&mu_);
  return batches_.size();
}

absl::StatusOr<std::string> AgentCore::LocalDescriptor(absl::string_view metadata) {
  if (metadata.size() > kMaxDescriptorMetadataBytes) {
    return absl::InvalidArgumentError("descriptor metadata too large");
  }
  AgentDescriptor d;
  d.kind = backend_->Kind();
  d.agent_id = agent_id_;
  d.address = backend_->Address();
  d.metadata = std::string(metadata);
  absl::MutexLock l(&mu_);
  for (const auto& [id, r] : regions_) {
    d.regions.push_back(
        RegionDescriptor{id, reinterpret_cast<uint64_t>(r.base), r.length, r.rkey});
  }
  return SerializeDescriptor(d);
}

absl::StatusOr<PeerId> AgentCore::Connect(absl::string_view peer_descriptor) {
  auto d = ParseDescriptor(peer_descriptor);
  if (!d.ok()) return d.status();
  if (d->kind != backend_->Kind()) {
    return absl::InvalidArgumentError(
        absl::StrCat("descriptor is not a ", backend_->Name(), " agent's"));
  }
  absl::MutexLock l(&mu_);
  const PeerId id = next_peer_++;
  absl::Status st = backend_->ConnectLocked(id, *d);
  if (!st.ok()) return st;
  peers_[id] = Peer{*std::move(d)};
  return id;
}

bool AgentCore::PeerIdleLocked(PeerId peer) const {
  for (const auto& [id, b] : batches_) {
    if (!b->ended && b->peer == peer) return false;
  }
  return true;
}

absl::Status AgentCore::Disconnect(PeerId peer) {
  absl::ReleasableMutexLock l(&mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end())
    return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
  const bool graceful = it->second.error.ok() && PeerIdleLocked(peer);
  for (auto& [id, b] : batches_) {
    if (b->peer == peer && !b->ended) {
      b->cancel_requested = true;
      if (b->status.ok()) b->status = absl::CancelledError("peer disconnected");
    }
  }
  // Busy: forced, so the pending operations fail and the batches can end.
  backend_->ClosePeerLocked(peer, graceful, /*wait=*/true,
                            absl::Now() + absl::Seconds(5));
  peers_.erase(it);
  for (auto& [id, b] : batches_) {
    if (b->peer == peer) MaybeEndLocked(b.get());
  }
  backend_->ForgetPeerLocked(peer);
  l.Release();
  backend_->Wake();  // the ended batches' callbacks run on the progress thread
  return absl::OkStatus();
}

size_t AgentCore::NumPeers() const {
  absl::MutexLock l(&mu_);
  return peers_.size();
}

absl::StatusOr<BatchId> AgentCore::PostWrite(PeerId peer,
                                             absl::Span<const Segment> segments,
                                             CompletionCallback on_done) {
  return Post(peer, segments, /*write=*/true, std::move(on_done));
}

absl::StatusOr<BatchId> AgentCore::PostRead(PeerId peer,
                                            absl::Span<const Segment> segments,
                                            CompletionCallback on_done) {
  return Post(peer, segments, /*write=*/false, std::move(on_done));
}

absl::StatusOr<BatchId> AgentCore::Post(PeerId peer, absl::Span<const Segment> segments,
                                        bool write, CompletionCallback on_done) {
  if (absl::Status usable = backend_->Usable(); !usable.ok()) return usable;
  BatchId id = 0;
  {
    absl::MutexLock l(&mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end())
      return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
    const Peer& p = it->second;
    if (!p.error.ok()) return p.error;
    absl::Status st = CheckSegments(
        segments,
        [this](RegionId r) ABSL_NO_THREAD_SAFETY_ANALYSIS -> uint64_t {
          auto x = regions_.find(r);
          return x == regions_.end() ? 0 : x->second.length;
        },
        p.descriptor);
    if (!st.ok()) return st;
    auto b = std::make_unique<Batch>();
    b->host = this;
    b->id = id = next_batch_++;
    b->peer = peer;
    b->write = write;
    b->segments.assign(segments.begin(), segments.end());
    b->bytes = TotalBytes(segments);
    b->on_done = std::move(on_done);
    Batch* raw = b.get();
    batches_[id] = std::move(b);
    // A small batch is posted here (its latency is one post + fence); a large one
    // by the progress thread, so the caller returns at once.
    if (raw->bytes <= limits_.inline_post_bytes) {
      uint64_t budget = raw->bytes + 1;
      PumpLocked(raw, &budget);
      MaybeEndLocked(raw);
    }
  }
  backend_->Wake();
  return id;
}

void AgentCore::OpDoneLocked(OpToken op, absl::Status status) {
  auto* b = static_cast<Batch*>(op);
  --b->inflight;
  if (!status.ok() && b->status.ok()) {
    b->status =
        Annotate(status, absl::StrCat(b->write ? "write" : "read", " batch ", b->id));
  }
}

void AgentCore::PumpLocked(Batch* b, uint64_t* budget) {
  b->stalled = false;
  auto it = peers_.find(b->peer);
  if (it == peers_.end()) {
    if (b->status.ok()) b->status = absl::CancelledError("peer disconnected");
    return;
  }
  const Peer& p = it->second;
  if (!p.error.ok() && b->status.ok()) b->status = p.error;
  if (b->cancel_requested || !b->status.ok()) return;
  while (b->next_segment < b->segments.size() &&
         (b->inflight < limits_.max_inflight_ops) && (*budget > 0)) {
    const Segment& s = b->segments[b->next_segment];
    auto r = regions_.find(s.local_region);
    if (r == regions_.end()) {
      b->status = absl::InternalError("local region vanished during a transfer");
      return;
    }
    // At most max_piece_bytes per piece: a transport that copies inline does so
    // under the agent lock, so this bounds how long Wait deadlines, Cancel and
    // other batches wait for it.
    Backend::Piece piece;
    piece.length =
        std::min<uint64_t>(s.length - b->next_offset, limits_.max_piece_bytes);
    piece.local =
        static_cast<uint8_t*>(r->second.base) + s.local_offset + b->next_offset;
    piece.remote = p.descriptor.FindRegion(s.remote_region);
    piece.remote_offset = s.remote_offset + b->next_offset;
    piece.local_memory = r->second.kind;
    auto posted = backend_->PostPieceLocked(b->peer, b->write, piece, b);
    if (posted.ok() && *posted == Backend::PostResult::kRetryLater) {
      b->stalled = true;
      return;
    }
    *budget -= std::min(*budget, piece.length);
    b->next_offset += piece.length;
    if (b->next_offset == s.length) {
      ++b->next_segment;
      b->next_offset = 0;
    }
    if (!posted.ok()) {
      b->status = Annotate(posted.status(), absl::StrCat("posting batch ", b->id));
      return;
    }
    if (*posted == Backend::PostResult::kPending) ++b->inflight;
  }
  if (b->next_segment == b->segments.size() && !b->fence_posted) {
    // Completion of a piece may be local; the fence makes the batch's bytes
    // visible at the target before the batch is reported complete.
    b->fence_posted = true;
    auto fenced = backend_->PostFenceLocked(b->peer, b);
    if (!fenced.ok()) {
      b->status = Annotate(fenced.status(), absl::StrCat("flushing batch ", b->id));
    } else if (*fenced == Backend::PostResult::kPending) {
      ++b->inflight;
    }
  }
}

void AgentCore::MaybeEndLocked(Batch* b) {
  if (b->ended || b->inflight > 0) return;
  const bool stopped = b->cancel_requested || !b->status.ok();
  if (!stopped && !b->fence_posted) return;
  b->ended = true;
  if (b->cancel_requested && b->status.ok()) {
    b->status = absl::CancelledError(absl::StrCat("batch ", b->id, " cancelled"));
  }
  if (b->on_done) done_callbacks_.push_back({b->on_done, {b->id, b->status}});
}

AgentCore::PumpResult AgentCore::ServiceLocked() {
  for (auto& [id, p] : peers_) {
    if (!p.error.ok() && !p.closing) {
      p.closing = true;
      backend_->ClosePeerLocked(id, /*graceful=*/false, /*wait=*/false, absl::Now());
    }
  }
  // Batches are served in order, about max_piece_bytes per pass, so the lock is
  // released between pieces that the transport completes inline.
  PumpResult result;
  uint64_t budget = limits_.max_piece_bytes;
  for (auto& [id, b] : batches_) {
    if (b->ended) continue;
    PumpLocked(b.get(), &budget);
    MaybeEndLocked(b.get());
    if (b->ended) continue;
    if (b->stalled) {
      result.stalled = true;
    } else {
      result.live = true;
    }
  }
  result.posted = budget < limits_.max_piece_bytes;
  return result;
}

void AgentCore::RunCallbacks() {
  std::vector<std::pair<CompletionCallback, std::pair<BatchId, absl::Status>>> done;
  bool notes_due = false;
  {
    absl::MutexLock l(&mu_);
    done.swap(done_callbacks_);
    notes_due = !to_dispatch_.empty();
  }
  for (auto& [cb, arg] : done) cb(arg.first, arg.second);
  if (!notes_due) return;  // one queued later goes out on the next pass
  // The notification callback is read under callback_mu_, the lock that
  // SetNotificationCallback takes: once it returns, the old callback has run its
  // last time (a service may be destroyed right after clearing it), and a
  // notification taken here goes to the callback set now, or to the queue.
  absl::MutexLock c(&callback_mu_);
  std::vector<Notification> notes;
  NotificationCallback ncb;
  {
    absl::MutexLock l(&mu_);
    notes.swap(to_dispatch_);
    ncb = notification_callback_;
    if (!ncb) {
      for (Notification& n : notes) notifications_.push_back(std::move(n));
      return;
    }
  }
  for (const Notification& n : notes) ncb(n);
}

void AgentCore::ProgressLoop() {
  while (true) {
    bool active = false;
    bool progressed = false;
    bool stalled = false;
    {
      absl::MutexLock l(&mu_);
      if (stop_) break;
      progressed = backend_->ProgressLocked();
      // Posting is progress too: no yield between pieces of a transfer (on a
      // loaded machine a yield per piece hands the core to other processes).
      const PumpResult pumped = ServiceLocked();
      progressed |= pumped.posted;
      active = (busy_waiters_ > 0 && limits_.spin_while_waiting) || pumped.live ||
               backend_->BusyLocked();
      stalled = pumped.stalled;
    }
    RunCallbacks();
    if (progressed) continue;
    if (active) {
      std::this_thread::yield();
      continue;
    }
    absl::Duration sleep;
    {
      absl::MutexLock l(&mu_);
      if (stop_) break;
      sleep = backend_->ArmLocked();
    }
    if (sleep <= absl::ZeroDuration()) continue;
    // A stalled batch looks again shortly (its target may take bytes again).
    if (stalled) sleep = std::min(sleep, absl::Milliseconds(1));
    backend_->Sleep(sleep);
  }
}

absl::StatusOr<bool> AgentCore::Poll(BatchId batch) {
  absl::MutexLock l(&mu_);
  auto it = batches_.find(batch);
  if (it == batches_.end())
    return absl::NotFoundError(absl::StrCat("unknown batch ", batch));
  if (!it->second->ended) return false;
  absl::Status st = it->second->status;
  batches_.erase(it);
  if (!st.ok()) return st;
  return true;
}

absl::Status AgentCore::Wait(BatchId batch, absl::Time deadline) {
  absl::MutexLock l(&mu_);
  auto it = batches_.find(batch);
  if (it == batches_.end())
    return absl::NotFoundError(absl::StrCat("unknown batch ", batch));
  // The batch is looked up again after the wait: another caller's Poll or Wait
  // may report (and forget) it meanwhile.
  auto ended_or_gone = [this, batch]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto f = batches_.find(batch);
    return f == batches_.end() || f->second->ended;
  };
  const bool ended = mu_.AwaitWithDeadline(absl::Condition(&ended_or_gone), deadline);
  it = batches_.find(batch);
  if (it == batches_.end()) {
    return absl::NotFoundError(
        absl::StrCat("batch ", batch, " was reported to another caller"));
  }
  Batch* b = it->second.get();
  if (!ended && !b->ended) {
    return absl::DeadlineExceededError(
        absl::StrCat("batch ", batch, " still running at its deadline (",
                     b->next_segment, "/", b->segments.size(), " segments posted)"));
  }
  absl::Status st = b->status;
  batches_.erase(it);
  return st;
}

absl::Status AgentCore::Cancel(BatchId batch) {
  {
    absl::MutexLock l(&mu_);
    auto it = batches_.find(batch);
    if (it == batches_.end()) {
      return absl::NotFoundError(absl::StrCat("unknown batch ", batch));
    }
    Batch* b = it->second.get();
    if (b->ended) return absl::OkStatus();
    b->cancel_requested = true;
    MaybeEndLocked(b);
  }
  backend_->Wake();
  return absl::OkStatus();
}

bool AgentCore::AwaitLocked(const absl::Condition& cond, absl::Time deadline) {
  ++busy_waiters_;
  backend_->Wake();
  const bool met = mu_.AwaitWithDeadline(cond, deadline);
  --busy_waiters_;
  return met;
}

absl::Status AgentCore::Notify(PeerId peer, absl::string_view request_id,
                               absl::string_view payload, absl::Time deadline) {
  if (request_id.size() + payload.size() > kMaxNotificationBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("notification of ", request_id.size() + payload.size(),
                     " bytes exceeds ", kMaxNotificationBytes));
  }
  if (absl::Status usable = backend_->Usable(); !usable.ok()) return usable;
  std::function<absl::Status()> deliver;
  absl::Status st;
  {
    absl::MutexLock l(&mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end())
      return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
    if (!it->second.error.ok()) return it->second.error;
    // The fence: every batch posted to the peer before this call has ended (or
    // the peer failed or went away meanwhile).
    struct Args {
      AgentCore* a;
      PeerId peer;
      BatchId horizon;
    } args{this, peer, next_batch_};
    auto prior_ended = +[](Args* x) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      auto p = x->a->peers_.find(x->peer);
      if (p == x->a->peers_.end() || !p->second.error.ok()) return true;
      for (const auto& [id, b] : x->a->batches_) {
        if (id >= x->horizon) break;
        if (b->peer == x->peer && !b->ended) return false;
      }
      return true;
    };
    if (!AwaitLocked(absl::Condition(prior_ended, &args), deadline)) {
      return absl::DeadlineExceededError(
          "earlier batches to the peer still running at deadline");
    }
    it = peers_.find(peer);  // a Disconnect may have raced with the wait
    if (it == peers_.end())
      return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
    if (!it->second.error.ok()) return it->second.error;
    ++busy_waiters_;
    st = backend_->SendNotificationLocked(
        peer, Notification{agent_id_, std::string(request_id), std::string(payload)},
        deadline, &deliver);
    --busy_waiters_;
  }
  if (st.ok() && deliver) st = deliver();
  return st;
}

void AgentCore::NotificationReceivedLocked(Notification n) {
  if (notification_callback_) {
    to_dispatch_.push_back(std::move(n));
  } else {
    notifications_.push_back(std::move(n));
  }
}

void AgentCore::PeerFailedLocked(PeerId peer, absl::Status status) {
  auto it = peers_.find(peer);
  if (it != peers_.end() && it->second.error.ok()) it->second.error = std::move(status);
}

void AgentCore::DeliverNotification(const Notification& n) {
  absl::MutexLock c(&callback_mu_);
  NotificationCallback cb;
  {
    absl::MutexLock l(&mu_);
    if (!notification_callback_) {
      notifications_.push_back(n);
      return;
    }
    cb = notification_callback_;
  }
  cb(n);
}

void AgentCore::SetNotificationCallback(NotificationCallback callback) {
  absl::MutexLock c(&callback_mu_);
  std::vector<Notification> queued;
  {
    absl::MutexLock l(&mu_);
    notification_callback_ = callback;
    if (callback) queued.swap(notifications_);
  }
  for (const Notification& n : queued) callback(n);
}

std::vector<Notification> AgentCore::PollNotifications() {
  absl::MutexLock l(&mu_);
  std::vector<Notification> out;
  out.swap(notifications_);
  return out;
}

std::string AgentCore::Transport(PeerId peer) {
  absl::MutexLock l(&mu_);
  if (peers_.count(peer) == 0) return "";
  return backend_->TransportLocked(peer);
}

}  // namespace tandem::kvtransfer
