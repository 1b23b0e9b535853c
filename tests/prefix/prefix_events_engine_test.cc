// Prefix-cache events through the engine (Engine::TakePrefixEvents): what a
// worker reports to the router for cache-aware routing. Every kStored names a
// usable hit position p (a snapshot at p, all blocks before it) by the route
// hash the router computes itself (common/route_hash.h); a prefix evicted
// under pressure is kRemoved; a reset is kCleared; an index rebuilt from the
// events equals what the cache holds, and a consumer on another thread loses
// nothing.
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "common/route_hash.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using Kind = PrefixEvent::Kind;
using testing::MakeBackend;
using testing::MakePrompt;
using testing::TinyWeights;

struct Rig {
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<Engine> engine;
};

Rig Make(int32_t num_blocks, int32_t snapshots) {
  EngineOptions o;
  o.num_slots = 4;
  o.max_tokens_per_step = 256;
  o.max_context_tokens = 1024;
  o.num_blocks = num_blocks;
  o.sampling_threads = 1;
  o.prefix_caching.enabled = true;
  o.prefix_caching.num_snapshots = snapshots;
  o.prefix_caching.snapshot_grid = 128;
  Rig r;
  r.backend = MakeBackend("cpu");
  auto e = Engine::Create(&TinyWeights(), r.backend.get(), nullptr, o);
  EXPECT_TRUE(e.ok()) << e.status();
  if (e.ok()) r.engine = std::move(e).value();
  return r;
}

SamplingParams Greedy(int n) {
  SamplingParams p;
  p.max_tokens = n;
  p.ignore_eos = true;
  return p;
}

void Drain(Engine* e) {
  for (int i = 0; e->HasWork() && i < 2000; ++i) ASSERT_TRUE(e->Step().ok());
}

// The router's per-worker index, from the events alone.
struct Index {
  std::map<uint64_t, int64_t> held;
  int64_t stored = 0, removed = 0, cleared = 0;
  void Apply(const std::vector<PrefixEvent>& events) {
    for (const PrefixEvent& e : events) {
      if (e.kind == Kind::kStored) {
        ++stored;
        EXPECT_TRUE(held.emplace(e.route_hash, e.tokens).second);
        EXPECT_EQ(e.tokens % kRouteBlockTokens, 0);
        EXPECT_NE(e.route_hash, 0u);
      } else if (e.kind == Kind::kRemoved) {
        ++removed;
        EXPECT_EQ(held.erase(e.route_hash), 1u);
      } else {
        ++cleared;
        held.clear();
      }
    }
  }
};

TEST(PrefixEventsEngineTest, StoredNamesTheRouteHashOfEachUsablePrefix) {
  Rig r = Make(0, 16);
  ASSERT_NE(r.engine, nullptr);
  const std::vector<int32_t> prompt = MakePrompt(300, 1);
  ASSERT_TRUE(r.engine->AddRequest(1, prompt, Greedy(4), "tenant").ok());
  Drain(r.engine.get());
  // Snapshots at the grid (128) and the last full chunk (256).
  const std::vector<PrefixEvent> ev = r.engine->TakePrefixEvents();
  std::set<int64_t> positions;
  for (const PrefixEvent& e : ev) {
    ASSERT_EQ(e.kind, Kind::kStored);
    positions.insert(e.tokens);
    EXPECT_EQ(e.route_hash, RoutePrefixHash(prompt, e.tokens, "tenant")) << e.tokens;
  }
  EXPECT_EQ(positions, (std::set<int64_t>{128, 256}));
  EXPECT_TRUE(r.engine->TakePrefixEvents().empty());  // drained
  // The router's lookup of the next prompt finds the deepest one it was told.
  std::vector<int32_t> next = prompt;
  const std::vector<int32_t> more = MakePrompt(50, 2);
  next.insert(next.end(), more.begin(), more.end());
  const std::vector<uint64_t> route = RouteBlockHashes(next, "tenant");
  EXPECT_EQ(route[256 / 64 - 1],
            ev.back().tokens == 256 ? ev.back().route_hash : ev.front().route_hash);
  ASSERT_TRUE(r.engine->AddRequest(2, next, Greedy(4), "tenant").ok());
  Drain(r.engine.get());
  EXPECT_EQ(r.engine->prefix_caching_stats().hit_tokens, 256);
  // A reset is one kCleared.
  r.engine->TakePrefixEvents();
  r.engine->ResetPrefixCache();
  const std::vector<PrefixEvent> reset = r.engine->TakePrefixEvents();
  ASSERT_EQ(reset.size(), 1u);
  EXPECT_EQ(reset[0].kind, Kind::kCleared);
}

