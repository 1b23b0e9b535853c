#include "engine/cache/host_tier.h"

#include <cstdint>
#include <map>
#include <random>
#include <vector>

#include "engine/cache/block_allocator.h"
#include "engine/cache/prefix_cache.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

std::vector<uint8_t> Bytes(size_t n, uint8_t v) { return std::vector<uint8_t>(n, v); }

TEST(ResolveHostTierBudgetTest, Table) {
  constexpr int64_t kGiB = int64_t{1} << 30;
  // Default: twice the KV cache budget, capped at half the available memory.
  EXPECT_EQ(*ResolveHostTierBudget("", 8 * kGiB, 100 * kGiB), 16 * kGiB);
  EXPECT_EQ(*ResolveHostTierBudget("", 80 * kGiB, 100 * kGiB), 50 * kGiB);
  EXPECT_EQ(*ResolveHostTierBudget("0", 8 * kGiB, 100 * kGiB), 0);
  EXPECT_EQ(*ResolveHostTierBudget("512MiB", 8 * kGiB, 0), 512 << 20);
  EXPECT_EQ(*ResolveHostTierBudget("2G", 0, 0), 2 * kGiB);
  EXPECT_EQ(*ResolveHostTierBudget("1048576", 0, 0), 1 << 20);
  for (const char* bad : {"0.5", "-1", "lots", "12XB"}) {
    auto r = ResolveHostTierBudget(bad, 8 * kGiB, 100 * kGiB);
    EXPECT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("--prefix_host_memory"), std::string::npos)
        << r.status();
  }
  EXPECT_FALSE(ResolveHostTierBudget("", 8 * kGiB, 0).ok());  // unknown: ask for bytes
}

TEST(HostTierTest, BudgetLeavesFirstAndPins) {
  HostTier t(300);
  std::vector<PrefixEvent> removed;
  // A chain a <- b <- c (100 bytes each) fills the budget.
  ASSERT_TRUE(t.PutBlock(1, 0, false, Bytes(100, 1), &removed));
  ASSERT_TRUE(t.PutBlock(2, 1, true, Bytes(100, 2), &removed));
  ASSERT_TRUE(t.PutBlock(3, 2, true, Bytes(100, 3), &removed));
  EXPECT_EQ(t.bytes_held(), 300);
  // Too big for the whole budget: refused, nothing changes.
  EXPECT_FALSE(t.PutBlock(9, 0, false, Bytes(301, 9), &removed));
  EXPECT_EQ(t.num_blocks(), 3);
  // Another root: the LRU leaf goes (c, the deepest), not the older root a.
  ASSERT_TRUE(t.PutBlock(4, 0, false, Bytes(100, 4), &removed));
  EXPECT_FALSE(t.HasBlock(3));
  EXPECT_TRUE(t.HasBlock(1));
  EXPECT_TRUE(t.HasBlock(2));
  // A snapshot at b (50 bytes): b is the least recently used leaf, but the
  // block of the snapshot being put stays, so the next leaf (4) goes.
  ASSERT_TRUE(t.PutSnapshot(2, 128, 77, Bytes(50, 5), &removed));
  EXPECT_TRUE(t.HasBlock(2));
  EXPECT_FALSE(t.HasBlock(4));
  EXPECT_TRUE(removed.empty());
  // Evicting b later drops the snapshot at its end: one kRemoved.
  t.Pin({1}, std::nullopt);
  // With a pinned, b and its snapshot (150 bytes) are all that can go: 201
  // bytes cannot fit, and the refused put evicts nothing.
  EXPECT_FALSE(t.PutBlock(5, 0, false, Bytes(201, 6), &removed));
  EXPECT_TRUE(t.HasBlock(2));
  EXPECT_TRUE(t.HasSnapshot(2));
  EXPECT_EQ(t.stats().puts_refused, 2);
  t.UnpinAll();
  ASSERT_TRUE(t.PutBlock(5, 0, false, Bytes(150, 6), &removed));
  EXPECT_FALSE(t.HasBlock(2));
  EXPECT_FALSE(t.HasSnapshot(2));
  ASSERT_EQ(removed.size(), 1u);
  EXPECT_EQ(removed[0], (PrefixEvent{PrefixEvent::Kind::kRemoved, 128, 77}));
  EXPECT_TRUE(t.CheckInvariants().ok()) << t.CheckInvariants();
  // Take gives the bytes back and frees them.
  auto b = t.TakeBlock(5);
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(*b, Bytes(150, 6));
  EXPECT_EQ(t.bytes_held(), 100);
  // DropSubtree drops everything below, with the snapshots.
  removed.clear();
  ASSERT_TRUE(t.PutBlock(6, 1, true, Bytes(10, 0), &removed));
  ASSERT_TRUE(t.PutBlock(7, 6, true, Bytes(10, 0), &removed));
  ASSERT_TRUE(t.PutSnapshot(7, 64, 8, Bytes(10, 0), &removed));
  t.DropSubtree(1, &removed);
  EXPECT_EQ(t.num_blocks(), 0);
  EXPECT_EQ(t.num_snapshots(), 0);
  EXPECT_EQ(t.bytes_held(), 0);
  EXPECT_EQ(removed.size(), 1u);
  EXPECT_TRUE(t.CheckInvariants().ok()) << t.CheckInvariants();
}

