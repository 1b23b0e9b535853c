// Snapshots at the end of a finished generation (issue 17): the next chat turn
// (previous prompt + the reply + a new message) continues from deeper than the
// previous prompt, with outputs equal to the cache off, token for token.
//
// Why a recompute: the KDA state token-by-token decode reaches is not the
// state the chunked prefill computes for the same tokens (DecodeStateIsNot
// PrefillState below), and MLA rows of later layers inherit the difference, so
// neither the decode slot nor the decode-written blocks may enter the cache.
// A finished request's cacheable positions are recomputed by an internal
// prefill continuation (engine/scheduler/scheduler.h, "background").
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "engine/runtime/engine.h"
#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using testing::BlockRange;
using testing::Feed;
using testing::MakeBackend;
using testing::MakeCache;
using testing::MakePrompt;
using testing::TestSequence;
using testing::TinyWeights;

struct State {
  std::vector<float> logits;
  std::vector<uint8_t> bytes;
};

// Feeds `tokens` in forwards of `chunks` tokens; the KDA and MLA state after.
State FeedChunks(const std::vector<int32_t>& tokens,
                 const std::vector<int64_t>& chunks) {
  auto backend = MakeBackend("cpu");
  auto cache = MakeCache(TinyWeights(), 32, 16, 1);
  ModelRunner runner(&TinyWeights(), cache.get(), backend.get());
  TestSequence s{BlockRange(0, 32), 0, 0};
  State st;
  size_t at = 0;
  for (int64_t c : chunks) {
    EXPECT_TRUE(
        Feed(&runner, &s, absl::MakeConstSpan(tokens).subspan(at, c), false, &st.logits)
            .ok());
    at += c;
  }
  EXPECT_EQ(at, tokens.size());
  auto ranges = cache->ExportSequence(s.blocks, s.pos, s.slot);
  EXPECT_TRUE(ranges.ok());
  for (const StateRange& r : *ranges)
    st.bytes.insert(st.bytes.end(), r.data, r.data + r.bytes);
  return st;
}

TEST(GenerationSnapshotNumericsTest, DecodeStateIsNotPrefillState) {
  const std::vector<int32_t> t = MakePrompt(192, 9);
  const State prefill = FeedChunks(t, {192});
  const State aligned = FeedChunks(t, {128, 64});  // the control: aligned chunks agree
  EXPECT_TRUE(prefill.bytes == aligned.bytes);
  std::vector<int64_t> decode = {128};
  decode.resize(1 + 64, 1);  // then 64 decode steps of one token
  const State decoded = FeedChunks(t, decode);
  ASSERT_EQ(decoded.bytes.size(), prefill.bytes.size());
  EXPECT_FALSE(decoded.bytes == prefill.bytes)
      << "decode reached the prefill's state bit for bit: a decode-state snapshot "
         "would do (docs/prefix_caching.md)";
}

struct Rig {
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<Engine> engine;
};

Rig Make(const EngineOptions& o) {
  Rig r;
  r.backend = MakeBackend("cpu");
  auto e = Engine::Create(&TinyWeights(), r.backend.get(), nullptr, o);
  EXPECT_TRUE(e.ok()) << e.status();
  if (e.ok()) r.engine = std::move(e).value();
  return r;
}

EngineOptions Base() {
  EngineOptions o;
  o.num_slots = 4;
  o.max_tokens_per_step = 256;
  o.max_context_tokens = 1024;
  o.sampling_threads = 1;
  return o;
}