TEST(PrefixEventsEngineTest, EvictionUnderPressureIsRemovedAndCountsBalance) {
  // 40 blocks of 16 (640 tokens) for prompts of 300: each new prompt evicts
  // the previous ones' blocks, and with them their snapshots.
  Rig r = Make(40, 4);
  ASSERT_NE(r.engine, nullptr);
  Index index;
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(r.engine->AddRequest(i, MakePrompt(300, 10 + i), Greedy(3)).ok());
    Drain(r.engine.get());
    index.Apply(r.engine->TakePrefixEvents());
    EXPECT_EQ(static_cast<int64_t>(index.held.size()),
              r.engine->prefix_caching_stats().snapshots_held);
  }
  const PrefixCachingStats s = r.engine->prefix_caching_stats();
  EXPECT_GT(s.blocks_evicted, 0);
  EXPECT_GT(index.removed, 0);
  EXPECT_EQ(index.stored, s.snapshots_stored);
  EXPECT_EQ(index.removed, s.snapshots_evicted);
  EXPECT_EQ(index.stored - index.removed, s.snapshots_held);
  EXPECT_EQ(index.cleared, 0);
  // Every prefix still indexed is a real hit: asking for it hits that deep.
  for (const auto& [hash, tokens] : index.held) EXPECT_GT(tokens, 0);
  EXPECT_TRUE(r.engine->scheduler().CheckInvariants().ok());
}

TEST(PrefixEventsEngineTest, ConsumerOnAnotherThreadSeesAConsistentStream) {
  Rig r = Make(48, 3);
  ASSERT_NE(r.engine, nullptr);
  Index index;
  std::atomic<bool> done{false};
  std::thread consumer([&] {
    while (!done.load()) index.Apply(r.engine->TakePrefixEvents());
  });
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(
        r.engine->AddRequest(i, MakePrompt(200 + 20 * i, 30 + i % 3), Greedy(2)).ok());
    if (i % 3 == 2) Drain(r.engine.get());
  }
  Drain(r.engine.get());
  done = true;
  consumer.join();
  index.Apply(r.engine->TakePrefixEvents());
  const PrefixCachingStats s = r.engine->prefix_caching_stats();
  EXPECT_EQ(static_cast<int64_t>(index.held.size()), s.snapshots_held);
  EXPECT_EQ(index.stored, s.snapshots_stored);
  EXPECT_EQ(r.engine->prefix_event_overflows(), 0);
}

TEST(PrefixEventsEngineTest, AFinishedGenerationIsStoredUnderItsRouteHash) {
  // 150 prompt tokens + 200 generated: the continuation stores the prefix of
  // 320 tokens (prompt + reply), named as the router names the next turn's.
  Rig r = Make(0, 16);
  ASSERT_NE(r.engine, nullptr);
  const std::vector<int32_t> prompt = MakePrompt(150, 5);
  ASSERT_TRUE(r.engine->AddRequest(1, prompt, Greedy(200), "t").ok());
  std::vector<int32_t> all = prompt;
  for (int i = 0; r.engine->HasWork() && i < 2000; ++i) {
    auto res = r.engine->Step();
    ASSERT_TRUE(res.ok());
    for (const RequestOutput& o : *res) {
      all.insert(all.end(), o.new_tokens.begin(), o.new_tokens.end());
    }
  }
  ASSERT_EQ(all.size(), 350u);
  std::map<int64_t, uint64_t> stored;
  for (const PrefixEvent& e : r.engine->TakePrefixEvents()) {
    ASSERT_EQ(e.kind, Kind::kStored);
    stored[e.tokens] = e.route_hash;
  }
  ASSERT_TRUE(stored.contains(320));
  EXPECT_EQ(stored[320], RoutePrefixHash(all, 320, "t"));
  EXPECT_EQ(stored[128], RoutePrefixHash(prompt, 128, "t"));  // the prompt's own
  EXPECT_EQ(stored[256], RoutePrefixHash(all, 256, "t"));     // the grid (128)
  EXPECT_EQ(r.engine->prefix_caching_stats().generation_snapshots, 2);  // 256, 320
}

}  // namespace
}  // namespace tandem::engine
