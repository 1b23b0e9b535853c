// The host-memory tier of the prefix cache (docs/prefix_caching.md, "The
// host-memory tier"): a budgeted pool in host memory that holds the bytes of
// MLA blocks and KDA snapshots the device tier (PrefixCache over the engine's
// KvCache) evicted, keyed by the same chained block hashes / snapshot keys, so
// that a later lookup can load them back instead of recomputing the prefix.
//
// Bookkeeping and bytes only: PrefixCache decides what moves (device eviction
// moves a block and the snapshot at its end here; a hit found here is taken
// out and loaded back into device blocks / a snapshot slot) and the engine does
// the copies (KvCache, every TP rank).
//
// Budget: the bytes of every block and snapshot held (their payloads) stay <=
// budget_bytes. A put that would pass it evicts, least recently used first:
// snapshots and LEAF blocks only (a block whose children are all gone from this
// tier), so a chain loses its deepest blocks before its root and never a middle
// block while its children are here; evicting a block drops the snapshot at its
// end (a snapshot without its block is useless). Pinned entries (a load in
// progress) and the entry being put are never victims; a put that cannot fit
// fails and changes nothing.
//
// Every snapshot dropped (evicted, or with its block) is reported in `removed`
// (a kRemoved event of its position and route hash), for the caller to publish
// when the prefix is usable from neither tier.
//
// Not thread-safe: the prefix cache's owner (the engine loop) uses it.
#ifndef TANDEM_ENGINE_CACHE_HOST_TIER_H_
#define TANDEM_ENGINE_CACHE_HOST_TIER_H_

#include <cstdint>
#include <optional>
#include <set>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/cache/prefix_events.h"

namespace tandem::engine {

// The host tier's budget from --prefix_host_memory: bytes with a unit
// (ParseMemoryBudget's: 64GiB, 512MB, 1048576), "0" for off, or empty for the
// production default min(2 x kv_cache_budget_bytes, mem_available_bytes / 2)
// (SGLang HiCache's ratio of 2, capped at half the host memory available at
// start). A fraction, a negative or garbled size is INVALID_ARGUMENT naming the
// flag; an empty spec with mem_available_bytes <= 0 (unknown) too, asking for bytes.
absl::StatusOr<int64_t> ResolveHostTierBudget(absl::string_view spec,
                                              int64_t kv_cache_budget_bytes,
                                              int64_t mem_available_bytes);

struct HostTierStats {
  int64_t blocks_stored = 0;      // blocks put here
  int64_t snapshots_stored = 0;   // snapshots put here
  int64_t blocks_evicted = 0;     // dropped by this tier's LRU (budget)
  int64_t snapshots_evicted = 0;  // dropped by this tier's LRU, or with a block
  int64_t blocks_taken = 0;       // taken out (loaded back, or recomputed)
  int64_t snapshots_taken = 0;
  int64_t puts_refused = 0;  // puts that could not fit
};

class HostTier {
 public:
  using Hash = uint64_t;
  struct SnapshotInfo {
    int64_t tokens = 0;  // for events
    uint64_t route_hash = 0;
    std::vector<uint8_t> bytes;
  };

  // budget_bytes > 0 (0 is "no host tier": do not make one).
  explicit HostTier(int64_t budget_bytes);
  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  int64_t budget_bytes() const { return budget_; }
  int64_t bytes_held() const { return held_; }
  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  int64_t num_snapshots() const { return static_cast<int64_t>(snapshots_.size()); }
  const HostTierStats& stats() const { return stats_; }

  bool HasBlock(Hash h) const { return blocks_.contains(h); }
  bool HasSnapshot(Hash key) const { return snapshots_.contains(key); }

  // Puts block `h` (child of `parent` when has_parent) with its bytes; false
  // when it cannot fit (then nothing changed). AlreadyExists is a caller bug:
  // false too.
  bool PutBlock(Hash h, Hash parent, bool has_parent, std::vector<uint8_t> bytes,
                std::vector<PrefixEvent>* removed);
  // Puts the snapshot at the end of block `key` (the caller holds that block in
  // one of the tiers); false when it cannot fit.
  bool PutSnapshot(Hash key, int64_t tokens, uint64_t route_hash,
                   std::vector<uint8_t> bytes, std::vector<PrefixEvent>* removed);

  // Takes block `h` out (its bytes; its children here stay, under the same
  // parent hash); nullopt when not here.
  std::optional<std::vector<uint8_t>> TakeBlock(Hash h);
  std::optional<SnapshotInfo> TakeSnapshot(Hash key);
  // The snapshot's event fields without taking it (nullptr: not here).
  const SnapshotInfo* PeekSnapshot(Hash key) const;

  // Drops block `h` (if here), the snapshot at `h` (if here) and every block
  // here below `h` with their snapshots: `h` is gone from every tier, so they
  // can never be reached again.
  void DropSubtree(Hash h, std::vector<PrefixEvent>* removed);
  void DropSnapshot(Hash key, std::vector<PrefixEvent>* removed);
  // Marks as recently used.
  void Touch(Hash h);

  // Entries a load in progress needs: never chosen as victims until Unpin.
  void Pin(absl::Span<const Hash> blocks, std::optional<Hash> snapshot);
  void UnpinAll();

  // Drops everything (no events: the caller publishes one kCleared).
  void Clear();
  // kStored of every snapshot held (for a resync).
  void AppendStored(std::vector<PrefixEvent>* out) const;
  // Every parent hash of a block held, for the caller's cross-tier checks.
  std::vector<std::pair<Hash, Hash>> BlockParents() const;  // (block, parent)
  std::vector<Hash> SnapshotKeys() const;

  // Bytes add up, children counts and the LRU index agree, budget held.
  absl::Status CheckInvariants() const;

 private:
  struct Block {
    Hash parent = 0;
    bool has_parent = false;
    uint64_t last_use = 0;
    std::vector<uint8_t> bytes;
  };
  struct Snap {
    uint64_t last_use = 0;
    SnapshotInfo info;
  };
  enum Kind : int { kSnapshotKind = 0, kBlockKind = 1 };
  using LruKey = std::tuple<uint64_t, int, Hash>;  // last use, kind, hash

  // Evicts victims until `extra` more bytes fit; false when they cannot.
  bool MakeRoom(int64_t extra, std::vector<PrefixEvent>* removed);
  void RemoveBlock(Hash h);  // bookkeeping only (no cascade)
  bool IsLeaf(Hash h) const;

  int64_t budget_;
  int64_t held_ = 0;
  uint64_t clock_ = 0;
  absl::flat_hash_map<Hash, Block> blocks_;
  absl::flat_hash_map<Hash, Snap> snapshots_;
  // parent hash -> hashes of its children held here (the parent may be in
  // either tier, or gone).
  absl::flat_hash_map<Hash, absl::flat_hash_set<Hash>> children_;
  std::set<LruKey> lru_;
  absl::flat_hash_set<Hash> pinned_blocks_;
  absl::flat_hash_set<Hash> pinned_snapshots_;
  HostTierStats stats_;
};

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_CACHE_HOST_TIER_H_
