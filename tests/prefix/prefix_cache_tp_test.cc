// Prefix caching at TP 2 (issue 17, "Tests"): a TP 2 engine (two CPU ranks,
// threads of this process, over the tiny checkpoint's shards) with the cache on
// gives exactly the tokens of a TP 2 engine with it off, greedy and seeded,
// across a shared prefix that does hit (every rank restores its own KDA heads
// from the snapshot and reuses its own MLA blocks), chunked prefill mixed with
// decodes, and a reset of the cache between waves.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "absl/time/time.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using testing::MakePrompt;

const model::Checkpoint& Tiny() {
  static const model::Checkpoint* c = [] {
    auto ckpt = model::Checkpoint::Open(testing::kTinyCheckpointDir);
    if (!ckpt.ok()) std::abort();
    return ckpt->release();
  }();
  return *c;
}

EngineOptions Tp2(bool cached) {
  EngineOptions o;
  o.num_slots = 6;
  o.max_context_tokens = 512;
  o.max_tokens_per_step = 96;  // prompts are chunked and mixed with decodes
  o.sampling_threads = 1;
  o.tp.tp_size = 2;
  o.tp.backend = "cpu";
  o.tp.threads_per_rank = 1;
  o.tp.timeout = absl::Seconds(30);
  o.tp_checkpoint = &Tiny();
  if (cached) {
    o.prefix_caching.enabled = true;
    o.prefix_caching.num_snapshots = 8;
    o.prefix_caching.snapshot_grid = 128;
  }
  return o;
}

SamplingParams Greedy(int n) {
  SamplingParams p;
  p.max_tokens = n;
  p.ignore_eos = true;
  return p;
}

SamplingParams Seeded(int n, uint64_t seed) {
  SamplingParams p = Greedy(n);
  p.temperature = 0.9f;
  p.top_k = 50;
  p.seed = seed;
  return p;
}

struct Req {
  RequestId id;
  std::vector<int32_t> prompt;
  SamplingParams params;
};

struct RunResult {
  std::map<RequestId, std::vector<int32_t>> out;
  int64_t prefill_tokens = 0;
  PrefixCachingStats stats;
};

std::vector<int32_t> Cat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Waves of requests, each submitted when the previous one has finished; the
// cache is reset before wave `reset_before` (-1: never).
RunResult RunWaves(const EngineOptions& o, const std::vector<std::vector<Req>>& waves,
                   int reset_before) {
  RunResult run;
  auto e = Engine::Create(nullptr, nullptr, nullptr, o);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return run;
  Engine& engine = **e;
  const int32_t blocks = engine.num_free_blocks();
  for (size_t w = 0; w < waves.size(); ++w) {
    if (static_cast<int>(w) == reset_before) engine.ResetPrefixCache();
    for (const Req& q : waves[w])
      EXPECT_TRUE(engine.AddRequest(q.id, q.prompt, q.params).ok());
    for (int step = 0; engine.HasWork() && step < 3000; ++step) {
      auto res = engine.Step();
      EXPECT_TRUE(res.ok()) << res.status();
      if (!res.ok()) return run;
      for (const RequestOutput& out : *res) {
        auto& v = run.out[out.id];
        v.insert(v.end(), out.new_tokens.begin(), out.new_tokens.end());
      }
    }
    EXPECT_FALSE(engine.HasWork());
  }
  EXPECT_EQ(engine.num_free_blocks(), blocks);
  EXPECT_EQ(engine.num_free_slots(), o.num_slots);
  run.prefill_tokens = engine.prefill_tokens();
  run.stats = engine.prefix_caching_stats();
  return run;
}

// A 200-token shared prefix: one request, then four with suffixes of 1..70
// tokens, then the same four again and one with exactly 128 shared tokens.
std::vector<std::vector<Req>> Waves(const std::function<SamplingParams(int)>& params) {
  const std::vector<int32_t> sys = MakePrompt(200, 7);
  std::vector<std::vector<Req>> w(3);
  w[0].push_back({0, Cat(sys, MakePrompt(10, 8)), params(0)});
  for (int i = 1; i <= 4; ++i) {
    w[1].push_back({i, Cat(sys, MakePrompt(1 + (i - 1) * 23, 20 + i)), params(i)});
  }
  for (int i = 1; i <= 4; ++i) w[2].push_back({100 + i, w[1][i - 1].prompt, params(i)});
  w[2].push_back(
      {200, std::vector<int32_t>(sys.begin(), sys.begin() + 128), params(5)});
  return w;
}

void ExpectSame(const RunResult& off, const RunResult& on) {
  ASSERT_EQ(off.out.size(), on.out.size());
  for (const auto& [id, toks] : off.out) {
    auto it = on.out.find(id);
    ASSERT_NE(it, on.out.end()) << id;
    EXPECT_FALSE(toks.empty()) << id;
    EXPECT_EQ(it->second, toks) << "request " << id;
  }
}

TEST(PrefixCacheTpTest, GreedyAtTp2EqualsNoCache) {
  const auto w = Waves([](int) { return Greedy(10); });
  const RunResult off = RunWaves(Tp2(false), w, -1);
  const RunResult on = RunWaves(Tp2(true), w, -1);
  ExpectSame(off, on);
  EXPECT_EQ(off.stats.hits, 0);
  EXPECT_GE(on.stats.hits, 5) << "the shared prefix did not hit at TP 2";
  EXPECT_GT(on.stats.hit_tokens, 0);
  EXPECT_LT(on.prefill_tokens, off.prefill_tokens);
}

TEST(PrefixCacheTpTest, SeededAtTp2EqualsNoCacheAcrossAReset) {
  const auto w = Waves([](int i) { return Seeded(12, 500 + i); });
  const RunResult off = RunWaves(Tp2(false), w, -1);
  const RunResult on = RunWaves(Tp2(true), w, -1);
  ExpectSame(off, on);
  EXPECT_GT(on.stats.hit_tokens, 0);
  // Reset before the last wave: it recomputes what it would have hit (fewer
  // hits than without the reset) and still gives the same tokens.
  const RunResult reset = RunWaves(Tp2(true), w, 2);
  ExpectSame(off, reset);
  EXPECT_LT(reset.stats.hit_tokens, on.stats.hit_tokens);
  EXPECT_GT(reset.prefill_tokens, on.prefill_tokens);
}

}  // namespace
}  // namespace tandem::engine
