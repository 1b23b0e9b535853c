#include "kvtransfer/loopback_agent.h"

#include <sys/mman.h>

#include <atomic>
#include <cstring>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kvtransfer/backend.h"

namespace tandem::kvtransfer {
namespace {

constexpr uint64_t kChunkBytes = 4 << 20;

struct Memory {
  uint8_t* base;
  uint64_t length;
  bool owned;  // from AllocateMemory: unmapped on deregistration
};

// What other agents of the process reach of one agent. Shared by the registry
// and the agent's backend, so a peer holding it never sees freed memory.
//
// Locks, in order: an agent's lock (AgentCore) → g_registry_mu (leaf) or
// another agent's mem_mu (leaf). Deliveries take no agent lock of the sender:
// deliver_mu → the receiver's callback and agent locks.
struct Endpoint {
  explicit Endpoint(uint64_t id) : agent_id(id) {}
  const uint64_t agent_id;
  std::atomic<bool> paused{false};
  std::atomic<bool> dead{false};
  // Held during every copy into or out of this agent's registered memory.
  absl::Mutex mem_mu;
  std::map<RegionId, Memory> memory ABSL_GUARDED_BY(mem_mu);
  // Held while a notification is delivered into this agent.
  absl::Mutex deliver_mu;
  AgentCore* sink ABSL_GUARDED_BY(deliver_mu) = nullptr;  // null once detached
};

absl::Mutex g_registry_mu;
std::map<uint64_t, std::shared_ptr<Endpoint>>& Registry()
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_registry_mu) {
  static auto* agents = new std::map<uint64_t, std::shared_ptr<Endpoint>>();
  return *agents;
}

// The live (not killed, not destroyed) agent `id`, or null.
std::shared_ptr<Endpoint> Find(uint64_t id) {
  absl::MutexLock l(&g_registry_mu);
  auto it = Registry().find(id);
  if (it == Registry().end() || it->second->dead) return nullptr;
  return it->second;
}

std::string IdAddress(uint64_t id) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((id >> (8 * i)) & 0xff);
  return s;
}

absl::Status PeerDied(uint64_t id) {
  return absl::UnavailableError(absl::StrCat("loopback peer ", absl::Hex(id), " died"));
}

}  // namespace

// The loopback transport: a piece is a memmove into (or out of) the target
// agent's memory under its mem_mu, done at once (kDone) unless the target is
// paused (kRetryLater); the fence is a no-op; a notification is handed to the
// target agent directly after the sender released its agent lock.
class LoopbackBackend final : public Backend {
 public:
  void Start(BackendHost* /*host*/, uint64_t agent_id) override {
    self_ = std::make_shared<Endpoint>(agent_id);
    absl::MutexLock l(&g_registry_mu);
    Registry()[agent_id] = self_;
  }
  void SetSink(AgentCore* sink) {
    absl::MutexLock d(&self_->deliver_mu);
    self_->sink = sink;
  }
  void Detach() override {
    {
      absl::MutexLock l(&g_registry_mu);
      Registry().erase(self_->agent_id);
    }
    // Waits out notifications being delivered to us.
    absl::MutexLock d(&self_->deliver_mu);
    self_->sink = nullptr;
  }
  void ShutdownLocked(absl::Time /*deadline*/) override {
    // Every region was deregistered by the agent; peers still holding the
    // endpoint find no memory.
    absl::MutexLock m(&self_->mem_mu);
    for (const auto& [id, r] : self_->memory) {
      if (r.owned) munmap(r.base, r.length);
    }
    self_->memory.clear();
  }

