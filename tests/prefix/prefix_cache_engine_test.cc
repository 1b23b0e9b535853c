// Prefix caching through the engine on the tiny model: every workload runs on an
// engine with the cache off and on one with it on, in the same waves (a wave
// is submitted when the previous one has finished, so later waves can hit), and
// the generated tokens must be equal, token for token. Hits must actually
// happen (hit tokens > 0, fewer prefill tokens computed) and every block, slot
// and snapshot must be back to idle at the end.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "engine/runtime/engine.h"
#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using testing::MakeBackend;
using testing::MakePrompt;
using testing::TinyWeights;

struct Rig {
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<Engine> engine;
};

Rig Make(EngineOptions o) {
  Rig r;
  r.backend = MakeBackend("cpu");
  auto e = Engine::Create(&TinyWeights(), r.backend.get(), nullptr, o);
  EXPECT_TRUE(e.ok()) << e.status();
  if (e.ok()) r.engine = std::move(e).value();
  return r;
}

EngineOptions Base() {
  EngineOptions o;
  o.num_slots = 8;
  o.max_tokens_per_step = 256;
  o.max_context_tokens = 2048;
  o.sampling_threads = 1;
  return o;
}

EngineOptions Cached(EngineOptions o, int32_t snapshots = 16) {
  o.prefix_caching.enabled = true;
  o.prefix_caching.num_snapshots = snapshots;
  o.prefix_caching.snapshot_grid = 256;
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
  std::string salt;
};
using Waves = std::vector<std::vector<Req>>;
using Outputs = std::map<RequestId, std::vector<int32_t>>;

struct RunResult {
  Outputs out;
  int64_t prefill_tokens = 0;
  PrefixCachingStats stats;
};

// Runs the waves; `abort_at` (request id -> step of its wave) cancels requests.
RunResult RunWaves(EngineOptions o, const Waves& waves,
                   const std::map<RequestId, int>& abort_at = {}) {
  RunResult run;
  Rig r = Make(o);
  if (r.engine == nullptr) return run;
  const int32_t blocks = r.engine->num_free_blocks();
  for (const auto& wave : waves) {
    for (const Req& q : wave) {
      EXPECT_TRUE(r.engine->AddRequest(q.id, q.prompt, q.params, q.salt).ok());
    }
    for (int step = 0; r.engine->HasWork() && step < 5000; ++step) {
      for (const auto& [id, at] : abort_at) {
        if (at == step) r.engine->Abort(id).IgnoreError();
      }
      auto res = r.engine->Step();
      EXPECT_TRUE(res.ok()) << res.status();
      if (!res.ok()) return run;
      EXPECT_TRUE(r.engine->scheduler().CheckInvariants().ok())
          << r.engine->scheduler().CheckInvariants();
      for (const RequestOutput& out : *res) {
        auto& v = run.out[out.id];
        v.insert(v.end(), out.new_tokens.begin(), out.new_tokens.end());
      }
    }
  }
  // Back to idle: every block free or evictable, every slot free.
  EXPECT_EQ(r.engine->num_free_blocks(), blocks);
  EXPECT_EQ(r.engine->num_free_slots(), o.num_slots);
  run.prefill_tokens = r.engine->prefill_tokens();
  run.stats = r.engine->prefix_caching_stats();
  EXPECT_LE(run.stats.snapshots_held, o.prefix_caching.num_snapshots);
  r.engine->ResetPrefixCache();
  EXPECT_EQ(r.engine->prefix_caching_stats().blocks_cached, 0);
  EXPECT_EQ(r.engine->prefix_caching_stats().snapshots_held, 0);
  EXPECT_EQ(r.engine->num_free_blocks(), blocks);
  return run;
}

std::vector<int32_t> Cat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A shared 300-token system prompt; wave 1 one request, wave 2 eight with
// suffixes of 1..150 tokens, wave 3 the same prompts again and two with 128 and
// 192 (exact chunk multiples) shared tokens only.
Waves SharedPrefix(const std::function<SamplingParams(int)>& params) {
  const std::vector<int32_t> sys = MakePrompt(300, 1);
  Waves w(3);
  w[0].push_back({0, Cat(sys, MakePrompt(20, 2)), params(0)});
  for (int i = 1; i <= 8; ++i) {
    w[1].push_back({i, Cat(sys, MakePrompt(1 + i * 18, 10 + i)), params(i)});
  }
  for (int i = 1; i <= 8; ++i) w[2].push_back({100 + i, w[1][i - 1].prompt, params(i)});
  w[2].push_back(
      {200, std::vector<int32_t>(sys.begin(), sys.begin() + 128), params(7)});
  w[2].push_back(
      {201, std::vector<int32_t>(sys.begin(), sys.begin() + 193), params(8)});
  return w;
}

