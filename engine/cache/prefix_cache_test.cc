#include "engine/cache/prefix_cache.h"

#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

std::vector<int32_t> Tokens(int n, int seed) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = (i * 7919 + seed * 104729) % 50000;
  return t;
}

TEST(ChainedBlockHashesTest, ChainsSaltsAndMedia) {
  const std::vector<int32_t> a = Tokens(100, 1);
  std::vector<int32_t> b = a;
  b[40] += 1;  // block 2 (of 16) differs
  const auto ha = ChainedBlockHashes(a, 16, "");
  const auto hb = ChainedBlockHashes(b, 16, "");
  ASSERT_EQ(ha.size(), 6u);  // full blocks only
  EXPECT_EQ(ha[0], hb[0]);
  EXPECT_EQ(ha[1], hb[1]);
  for (int i = 2; i < 6; ++i) EXPECT_NE(ha[i], hb[i]) << i;  // chained: all after
  // Another tenant never matches, even block 0.
  const auto hs = ChainedBlockHashes(a, 16, "tenant-b");
  for (int i = 0; i < 6; ++i) EXPECT_NE(ha[i], hs[i]);
  EXPECT_EQ(ChainedBlockHashes(a, 16, "tenant-b"), hs);  // deterministic
  // Media in block 3 changes blocks 3.. only.
  const MediaHash m{50, 0xabcdef};
  const auto hm = ChainedBlockHashes(a, 16, "", {&m, 1});
  EXPECT_EQ(hm[2], ha[2]);
  EXPECT_NE(hm[3], ha[3]);
  // Equal blocks at other depths hash differently (the parent is mixed in).
  std::vector<int32_t> rep(64, 5);
  const auto hr = ChainedBlockHashes(rep, 16, "");
  EXPECT_NE(hr[0], hr[1]);
}

// The rule, as a table: (matched blocks, block size, prompt tokens, snapshot
// block counts) -> the usable prefix.
struct RuleCase {
  const char* name;
  int64_t matched;
  int32_t block_size;
  int64_t prompt;
  std::set<int64_t> snapshots;  // k: a snapshot at position k * block_size
  int64_t want;
};

TEST(UsablePrefixTest, Table) {
  const std::vector<RuleCase> cases = {
      {"no blocks", 0, 16, 1000, {4}, 0},
      {"blocks but no snapshot: a miss, not an MLA-only hit", 10, 16, 1000, {}, 0},
      {"snapshot at 64", 10, 16, 1000, {4}, 64},
      {"deepest snapshot wins", 10, 16, 1000, {4, 8}, 128},
      {"snapshot beyond the matched blocks is unusable", 6, 16, 1000, {4, 8}, 64},
      {"snapshot off the KDA chunk is never used", 10, 16, 1000, {3, 5, 6}, 0},
      {"chunk multiple, block multiple", 10, 16, 1000, {3, 4, 5}, 64},
      {"p must leave a token: prompt of exactly 128", 8, 16, 128, {8}, 0},
      {"p must leave a token: falls back to 64", 8, 16, 128, {4, 8}, 64},
      {"prompt 129 uses 128", 8, 16, 129, {8}, 128},
      {"block size 32: k = 2 is position 64", 4, 32, 1000, {2}, 64},
      {"block size 32: k = 3 (96) is off chunk", 4, 32, 1000, {3}, 0},
      {"block size 128: every block end aligned", 3, 128, 1000, {1, 3}, 384},
      {"block size 48: lcm 192", 5, 48, 1000, {1, 2, 3, 4}, 192},
  };
  for (const RuleCase& c : cases) {
    const int64_t got =
        UsablePrefix(c.matched, c.block_size, kKdaChunk, c.prompt,
                     [&](int64_t k) { return c.snapshots.contains(k); });
    EXPECT_EQ(got, c.want) << c.name;
  }
}