EngineOptions Cached(EngineOptions o, bool generations = true) {
  o.prefix_caching.enabled = true;
  o.prefix_caching.num_snapshots = 8;
  o.prefix_caching.snapshot_grid = 0;
  o.prefix_caching.snapshot_generations = generations;
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

std::vector<int32_t> Cat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

struct Turn {
  RequestId id;
  std::vector<int32_t> prompt;
  SamplingParams params;
  int abort_after_tokens = -1;  // cancel it once it generated this many (-1: never)
};
using Outputs = std::map<RequestId, std::vector<int32_t>>;

struct TurnsResult {
  Outputs out;
  std::map<RequestId, int64_t> cached;  // cached_prompt_tokens per request
  PrefixCachingStats stats;
  int64_t prefill_tokens = 0;
};

// The turns one after another: each submitted once the engine is idle (the
// previous turn's continuation has run), or, for ids in `overlap`, that many
// steps after the previous turn finished.
TurnsResult RunTurns(const EngineOptions& o, const std::vector<Turn>& turns,
                     const std::map<RequestId, int>& overlap = {}) {
  TurnsResult run;
  Rig r = Make(o);
  if (r.engine == nullptr) return run;
  const int32_t blocks = r.engine->num_free_blocks();
  std::set<RequestId> finished, aborted;
  auto step = [&]() -> bool {
    for (const Turn& q : turns) {
      if (q.abort_after_tokens >= 0 && !aborted.contains(q.id) &&
          static_cast<int>(run.out[q.id].size()) >= q.abort_after_tokens) {
        EXPECT_TRUE(r.engine->Abort(q.id).ok());
        aborted.insert(q.id);
      }
    }
    auto res = r.engine->Step();
    EXPECT_TRUE(res.ok()) << res.status();
    if (!res.ok()) return false;
    EXPECT_TRUE(r.engine->scheduler().CheckInvariants().ok())
        << r.engine->scheduler().CheckInvariants();
    for (const RequestOutput& out : *res) {
      auto& v = run.out[out.id];
      v.insert(v.end(), out.new_tokens.begin(), out.new_tokens.end());
      if (!out.new_tokens.empty()) run.cached[out.id] = out.cached_prompt_tokens;
      if (out.finished) finished.insert(out.id);
    }
    return true;
  };
  for (size_t t = 0; t < turns.size(); ++t) {
    EXPECT_TRUE(
        r.engine->AddRequest(turns[t].id, turns[t].prompt, turns[t].params).ok());
    if (t + 1 < turns.size() && overlap.contains(turns[t + 1].id)) {
      // Until this turn has finished (its continuation queued), and k more.
      for (int i = 0; i < 2000 && !finished.contains(turns[t].id); ++i) {
        if (!step()) return run;
      }
      for (int i = 0; i < overlap.at(turns[t + 1].id); ++i) {
        if (!step()) return run;
      }
      continue;
    }
    for (int i = 0; r.engine->HasWork() && i < 5000; ++i) {
      if (!step()) return run;
    }
  }
  EXPECT_FALSE(r.engine->HasWork());
  EXPECT_EQ(r.engine->num_free_blocks(), blocks);
  EXPECT_EQ(r.engine->num_free_slots(), o.num_slots);
  run.stats = r.engine->prefix_caching_stats();
  run.prefill_tokens = r.engine->prefill_tokens();
  return run;
}

void ExpectSame(const TurnsResult& off, const TurnsResult& on) {
  ASSERT_EQ(off.out.size(), on.out.size());
  for (const auto& [id, toks] : off.out) {
    auto it = on.out.find(id);
    ASSERT_NE(it, on.out.end()) << id;
    EXPECT_EQ(it->second, toks) << "request " << id;
  }
}

// Turn 1: a 150-token prompt and a 200-token reply (350 tokens: the
// continuation recomputes [128, 320) from the prompt's snapshot at 128 and
// snapshots 320); turn 2: turn 1's prompt + reply + 40 new tokens.
std::vector<Turn> TwoTurns(const std::function<SamplingParams(int)>& params) {
  std::vector<Turn> turns = {{1, MakePrompt(150, 3), params(1)}};
  const TurnsResult first = RunTurns(Base(), turns);
  EXPECT_EQ(first.out.at(1).size(), 200u);
  turns.push_back(
      {2, Cat(Cat(turns[0].prompt, first.out.at(1)), MakePrompt(40, 4)), params(2)});
  return turns;
}

TEST(GenerationSnapshotTest, SecondTurnHitsPastTheFirstPromptGreedy) {
  const std::vector<Turn> turns = TwoTurns([](int) { return Greedy(200); });
  const TurnsResult off = RunTurns(Base(), turns);
  const TurnsResult on = RunTurns(Cached(Base()), turns);
  const TurnsResult prompt_only =
      RunTurns(Cached(Base(), /*generations=*/false), turns);
  ExpectSame(off, on);
  ExpectSame(off, prompt_only);
  EXPECT_EQ(prompt_only.cached.at(2), 128);  // the first prompt's snapshot only
  EXPECT_EQ(on.cached.at(2), 320);           // the generation's end
  EXPECT_GT(on.cached.at(2), static_cast<int64_t>(turns[0].prompt.size()));
  EXPECT_EQ(on.stats.continuations_submitted, 2);  // one per finished turn
  EXPECT_EQ(on.stats.continuations_completed, 2);
  EXPECT_EQ(on.stats.generation_snapshots, 2);
  // Turn 1's continuation: [128, 320); turn 2's (390 + 200 tokens), from its
  // prompt's snapshot at 384: [384, 576).
  EXPECT_EQ(on.stats.continuation_tokens, 192 + 192);
  EXPECT_EQ(prompt_only.stats.continuations_submitted, 0);
}

TEST(GenerationSnapshotTest, SecondTurnHitsPastTheFirstPromptSeeded) {
  const std::vector<Turn> turns = TwoTurns([](int i) { return Seeded(200, 40 + i); });
  const TurnsResult off = RunTurns(Base(), turns);
  const TurnsResult on = RunTurns(Cached(Base()), turns);
  ExpectSame(off, on);
  EXPECT_EQ(on.cached.at(2), 320);
}

TEST(GenerationSnapshotTest, SpeculativeDecodingCachesOnlyVerifiedTokens) {
  std::vector<Turn> turns = TwoTurns([](int) { return Greedy(200); });
  const TurnsResult off = RunTurns(Base(), turns);
  for (SpeculativeMethod m : {SpeculativeMethod::kNgram, SpeculativeMethod::kDraft}) {
    EngineOptions o = Cached(Base());
    o.speculative.method = m;
    o.speculative.num_speculative_tokens = 3;
    o.speculative.ngram.min_n = 1;
    o.speculative.ngram.max_n = 3;
    if (m == SpeculativeMethod::kDraft) o.speculative.draft_weights = &TinyWeights();
    const TurnsResult on = RunTurns(o, turns);
    ExpectSame(off, on);
    EXPECT_EQ(on.cached.at(2), 320) << static_cast<int>(m);
  }
}

TEST(GenerationSnapshotTest, CancelledRequestQueuesNothing) {
  std::vector<Turn> turns = TwoTurns([](int) { return Greedy(200); });
  turns[0].abort_after_tokens = 50;  // mid-decode
  const TurnsResult off = RunTurns(Base(), turns);
  const TurnsResult on = RunTurns(Cached(Base()), turns);
  ExpectSame(off, on);
  // Only turn 2 finished: turn 1's tokens never entered the cache, so turn 2
  // hits at turn 1's prompt snapshot only.
  EXPECT_EQ(on.stats.continuations_submitted, 1);
  EXPECT_EQ(on.cached.at(2), 128);
}

TEST(GenerationSnapshotTest, ARealRequestCancelsTheContinuation) {
  // One slot, 64-token steps: turn 2 (another conversation) arrives one step
  // into turn 1's continuation (three chunks); it takes the slot and the
  // continuation is dropped. Turn 2 (300 + 8 tokens) has nothing to continue.
  EngineOptions o = Base();
  o.num_slots = 1;
  o.max_tokens_per_step = 64;
  std::vector<Turn> turns = {{1, MakePrompt(150, 3), Greedy(200)},
                             {2, MakePrompt(300, 8), Greedy(8)}};
  const TurnsResult off = RunTurns(o, turns, {{2, 1}});
  const TurnsResult on = RunTurns(Cached(o), turns, {{2, 1}});
  ExpectSame(off, on);
  EXPECT_EQ(on.stats.continuations_submitted, 1);
  EXPECT_EQ(on.stats.continuations_cancelled, 1);
  EXPECT_EQ(on.stats.continuations_completed, 0);
  EXPECT_EQ(on.stats.generation_snapshots, 0);
  EXPECT_EQ(on.stats.continuation_tokens, 64);  // its first chunk
}

TEST(GenerationSnapshotTest, ContinuationUnderBlockPressureEqualsNoCache) {
  // 40 blocks (640 tokens): the continuation's blocks compete with the second
  // turn's; everything is evicted, skipped or cancelled rather than wrong.
  EngineOptions o = Base();
  o.num_blocks = 40;
  std::vector<Turn> turns = TwoTurns([](int) { return Greedy(200); });
  const TurnsResult off = RunTurns(o, turns);
  const TurnsResult on = RunTurns(Cached(o), turns);
  ExpectSame(off, on);
  EXPECT_EQ(on.stats.continuations_submitted, 2);
}

}  // namespace
}  // namespace tandem::engine
