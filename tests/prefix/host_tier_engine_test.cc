// The prefix cache's host tier through the engine on the tiny model: a device
// tier too small to keep more than one prompt's blocks (and two snapshots)
// forces every repeat to hit through the host tier (blocks and snapshots moved
// there on eviction, loaded back at admission by memcpy between the KvCache and
// the host pool, the copy path a GPU worker runs with device copies). The
// generated tokens must equal the cache off, token for token (greedy and
// seeded); hits must come from the host (counted); events must balance
// (stored - removed = snapshots usable in either tier); every block and slot
// must be idle at the end.
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <vector>

#include "absl/time/time.h"
#include "common/route_hash.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using testing::MakeBackend;
using testing::MakePrompt;
using testing::TinyWeights;

const model::Checkpoint& TinyCheckpoint() {
  static const model::Checkpoint* c = [] {
    auto ckpt = model::Checkpoint::Open(testing::kTinyCheckpointDir);
    if (!ckpt.ok()) std::abort();
    return ckpt->release();
  }();
  return *c;
}

// TP 2 (two CPU ranks): each rank copies its own KDA heads and MLA replica.
EngineOptions Tp2(EngineOptions o) {
  o.tp.tp_size = 2;
  o.tp.backend = "cpu";
  o.tp.threads_per_rank = 1;
  o.tp.timeout = absl::Seconds(30);
  o.tp_checkpoint = &TinyCheckpoint();
  return o;
}

EngineOptions Base() {
  EngineOptions o;
  o.num_slots = 2;
  o.num_blocks = 24;  // one 220-token request (15 blocks) and a few cached
  o.max_tokens_per_step = 256;
  o.max_context_tokens = 1024;
  o.sampling_threads = 1;
  return o;
}

EngineOptions Cached(int64_t host_bytes) {
  EngineOptions o = Base();
  o.prefix_caching.enabled = true;
  o.prefix_caching.num_snapshots = 2;
  o.prefix_caching.snapshot_grid = 0;
  o.prefix_caching.snapshot_generations = false;
  o.prefix_caching.host_memory_bytes = host_bytes;
  return o;
}

SamplingParams Params(int i, bool seeded) {
  SamplingParams p;
  p.max_tokens = 12;
  p.ignore_eos = true;
  if (seeded) {
    p.temperature = 0.9f;
    p.top_k = 50;
    p.seed = 1000 + i;
  }
  return p;
}

struct RunResult {
  std::map<RequestId, std::vector<int32_t>> out;
  int64_t prefill_tokens = 0;
  PrefixCachingStats stats;
  int64_t stored = 0, removed = 0;
};

// Four distinct 220-token prompts one after the other, then each again twice
// (one request at a time, so each repeat finds its prefix evicted from the
// device tier by the others).
RunResult RunOne(const EngineOptions& o, bool seeded) {
  RunResult run;
  const bool tp = o.tp.tp_size > 1;
  auto backend = tp ? nullptr : MakeBackend("cpu");
  auto made = tp ? Engine::Create(nullptr, nullptr, nullptr, o)
                 : Engine::Create(&TinyWeights(), backend.get(), nullptr, o);
  EXPECT_TRUE(made.ok()) << made.status();
  if (!made.ok()) return run;
  Engine& e = **made;
  const int32_t blocks = e.num_free_blocks();
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 4; ++i) prompts.push_back(MakePrompt(220, 50 + i));
  RequestId id = 0;
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 4; ++i) {
      EXPECT_TRUE(e.AddRequest(id, prompts[i], Params(i, seeded)).ok());
      for (int step = 0; e.HasWork() && step < 2000; ++step) {
        auto res = e.Step();
        EXPECT_TRUE(res.ok()) << res.status();
        if (!res.ok()) return run;
        EXPECT_TRUE(e.scheduler().CheckInvariants().ok())
            << e.scheduler().CheckInvariants();
        if (e.scheduler().prefix_cache() != nullptr) {
          EXPECT_TRUE(e.scheduler().prefix_cache()->CheckInvariants().ok())
              << e.scheduler().prefix_cache()->CheckInvariants();
        }
        for (const RequestOutput& r : *res) {
          auto& v = run.out[r.id];
          v.insert(v.end(), r.new_tokens.begin(), r.new_tokens.end());
        }
      }
      ++id;
    }
  }
  for (const PrefixEvent& ev : e.TakePrefixEvents()) {
    run.stored += ev.kind == PrefixEvent::Kind::kStored;
    run.removed += ev.kind == PrefixEvent::Kind::kRemoved;
    EXPECT_NE(ev.kind, PrefixEvent::Kind::kCleared);  // no overflow here
  }
  EXPECT_EQ(e.num_free_blocks(), blocks);
  EXPECT_EQ(e.num_free_slots(), o.num_slots);
  run.prefill_tokens = e.prefill_tokens();
  run.stats = e.prefix_caching_stats();
  e.ResetPrefixCache();
  const PrefixCachingStats after = e.prefix_caching_stats();
  EXPECT_EQ(after.blocks_cached, 0);
  EXPECT_EQ(after.snapshots_held, 0);
  EXPECT_EQ(after.host_bytes_held, 0);
  EXPECT_EQ(e.num_free_blocks(), blocks);
  return run;
}