TEST(SnapshotPositionsTest, Table) {
  struct Case {
    const char* name;
    int64_t prompt, hit, matched;
    int64_t grid;
    std::vector<int64_t> want;
  };
  const std::vector<Case> cases = {
      {"short prompt: nothing aligned below it", 50, 0, 0, 0, {}},
      {"last full chunk below the last token", 200, 0, 0, 0, {192}},
      {"prompt of 128: 64 (128 would leave no token)", 128, 0, 0, 0, {64}},
      {"prompt of 129", 129, 0, 0, 0, {128}},
      {"branch point rounded down", 300, 0, 10 /*160*/, 0, {128, 256}},
      {"branch point at the hit: nothing new there", 300, 128, 8, 0, {256}},
      {"hit at the last chunk: nothing to store", 200, 192, 12, 0, {}},
      {"grid", 1000, 0, 0, 256, {256, 512, 768, 960}},
      {"grid above the hit only", 1000, 512, 32, 256, {768, 960}},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(SnapshotPositions(c.prompt, c.hit, c.matched, 16, kKdaChunk, c.grid),
              c.want)
        << c.name;
  }
}

struct Fixture {
  explicit Fixture(int32_t blocks, int32_t snapshots)
      : alloc(blocks), cache({16, kKdaChunk, snapshots, 0}, &alloc) {}
  BlockAllocator alloc;
  PrefixCache cache;
};

// A "request" computing `hashes.size()` blocks: allocates, inserts, releases.
std::vector<BlockId> Compute(Fixture* f, const std::vector<BlockHash>& h,
                             bool release = true) {
  std::vector<BlockId> ids;
  EXPECT_TRUE(f->alloc.AllocateN(h.size(), &ids).ok());
  for (size_t i = 0; i < h.size(); ++i) f->cache.InsertBlock(h, i, ids[i]);
  if (release) {
    for (BlockId b : ids) EXPECT_TRUE(f->alloc.Free(b).ok());
  }
  return ids;
}

