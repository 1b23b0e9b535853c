// Prefix caching for the hybrid model: which full MLA blocks and which KDA state
// snapshots are cached, by content; bookkeeping only (ids, hashes, counts; the
// bytes live in the engine's KvCache: blocks in the paged MLA pool, snapshots in
// extra KDA slots beside the running sequences' slots).
//
// Content addressing. A prompt's full blocks get chained hashes: block i's hash
// covers the tenant salt, blocks 0..i-1 (through its parent's hash), its own
// token ids and the media hashes placed in it (XXH3-64). Equal hashes mean equal
// prefixes; another `cache_salt` (tenant) never matches.
//
// THE RULE (where a hit may start; UsablePrefix below). A cached prefix is usable
// only up to the deepest position p such that
//   (a) every MLA block before p is cached (blocks 0 .. p/block_size - 1 match),
//   (b) a KDA snapshot taken at exactly position p exists (keyed by the hash of
//       block p/block_size - 1: the state after exactly those tokens), and
//   (c) p is a multiple of the KDA chunk (64) and of the block size, so that the
//       state the request continues from is bit-identical to recomputing the
//       prefix (prompts are cut at chunk multiples: chunk_alignment_test),
//   (d) p < the prompt's length (at least one token is computed, for its logits).
// Matching blocks without a snapshot at their end are NOT a hit (the failure of
// tpu-inference #3358 / SGLang #31474: MLA hits reused at a position whose
// recurrent state is not the one the tokens produced gives wrong output at full
// speed); p = 0 is a miss.
//
// Reference counts. The cache holds one reference (BlockAllocator ref count) on
// every cached block; a running sequence using it holds another. A block is
// evictable only when the cache's is its only reference (ref count 1): blocks of
// running requests are never evicted. Eviction is LRU over leaves only (a block
// whose cached children are gone), so the deepest blocks go before the root and a
// chain never loses a middle block; evicting a block drops the snapshot at its
// end (a snapshot without its blocks is useless). Snapshots have their own pool
// (a fixed number of KDA slots, their share of the memory budget) and LRU.
//
// Events (engine/cache/prefix_events.h): with an event queue set, every snapshot
// stored is a kStored of its position and route hash, every snapshot dropped
// (pool LRU, its block evicted) a kRemoved, and Clear a kCleared: a snapshot
// exists only while all the blocks before it are cached (eviction takes leaves
// and drops the snapshot at the evicted block), so the snapshots held are
// exactly the usable hit positions.
//
// Not thread-safe: the scheduler (one engine loop) owns it (the event queue is
// thread-safe on its own).
#ifndef TANDEM_ENGINE_CACHE_PREFIX_CACHE_H_
#define TANDEM_ENGINE_CACHE_PREFIX_CACHE_H_

#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/cache/block_allocator.h"
#include "engine/cache/host_tier.h"
#include "engine/cache/prefix_events.h"