int64_t OneBlockBytes() {
  auto backend = MakeBackend("cpu");
  auto e = Engine::Create(&TinyWeights(), backend.get(), nullptr, Base());
  EXPECT_TRUE(e.ok());
  return e.ok() ? static_cast<int64_t>((*e)->cache().block_bytes()) : 0;
}

int64_t OneSlotBytes() {
  auto backend = MakeBackend("cpu");
  auto e = Engine::Create(&TinyWeights(), backend.get(), nullptr, Base());
  EXPECT_TRUE(e.ok());
  return e.ok() ? static_cast<int64_t>((*e)->cache().kda_bytes_per_slot()) : 0;
}

void ExpectSame(const RunResult& off, const RunResult& on) {
  ASSERT_EQ(off.out.size(), on.out.size());
  for (const auto& [id, tokens] : off.out) {
    ASSERT_TRUE(on.out.contains(id)) << id;
    EXPECT_EQ(on.out.at(id), tokens) << "request " << id;
    EXPECT_EQ(tokens.size(), 12u);
  }
}

class HostTierEngineTest : public ::testing::TestWithParam<bool> {};

TEST_P(HostTierEngineTest, EveryRepeatHitsThroughTheHostTier) {
  const bool seeded = GetParam();
  const RunResult off = RunOne(Base(), seeded);
  const RunResult on = RunOne(Cached(int64_t{64} << 20), seeded);
  ExpectSame(off, on);
  // 8 repeats; each finds its blocks and snapshot on the host (the device tier
  // holds one prompt's worth), hits at 192 and computes 28 tokens.
  EXPECT_EQ(on.stats.hits, 8);
  EXPECT_EQ(on.stats.hit_tokens, 8 * 192);
  EXPECT_GE(on.stats.hits_from_host, 6);
  EXPECT_GT(on.stats.blocks_moved_to_host, 0);
  EXPECT_GT(on.stats.blocks_loaded_from_host, 0);
  EXPECT_GT(on.stats.snapshots_loaded_from_host, 0);
  EXPECT_EQ(on.prefill_tokens, off.prefill_tokens - 8 * 192);
  // A prefix is removed only when usable from neither tier: with room for all
  // of them on the host, none is.
  EXPECT_EQ(on.removed, 0);
  EXPECT_EQ(on.stored - on.removed,
            on.stats.snapshots_held + on.stats.host_snapshots_held);
  EXPECT_EQ(on.stats.host_blocks_evicted, 0);
}

// Without the host tier the same workload never hits (each prefix is evicted
// before it comes back): the tier is what the hits above come from.
TEST_P(HostTierEngineTest, NoHostTierNoHits) {
  const RunResult on = RunOne(Cached(0), GetParam());
  EXPECT_EQ(on.stats.hits, 0);
  EXPECT_EQ(on.stats.hits_from_host, 0);
  EXPECT_EQ(on.stats.host_budget_bytes, 0);
}

// A host budget of about two prompts: the host tier's own LRU drops prefixes
// (removed events, host evictions); outputs still equal the cache off and the
// events still balance.
TEST_P(HostTierEngineTest, SmallHostBudgetEvictsAndStaysExact) {
  const bool seeded = GetParam();
  const int64_t budget = 2 * (13 * OneBlockBytes() + OneSlotBytes());
  const RunResult off = RunOne(Base(), seeded);
  const RunResult on = RunOne(Cached(budget), seeded);
  ExpectSame(off, on);
  EXPECT_GT(on.stats.host_blocks_evicted, 0);
  EXPECT_GT(on.removed, 0);
  EXPECT_LE(on.stats.host_bytes_held, budget);
  EXPECT_EQ(on.stored - on.removed,
            on.stats.snapshots_held + on.stats.host_snapshots_held);
  EXPECT_EQ(on.prefill_tokens, off.prefill_tokens - on.stats.hit_tokens);
}

TEST_P(HostTierEngineTest, Tp2EqualsNoCacheThroughTheHostTier) {
  const bool seeded = GetParam();
  const RunResult off = RunOne(Tp2(Base()), seeded);
  const RunResult on = RunOne(Tp2(Cached(int64_t{64} << 20)), seeded);
  ExpectSame(off, on);
  EXPECT_EQ(on.stats.hits, 8);
  EXPECT_GE(on.stats.hits_from_host, 6);
  EXPECT_EQ(on.prefill_tokens, off.prefill_tokens - 8 * 192);
}