TEST(PrefixCacheTest, HitNeedsBlocksAndSnapshotAtTheSamePosition) {
  Fixture f(64, 4);
  const auto h = ChainedBlockHashes(Tokens(16 * 10, 3), 16, "");
  Compute(&f, h);
  EXPECT_EQ(f.cache.Lookup(h, 1000).tokens, 0);   // blocks only: a miss
  ASSERT_TRUE(f.cache.StoreSnapshot(h[7]).ok());  // position 128
  PrefixHit hit = f.cache.Lookup(h, 1000);
  EXPECT_EQ(hit.tokens, 128);
  EXPECT_EQ(hit.blocks.size(), 8u);
  EXPECT_EQ(hit.matched_blocks, 10);
  EXPECT_GE(hit.snapshot, 0);
  // Snapshot keyed by a block that is not cached: refused.
  EXPECT_EQ(f.cache.StoreSnapshot(12345).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(f.cache.StoreSnapshot(h[7]).status().code(),
            absl::StatusCode::kAlreadyExists);
  // Another tenant: nothing.
  EXPECT_EQ(f.cache.Lookup(ChainedBlockHashes(Tokens(160, 3), 16, "x"), 1000).tokens,
            0);
  EXPECT_TRUE(f.cache.CheckInvariants().ok());
  EXPECT_EQ(f.cache.stats().hits, 1);
  EXPECT_EQ(f.cache.stats().hit_tokens, 128);
}

TEST(PrefixCacheTest, ReferencedBlocksAreNeverEvicted) {
  Fixture f(12, 2);
  const auto h = ChainedBlockHashes(Tokens(16 * 8, 4), 16, "");
  std::vector<BlockId> held = Compute(&f, h, /*release=*/false);  // running
  EXPECT_EQ(f.alloc.num_free(), 4);
  EXPECT_EQ(f.cache.Reclaim(12), 0);
  EXPECT_EQ(f.cache.num_evictable_blocks(), 0);
  for (BlockId b : held) ASSERT_TRUE(f.alloc.Free(b).ok());  // it finishes
  EXPECT_EQ(f.cache.num_evictable_blocks(), 8);
  EXPECT_EQ(f.cache.Reclaim(6), 2);
  EXPECT_EQ(f.alloc.num_free(), 6);
  // Leaves first: the root chain survives, the deepest blocks went.
  EXPECT_EQ(f.cache.Lookup(h, 1000).matched_blocks, 6);
  EXPECT_TRUE(f.cache.CheckInvariants().ok());
}

TEST(PrefixCacheTest, EvictionIsLruAndDropsTheSnapshotAtTheBlock) {
  Fixture f(16, 2);
  const auto a = ChainedBlockHashes(Tokens(16 * 4, 5), 16, "");
  const auto b = ChainedBlockHashes(Tokens(16 * 4, 6), 16, "");
  Compute(&f, a);
  Compute(&f, b);
  ASSERT_TRUE(f.cache.StoreSnapshot(a[3]).ok());
  ASSERT_TRUE(f.cache.StoreSnapshot(b[3]).ok());
  EXPECT_EQ(f.cache.Lookup(a, 100).tokens, 64);  // a is now the most recent
  EXPECT_EQ(f.cache.Reclaim(16), 8);             // everything unreferenced goes
  EXPECT_EQ(f.cache.num_snapshots(), 0);
  Compute(&f, a);
  Compute(&f, b);
  ASSERT_TRUE(f.cache.StoreSnapshot(a[3]).ok());
  ASSERT_TRUE(f.cache.StoreSnapshot(b[3]).ok());
  EXPECT_EQ(f.cache.Lookup(a, 100).tokens, 64);
  EXPECT_EQ(f.cache.Reclaim(9), 1);  // b's leaf (least recent), with its snapshot
  EXPECT_EQ(f.cache.Lookup(b, 100).tokens, 0);
  EXPECT_EQ(f.cache.Lookup(a, 100).tokens, 64);
  EXPECT_TRUE(f.cache.CheckInvariants().ok());
}

TEST(PrefixCacheTest, SnapshotPoolEvictsLeastRecentlyUsed) {
  Fixture f(64, 2);
  std::vector<std::vector<BlockHash>> h;
  for (int i = 0; i < 3; ++i) {
    h.push_back(ChainedBlockHashes(Tokens(64, 10 + i), 16, ""));
    Compute(&f, h.back());
  }
  ASSERT_TRUE(f.cache.StoreSnapshot(h[0][3]).ok());
  ASSERT_TRUE(f.cache.StoreSnapshot(h[1][3]).ok());
  EXPECT_EQ(f.cache.Lookup(h[0], 100).tokens, 64);   // 0 used again
  ASSERT_TRUE(f.cache.StoreSnapshot(h[2][3]).ok());  // evicts 1's
  EXPECT_EQ(f.cache.Lookup(h[1], 100).tokens, 0);
  EXPECT_EQ(f.cache.Lookup(h[0], 100).tokens, 64);
  EXPECT_EQ(f.cache.Lookup(h[2], 100).tokens, 64);
  EXPECT_EQ(f.cache.stats().snapshots_evicted, 1);
  f.cache.Clear();
  EXPECT_EQ(f.alloc.num_free(), 64);
  EXPECT_TRUE(f.cache.CheckInvariants().ok());
}

TEST(PrefixCacheTest, WithoutAPoolNothingHits) {
  Fixture f(16, 0);
  const auto h = ChainedBlockHashes(Tokens(64, 1), 16, "");
  Compute(&f, h);
  EXPECT_FALSE(f.cache.StoreSnapshot(h[3]).ok());
  EXPECT_EQ(f.cache.Lookup(h, 100).tokens, 0);
}

// Random insert / lookup-and-adopt / finish / cancel / reclaim sequences: a
// block a live "request" holds is never freed under it, counts balance.
TEST(PrefixCacheTest, FuzzNeverFreesABlockInUse) {
  std::mt19937_64 rng(7);
  Fixture f(96, 6);
  std::vector<std::vector<BlockHash>> prompts;
  for (int i = 0; i < 8; ++i) {
    // Shared first 4 blocks for half of them.
    std::vector<int32_t> t = Tokens(64, i % 2 == 0 ? 100 : 200 + i);
    std::vector<int32_t> tail = Tokens(16 * (2 + i % 5), 300 + i);
    t.insert(t.end(), tail.begin(), tail.end());
    prompts.push_back(ChainedBlockHashes(t, 16, ""));
  }
  struct Live {
    std::vector<BlockId> blocks;
  };
  std::map<int, Live> live;
  int next = 0;
  for (int step = 0; step < 3000; ++step) {
    const int op = static_cast<int>(rng() % 4);
    if (op == 0 || live.empty()) {  // a request: lookup, adopt, compute the rest
      const auto& h = prompts[rng() % prompts.size()];
      PrefixHit hit = f.cache.Lookup(h, static_cast<int64_t>(h.size()) * 16 + 1);
      Live l;
      for (BlockId b : hit.blocks) {
        ASSERT_TRUE(f.alloc.IncRef(b).ok());
        l.blocks.push_back(b);
      }
      const int64_t need = static_cast<int64_t>(h.size() - hit.blocks.size());
      f.cache.Reclaim(need);
      if (!f.alloc.AllocateN(need, &l.blocks).ok()) {
        for (BlockId b : l.blocks) ASSERT_TRUE(f.alloc.Free(b).ok());
        continue;
      }
      for (size_t i = hit.blocks.size(); i < h.size(); ++i) {
        f.cache.InsertBlock(h, i, l.blocks[i]);
      }
      if (h.size() >= 4 && rng() % 2 == 0) f.cache.StoreSnapshot(h[3]).IgnoreError();
      live[next++] = std::move(l);
    } else if (op == 1 || op == 2) {  // finish or cancel
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      for (BlockId b : it->second.blocks) ASSERT_TRUE(f.alloc.Free(b).ok());
      live.erase(it);
    } else {
      f.cache.Reclaim(static_cast<int64_t>(rng() % 96));
    }
    for (const auto& [id, l] : live) {
      for (BlockId b : l.blocks) ASSERT_GE(f.alloc.ref_count(b), 1) << "freed in use";
    }
    ASSERT_TRUE(f.cache.CheckInvariants().ok()) << f.cache.CheckInvariants();
    ASSERT_TRUE(f.alloc.CheckInvariants().ok());
  }
  for (const auto& [id, l] : live) {
    for (BlockId b : l.blocks) ASSERT_TRUE(f.alloc.Free(b).ok());
  }
  f.cache.Clear();
  EXPECT_EQ(f.alloc.num_free(), 96);
}

// The router's view: an index of usable prefixes rebuilt from the events alone.
// A kStored of a prefix already indexed, or a kRemoved of one that is not, is a
// broken stream.
struct EventIndex {
  std::map<uint64_t, int64_t> held;  // route hash -> tokens
  int64_t stored = 0, removed = 0, cleared = 0;
  void Apply(const std::vector<PrefixEvent>& events) {
    for (const PrefixEvent& e : events) {
      switch (e.kind) {
        case PrefixEvent::Kind::kStored:
          ++stored;
          EXPECT_TRUE(held.emplace(e.route_hash, e.tokens).second) << e.route_hash;
          break;
        case PrefixEvent::Kind::kRemoved:
          ++removed;
          EXPECT_EQ(held.erase(e.route_hash), 1u) << e.route_hash;
          break;
        case PrefixEvent::Kind::kCleared:
          ++cleared;
          held.clear();
          break;
      }
    }
  }
  // Equal to what the cache holds (its resync lists every snapshot).
  void ExpectMatches(const PrefixCache& cache) const {
    std::map<uint64_t, int64_t> want;
    for (const PrefixEvent& e : cache.ResyncEvents()) {
      if (e.kind == PrefixEvent::Kind::kStored) want[e.route_hash] = e.tokens;
    }
    EXPECT_EQ(held, want);
    EXPECT_EQ(static_cast<int32_t>(held.size()), cache.num_snapshots());
  }
};

TEST(PrefixCacheEventsTest, StoredRemovedClearedNameUsablePrefixes) {
  Fixture f(16, 2);
  PrefixEventQueue q(64);
  f.cache.set_event_queue(&q);
  const auto a = ChainedBlockHashes(Tokens(16 * 8, 5), 16, "");
  const auto b = ChainedBlockHashes(Tokens(16 * 4, 6), 16, "");
  Compute(&f, a);
  Compute(&f, b);
  EXPECT_TRUE(q.Take().empty());  // blocks alone are no usable prefix
  ASSERT_TRUE(f.cache.StoreSnapshot(a[3], 64, 0xa64).ok());
  ASSERT_TRUE(f.cache.StoreSnapshot(a[7], 128, 0xa128).ok());
  std::vector<PrefixEvent> ev = q.Take();
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0], (PrefixEvent{PrefixEvent::Kind::kStored, 64, 0xa64}));
  EXPECT_EQ(ev[1], (PrefixEvent{PrefixEvent::Kind::kStored, 128, 0xa128}));
  // The pool (2) is full: b's snapshot evicts the least recently used (a at 64).
  EXPECT_EQ(f.cache.Lookup(a, 1000).tokens, 128);  // touches a[7]'s snapshot
  ASSERT_TRUE(f.cache.StoreSnapshot(b[3], 64, 0xb64).ok());
  ev = q.Take();
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0], (PrefixEvent{PrefixEvent::Kind::kRemoved, 64, 0xa64}));
  EXPECT_EQ(ev[1], (PrefixEvent{PrefixEvent::Kind::kStored, 64, 0xb64}));
  // Evicting a's deepest block drops the snapshot at its end: removed.
  EXPECT_EQ(f.cache.Lookup(b, 1000).tokens, 64);  // b most recent
  EXPECT_EQ(f.cache.Reclaim(5), 1);               // a[7], the LRU leaf
  ev = q.Take();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0], (PrefixEvent{PrefixEvent::Kind::kRemoved, 128, 0xa128}));
  EXPECT_EQ(f.cache.Lookup(a, 1000).tokens, 0);
  EXPECT_EQ(f.cache.Lookup(b, 1000).tokens, 64);  // b most recent again
  // Evicting blocks without snapshots (a's, LRU) says nothing.
  EXPECT_EQ(f.cache.Reclaim(11), 6);
  EXPECT_TRUE(q.Take().empty());
  f.cache.Clear();
  ev = q.Take();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, PrefixEvent::Kind::kCleared);
  EXPECT_TRUE(f.cache.CheckInvariants().ok());
}