namespace tandem::engine {

using BlockHash = uint64_t;
// A snapshot's index in the snapshot pool, [0, num_snapshots); the engine keeps
// snapshot s in KDA slot (running slots + s).
using SnapshotId = int32_t;

// The KDA chunk length (KdaChunked): state is bit-identical only at its multiples.
inline constexpr int32_t kKdaChunk = 64;

// A media item's content hash (an image's, later) at a token position: the
// block holding `position` mixes `hash` in, so equal token ids with other media
// do not match.
struct MediaHash {
  int64_t position = 0;
  uint64_t hash = 0;
};

// Chained hashes of the full blocks of `tokens` (tokens.size() / block_size of
// them): hash[i] covers salt, blocks 0..i and the media placed in them.
std::vector<BlockHash> ChainedBlockHashes(absl::Span<const int32_t> tokens,
                                          int32_t block_size, std::string_view salt,
                                          absl::Span<const MediaHash> media = {});

// The rule, as a pure function: the deepest usable position p (0: none) given
// that the first `matched_blocks` blocks are cached, the prompt has
// `prompt_tokens` tokens, and has_snapshot_at(k) tells whether a snapshot exists
// at the end of block k - 1 (position k * block_size). p = k * block_size with
// k <= matched_blocks, p % kda_chunk == 0, p < prompt_tokens, snapshot at k.
int64_t UsablePrefix(int64_t matched_blocks, int32_t block_size, int32_t kda_chunk,
                     int64_t prompt_tokens,
                     const std::function<bool(int64_t blocks)>& has_snapshot_at);

// Positions where a prompt's KDA state is worth a snapshot (the snapshot
// policy), ascending, each a multiple of lcm(kda_chunk, block_size), > hit and
// < prompt_tokens:
//   - the end of the prompt's last full chunk below its last token (the next
//     turn of a chat, or the same prompt again, continues from it);
//   - the branch point: where the prompt leaves the cached blocks it matched
//     (matched_blocks, rounded down), so that the next prompt sharing that
//     prefix (a system prompt, a shared document) hits there even though the
//     first one's own snapshot lies in its unique tokens (vLLM #45238);
//   - every `grid` tokens (0: none) for very long prompts.
std::vector<int64_t> SnapshotPositions(int64_t prompt_tokens, int64_t hit_tokens,
                                       int64_t matched_blocks, int32_t block_size,
                                       int32_t kda_chunk, int64_t grid);

struct PrefixCacheConfig {
  int32_t block_size = 16;
  int32_t kda_chunk = kKdaChunk;
  int32_t num_snapshots = 0;  // the snapshot pool; 0: no snapshots, so no hits
  int64_t snapshot_grid = 0;  // SnapshotPositions' grid (0: off)
};

struct PrefixCacheStats {
  int64_t queried_tokens = 0;  // prompt tokens looked up
  int64_t hit_tokens = 0;      // tokens reused (not computed)
  int64_t lookups = 0;
  int64_t hits = 0;  // lookups with hit_tokens > 0
  int64_t blocks_inserted = 0;
  int64_t blocks_evicted = 0;
  int64_t snapshots_stored = 0;
  int64_t snapshots_evicted = 0;
  // The host tier (set_host_tier): device evictions that moved there instead
  // of being dropped, and loads back into the device tier.
  int64_t blocks_moved_to_host = 0;
  int64_t snapshots_moved_to_host = 0;
  int64_t blocks_loaded_from_host = 0;
  int64_t snapshots_loaded_from_host = 0;
  int64_t hits_from_host = 0;      // lookups whose hit needed a load from the host
  int64_t host_load_failures = 0;  // loads given up (no device room, copy error)
  // Reservations (MatchBlocks): prompt tokens asked about, MLA rows found.
  int64_t reserve_queried_tokens = 0;
  int64_t reserve_hit_tokens = 0;
  double hit_rate() const {
    return queried_tokens > 0 ? static_cast<double>(hit_tokens) / queried_tokens : 0.0;
  }
};

struct PrefixHit {
  int64_t tokens = 0;           // p: positions reused (0: a miss)
  std::vector<BlockId> blocks;  // the cached blocks of [0, p)
  SnapshotId snapshot = -1;     // the KDA state at p
  int64_t matched_blocks = 0;   // leading blocks cached (>= p / block_size)
};

// Copies between the device tier's storage (the engine's KvCache on every TP
// rank) and host bytes, for the host tier. Each fills or reads one whole block
// (every MLA layer, every rank) or one snapshot slot (every KDA layer, every
// rank).
struct PrefixTierCopier {
  std::function<absl::Status(BlockId, std::vector<uint8_t>*)> save_block;
  std::function<absl::Status(BlockId, absl::Span<const uint8_t>)> load_block;
  std::function<absl::Status(SnapshotId, std::vector<uint8_t>*)> save_snapshot;
  std::function<absl::Status(SnapshotId, absl::Span<const uint8_t>)> load_snapshot;
};

class PrefixCache {
 public:
  // `blocks` (not owned) is the pool the cached blocks belong to.
  PrefixCache(const PrefixCacheConfig& config, BlockAllocator* blocks);
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  const PrefixCacheConfig& config() const { return config_; }

  // The usable hit for a prompt of `prompt_tokens` tokens whose full blocks
  // hash to `hashes` (the rule above). Marks what it matched as recently used
  // and counts the lookup unless `record` is false (then RecordLookup counts
  // it once it is used). Takes no references (the caller adopts hit.blocks).
  PrefixHit Lookup(absl::Span<const BlockHash> hashes, int64_t prompt_tokens,
                   bool record = true);
  void RecordLookup(int64_t prompt_tokens, int64_t hit_tokens);

  // The MLA blocks alone: the device-tier blocks of the longest cached chain
  // hashes[0 .. k) (k <= max_blocks), marked recently used. Not a hit by THE
  // RULE (no snapshot is asked for): it serves a decode worker's reservation,
  // whose KDA state arrives whole from the prefill worker, so only the MLA rows
  // before k * block_size need not cross the wire (Scheduler::Reserve). The
  // host tier is not searched (a load there would cost what the wire saves, on
  // the reservation's critical path). Takes no references; counted apart from
  // Lookup's hits (reserve_queried_tokens, reserve_hit_tokens).
  std::vector<BlockId> MatchBlocks(absl::Span<const BlockHash> hashes,
                                   int64_t max_blocks, int64_t queried_tokens);
  // Announces that the MLA blocks of [0, tokens) are cached, `key` being the
  // hash of the last of them (a multiple of 64 tokens, named `route_hash` in
  // the events): a kStored blocks_only event now, and a kRemoved blocks_only
  // one when that block leaves the device tier (prefix_events.h). False (no
  // event) when `key` is not cached or was announced already.
  bool AnnounceBlocks(BlockHash key, int64_t tokens, uint64_t route_hash);

  // Caches block `id` (full, computed, held by the caller) as the block with
  // hash hashes[index] (whose parent is hashes[index - 1]); takes a reference.
  // False (nothing changes) when that hash is already cached (another request
  // computed it first) or its parent is not.
  bool InsertBlock(absl::Span<const BlockHash> hashes, int64_t index, BlockId id);

