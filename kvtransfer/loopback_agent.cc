#include "kvtransfer/loopback_agent.h"

#include <sys/mman.h>

#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "kvtransfer/segment_check.h"

namespace tandem::kvtransfer {
namespace {

constexpr uint64_t kChunkBytes = 4 << 20;

// Process-wide directory of live agents. Lock order: g_registry_mu, then an
// agent's callback_mu_, then an agent's mu_; nobody takes g_registry_mu while
// holding an agent lock.
absl::Mutex g_registry_mu;
std::map<uint64_t, LoopbackAgent*>& Registry()
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_registry_mu) {
  static auto* agents = new std::map<uint64_t, LoopbackAgent*>();
  return *agents;
}

uint64_t RandomId() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ 1;
}

std::string IdAddress(uint64_t id) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((id >> (8 * i)) & 0xff);
  return s;
}

}  // namespace

LoopbackAgent::LoopbackAgent() : agent_id_(RandomId()) {
  {
    absl::MutexLock l(&g_registry_mu);
    Registry()[agent_id_] = this;
  }
  worker_ = std::thread([this] { WorkerLoop(); });
}

LoopbackAgent::~LoopbackAgent() {
  {
    absl::MutexLock l(&g_registry_mu);
    Registry().erase(agent_id_);
  }
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  worker_.join();
  // Wait out notifications being delivered to us and copies touching our memory.
  absl::MutexLock c(&callback_mu_);
  absl::MutexLock l(&mu_);
  for (const auto& [id, r] : regions_) {
    if (r.owned) munmap(r.base, r.length);
  }
}

absl::StatusOr<RegionId> LoopbackAgent::RegisterMemory(void* base, size_t len) {
  if (base == nullptr || len == 0) {
    return absl::InvalidArgumentError("RegisterMemory: null base or empty region");
  }
  absl::MutexLock l(&mu_);
  const RegionId id = next_region_++;
  regions_[id] = Region{static_cast<uint8_t*>(base), len};
  return id;
}

absl::StatusOr<Allocation> LoopbackAgent::AllocateMemory(size_t len) {
  if (len == 0) return absl::InvalidArgumentError("AllocateMemory: empty region");
  void* p =
      mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("mmap of ", len, " bytes failed"));
  }
  absl::MutexLock l(&mu_);
  const RegionId id = next_region_++;
  regions_[id] = Region{static_cast<uint8_t*>(p), len, /*owned=*/true};
  return Allocation{id, p};
}