// Block announcements (a decode worker's landed prompts): a blocks_only
// kStored once per block, in the resync, and a blocks_only kRemoved when the
// block leaves the device tier; never for a block not cached.
TEST(PrefixCacheEventsTest, AnnouncedBlocksAreStoredAndRemovedBlocksOnly) {
  Fixture f(16, 2);
  PrefixEventQueue q(64);
  f.cache.set_event_queue(&q);
  const auto a = ChainedBlockHashes(Tokens(16 * 8, 5), 16, "");
  Compute(&f, a);
  EXPECT_TRUE(f.cache.AnnounceBlocks(a[7], 128, 0xa128));
  EXPECT_FALSE(f.cache.AnnounceBlocks(a[7], 128, 0xa128));  // once
  EXPECT_FALSE(f.cache.AnnounceBlocks(0x1234, 64, 0x99));   // not cached
  std::vector<PrefixEvent> ev = q.Take();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0], (PrefixEvent{PrefixEvent::Kind::kStored, 128, 0xa128, true}));
  EXPECT_NE(ev[0], (PrefixEvent{PrefixEvent::Kind::kStored, 128, 0xa128, false}));
  // A snapshot at a[3] as well: the resync lists both kinds.
  ASSERT_TRUE(f.cache.StoreSnapshot(a[3], 64, 0xa64).ok());
  q.Take();
  const std::vector<PrefixEvent> sync = f.cache.ResyncEvents();
  ASSERT_EQ(sync.size(), 3u);
  EXPECT_EQ(sync[0].kind, PrefixEvent::Kind::kCleared);
  EXPECT_EQ(sync[1], (PrefixEvent{PrefixEvent::Kind::kStored, 64, 0xa64, false}));
  EXPECT_EQ(sync[2], (PrefixEvent{PrefixEvent::Kind::kStored, 128, 0xa128, true}));
  // Evicting the announced leaf: removed, blocks_only; the snapshot stays.
  EXPECT_EQ(f.cache.Reclaim(9), 1);
  ev = q.Take();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0], (PrefixEvent{PrefixEvent::Kind::kRemoved, 128, 0xa128, true}));
  EXPECT_EQ(f.cache.Lookup(a, 1000).tokens, 64);
  EXPECT_TRUE(f.cache.CheckInvariants().ok());
}