  // Whether a snapshot exists after hashes' block `key` (its hash), in either tier.
  bool HasSnapshot(BlockHash key) const {
    return snapshots_.contains(key) || (host_ != nullptr && host_->HasSnapshot(key));
  }
  // A pool entry for the KDA state at the end of the block hashed `key`, now
  // registered under it: the caller copies the state into it at once. Evicts
  // the least recently used snapshot when the pool is full. NotFound when the
  // block is not cached (a snapshot without its blocks is useless),
  // AlreadyExists when `key` has one, FailedPrecondition without a pool.
  // `tokens` (the position, a multiple of 64) and `route_hash`
  // (RoutePrefixHash of the prompt at it) name it in the events.
  absl::StatusOr<SnapshotId> StoreSnapshot(BlockHash key, int64_t tokens = 0,
                                           uint64_t route_hash = 0);

  // The host tier (not owned; null: none, evictions drop). From now on a
  // device eviction (Reclaim, the snapshot pool's LRU) moves the block and the
  // snapshot at its end to `host` when they fit (else drops them), and Lookup
  // matches across both tiers and loads what the hit needs from the host into
  // device blocks / a snapshot slot (evicting unreferenced device leaves
  // outside the hit when the pool has no free block) before returning it. A
  // prefix is kRemoved only when usable from neither tier.
  void set_host_tier(HostTier* host, PrefixTierCopier copier) {
    host_ = host;
    copier_ = std::move(copier);
  }
  const HostTier* host_tier() const { return host_; }

  // Events go to `queue` (not owned; null: none) from now on.
  void set_event_queue(PrefixEventQueue* queue) { events_ = queue; }
  // kCleared, then kStored for every snapshot held (ascending positions): the
  // state a consumer rebuilds its index from.
  std::vector<PrefixEvent> ResyncEvents() const;

  // Evicts unreferenced cached blocks (LRU leaves first) until the allocator
  // has `free_blocks` free or nothing more can go; returns how many went.
  int64_t Reclaim(int64_t free_blocks);
  // Drops every cached block (a running sequence keeps its own reference) and
  // every snapshot; the statistics stay.
  void Clear();

  bool Holds(BlockId id) const { return by_block_.contains(id); }
  int64_t num_cached_blocks() const { return static_cast<int64_t>(entries_.size()); }
  // Cached blocks no running sequence holds (what Reclaim could free, at most).
  int64_t num_evictable_blocks() const;
  int32_t num_snapshots() const { return static_cast<int32_t>(snapshots_.size()); }
  const PrefixCacheStats& stats() const { return stats_; }

  // Every cached block is used and has the cache's reference; children counts
  // and the snapshot pool agree. For tests and debug checks.
  absl::Status CheckInvariants() const;

 private:
  struct Entry {
    BlockId block = -1;
    BlockHash parent = 0;
    bool has_parent = false;
    int32_t children = 0;  // cached blocks whose parent this is
    uint64_t last_use = 0;
    // AnnounceBlocks at this block's end (0: not announced).
    int64_t announced_tokens = 0;
    uint64_t announced_route_hash = 0;
  };
  struct Snapshot {
    SnapshotId id = -1;
    uint64_t last_use = 0;
    int64_t tokens = 0;       // for events
    uint64_t route_hash = 0;  // for events
  };
  void Publish(const PrefixEvent& e);
  void PublishAll(const std::vector<PrefixEvent>& events);
  void Evict(BlockHash h);
  void DropSnapshot(BlockHash key);
  // The snapshot pool's LRU victim goes to the host tier (or is dropped).
  void DemoteSnapshot(BlockHash key);
  bool InHost(BlockHash h) const { return host_ != nullptr && host_->HasBlock(h); }
  // Loads hashes[first, blocks) and the snapshot at hashes[blocks - 1] from the
  // host tier into the device tier, marking them used at `now`; false when it
  // could not (what was loaded stays cached on the device).
  bool LoadFromHost(absl::Span<const BlockHash> hashes, int64_t first, int64_t blocks,
                    uint64_t now);
  // A free device block for a load, evicting one unreferenced device leaf not
  // used at `now` (the hit's own blocks) when none is free.
  bool FreeOneForLoad(uint64_t now);

  PrefixCacheConfig config_;
  BlockAllocator* blocks_;  // not owned
  absl::flat_hash_map<BlockHash, Entry> entries_;
  absl::flat_hash_map<BlockId, BlockHash> by_block_;
  absl::flat_hash_map<BlockHash, Snapshot> snapshots_;
  std::vector<SnapshotId> free_snapshots_;  // stack
  uint64_t clock_ = 0;
  PrefixCacheStats stats_;
  PrefixEventQueue* events_ = nullptr;  // not owned
  HostTier* host_ = nullptr;            // not owned; null: no host tier
  PrefixTierCopier copier_;
};

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_CACHE_PREFIX_CACHE_H_
