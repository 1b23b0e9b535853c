#include "prefill/peer_cache.h"

#include "common/status.h"
#include "kvtransfer/descriptor.h"

namespace tandem::prefill {

absl::StatusOr<kvtransfer::PeerId> PeerCache::Get(absl::string_view descriptor) {
  TANDEM_ASSIGN_OR_RETURN(kvtransfer::AgentDescriptor d,
                          kvtransfer::ParseDescriptor(descriptor));
  {
    absl::MutexLock l(&mu_);
    auto it = peers_.find(d.agent_id);
    if (it != peers_.end()) return it->second;
  }
  // Outside the lock: a connect may take a while. Two racing requests may both
  // connect; the first one stored is kept and the other closed.
  TANDEM_ASSIGN_OR_RETURN(kvtransfer::PeerId p, agent_->Connect(descriptor));
  {
    absl::ReleasableMutexLock l(&mu_);
    auto [it, inserted] = peers_.emplace(d.agent_id, p);
    if (inserted) return p;
    if (it->second == p) return p;
    const kvtransfer::PeerId kept = it->second;
    l.Release();
    agent_->Disconnect(p).IgnoreError();
    return kept;
  }
}

void PeerCache::Drop(kvtransfer::PeerId peer) {
  {
    absl::MutexLock l(&mu_);
    for (auto it = peers_.begin(); it != peers_.end(); ++it) {
      if (it->second == peer) {
        peers_.erase(it);
        break;
      }
    }
  }
  agent_->Disconnect(peer).IgnoreError();
}

size_t PeerCache::size() const {
  absl::MutexLock l(&mu_);
  return peers_.size();
}

}  // namespace tandem::prefill
