// PeerCache: the prefill worker's connections to decode workers' transfer
// agents, one per decode agent (keyed by the agent id in its descriptor),
// shared by every request's SendSession.
//
//   Get(descriptor) → cached PeerId, or Connect (UNAVAILABLE / INVALID_ARGUMENT
//                     from the agent) and remember it
//   Drop(peer)      → forget it and Disconnect (its in-flight batches end
//                     CANCELLED); the next Get connects afresh
//
// Thread-safe.
#ifndef TANDEM_PREFILL_PEER_CACHE_H_
#define TANDEM_PREFILL_PEER_CACHE_H_

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kvtransfer/transfer_agent.h"

namespace tandem::prefill {

class PeerCache {
 public:
  // `agent` is not owned and must outlive the cache.
  explicit PeerCache(kvtransfer::TransferAgent* agent) : agent_(agent) {}
  PeerCache(const PeerCache&) = delete;
  PeerCache& operator=(const PeerCache&) = delete;

  absl::StatusOr<kvtransfer::PeerId> Get(absl::string_view descriptor);
  void Drop(kvtransfer::PeerId peer);
  size_t size() const;

 private:
  kvtransfer::TransferAgent* const agent_;  // not owned
  mutable absl::Mutex mu_;
  // Decode agent id -> its connection.
  absl::flat_hash_map<uint64_t, kvtransfer::PeerId> peers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::prefill

#endif  // TANDEM_PREFILL_PEER_CACHE_H_