  AgentKind Kind() const override { return AgentKind::kLoopback; }
  absl::string_view Name() const override { return "loopback"; }
  std::string Address() const override { return IdAddress(self_->agent_id); }
  BackendLimits Limits() const override {
    BackendLimits l;
    l.max_piece_bytes = kChunkBytes;
    l.max_inflight_ops = 1;  // pieces complete inline
    l.inline_post_bytes = 0;
    l.spin_while_waiting = false;  // nothing completes by progressing
    return l;
  }
  absl::Status Usable() const override {
    if (self_->dead) return absl::UnavailableError("this agent was killed");
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> RegisterMemoryLocked(RegionId region, void* base,
                                                   size_t len,
                                                   MemoryKind kind) override {
    // Pieces are memmoves by the host.
    if (!kind.is_host()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the loopback transfer agent moves host memory only, not ",
                       MemoryKindName(kind), " memory"));
    }
    absl::MutexLock m(&self_->mem_mu);
    self_->memory[region] = Memory{static_cast<uint8_t*>(base), len, /*owned=*/false};
    return std::string();
  }
  absl::StatusOr<Allocated> AllocateMemoryLocked(RegionId region, size_t len) override {
    void* p =
        mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("mmap of ", len, " bytes failed"));
    }
    absl::MutexLock m(&self_->mem_mu);
    self_->memory[region] = Memory{static_cast<uint8_t*>(p), len, /*owned=*/true};
    return Allocated{p, "", /*zeroed=*/true};
  }
  void DeregisterMemoryLocked(RegionId region) override {
    // Peers copy under mem_mu, so unmapping here is safe.
    absl::MutexLock m(&self_->mem_mu);
    auto it = self_->memory.find(region);
    if (it == self_->memory.end()) return;
    if (it->second.owned) munmap(it->second.base, it->second.length);
    self_->memory.erase(it);
  }

  absl::Status ConnectLocked(PeerId peer, const AgentDescriptor& d) override {
    if (d.address != IdAddress(d.agent_id)) {
      return absl::InvalidArgumentError(
          "loopback descriptor address does not match its agent id");
    }
    if (self_->dead) return absl::UnavailableError("this agent was killed");
    if (Find(d.agent_id) == nullptr) {
      return absl::UnavailableError(
          absl::StrCat("loopback peer ", absl::Hex(d.agent_id), " is not reachable"));
    }
    peers_[peer] = d.agent_id;
    return absl::OkStatus();
  }
  void ClosePeerLocked(PeerId, bool, bool, absl::Time) override {}
  void ForgetPeerLocked(PeerId peer) override { peers_.erase(peer); }
  std::string TransportLocked(PeerId /*peer*/) override { return "loopback"; }

  absl::StatusOr<PostResult> PostPieceLocked(PeerId peer, bool write,
                                             const Piece& piece, OpToken) override {
    if (self_->dead) return absl::UnavailableError("this agent was killed");
    const uint64_t target_id = peers_.at(peer);
    std::shared_ptr<Endpoint> target = Find(target_id);
    if (target == nullptr) return PeerDied(target_id);
    if (target->paused) return PostResult::kRetryLater;
    absl::MutexLock m(&target->mem_mu);
    auto r = target->memory.find(piece.remote->id);
    if (r == target->memory.end() ||
        piece.remote_offset + piece.length > r->second.length) {
      return absl::UnavailableError(
          absl::StrCat("peer region ", piece.remote->id, " is no longer registered"));
    }
    uint8_t* remote = r->second.base + piece.remote_offset;
    auto* mine = static_cast<uint8_t*>(piece.local);
    if (write) {
      std::memmove(remote, mine, piece.length);
    } else {
      std::memmove(mine, remote, piece.length);
    }
    return PostResult::kDone;
  }
  absl::StatusOr<PostResult> PostFenceLocked(PeerId, OpToken) override {
    return PostResult::kDone;  // every piece was copied when posted
  }

  absl::Status SendNotificationLocked(PeerId peer, const Notification& n,
                                      absl::Time /*deadline*/,
                                      std::function<absl::Status()>* deliver) override {
    const uint64_t target_id = peers_.at(peer);
    *deliver = [target_id, n]() {
      std::shared_ptr<Endpoint> target = Find(target_id);
      if (target == nullptr) return PeerDied(target_id);
      absl::MutexLock d(&target->deliver_mu);
      if (target->sink == nullptr) return PeerDied(target_id);
      target->sink->DeliverNotification(n);
      return absl::OkStatus();
    };
    return absl::OkStatus();
  }

  bool ProgressLocked() override { return false; }
  absl::Duration ArmLocked() override { return absl::Milliseconds(100); }
  void Sleep(absl::Duration timeout) override {
    absl::MutexLock l(&wake_mu_);
    wake_mu_.AwaitWithTimeout(absl::Condition(&woken_), timeout);
    woken_ = false;
  }
  void Wake() override {
    absl::MutexLock l(&wake_mu_);
    woken_ = true;
  }

  void SetPaused(bool paused) { self_->paused = paused; }
  void Kill() {
    absl::MutexLock l(&g_registry_mu);
    self_->dead = true;
    Registry().erase(self_->agent_id);
  }

 private:
  std::shared_ptr<Endpoint> self_;
  std::map<PeerId, uint64_t> peers_;  // agent lock: peer → its agent id
  absl::Mutex wake_mu_;
  bool woken_ ABSL_GUARDED_BY(wake_mu_) = false;
};

LoopbackAgent::LoopbackAgent() : LoopbackAgent(new LoopbackBackend()) {}

LoopbackAgent::LoopbackAgent(LoopbackBackend* backend)
    : AgentCore(std::unique_ptr<Backend>(backend)), loopback_(backend) {
  loopback_->SetSink(this);
}

LoopbackAgent::~LoopbackAgent() = default;

void LoopbackAgent::SetPaused(bool paused) { loopback_->SetPaused(paused); }

void LoopbackAgent::Kill() { loopback_->Kill(); }

}  // namespace tandem::kvtransfer