INSTANTIATE_TEST_SUITE_P(GreedyAndSeeded, HostTierEngineTest, ::testing::Bool());

// What a decode worker tells the router it holds for reservations (blocks_only
// events) is what a reservation can share: the device tier only (Reserve does
// not search the host tier). Four prompts computed on the engine one after the
// other push each earlier one's blocks and snapshot to the host tier: its
// usable position stays (a colocated hit loads it back), its blocks-only
// announcement goes, and a reservation of it shares nothing. The router's
// held estimate (PrefixIndex::MatchBlocks) reads only the announcements, so
// it never exceeds what Reserve shares; the usable positions, which it read
// before, would have claimed 192 held tokens of every evicted prompt.
TEST(HostTierHeldBlocksTest, AnnouncedBlocksAreWhatAReservationShares) {
  EngineOptions o = Cached(int64_t{64} << 20);
  o.prefix_caching.announce_blocks = true;  // decode_main's
  auto backend = MakeBackend("cpu");
  auto made = Engine::Create(&TinyWeights(), backend.get(), nullptr, o);
  ASSERT_TRUE(made.ok()) << made.status();
  Engine& e = **made;
  std::map<uint64_t, int64_t> announced, usable;  // route hash -> tokens
  auto drain = [&] {
    for (const PrefixEvent& ev : e.TakePrefixEvents()) {
      ASSERT_NE(ev.kind, PrefixEvent::Kind::kCleared);
      auto& set = ev.blocks_only ? announced : usable;
      if (ev.kind == PrefixEvent::Kind::kStored) set[ev.route_hash] = ev.tokens;
      if (ev.kind == PrefixEvent::Kind::kRemoved) set.erase(ev.route_hash);
    }
  };
  // The deepest 64-multiple of `prompt` in `set` (the router's match).
  auto match = [](const std::map<uint64_t, int64_t>& set,
                  const std::vector<int32_t>& prompt) {
    const std::vector<uint64_t> h = RouteBlockHashes(prompt, "");
    for (int64_t b = static_cast<int64_t>(h.size()); b >= 1; --b) {
      auto it = set.find(h[b - 1]);
      if (it != set.end() && it->second == b * 64) return b * 64;
    }
    return int64_t{0};
  };
  RequestId next = 100;
  auto reserve_shares = [&](const std::vector<int32_t>& prompt) {
    const RequestId id = next++;
    auto loc = e.Reserve(id, static_cast<int64_t>(prompt.size()), prompt, "",
                         /*share_held_prefix=*/true);
    EXPECT_TRUE(loc.ok()) << loc.status();
    const int64_t held = loc.ok() ? loc->held_prefix_tokens : -1;
    EXPECT_TRUE(e.Abort(id).ok());
    return held;
  };
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 4; ++i) prompts.push_back(MakePrompt(220, 50 + i));
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(e.AddRequest(i, prompts[i], Params(i, false)).ok());
    for (int step = 0; e.HasWork() && step < 2000; ++step) ASSERT_TRUE(e.Step().ok());
    drain();
    // Just computed: announced at its deepest 64-multiple of 13 full blocks.
    EXPECT_EQ(match(announced, prompts[i]), 192) << i;
    for (int j = 0; j <= i; ++j) {
      SCOPED_TRACE(::testing::Message() << "prompt " << j << " after " << i);
      const int64_t router = match(announced, prompts[j]);
      const int64_t shared = reserve_shares(prompts[j]);
      drain();  // the reservation's reclaim may move blocks
      EXPECT_LE(router, shared);
      // Every prompt's usable position survives in one tier or the other.
      EXPECT_EQ(match(usable, prompts[j]), 192);
    }
  }
  // The device tier holds about one prompt: the first is on the host now.
  ASSERT_GT(e.prefix_caching_stats().blocks_moved_to_host, 0);
  EXPECT_EQ(match(announced, prompts[0]), 0);
  EXPECT_EQ(reserve_shares(prompts[0]), 0);
  EXPECT_EQ(match(usable, prompts[0]), 192);  // a colocated hit still loads it
  // Computed again (a hit through the host tier): announced anew.
  ASSERT_TRUE(e.AddRequest(9, prompts[0], Params(0, false)).ok());
  for (int step = 0; e.HasWork() && step < 2000; ++step) ASSERT_TRUE(e.Step().ok());
  drain();
  EXPECT_GT(e.prefix_caching_stats().hits_from_host, 0);
  EXPECT_EQ(match(announced, prompts[0]), 192);
  EXPECT_GE(reserve_shares(prompts[0]), 192);
}

}  // namespace
}  // namespace tandem::engine