// A fake device: each block's "rows" and each snapshot slot's "state" are a
// vector of bytes; the copier moves them to and from host bytes, so a load
// that brings back the wrong bytes (or into a block in use) is seen.
struct FakeDevice {
  std::map<BlockId, std::vector<uint8_t>> blocks;
  std::map<SnapshotId, std::vector<uint8_t>> slots;
  PrefixTierCopier Copier() {
    PrefixTierCopier c;
    c.save_block = [this](BlockId id, std::vector<uint8_t>* out) {
      *out = blocks[id];
      return absl::OkStatus();
    };
    c.load_block = [this](BlockId id, absl::Span<const uint8_t> in) {
      blocks[id].assign(in.begin(), in.end());
      return absl::OkStatus();
    };
    c.save_snapshot = [this](SnapshotId s, std::vector<uint8_t>* out) {
      *out = slots[s];
      return absl::OkStatus();
    };
    c.load_snapshot = [this](SnapshotId s, absl::Span<const uint8_t> in) {
      slots[s].assign(in.begin(), in.end());
      return absl::OkStatus();
    };
    return c;
  }
};

std::vector<uint8_t> ContentOf(BlockHash h) {
  std::vector<uint8_t> v(16);
  for (int i = 0; i < 16; ++i) v[i] = static_cast<uint8_t>(h >> (i % 8 * 8)) ^ i;
  return v;
}