absl::Status LoopbackAgent::DeregisterMemory(RegionId region) {
  absl::MutexLock l(&mu_);
  if (regions_.count(region) == 0) {
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
  // Peers copy into our regions under mu_ (CopyChunk), so unmapping here is safe.
  const Region& r = regions_[region];
  if (r.owned) munmap(r.base, r.length);
  regions_.erase(region);
  return absl::OkStatus();
}

size_t LoopbackAgent::NumRegisteredRegions() const {
  absl::MutexLock l(&mu_);
  return regions_.size();
}

absl::StatusOr<std::string> LoopbackAgent::LocalDescriptor(absl::string_view metadata) {
  if (metadata.size() > kMaxDescriptorMetadataBytes) {
    return absl::InvalidArgumentError("descriptor metadata too large");
  }
  AgentDescriptor d;
  d.kind = AgentKind::kLoopback;
  d.agent_id = agent_id_;
  d.address = IdAddress(agent_id_);
  d.metadata = std::string(metadata);
  absl::MutexLock l(&mu_);
  for (const auto& [id, r] : regions_) {
    d.regions.push_back(
        RegionDescriptor{id, reinterpret_cast<uint64_t>(r.base), r.length, ""});
  }
  return SerializeDescriptor(d);
}

absl::StatusOr<PeerId> LoopbackAgent::Connect(absl::string_view peer_descriptor) {
  auto d = ParseDescriptor(peer_descriptor);
  if (!d.ok()) return d.status();
  if (d->kind != AgentKind::kLoopback) {
    return absl::InvalidArgumentError("descriptor is not a loopback agent's");
  }
  if (d->address != IdAddress(d->agent_id)) {
    return absl::InvalidArgumentError(
        "loopback descriptor address does not match its agent id");
  }
  if (dead_) return absl::UnavailableError("this agent was killed");
  {
    absl::MutexLock l(&g_registry_mu);
    if (Registry().count(d->agent_id) == 0) {
      return absl::UnavailableError(
          absl::StrCat("loopback peer ", absl::Hex(d->agent_id), " is not reachable"));
    }
  }
  absl::MutexLock l(&mu_);
  const PeerId id = next_peer_++;
  peers_[id] = Peer{d->agent_id, *std::move(d)};
  return id;
}

absl::Status LoopbackAgent::Disconnect(PeerId peer) {
  std::vector<std::pair<CompletionCallback, BatchId>> done;
  {
    absl::MutexLock l(&mu_);
    if (peers_.erase(peer) == 0)
      return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
    for (auto& [id, b] : batches_) {
      if (b->peer == peer && !b->ended) b->cancel_requested = true;
    }
  }
  return absl::OkStatus();
}

size_t LoopbackAgent::NumPeers() const {
  absl::MutexLock l(&mu_);
  return peers_.size();
}

absl::StatusOr<BatchId> LoopbackAgent::PostWrite(PeerId peer,
                                                 absl::Span<const Segment> segments,
                                                 CompletionCallback on_done) {
  return Post(peer, segments, /*write=*/true, std::move(on_done));
}

absl::StatusOr<BatchId> LoopbackAgent::PostRead(PeerId peer,
                                                absl::Span<const Segment> segments,
                                                CompletionCallback on_done) {
  return Post(peer, segments, /*write=*/false, std::move(on_done));
}

absl::StatusOr<BatchId> LoopbackAgent::Post(PeerId peer,
                                            absl::Span<const Segment> segments,
                                            bool write, CompletionCallback on_done) {
  if (dead_) return absl::UnavailableError("this agent was killed");
  absl::MutexLock l(&mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end())
    return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
  absl::Status st = CheckSegments(
      segments,
      [this](RegionId id) ABSL_NO_THREAD_SAFETY_ANALYSIS -> uint64_t {
        auto r = regions_.find(id);
        return r == regions_.end() ? 0 : r->second.length;
      },
      it->second.descriptor);
  if (!st.ok()) return st;
  auto batch = std::make_unique<Batch>();
  batch->id = next_batch_++;
  batch->peer = peer;
  batch->target_agent = it->second.agent_id;
  batch->write = write;
  batch->segments.assign(segments.begin(), segments.end());
  batch->on_done = std::move(on_done);
  const BatchId id = batch->id;
  batches_[id] = std::move(batch);
  queue_.push_back(id);
  return id;
}

bool LoopbackAgent::CopyChunk(const Batch& b, Segment* piece, absl::Status* status,
                              bool* stalled) {
  uint8_t* local = nullptr;
  {
    absl::MutexLock l(&mu_);
    auto r = regions_.find(piece->local_region);
    if (r == regions_.end()) {
      *status = absl::InternalError("local region vanished during a transfer");
      return false;
    }
    local = r->second.base;
  }
  g_registry_mu.Lock();
  auto t = Registry().find(b.target_agent);
  if (t == Registry().end() || t->second->dead_) {
    g_registry_mu.Unlock();
    *status = absl::UnavailableError(
        absl::StrCat("loopback peer ", absl::Hex(b.target_agent), " died"));
    return false;
  }
  LoopbackAgent* target = t->second;
  if (target->paused_) {
    g_registry_mu.Unlock();
    *stalled = true;
    return true;
  }
  target->mu_.Lock();
  g_registry_mu.Unlock();
  auto r = target->regions_.find(piece->remote_region);
  if (r == target->regions_.end() ||
      piece->remote_offset + piece->length > r->second.length) {
    target->mu_.Unlock();
    *status = absl::UnavailableError(
        absl::StrCat("peer region ", piece->remote_region, " is no longer registered"));
    return false;
  }
  uint8_t* remote = r->second.base + piece->remote_offset;
  uint8_t* mine = local + piece->local_offset;
  if (b.write) {
    std::memmove(remote, mine, piece->length);
  } else {
    std::memmove(mine, remote, piece->length);
  }
  target->mu_.Unlock();
  return true;
}

void LoopbackAgent::Finish(Batch* b, absl::Status status) {
  b->ended = true;
  b->status = std::move(status);
}

void LoopbackAgent::WorkerLoop() {
  while (true) {
    Batch snapshot;
    Segment piece;
    {
      absl::MutexLock l(&mu_);
      mu_.Await(absl::Condition(
          +[](LoopbackAgent* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return a->stop_ || !a->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stop_
      Batch* b = batches_[queue_.front()].get();
      if (stop_ || b->cancel_requested || dead_) {
        queue_.pop_front();
        Finish(b, dead_ ? absl::UnavailableError("this agent was killed")
                        : absl::CancelledError(
                              absl::StrCat("batch ", b->id, " cancelled")));
        CompletionCallback cb = b->on_done;
        const BatchId id = b->id;
        const absl::Status st = b->status;
        mu_.Unlock();
        if (cb) cb(id, st);
        mu_.Lock();
        continue;
      }
      snapshot.id = b->id;
      snapshot.target_agent = b->target_agent;
      snapshot.write = b->write;
      piece = b->segments[b->next_segment];
      piece.local_offset += b->next_offset;
      piece.remote_offset += b->next_offset;
      piece.length = std::min<uint64_t>(piece.length - b->next_offset, kChunkBytes);
    }
    absl::Status st;
    bool stalled = false;
    const bool ok = CopyChunk(snapshot, &piece, &st, &stalled);
    CompletionCallback cb;
    absl::Status final_status;
    {
      absl::MutexLock l(&mu_);
      Batch* b = batches_[snapshot.id].get();
      if (stalled) {
        // The target is paused: look again shortly, or sooner if cancelled/stopped.
        mu_.AwaitWithTimeout(absl::Condition(
                                 +[](Batch* x) { return x->cancel_requested; }, b),
                             absl::Milliseconds(1));
        continue;
      }
      bool done = false;
      if (!ok) {
        Finish(b, st);
        done = true;
      } else {
        b->next_offset += piece.length;
        if (b->next_offset == b->segments[b->next_segment].length) {
          b->next_offset = 0;
          if (++b->next_segment == b->segments.size()) {
            Finish(b, absl::OkStatus());
            done = true;
          }
        }
      }
      if (!done) continue;
      queue_.pop_front();
      cb = b->on_done;
      final_status = b->status;
    }
    if (cb) cb(snapshot.id, final_status);
  }
}

absl::StatusOr<bool> LoopbackAgent::Poll(BatchId batch) {
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

absl::Status LoopbackAgent::Wait(BatchId batch, absl::Time deadline) {
  absl::MutexLock l(&mu_);
  auto it = batches_.find(batch);
  if (it == batches_.end())
    return absl::NotFoundError(absl::StrCat("unknown batch ", batch));
  Batch* b = it->second.get();
  if (!mu_.AwaitWithDeadline(absl::Condition(&b->ended), deadline) && !b->ended) {
    return absl::DeadlineExceededError(
        absl::StrCat("batch ", batch, " still running at deadline"));
  }
  absl::Status st = b->status;
  batches_.erase(batch);
  return st;
}

absl::Status LoopbackAgent::Cancel(BatchId batch) {
  CompletionCallback cb;
  absl::Status st;
  {
    absl::MutexLock l(&mu_);
    auto it = batches_.find(batch);
    if (it == batches_.end())
      return absl::NotFoundError(absl::StrCat("unknown batch ", batch));
    Batch* b = it->second.get();
    if (b->ended) return absl::OkStatus();
    b->cancel_requested = true;
    // A queued batch that is not being copied ends at once.
    if (queue_.empty() || queue_.front() != batch) {
      for (auto q = queue_.begin(); q != queue_.end(); ++q) {
        if (*q == batch) {
          queue_.erase(q);
          break;
        }
      }
      Finish(b, absl::CancelledError(absl::StrCat("batch ", batch, " cancelled")));
      cb = b->on_done;
      st = b->status;
    }
  }
  if (cb) cb(batch, st);
  return absl::OkStatus();
}

absl::Status LoopbackAgent::Notify(PeerId peer, absl::string_view request_id,
                                   absl::string_view payload, absl::Time deadline) {
  if (request_id.size() + payload.size() > kMaxNotificationBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("notification of ", request_id.size() + payload.size(),
                     " bytes exceeds ", kMaxNotificationBytes));
  }
  if (dead_) return absl::UnavailableError("this agent was killed");
  uint64_t target_id = 0;
  {
    absl::MutexLock l(&mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end())
      return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
    target_id = it->second.agent_id;
    const BatchId horizon = next_batch_;
    struct Args {
      LoopbackAgent* a;
      PeerId peer;
      BatchId horizon;
    } args{this, peer, horizon};
    auto prior_ended = +[](Args* x) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      for (const auto& [id, b] : x->a->batches_) {
        if (id < x->horizon && b->peer == x->peer && !b->ended) return false;
      }
      return true;
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(prior_ended, &args), deadline)) {
      return absl::DeadlineExceededError(
          "earlier batches to the peer still running at deadline");
    }
  }
  Notification n{agent_id_, std::string(request_id), std::string(payload)};
  g_registry_mu.Lock();
  auto t = Registry().find(target_id);
  if (t == Registry().end() || t->second->dead_) {
    g_registry_mu.Unlock();
    return absl::UnavailableError(
        absl::StrCat("loopback peer ", absl::Hex(target_id), " died"));
  }
  LoopbackAgent* target = t->second;
  target->callback_mu_.Lock();
  g_registry_mu.Unlock();
  target->Deliver(std::move(n));
  target->callback_mu_.Unlock();
  return absl::OkStatus();
}

void LoopbackAgent::Deliver(Notification n) {
  NotificationCallback cb;
  {
    absl::MutexLock l(&mu_);
    if (!notification_callback_) {
      notifications_.push_back(std::move(n));
      return;
    }
    cb = notification_callback_;
  }
  cb(n);
}

void LoopbackAgent::SetNotificationCallback(NotificationCallback callback) {
  absl::MutexLock c(&callback_mu_);
  std::vector<Notification> queued;
  {
    absl::MutexLock l(&mu_);
    notification_callback_ = callback;
    if (callback) queued.swap(notifications_);
  }
  for (const Notification& n : queued) callback(n);
}

std::vector<Notification> LoopbackAgent::PollNotifications() {
  absl::MutexLock l(&mu_);
  std::vector<Notification> out;
  out.swap(notifications_);
  return out;
}

std::string LoopbackAgent::Transport(PeerId peer) {
  absl::MutexLock l(&mu_);
  return peers_.count(peer) ? "loopback" : "";
}

void LoopbackAgent::SetPaused(bool paused) { paused_ = paused; }

void LoopbackAgent::Kill() {
  {
    absl::MutexLock l(&g_registry_mu);
    dead_ = true;
    Registry().erase(agent_id_);
  }
}

}  // namespace tandem::kvtransfer
