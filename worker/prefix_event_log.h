// The worker's side of cache-aware routing (router/prefix_routing.h): the
// engine's prefix events (engine/cache/prefix_events.h) numbered into one
// stream per process (an epoch), kept until the router acknowledges them,
// and a mirror of every usable prefix the engine holds, for the full snapshot
// a registration carries.
//
//   Add(engine events)  → mirror updated; each event gets seq = last + 1
//   FillRegister        → epoch, seq (the last), snapshot (STORED per mirror
//                         entry); the snapshot covers every pending event
//   FillHeartbeat       → epoch, first pending seq (or the next), pending
//                         events (at most max_per_report, oldest first)
//   OnHeartbeatResponse → forget events <= prefix_acked_seq; resync asked →
//                         needs_register() (register again with a snapshot)
//   more than max_pending unacknowledged (a router unreachable for long) →
//                         pending dropped, needs_register()
// A lost heartbeat (RPC error) is no loss: its events stay pending and go
// again; the router skips those it applied. Not thread-safe (the
// registration thread owns it).
#ifndef TANDEM_WORKER_PREFIX_EVENT_LOG_H_
#define TANDEM_WORKER_PREFIX_EVENT_LOG_H_

#include <cstdint>
#include <deque>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "engine/cache/prefix_events.h"
#include "proto/worker.pb.h"

namespace tandem::worker {

class PrefixEventLog {
 public:
  // `epoch` != 0 (RandomPrefixEpoch()).
  explicit PrefixEventLog(uint64_t epoch, int64_t max_pending = 1 << 16,
                          int max_per_report = 4096);

  void Add(const std::vector<engine::PrefixEvent>& events);
  void FillRegister(tandem::v1::RegisterRequest* request);
  void FillHeartbeat(tandem::v1::HeartbeatRequest* request) const;
  // The answer to a heartbeat that reached the router (known = true).
  void OnHeartbeatResponse(const tandem::v1::HeartbeatResponse& response);

  bool needs_register() const { return needs_register_; }
  bool has_pending() const { return !pending_.empty(); }
  uint64_t epoch() const { return epoch_; }
  uint64_t last_seq() const { return last_seq_; }
  int64_t pending() const { return static_cast<int64_t>(pending_.size()); }
  // Usable prefixes the engine holds (the mirror), and its blocks-only
  // announcements (prefix_events.h).
  int64_t held() const { return static_cast<int64_t>(held_.size()); }
  int64_t held_blocks() const { return static_cast<int64_t>(held_blocks_.size()); }

 private:
  const uint64_t epoch_;
  const int64_t max_pending_;
  const int max_per_report_;
  uint64_t last_seq_ = 0;  // of the last event numbered
  // Unacknowledged events, seq order: pending_[i] has seq first_pending_ + i.
  std::deque<tandem::v1::PrefixCacheEvent> pending_;
  uint64_t first_pending_ = 1;
  bool needs_register_ = false;
  absl::flat_hash_map<uint64_t, int64_t> held_;         // route hash -> tokens
  absl::flat_hash_map<uint64_t, int64_t> held_blocks_;  // blocks_only ones
};

// A random epoch, never 0.
uint64_t RandomPrefixEpoch();

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_PREFIX_EVENT_LOG_H_