void ExpectSame(const RunResult& off, const RunResult& on) {
  ASSERT_EQ(off.out.size(), on.out.size());
  for (const auto& [id, toks] : off.out) {
    auto it = on.out.find(id);
    ASSERT_NE(it, on.out.end()) << id;
    EXPECT_EQ(it->second, toks) << "request " << id;
  }
}

TEST(PrefixCacheEngineTest, GreedySharedPrefixEqualsNoCache) {
  const Waves w = SharedPrefix([](int) { return Greedy(12); });
  const RunResult off = RunWaves(Base(), w);
  const RunResult on = RunWaves(Cached(Base()), w);
  ExpectSame(off, on);
  EXPECT_EQ(off.stats.queried_tokens, 0);
  EXPECT_GT(on.stats.hits, 8);
  EXPECT_GT(on.stats.hit_rate(), 0.5);
  EXPECT_LT(on.prefill_tokens, off.prefill_tokens / 2);
  EXPECT_GT(on.stats.snapshots_stored, 0);
}

TEST(PrefixCacheEngineTest, SeededSamplingEqualsNoCache) {
  const Waves w = SharedPrefix([](int i) { return Seeded(16, 1000 + i); });
  const RunResult off = RunWaves(Base(), w);
  const RunResult on = RunWaves(Cached(Base()), w);
  ExpectSame(off, on);
  EXPECT_GT(on.stats.hit_tokens, 0);
}

TEST(PrefixCacheEngineTest, MultiTurnChatContinuesFromTheLastTurn) {
  // Turn t's prompt = turn t-1's prompt + its reply + a new user message; the
  // replies come from the no-cache run so both engines see the same prompts.
  std::vector<int32_t> prompt = MakePrompt(150, 3);
  Waves turns;
  Outputs replies;
  for (int t = 0; t < 4; ++t) {
    turns.push_back({{t, prompt, Greedy(10)}});
    const RunResult off = RunWaves(Base(), turns);
    replies = off.out;
    prompt = Cat(Cat(prompt, replies[t]), MakePrompt(40 + 7 * t, 50 + t));
  }
  const RunResult off = RunWaves(Base(), turns);
  const RunResult on = RunWaves(Cached(Base()), turns);
  ExpectSame(off, on);
  EXPECT_EQ(on.stats.hits, 3);  // every turn after the first
  EXPECT_LT(on.prefill_tokens, off.prefill_tokens);
}

TEST(PrefixCacheEngineTest, TenantsWithAnotherSaltDoNotShare) {
  Waves w = SharedPrefix([](int) { return Greedy(4); });
  for (auto& wave : w) {
    for (Req& q : wave) q.salt = q.id % 2 == 0 ? "tenant-a" : "tenant-b";
  }
  w[1].push_back({50, w[0][0].prompt, Greedy(4), "tenant-c"});  // wave 0's prompt
  const RunResult off = RunWaves(Base(), w);
  const RunResult on = RunWaves(Cached(Base()), w);
  ExpectSame(off, on);
  // Request 0 (tenant-a) cached the system prompt; odd ids are tenant-b and
  // miss in wave 1, and tenant-c's exact repeat misses too.
  EXPECT_GT(on.stats.hits, 0);
  EXPECT_LT(on.stats.hits, 18);
}

TEST(PrefixCacheEngineTest, SpeculativeDecodingWithTheCacheEqualsPlain) {
  // n-gram drafts (mostly rejected on the random model: rollbacks) and the
  // target as its own draft (accepted): the cache only ever holds prompt
  // blocks and prefill snapshots, so a rollback never touches either.
  const Waves w = SharedPrefix([](int i) {
    SamplingParams p = Greedy(16);
    if (i % 2 == 1) p.repetition_penalty = 0.2f;  // loops: some drafts accepted
    return p;
  });
  const RunResult plain = RunWaves(Base(), w);
  for (SpeculativeMethod m : {SpeculativeMethod::kNgram, SpeculativeMethod::kDraft}) {
    EngineOptions o = Cached(Base());
    o.speculative.method = m;
    o.speculative.num_speculative_tokens = 3;
    o.speculative.ngram.min_n = 1;
    o.speculative.ngram.max_n = 3;
    if (m == SpeculativeMethod::kDraft) o.speculative.draft_weights = &TinyWeights();
    const RunResult on = RunWaves(o, w);
    ExpectSame(plain, on);
    EXPECT_GT(on.stats.hits, 8) << static_cast<int>(m);
  }
}