// Random prompts over a few shared prefixes on a small device tier and a small
// host tier; sequences adopt hits (holding references), compute the rest,
// insert and snapshot, finish in random order. After every operation: the
// invariants of both tiers hold, a block a sequence holds is never freed and
// still holds its content, every hit's blocks and snapshot hold exactly the
// content of their hashes (loads bring back the right bytes), and the events
// balance (stored - removed = snapshots held in both tiers).
TEST(HostTierFuzzTest, MovesAndLoadsNeverFreeABlockInUseAndCountsBalance) {
  constexpr int32_t kBs = 16;
  std::mt19937 rng(7);
  for (int64_t host_budget : {int64_t{16 * 20}, int64_t{16 * 200}}) {
    BlockAllocator alloc(40);
    PrefixCacheConfig cfg;
    cfg.block_size = kBs;
    cfg.kda_chunk = 64;
    cfg.num_snapshots = 3;
    PrefixCache pc(cfg, &alloc);
    HostTier host(host_budget);
    FakeDevice dev;
    pc.set_host_tier(&host, dev.Copier());
    PrefixEventQueue events(1 << 20);
    pc.set_event_queue(&events);
    struct Seq {
      std::vector<BlockHash> hashes;
      std::vector<BlockId> table;
    };
    std::vector<Seq> running;
    int64_t stored = 0, removed = 0;
    auto drain = [&] {
      for (const PrefixEvent& e : events.Take()) {
        ASSERT_NE(e.kind, PrefixEvent::Kind::kCleared);
        stored += e.kind == PrefixEvent::Kind::kStored;
        removed += e.kind == PrefixEvent::Kind::kRemoved;
      }
      ASSERT_EQ(stored - removed, pc.num_snapshots() + host.num_snapshots());
    };
    auto finish = [&](size_t i) {
      for (BlockId b : running[i].table) ASSERT_TRUE(alloc.Free(b).ok());
      running.erase(running.begin() + i);
    };
    int64_t loads_seen = 0;
    for (int op = 0; op < 3000; ++op) {
      if (!running.empty() && (running.size() >= 2 || rng() % 3 == 0)) {
        finish(rng() % running.size());
      } else {
        // A prompt of one of 6 prefixes (8 blocks each) + 0..4 own blocks.
        const int prefix = static_cast<int>(rng() % 6);
        const int own = static_cast<int>(rng() % 5);
        std::vector<int32_t> tokens;
        for (int i = 0; i < 8 * kBs; ++i) tokens.push_back(prefix * 1000 + i);
        for (int i = 0; i < own * kBs; ++i) tokens.push_back(op * 100000 + i);
        tokens.push_back(1);  // a last token to compute
        Seq s;
        s.hashes = ChainedBlockHashes(tokens, kBs, "");
        const PrefixHit hit = pc.Lookup(s.hashes, static_cast<int64_t>(tokens.size()));
        const int64_t nb = hit.tokens / kBs;
        for (int64_t i = 0; i < nb; ++i) {
          ASSERT_EQ(dev.blocks[hit.blocks[i]], ContentOf(s.hashes[i])) << "block " << i;
          ASSERT_TRUE(alloc.IncRef(hit.blocks[i]).ok());
          s.table.push_back(hit.blocks[i]);
        }
        if (nb > 0) {
          ASSERT_EQ(dev.slots[hit.snapshot], ContentOf(~s.hashes[nb - 1]));
        }
        const int64_t need = static_cast<int64_t>(s.hashes.size()) - nb;
        pc.Reclaim(need);
        bool ok = alloc.num_free() >= need;
        for (int64_t i = nb; ok && i < static_cast<int64_t>(s.hashes.size()); ++i) {
          BlockId b = *alloc.Allocate();
          dev.blocks[b] = ContentOf(s.hashes[i]);
          s.table.push_back(b);
          pc.InsertBlock(s.hashes, i, b);
          const int64_t p = (i + 1) * kBs;
          if (p % 64 == 0 && !pc.HasSnapshot(s.hashes[i])) {
            auto snap = pc.StoreSnapshot(s.hashes[i], p, s.hashes[i] ^ 1);
            if (snap.ok()) dev.slots[*snap] = ContentOf(~s.hashes[i]);
          }
        }
        running.push_back(std::move(s));
      }
      ASSERT_TRUE(pc.CheckInvariants().ok()) << pc.CheckInvariants();
      ASSERT_TRUE(alloc.CheckInvariants().ok());
      for (const Seq& s : running) {
        for (size_t i = 0; i < s.table.size(); ++i) {
          ASSERT_GE(alloc.ref_count(s.table[i]), 1);
          ASSERT_EQ(dev.blocks[s.table[i]], ContentOf(s.hashes[i]));
        }
      }
      ASSERT_LE(host.bytes_held(), host_budget);
      drain();
      loads_seen = pc.stats().blocks_loaded_from_host;
    }
    EXPECT_GT(pc.stats().blocks_moved_to_host, 0);
    EXPECT_GT(loads_seen, 0);
    EXPECT_GT(pc.stats().hits_from_host, 0);
    if (host_budget < 16 * 100) {
      EXPECT_GT(host.stats().blocks_evicted, 0);
    }
    while (!running.empty()) finish(0);
    pc.Clear();
    EXPECT_EQ(host.bytes_held(), 0);
    EXPECT_EQ(alloc.num_free(), 40);
  }
}

}  // namespace
}  // namespace tandem::engine