TEST(PrefixCacheEventsTest, OverflowResyncsTheConsumer) {
  Fixture f(64, 6);
  PrefixEventQueue q(3);
  f.cache.set_event_queue(&q);
  EventIndex index;
  std::vector<std::vector<BlockHash>> h;
  for (int i = 0; i < 6; ++i) {
    h.push_back(ChainedBlockHashes(Tokens(64, 20 + i), 16, ""));
    Compute(&f, h.back());
  }
  // Six stores into a queue of three: the fourth push resyncs (cleared + the
  // four held), the fifth and sixth overflow again.
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(f.cache.StoreSnapshot(h[i][3], 64, 1000 + i).ok());
  }
  EXPECT_GE(q.overflows(), 1);
  const std::vector<PrefixEvent> ev = q.Take();
  ASSERT_FALSE(ev.empty());
  index.Apply(ev);
  index.ExpectMatches(f.cache);
  EXPECT_EQ(index.held.size(), 6u);
}

// Random traffic with a consumer draining at random moments: the index the
// events build always equals the snapshots held, and the counts balance
// (stored - removed = held, once no kCleared came).
TEST(PrefixCacheEventsTest, FuzzEventsTrackTheHeldSnapshots) {
  std::mt19937_64 rng(11);
  Fixture f(80, 5);
  PrefixEventQueue q(1 << 16);
  f.cache.set_event_queue(&q);
  EventIndex index;
  std::vector<std::vector<BlockHash>> prompts;
  for (int i = 0; i < 10; ++i) {
    std::vector<int32_t> t = Tokens(64, i % 3 == 0 ? 100 : 200 + i);
    std::vector<int32_t> tail = Tokens(16 * (4 + 4 * (i % 3)), 300 + i);
    t.insert(t.end(), tail.begin(), tail.end());
    prompts.push_back(ChainedBlockHashes(t, 16, ""));
  }
  std::vector<std::vector<BlockId>> live;
  for (int step = 0; step < 2000; ++step) {
    const int op = static_cast<int>(rng() % 5);
    if (op <= 1 || live.empty()) {
      const size_t which = rng() % prompts.size();
      const auto& h = prompts[which];
      PrefixHit hit = f.cache.Lookup(h, static_cast<int64_t>(h.size()) * 16 + 1);
      std::vector<BlockId> blocks;
      for (BlockId b : hit.blocks) {
        ASSERT_TRUE(f.alloc.IncRef(b).ok());
        blocks.push_back(b);
      }
      const int64_t need = static_cast<int64_t>(h.size() - hit.blocks.size());
      f.cache.Reclaim(need);
      if (!f.alloc.AllocateN(need, &blocks).ok()) {
        for (BlockId b : blocks) ASSERT_TRUE(f.alloc.Free(b).ok());
        continue;
      }
      for (size_t i = hit.blocks.size(); i < h.size(); ++i) {
        f.cache.InsertBlock(h, i, blocks[i]);
      }
      for (size_t k = 4; k <= h.size(); k += 4) {
        if (rng() % 2 == 0) {
          f.cache.StoreSnapshot(h[k - 1], 16 * k, which * 1000 + k).IgnoreError();
        }
      }
      live.push_back(std::move(blocks));
    } else if (op == 2) {
      const size_t i = rng() % live.size();
      for (BlockId b : live[i]) ASSERT_TRUE(f.alloc.Free(b).ok());
      live.erase(live.begin() + i);
    } else if (op == 3) {
      f.cache.Reclaim(static_cast<int64_t>(rng() % 80));
    } else {
      index.Apply(q.Take());
      index.ExpectMatches(f.cache);
      if (rng() % 50 == 0) f.cache.Clear();
    }
  }
  index.Apply(q.Take());
  index.ExpectMatches(f.cache);
  EXPECT_GT(index.stored, 50);
  EXPECT_GT(index.removed, 10);
  for (const auto& blocks : live) {
    for (BlockId b : blocks) ASSERT_TRUE(f.alloc.Free(b).ok());
  }
  f.cache.Clear();
  index.Apply(q.Take());
  EXPECT_TRUE(index.held.empty());
  EXPECT_EQ(f.alloc.num_free(), 80);
}

}  // namespace
}  // namespace tandem::engine