TEST(PrefixCacheEngineTest, PreemptionAndEvictionUnderPressureEqualNoCache) {
  // 60 blocks of 16 for eight ~320-token prompts: cached blocks are evicted,
  // running ones preempted and recomputed (hitting their own prefix again).
  EngineOptions o = Base();
  o.num_blocks = 60;
  const Waves w = SharedPrefix([](int i) { return Seeded(24, 7 + i); });
  const RunResult off = RunWaves(o, w);
  const RunResult on = RunWaves(Cached(o, 4), w);
  ExpectSame(off, on);
  EXPECT_GT(on.stats.blocks_evicted, 0);
  EXPECT_GT(on.stats.hit_tokens, 0);
}

TEST(PrefixCacheEngineTest, AbortsLeaveNothingBehindAndOthersUnchanged) {
  const Waves w = SharedPrefix([](int) { return Greedy(12); });
  // Aborted mid-prefill (step 0 of wave 2), while decoding (step 3), at once.
  const std::map<RequestId, int> aborts = {{2, 1}, {5, 3}, {104, 0}, {106, 2}};
  RunResult off = RunWaves(Base(), w, aborts);
  RunResult on = RunWaves(Cached(Base()), w, aborts);
  for (RequestId id : {2, 5, 104, 106}) {
    off.out.erase(id);
    on.out.erase(id);
  }
  ExpectSame(off, on);
}

// The disaggregated hand-off in-process with hits on the prefill side: each
// request prefills on engine P (cache on: later ones hit the shared prefix),
// its state is exported (shared blocks included) and decoded on engine D;
// tokens equal the colocated run without a cache. The layer-progress callback
// reports a hit's first chunk from position 0 (the prefix is already in the
// cache), as a prefill worker streaming layer by layer needs.
TEST(PrefixCacheEngineTest, HandOffAfterAHitEqualsColocatedNoCache) {
  const Waves w = SharedPrefix([](int) { return Greedy(8); });
  const RunResult plain = RunWaves(Base(), w);
  Rig p = Make(Cached(Base()));
  Rig d = Make(Base());
  ASSERT_NE(p.engine, nullptr);
  ASSERT_NE(d.engine, nullptr);
  std::map<RequestId, int64_t> first_start;  // first reported start per request
  std::map<RequestId, int64_t> first_end;
  p.engine->set_layer_progress_callback(
      [&](int layer, absl::Span<const LayerProgressEntry> entries) {
        if (layer != 0) return;
        for (const LayerProgressEntry& e : entries) {
          if (!first_start.contains(e.id)) {
            first_start[e.id] = e.start_pos;
            first_end[e.id] = e.end_pos;
          }
        }
      });
  Outputs out;
  for (const auto& wave : w) {
    for (const Req& q : wave) {
      SamplingParams one = q.params;
      ASSERT_TRUE(p.engine->AddRequest(q.id, q.prompt, one).ok());
      bool prefilled = false;
      for (int step = 0; step < 100 && !prefilled; ++step) {
        auto res = p.engine->Step();
        ASSERT_TRUE(res.ok()) << res.status();
        for (const RequestOutput& o : *res) prefilled |= !o.new_tokens.empty();
      }
      ASSERT_TRUE(prefilled);
      auto st = p.engine->ExportState(q.id);
      ASSERT_TRUE(st.ok()) << st.status();
      ASSERT_TRUE(d.engine->AddPrefilledRequest(q.id, *st, q.params).ok());
      out[q.id] = st->generated;
      ASSERT_TRUE(p.engine->Abort(q.id).ok());
      while (d.engine->HasWork()) {
        auto res = d.engine->Step();
        ASSERT_TRUE(res.ok()) << res.status();
        for (const RequestOutput& o : *res) {
          out[o.id].insert(out[o.id].end(), o.new_tokens.begin(), o.new_tokens.end());
        }
      }
    }
  }
  for (const auto& [id, toks] : plain.out) EXPECT_EQ(out[id], toks) << "request " << id;
  EXPECT_GT(p.engine->prefix_caching_stats().hits, 8);
  for (const auto& [id, start] : first_start) EXPECT_EQ(start, 0) << "request " << id;
  // A hit computed less than its whole prompt in its first chunk and still
  // reported [0, end): request 101 repeats request 1's prompt.
  EXPECT_EQ(first_end[101], static_cast<int64_t>(w[2][0].prompt.size()));
  EXPECT_EQ(p.engine->num_free_slots(), 8);
  EXPECT_TRUE(p.engine->scheduler().CheckInvariants().ok());
}

}  // namespace
}  // namespace tandem::engine
