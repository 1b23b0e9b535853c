// Prefix-cache events for cache-aware routing: what a worker's cache can serve,
// as the router sees it (router/prefix_routing.h keeps a per-worker index of
// them, fed over the heartbeat stream).
//
// An event names a USABLE hit position p (engine/cache/prefix_cache.h, the
// rule): a KDA snapshot taken at exactly p exists and every MLA block before p
// is cached. p is a multiple of 64 (the KDA chunk), so the router can name the
// prefix by the 64-token chained hash both sides compute
// (common/route_hash.h: route_hash = RoutePrefixHash(prompt, p, cache_salt)).
//   kStored:  the prefix tokens [0, p) became usable (a snapshot was stored);
//   kRemoved: it stopped being usable (the snapshot was dropped, or a block
//             before it was evicted, which drops it);
//   kCleared: every prefix is gone (ResetPrefixCache, or a resync).
// blocks_only events name a weaker holding: the MLA blocks of [0, p) are
// cached in the device tier but no snapshot at p need exist. They serve
// decode workers' reservations (a decode-side prefix hit needs the MLA rows
// only: the KDA state arrives whole), so the router can send a request to the
// decode worker already holding most of its prompt. A decode worker announces
// each landed or computed prompt's cached blocks at its deepest 64-multiple,
// branch point and grid (Scheduler AnnouncedPositions,
// PrefixCache::AnnounceBlocks); kRemoved blocks_only when that block leaves
// the device tier. A usable position does not imply them: its blocks may be
// in the host tier, which a reservation does not search.
// The queue is bounded: when a push would overflow it, its contents are
// replaced by a resync (kCleared, then kStored for every usable prefix held),
// so a consumer that falls behind rebuilds its index from the stream alone.
// Thread-safe: the engine thread pushes, any thread takes.
#ifndef TANDEM_ENGINE_CACHE_PREFIX_EVENTS_H_
#define TANDEM_ENGINE_CACHE_PREFIX_EVENTS_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace tandem::engine {

struct PrefixEvent {
  enum class Kind { kStored, kRemoved, kCleared };
  Kind kind = Kind::kStored;
  int64_t tokens = 0;        // p (0 for kCleared)
  uint64_t route_hash = 0;   // RoutePrefixHash(prompt, p, cache_salt) (0: kCleared)
  bool blocks_only = false;  // the MLA blocks of [0, p), no snapshot implied

  bool operator==(const PrefixEvent& o) const {
    return kind == o.kind && tokens == o.tokens && route_hash == o.route_hash &&
           blocks_only == o.blocks_only;
  }
};

const char* PrefixEventKindName(PrefixEvent::Kind kind);

class PrefixEventQueue {
 public:
  // `capacity` >= 1: pending events at most before a resync replaces them.
  explicit PrefixEventQueue(int64_t capacity);
  PrefixEventQueue(const PrefixEventQueue&) = delete;
  PrefixEventQueue& operator=(const PrefixEventQueue&) = delete;

  // Appends `event`; when the queue is full, replaces everything pending with
  // resync() (the producer's current state: kCleared + one kStored per usable
  // prefix; it runs under the queue's lock and must not call back into it).
  void Push(const PrefixEvent& event,
            const std::function<std::vector<PrefixEvent>()>& resync);
  // Everything pending, oldest first; the queue is empty afterwards.
  std::vector<PrefixEvent> Take();

  int64_t capacity() const { return capacity_; }
  int64_t size() const;
  // Times a push overflowed and the queue was replaced by a resync.
  int64_t overflows() const;

 private:
  const int64_t capacity_;
  mutable absl::Mutex mu_;
  std::vector<PrefixEvent> pending_ ABSL_GUARDED_BY(mu_);
  int64_t overflows_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_CACHE_PREFIX_EVENTS_H_
