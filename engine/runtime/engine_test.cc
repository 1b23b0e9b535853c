// The request loop on the tiny checkpoint: greedy output equals the bare runner,
// batching many requests changes nothing, seeds reproduce, max_tokens ends with
// kLength, cancellation frees every block and slot, and a request prefilled on
// one engine and decoded on another (different block size) produces the
// colocated tokens.
#include "engine/runtime/engine.h"

#include <cstring>
#include <iostream>
#include <map>

#include "absl/time/clock.h"
#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using testing::BlockRange;
using testing::GreedyGenerate;
using testing::MakeBackend;
using testing::MakeCache;
using testing::MakePrompt;
using testing::TestSequence;
using testing::TinyWeights;

struct Rig {
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<Engine> engine;
};

Rig MakeEngine(EngineOptions o = {}) {
  Rig r;
  r.backend = MakeBackend("cpu");
  auto e = Engine::Create(&TinyWeights(), r.backend.get(), nullptr, o);
  EXPECT_TRUE(e.ok()) << e.status();
  r.engine = std::move(e).value();
  return r;
}

engine::SamplingParams Greedy(int max_tokens) {
  engine::SamplingParams p;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

// Steps until a request samples (its prefill's first token); returns the tokens.
std::vector<int32_t> StepUntilFirstToken(Engine* e) {
  std::vector<int32_t> first;
  for (int step = 0; first.empty() && step < 1000; ++step) {
    auto res = e->Step();
    EXPECT_TRUE(res.ok()) << res.status();
    if (!res.ok()) break;
    for (const RequestOutput& o : *res) first = o.new_tokens;
  }
  return first;
}

// Runs until idle; returns every request's tokens and finish reason.
std::map<RequestId, std::vector<int32_t>> RunAll(
    Engine* e, std::map<RequestId, engine::FinishReason>* reasons = nullptr) {
  std::map<RequestId, std::vector<int32_t>> out;
  for (int step = 0; e->HasWork() && step < 10000; ++step) {
    auto res = e->Step();
    EXPECT_TRUE(res.ok()) << res.status();
    if (!res.ok()) break;
    for (const RequestOutput& o : *res) {
      auto& v = out[o.id];
      v.insert(v.end(), o.new_tokens.begin(), o.new_tokens.end());
      if (o.finished && reasons != nullptr) (*reasons)[o.id] = o.finish_reason;
    }
  }
  return out;
}

// The layer-progress callback reports every prefill chunk once per layer, in
// layer order, with ranges that tile the prompt; and the state a layer reports
// is final when reported: the bytes seen in the callback for the prompt's last
// chunk equal the cache after the step (the later layers and the FFNs do not
// touch it).
TEST(EngineTest, LayerProgressReportsFinalStatePerLayer) {
  EngineOptions o;
  o.max_tokens_per_step = 16;  // 40 tokens: chunks of 16, 16, 8
  Rig r = MakeEngine(o);
  Engine& e = *r.engine;
  const int num_layers = static_cast<int>(TinyWeights().layers.size());
  struct Seen {
    int layer;
    LayerProgressEntry entry;
    std::vector<uint8_t> bytes;  // the layer's state of the whole prefix so far
  };
  std::vector<Seen> seen;
  e.set_layer_progress_callback(
      [&](int layer, absl::Span<const LayerProgressEntry> entries) {
        ASSERT_EQ(entries.size(), 1u);
        Seen s{layer, entries[0], {}};
        auto ranges = e.cache().ExportSequence(entries[0].block_table,
                                               entries[0].end_pos, entries[0].slot);
        ASSERT_TRUE(ranges.ok()) << ranges.status();
        for (const StateRange& sr : *ranges) {
          if (sr.layer != layer) continue;
          s.bytes.insert(s.bytes.end(), sr.data, sr.data + sr.bytes);
        }
        EXPECT_FALSE(s.bytes.empty());
        s.entry.block_table = {};  // valid during the callback only
        seen.push_back(std::move(s));
      });
  ASSERT_TRUE(e.AddRequest(7, MakePrompt(40, 3), Greedy(3)).ok());
  // Prefill: 3 steps, each reporting every layer once, ascending.
  for (int step = 0; step < 3; ++step) {
    const size_t before = seen.size();
    auto out = e.Step();
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(seen.size(), before + num_layers) << "step " << step;
    for (int l = 0; l < num_layers; ++l) {
      const Seen& s = seen[before + l];
      EXPECT_EQ(s.layer, l);
      EXPECT_EQ(s.entry.id, 7u);
      EXPECT_EQ(s.entry.start_pos, 16 * step);
      EXPECT_EQ(s.entry.end_pos, std::min(40, 16 * (step + 1)));
      EXPECT_EQ(s.entry.completes_prefill, step == 2);
    }
  }
  // The last chunk's per-layer bytes are the final state of the prompt.
  auto loc = e.Locate(7);
  ASSERT_TRUE(loc.ok()) << loc.status();
  auto final_ranges = e.cache().ExportSequence(loc->block_ids, 40, loc->slot);
  ASSERT_TRUE(final_ranges.ok());
  for (int l = 0; l < num_layers; ++l) {
    std::vector<uint8_t> now;
    for (const StateRange& sr : *final_ranges) {
      if (sr.layer == l) now.insert(now.end(), sr.data, sr.data + sr.bytes);
    }
    EXPECT_EQ(seen[2 * num_layers + l].bytes, now) << "layer " << l;
  }
  // Decode steps are not reported.
  const size_t before = seen.size();
  RunAll(&e);
  EXPECT_EQ(seen.size(), before);
}

// Seeded sampling does not depend on how the steps cut a prompt: the engine
// aligns prefill chunks to the KDA chunk, so any token budget >= 64 computes
// bit-identical state: the same seeded tokens with bit-identical logprobs
// (unaligned cuts differ in the last bits of the logprobs).
TEST(EngineTest, SeededTokensDoNotDependOnTheStepBudget) {
  // Per request: (token, logprob bits) per generated token.
  using Trace = std::vector<std::pair<int32_t, uint32_t>>;
  std::map<RequestId, Trace> want;
  for (int64_t budget : {64, 100, 256, 1024}) {
    EngineOptions o;
    o.max_tokens_per_step = budget;
    Rig r = MakeEngine(o);
    for (int i = 0; i < 3; ++i) {
      engine::SamplingParams p = Greedy(8);
      p.temperature = 1.0f;
      p.seed = 77 + i;
      p.logprobs = true;
      ASSERT_TRUE(
          r.engine->AddRequest(i + 1, MakePrompt(150 + 60 * i, 11 + i), p).ok());
    }
    std::map<RequestId, Trace> got;
    for (int step = 0; r.engine->HasWork() && step < 1000; ++step) {
      auto res = r.engine->Step();
      ASSERT_TRUE(res.ok()) << res.status();
      for (const RequestOutput& out : *res) {
        ASSERT_EQ(out.logprobs.size(), out.new_tokens.size());
        for (size_t j = 0; j < out.new_tokens.size(); ++j) {
          uint32_t bits;
          std::memcpy(&bits, &out.logprobs[j].logprob, sizeof(bits));
          got[out.id].push_back({out.new_tokens[j], bits});
        }
      }
    }
    for (int i = 1; i <= 3; ++i) ASSERT_EQ(got[i].size(), 8u);
    if (want.empty()) {
      want = got;
    } else {
      EXPECT_EQ(got, want) << "budget " << budget;
    }
  }
}

// Rows sampled in parallel (sampling_threads) give exactly the tokens and
// logprob bits of sampling them one by one: 12 requests with different
// settings (greedy, temperature, top-p/top-k, penalties, logprobs) sharing
// steps.
TEST(EngineTest, ParallelRowSamplingEqualsSequential) {
  using Trace = std::vector<std::pair<int32_t, uint32_t>>;
  std::map<RequestId, Trace> want;
  for (int threads : {1, 2, 3}) {
    EngineOptions o;
    o.num_slots = 12;
    o.sampling_threads = threads;
    Rig r = MakeEngine(o);
    for (int i = 0; i < 12; ++i) {
      engine::SamplingParams p = Greedy(10);
      if (i % 4 != 0) {
        p.temperature = 0.6f + 0.2f * static_cast<float>(i % 3);
        p.seed = 500 + i;
      }
      if (i % 4 == 2) p.top_p = 0.8f;
      if (i % 4 == 3) {
        p.top_k = 40;
        p.presence_penalty = 0.5f;
        p.frequency_penalty = 0.3f;
      }
      p.logprobs = i % 2 == 0;
      ASSERT_TRUE(r.engine->AddRequest(i, MakePrompt(20 + 7 * i, 300 + i), p).ok());
    }
    std::map<RequestId, Trace> got;
    for (int step = 0; r.engine->HasWork() && step < 1000; ++step) {
      auto res = r.engine->Step();
      ASSERT_TRUE(res.ok()) << res.status();
      for (const RequestOutput& out : *res) {
        for (size_t j = 0; j < out.new_tokens.size(); ++j) {
          uint32_t bits = 0;
          if (j < out.logprobs.size()) {
            std::memcpy(&bits, &out.logprobs[j].logprob, sizeof(bits));
          }
          got[out.id].push_back({out.new_tokens[j], bits});
        }
      }
    }
    for (int i = 0; i < 12; ++i) ASSERT_EQ(got[i].size(), 10u) << i;
    if (want.empty()) {
      want = got;
    } else {
      EXPECT_EQ(got, want) << threads << " sampling threads";
    }
  }
}

TEST(EngineTest, GreedyEqualsBareRunner) {
  const std::vector<int32_t> prompt = MakePrompt(45, 1);
  auto backend = MakeBackend("cpu");
  auto cache = MakeCache(TinyWeights(), 16, 16, 1);
  ModelRunner runner(&TinyWeights(), cache.get(), backend.get());
  TestSequence s{BlockRange(0, 8), 0, 0};
  auto want = GreedyGenerate(&runner, &s, prompt, 1000, 7);
  ASSERT_TRUE(want.ok());

  EngineOptions o;
  o.max_tokens_per_step = 16;  // the prompt is prefilled in 3 chunks
  Rig r = MakeEngine(o);
  ASSERT_TRUE(r.engine->AddRequest(1, prompt, Greedy(7)).ok());
  std::map<RequestId, engine::FinishReason> reasons;
  auto got = RunAll(r.engine.get(), &reasons);
  EXPECT_EQ(got[1], *want);
  EXPECT_EQ(reasons[1], engine::FinishReason::kLength);
  EXPECT_EQ(r.engine->prefill_tokens(), 45);
  EXPECT_EQ(r.engine->decode_tokens(), 6);
}

// Prompt logprobs: every prompt token after the first scored under the raw
// model, equal to scoring the bare runner's logits of the whole prompt in one
// forward; delivered with the first token, whatever the chunking (the scored
// tokens' per-step cap cuts a 200-token prompt in several chunks); the rows
// they add to a step do not disturb the other requests' sampling; and no
// prefix-cache hit stands in for the rows.
TEST(EngineTest, PromptLogprobsEqualTheRunnersOneShotScores) {
  const std::vector<int32_t> prompt = MakePrompt(200, 3);
  auto backend = MakeBackend("cpu");
  auto cache = MakeCache(TinyWeights(), 64, 16, 1);
  ModelRunner runner(&TinyWeights(), cache.get(), backend.get());
  TestSequence seq{BlockRange(0, 13), 0, 0};
  std::vector<float> all;
  ASSERT_TRUE(testing::Feed(&runner, &seq, prompt, /*all_logits=*/true, &all).ok());
  const int64_t V = TinyWeights().config.text.vocab_size;
  ASSERT_EQ(static_cast<int64_t>(all.size()), 200 * V);

  const std::vector<int32_t> other = MakePrompt(30, 4);
  std::vector<int32_t> alone;
  {
    Rig r = MakeEngine();
    ASSERT_TRUE(r.engine->AddRequest(9, other, Greedy(12)).ok());
    alone = RunAll(r.engine.get())[9];
  }
  // Sampled one row at a time (1 thread) and in parallel (PresampleRows).
  for (int threads : {1, 2}) {
    SCOPED_TRACE(threads);
    EngineOptions o;
    o.sampling_threads = threads;
    o.prefix_caching.enabled = true;
    Rig r = MakeEngine(o);
    engine::SamplingParams p = Greedy(3);
    p.prompt_logprobs = 3;
    ASSERT_TRUE(r.engine->AddRequest(9, other, Greedy(12)).ok());
    ASSERT_TRUE(r.engine->AddRequest(1, prompt, p).ok());
    ASSERT_TRUE(r.engine->AddRequest(2, prompt, p).ok());  // the same prompt again
    std::map<RequestId, std::vector<engine::SampleResult>> scores;
    std::map<RequestId, std::vector<int32_t>> tokens;
    std::map<RequestId, int> outputs_with_scores;
    for (int step = 0; r.engine->HasWork() && step < 1000; ++step) {
      auto res = r.engine->Step();
      ASSERT_TRUE(res.ok()) << res.status();
      for (const RequestOutput& out : *res) {
        tokens[out.id].insert(tokens[out.id].end(), out.new_tokens.begin(),
                              out.new_tokens.end());
        if (!out.prompt_logprobs.empty()) {
          ++outputs_with_scores[out.id];
          EXPECT_FALSE(out.new_tokens.empty());  // with the first token
          EXPECT_EQ(tokens[out.id].size(), out.new_tokens.size());
          scores[out.id] = out.prompt_logprobs;
          EXPECT_EQ(out.cached_prompt_tokens, 0);
        }
      }
    }
    EXPECT_EQ(tokens[9], alone);
    EXPECT_FALSE(outputs_with_scores.contains(9));
    for (RequestId id : {1, 2}) {
      EXPECT_EQ(outputs_with_scores[id], 1) << id;
      ASSERT_EQ(scores[id].size(), prompt.size() - 1) << id;
      for (size_t k = 0; k + 1 < prompt.size(); ++k) {
        const engine::SampleResult& got = scores[id][k];
        auto want = engine::ScoreToken(absl::MakeConstSpan(all).subspan(k * V, V),
                                       prompt[k + 1], 3);
        ASSERT_TRUE(want.ok()) << want.status();
        ASSERT_EQ(got.token_id, prompt[k + 1]) << k;
        EXPECT_NEAR(got.logprob, want->logprob, 1e-4) << k;
        EXPECT_EQ(got.rank, want->rank) << k;
        ASSERT_EQ(got.top.size(), 3u) << k;
        for (int a = 0; a < 3; ++a) {
          EXPECT_EQ(got.top[a].token_id, want->top[a].token_id) << k << " " << a;
          EXPECT_NEAR(got.top[a].logprob, want->top[a].logprob, 1e-4) << k;
        }
      }
    }
    // The greedy tokens are the ones without scoring.
    EXPECT_EQ(tokens[1], tokens[2]);
    {
      Rig plain = MakeEngine();
      ASSERT_TRUE(plain.engine->AddRequest(1, prompt, Greedy(3)).ok());
      EXPECT_EQ(RunAll(plain.engine.get())[1], tokens[1]);
    }
    // A one-token prompt has nothing to score: an empty list, no error.
    engine::SamplingParams one = Greedy(1);
    one.prompt_logprobs = 0;
    ASSERT_TRUE(r.engine->AddRequest(5, {prompt[0]}, one).ok());
    EXPECT_EQ(RunAll(r.engine.get())[5].size(), 1u);
    EXPECT_EQ(r.engine->scheduler().num_free_blocks(),
              r.engine->scheduler().config().num_blocks);
    EXPECT_TRUE(r.engine->scheduler().CheckInvariants().ok());
  }
}

TEST(EngineTest, SixteenRequestsTogetherEqualEachAlone) {
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 16; ++i) prompts.push_back(MakePrompt(3 + (i * 11) % 40, 50 + i));
  std::map<RequestId, std::vector<int32_t>> alone;
  for (int i = 0; i < 16; ++i) {
    Rig r = MakeEngine();
    ASSERT_TRUE(r.engine->AddRequest(i, prompts[i], Greedy(4 + i % 5)).ok());
    alone[i] = RunAll(r.engine.get())[i];
  }
  EngineOptions o;
  o.num_slots = 16;
  o.max_tokens_per_step = 48;  // forces chunking and mixed prefill/decode steps
  Rig r = MakeEngine(o);
  for (int i = 0; i < 16; ++i)
    ASSERT_TRUE(r.engine->AddRequest(i, prompts[i], Greedy(4 + i % 5)).ok());
  auto together = RunAll(r.engine.get());
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(alone[i], together[i]) << "request " << i;
    EXPECT_EQ(alone[i].size(), 4u + i % 5);
  }
}

// Step timing: one forward per step that had work; a gap between each pair of
// back-to-back forwards (steps - 1 for one request run to the end); a request
// arriving after the engine went idle starts no gap (idle is not host gap).
TEST(EngineTest, StepTimingCountsForwardsAndBackToBackGaps) {
  Rig r = MakeEngine();
  Engine& e = *r.engine;
  ASSERT_TRUE(e.AddRequest(1, MakePrompt(20, 3), Greedy(5)).ok());
  int forwards = 0;
  for (int step = 0; e.HasWork() && step < 100; ++step) {
    auto res = e.Step();
    ASSERT_TRUE(res.ok()) << res.status();
    ++forwards;
  }
  const StepTimingStats t1 = e.step_timing();
  EXPECT_EQ(t1.steps, forwards);
  EXPECT_GE(forwards, 5);  // one prefill step, then one per further token
  EXPECT_EQ(t1.gaps, forwards - 1);
  EXPECT_GT(t1.forward_seconds, 0.0);
  EXPECT_GE(t1.max_host_gap_seconds * t1.gaps, t1.host_gap_seconds - 1e-12);
  EXPECT_GT(t1.host_gap_fraction(), 0.0);
  EXPECT_LT(t1.host_gap_fraction(), 1.0);
  // Idle for a while: the next request's first forward is not a gap.
  absl::SleepFor(absl::Milliseconds(50));
  ASSERT_TRUE(e.AddRequest(2, MakePrompt(8, 5), Greedy(2)).ok());
  ASSERT_TRUE(e.Step().ok());
  const StepTimingStats t2 = e.step_timing();
  EXPECT_EQ(t2.steps, t1.steps + 1);
  EXPECT_EQ(t2.gaps, t1.gaps);
  EXPECT_EQ(t2.host_gap_seconds, t1.host_gap_seconds);
  EXPECT_EQ(t2.max_host_gap_seconds, t1.max_host_gap_seconds);
}

TEST(EngineTest, SameSeedSameTokens) {
  const std::vector<int32_t> prompt = MakePrompt(12, 2);
  engine::SamplingParams p;
  p.temperature = 1.0f;
  p.max_tokens = 12;
  p.ignore_eos = true;
  std::vector<int32_t> runs[3];
  for (int i = 0; i < 3; ++i) {
    p.seed = i < 2 ? 1234 : 99;
    Rig r = MakeEngine();
    ASSERT_TRUE(r.engine->AddRequest(5, prompt, p).ok());
    runs[i] = RunAll(r.engine.get())[5];
    ASSERT_EQ(runs[i].size(), 12u);
  }
  EXPECT_EQ(runs[0], runs[1]);
  EXPECT_NE(runs[0], runs[2]);  // 12 draws at temperature 1 over 163,840 ids
}

TEST(EngineTest, CancellationFreesBlocksAndSlots) {
  EngineOptions o;
  o.num_slots = 4;
  o.max_tokens_per_step = 8;
  o.num_blocks = 64;
  Rig r = MakeEngine(o);
  const int32_t blocks = r.engine->num_free_blocks();
  const int32_t slots = r.engine->num_free_slots();
  ASSERT_TRUE(r.engine->AddRequest(1, MakePrompt(5, 1), Greedy(100)).ok());
  ASSERT_TRUE(r.engine->AddRequest(2, MakePrompt(60, 2), Greedy(100)).ok());
  ASSERT_TRUE(r.engine->AddRequest(3, MakePrompt(7, 3), Greedy(100)).ok());
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(r.engine->Step().ok());
  EXPECT_LT(r.engine->num_free_blocks(), blocks);
  EXPECT_LT(r.engine->num_free_slots(), slots);
  ASSERT_TRUE(r.engine->Abort(2).ok());   // mid-prefill
  ASSERT_TRUE(r.engine->Abort(1).ok());   // decoding
  EXPECT_FALSE(r.engine->Abort(1).ok());  // already gone
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(r.engine->Step().ok());
  ASSERT_TRUE(r.engine->Abort(3).ok());
  EXPECT_FALSE(r.engine->HasWork());
  EXPECT_EQ(r.engine->num_free_blocks(), blocks);
  EXPECT_EQ(r.engine->num_free_slots(), slots);
  EXPECT_TRUE(r.engine->scheduler().CheckInvariants().ok());
  // And a finished request frees them too.
  ASSERT_TRUE(r.engine->AddRequest(4, MakePrompt(9, 4), Greedy(3)).ok());
  RunAll(r.engine.get());
  EXPECT_EQ(r.engine->num_free_blocks(), blocks);
  EXPECT_EQ(r.engine->num_free_slots(), slots);
}

TEST(EngineTest, RejectsBadRequests) {
  Rig r = MakeEngine();
  EXPECT_FALSE(r.engine->AddRequest(1, {}, Greedy(3)).ok());
  EXPECT_FALSE(r.engine->AddRequest(1, {1, -2}, Greedy(3)).ok());
  EXPECT_FALSE(r.engine->AddRequest(1, {1, 200000}, Greedy(3)).ok());
  engine::SamplingParams bad = Greedy(3);
  bad.temperature = -1;
  EXPECT_FALSE(r.engine->AddRequest(1, {1}, bad).ok());
  ASSERT_TRUE(r.engine->AddRequest(1, {1, 2}, Greedy(3)).ok());
  EXPECT_FALSE(r.engine->AddRequest(1, {1, 2}, Greedy(3)).ok());  // duplicate id
}

TEST(EngineTest, PrefillOnOneEngineDecodeOnAnotherEqualsColocated) {
  const std::vector<int32_t> prompt = MakePrompt(41, 8);
  const int kTokens = 9;
  Rig colocated = MakeEngine();
  ASSERT_TRUE(colocated.engine->AddRequest(7, prompt, Greedy(kTokens)).ok());
  const std::vector<int32_t> want = RunAll(colocated.engine.get())[7];
  ASSERT_EQ(want.size(), static_cast<size_t>(kTokens));

  EngineOptions po;
  po.block_size = 16;
  Rig prefill = MakeEngine(po);
  ASSERT_TRUE(prefill.engine->AddRequest(7, prompt, Greedy(kTokens)).ok());
  const std::vector<int32_t> first = StepUntilFirstToken(prefill.engine.get());
  ASSERT_FALSE(first.empty());
  auto state = prefill.engine->ExportState(7);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->num_cached_tokens, static_cast<int64_t>(prompt.size()));

  EngineOptions dopt;
  dopt.block_size = 8;
  dopt.num_slots = 3;
  Rig decode = MakeEngine(dopt);
  // Another request occupies slot and blocks first, so the placement differs.
  ASSERT_TRUE(decode.engine->AddRequest(1, MakePrompt(20, 9), Greedy(30)).ok());
  ASSERT_TRUE(decode.engine->Step().ok());
  ASSERT_TRUE(decode.engine->AddPrefilledRequest(7, *state, Greedy(kTokens)).ok());
  ASSERT_TRUE(prefill.engine->Abort(7).ok());  // the hand-off is complete
  auto got = RunAll(decode.engine.get());
  std::vector<int32_t> all = first;
  all.insert(all.end(), got[7].begin(), got[7].end());
  EXPECT_EQ(all, want);
}

// The decode worker's reservation: the peer writes the state straight into the
// reserved blocks and slot, admission copies nothing; the tokens are the
// colocated run's. The reservation is never scheduled before admission and
// Abort frees it.
TEST(EngineTest, ReservedStateWrittenInPlaceDecodesLikeColocated) {
  const std::vector<int32_t> prompt = MakePrompt(41, 8);
  const int kTokens = 9;
  Rig colocated = MakeEngine();
  ASSERT_TRUE(colocated.engine->AddRequest(7, prompt, Greedy(kTokens)).ok());
  const std::vector<int32_t> want = RunAll(colocated.engine.get())[7];

  Rig prefill = MakeEngine();
  ASSERT_TRUE(prefill.engine->AddRequest(7, prompt, Greedy(kTokens)).ok());
  const std::vector<int32_t> first = StepUntilFirstToken(prefill.engine.get());
  ASSERT_FALSE(first.empty());
  auto state = prefill.engine->ExportState(7);
  ASSERT_TRUE(state.ok()) << state.status();

  EngineOptions dopt;
  dopt.block_size = 8;
  dopt.num_slots = 3;
  Rig decode = MakeEngine(dopt);
  Engine& e = *decode.engine;
  ASSERT_TRUE(e.AddRequest(1, MakePrompt(20, 9), Greedy(30)).ok());
  ASSERT_TRUE(e.Step().ok());
  const int32_t free_before = e.num_free_blocks();
  auto loc = e.Reserve(7, static_cast<int64_t>(prompt.size()));
  ASSERT_TRUE(loc.ok()) << loc.status();
  EXPECT_EQ(loc->block_ids.size(), (prompt.size() + 7) / 8);
  EXPECT_EQ(e.num_free_blocks(),
            free_before - static_cast<int32_t>(loc->block_ids.size()));
  EXPECT_EQ(e.scheduler().num_reserved(), 1);
  EXPECT_EQ(e.Reserve(7, 4).status().code(), absl::StatusCode::kAlreadyExists);
  // Other work steps while the state lands; the reservation is not touched.
  ASSERT_TRUE(e.Step().ok());
  // The peer's writes: into the reserved blocks and slot, in place.
  auto dst = e.executor().ExportSequence(loc->block_ids, loc->num_cached_tokens,
                                         static_cast<int32_t>(loc->slot));
  ASSERT_TRUE(dst.ok()) << dst.status();
  ASSERT_TRUE(CopyStateRanges(state->ranges, *dst).ok());
  ExportedState wrong = *state;
  wrong.prompt.pop_back();
  --wrong.num_cached_tokens;
  EXPECT_EQ(e.AdmitReserved(7, wrong, Greedy(kTokens)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e.scheduler().num_reserved(), 1);  // still reserved after the error
  auto out = e.AdmitReserved(7, *state, Greedy(kTokens));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->new_tokens, first);
  EXPECT_FALSE(out->finished);
  EXPECT_EQ(e.scheduler().num_reserved(), 0);
  auto got = RunAll(&e);
  std::vector<int32_t> all = first;
  all.insert(all.end(), got[7].begin(), got[7].end());
  EXPECT_EQ(all, want);
  EXPECT_EQ(e.num_free_blocks(), e.scheduler().config().num_blocks);
  EXPECT_EQ(e.num_free_slots(), e.scheduler().config().num_slots);
}

TEST(EngineTest, ReservationAbortAndImmediateFinish) {
  Rig r = MakeEngine();
  Engine& e = *r.engine;
  auto loc = e.Reserve(3, 10);
  ASSERT_TRUE(loc.ok()) << loc.status();
  EXPECT_FALSE(e.HasWork());  // a reservation is not work
  EXPECT_EQ(e.Step()->size(), 0u);
  ASSERT_TRUE(e.Abort(3).ok());
  EXPECT_EQ(e.scheduler().num_reserved(), 0);
  EXPECT_EQ(e.num_free_blocks(), e.scheduler().config().num_blocks);
  EXPECT_EQ(e.Abort(3).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(e.AdmitReserved(3, {}, Greedy(1)).status().code(),
            absl::StatusCode::kNotFound);
  // max_tokens 1: the first token ends it; the reservation is freed.
  ASSERT_TRUE(e.Reserve(4, 10).ok());
  ExportedState st;
  st.prompt = MakePrompt(10, 2);
  st.generated = {5};
  st.num_cached_tokens = 10;
  auto out = e.AdmitReserved(4, st, Greedy(1));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->finished);
  EXPECT_EQ(out->finish_reason, engine::FinishReason::kLength);
  EXPECT_EQ(e.scheduler().num_reserved(), 0);
  EXPECT_FALSE(e.HasWork());
  EXPECT_EQ(e.num_free_blocks(), e.scheduler().config().num_blocks);
  EXPECT_EQ(e.num_free_slots(), e.scheduler().config().num_slots);
}

// Admission cost, landing pool vs in place (printed, not asserted): the landing
// pool's path is AddPrefilledRequestWithOutput (a copy of the ranges) plus the
// first step's copy into the engine's blocks; in place it is AdmitReserved.
TEST(EngineTest, AdmissionTimeLandingPoolVersusInPlace) {
  const std::vector<int32_t> prompt = MakePrompt(1000, 3);
  EngineOptions o;
  o.max_tokens_per_step = 1024;
  Rig prefill = MakeEngine(o);
  ASSERT_TRUE(prefill.engine->AddRequest(1, prompt, Greedy(4)).ok());
  ASSERT_FALSE(StepUntilFirstToken(prefill.engine.get()).empty());
  auto state = prefill.engine->ExportState(1);
  ASSERT_TRUE(state.ok()) << state.status();
  size_t bytes = 0;
  for (const StateRange& r : state->ranges) bytes += r.bytes;
  constexpr int kRounds = 20;
  Rig decode = MakeEngine(o);
  Engine& e = *decode.engine;
  absl::Duration copy = absl::ZeroDuration(), in_place = absl::ZeroDuration();
  for (int i = 0; i < kRounds; ++i) {
    // Landing pool: copied at admission, then into the engine's blocks.
    absl::Time t0 = absl::Now();
    ASSERT_TRUE(e.AddPrefilledRequestWithOutput(10 + i, *state, Greedy(4)).ok());
    auto blocks = e.scheduler().Blocks(10 + i);
    auto dst = e.executor().ExportSequence(*blocks, state->num_cached_tokens,
                                           *e.scheduler().Slot(10 + i));
    ASSERT_TRUE(dst.ok());
    ASSERT_TRUE(CopyStateRanges(state->ranges, *dst).ok());
    copy += absl::Now() - t0;
    ASSERT_TRUE(e.Abort(10 + i).ok());
    // In place.
    ASSERT_TRUE(e.Reserve(100 + i, static_cast<int64_t>(prompt.size())).ok());
    t0 = absl::Now();
    ASSERT_TRUE(e.AdmitReserved(100 + i, *state, Greedy(4)).ok());
    in_place += absl::Now() - t0;
    ASSERT_TRUE(e.Abort(100 + i).ok());
  }
  std::cout << "admission of a " << prompt.size() << "-token state (" << bytes
            << " bytes), mean of " << kRounds << ": landing pool "
            << absl::ToDoubleMicroseconds(copy / kRounds) << " us, in place "
            << absl::ToDoubleMicroseconds(in_place / kRounds) << " us\n";
  EXPECT_EQ(e.num_free_blocks(), e.scheduler().config().num_blocks);
}

}  // namespace
}  // namespace tandem::engine

namespace tandem::engine {
namespace {

// Running out of cache blocks preempts sequences (their blocks and slot are freed
// and they recompute later from prompt + generated tokens): the tokens must be the
// ones each request produces alone with plenty of blocks.
TEST(EngineTest, PreemptionByRecomputeKeepsTokens) {
  constexpr int kRequests = 6;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < kRequests; ++i) prompts.push_back(MakePrompt(18 + 5 * i, 90 + i));
  std::map<RequestId, std::vector<int32_t>> alone;
  for (int i = 0; i < kRequests; ++i) {
    Rig r = MakeEngine();
    ASSERT_TRUE(r.engine->AddRequest(i, prompts[i], Greedy(20)).ok());
    alone[i] = RunAll(r.engine.get())[i];
    ASSERT_EQ(alone[i].size(), 20u);
  }
  EngineOptions o;
  o.block_size = 4;
  // Each request needs up to (43 + 20) / 4 = 16 blocks; all six at once need ~90.
  o.num_blocks = 24;
  o.num_slots = kRequests;
  o.max_tokens_per_step = 64;
  o.max_context_tokens = 96;
  Rig r = MakeEngine(o);
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(r.engine->AddRequest(i, prompts[i], Greedy(20)).ok());
  }
  auto together = RunAll(r.engine.get());
  EXPECT_GT(r.engine->scheduler().num_preemptions(), 0)
      << "the pool was meant to run out: the test no longer exercises preemption";
  for (int i = 0; i < kRequests; ++i)
    EXPECT_EQ(alone[i], together[i]) << "request " << i;
  EXPECT_EQ(r.engine->num_free_blocks(), 24);
  EXPECT_EQ(r.engine->num_free_slots(), kRequests);
}

}  // namespace
}  // namespace tandem::engine

namespace tandem::engine {
namespace {

// The cache sized from a memory budget: what the engine allocates is what the
// sizing promised and stays within the budget; the slots cap concurrency; a
// prompt the cache could never hold is refused at once, one that does not fit
// now waits.
TEST(EngineTest, SizedFromMemory) {
  const model::ModelConfig& c = TinyWeights().config;
  EngineOptions o;
  CacheMemoryOptions m;
  m.budget_bytes = int64_t{4} << 20;  // 4 MiB
  m.max_num_seqs = 3;
  auto s = SizeCacheFromMemory(c, m, &o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(o.num_slots, 3);
  EXPECT_EQ(o.num_blocks, s->num_blocks);
  // 2 MLA layers of (32 + 8) BF16 values per token on the tiny model.
  EXPECT_EQ(s->block_bytes, s->num_blocks * 16 * 2 * 40 * 2);
  EXPECT_EQ(o.max_context_tokens, s->cache_tokens);  // 1M does not fit 4 MiB
  EXPECT_TRUE(s->max_model_len_limited_by_memory);
  Rig r = MakeEngine(o);
  ASSERT_NE(r.engine, nullptr);
  EXPECT_EQ(r.engine->scheduler().config().num_slots, 3);
  EXPECT_EQ(r.engine->scheduler().config().num_blocks, s->num_blocks);
  EXPECT_EQ(r.engine->scheduler().config().max_context_tokens, s->max_model_len);
  // What the cache holds is exactly the sizing's bytes.
  EXPECT_EQ(static_cast<int64_t>(r.engine->cache().total_bytes()), s->total_bytes());
  EXPECT_LE(s->total_bytes(), m.budget_bytes);
  // Longer than the cache could ever hold: refused, naming the limit.
  absl::Status too_long =
      r.engine->AddRequest(1, MakePrompt(s->cache_tokens + 1, 1), Greedy(1));
  EXPECT_EQ(too_long.code(), absl::StatusCode::kInvalidArgument) << too_long;
  // An explicit --max_model_len beyond the budget is an error at start.
  CacheMemoryOptions big = m;
  big.max_model_len = 1048576;
  EngineOptions o2;
  EXPECT_EQ(SizeCacheFromMemory(c, big, &o2).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// With TP the MLA latent is replicated on every rank: half the tokens per byte.
TEST(EngineTest, SizedFromMemoryCountsReplicatedMlaPerRank) {
  const model::ModelConfig& c = TinyWeights().config;
  CacheMemoryOptions m;
  m.budget_bytes = int64_t{64} << 20;
  m.max_num_seqs = 4;
  EngineOptions one, two;
  two.tp.tp_size = 2;
  auto s1 = SizeCacheFromMemory(c, m, &one);
  auto s2 = SizeCacheFromMemory(c, m, &two);
  ASSERT_TRUE(s1.ok() && s2.ok());
  EXPECT_EQ(s1->slot_bytes, s2->slot_bytes);  // KDA heads split, same total
  EXPECT_NEAR(static_cast<double>(s2->num_blocks), s1->num_blocks / 2.0, 1.0);
}

// A device that only says what it is and its capacity (DefaultMaxTokensPerStep
// reads nothing else).
class NamedDevice final : public kernels::Device {
 public:
  NamedDevice(std::string name, int64_t total, bool host_addressable = false)
      : name_(std::move(name)), total_(total), host_addressable_(host_addressable) {}
  absl::string_view name() const override { return name_; }
  bool host_addressable() const override { return host_addressable_; }
  absl::StatusOr<void*> Allocate(size_t) override {
    return absl::UnimplementedError("stand-in");
  }
  void Free(void*) override {}
  bool Owns(const void*, size_t) const override { return false; }
  kernels::DeviceMemoryInfo MemoryInfo() const override { return {total_, total_, 0}; }
  kernels::Stream& compute_stream() override { return stream_; }
  absl::StatusOr<std::unique_ptr<kernels::Stream>> CreateStream() override {
    return absl::UnimplementedError("stand-in");
  }
  absl::StatusOr<std::unique_ptr<kernels::Event>> CreateEvent() override {
    return absl::UnimplementedError("stand-in");
  }
  absl::Status CopyToDevice(void*, const void*, size_t, kernels::Stream*) override {
    return absl::UnimplementedError("stand-in");
  }
  absl::Status CopyToHost(void*, const void*, size_t, kernels::Stream*) override {
    return absl::UnimplementedError("stand-in");
  }
  absl::Status CopyOnDevice(void*, const void*, size_t, kernels::Stream*) override {
    return absl::UnimplementedError("stand-in");
  }
  absl::Status Memset(void*, uint8_t, size_t, kernels::Stream*) override {
    return absl::UnimplementedError("stand-in");
  }

 private:
  class NullStream final : public kernels::Stream {
   public:
    void* native() override { return nullptr; }
    absl::Status Synchronize() override { return absl::OkStatus(); }
  };
  std::string name_;
  int64_t total_;
  bool host_addressable_;
  NullStream stream_;
};

// vLLM's API-server step budgets on a GPU by its memory, the host default
// elsewhere (the CPU, the emulator).
TEST(DefaultMaxTokensPerStepTest, ByDevice) {
  constexpr int64_t kGiB = int64_t{1} << 30;
  EXPECT_EQ(DefaultMaxTokensPerStep(NamedDevice("cuda:0", 141 * kGiB), 256), 8192);
  EXPECT_EQ(DefaultMaxTokensPerStep(NamedDevice("cuda:7", 70 * kGiB), 256), 8192);
  EXPECT_EQ(DefaultMaxTokensPerStep(NamedDevice("cuda:1", 70 * kGiB - 1), 256), 2048);
  EXPECT_EQ(DefaultMaxTokensPerStep(NamedDevice("cuda:0", 24 * kGiB), 256), 2048);
  EXPECT_EQ(DefaultMaxTokensPerStep(NamedDevice("cuda_sim", 141 * kGiB, true), 256),
            256);
  EXPECT_EQ(DefaultMaxTokensPerStep(NamedDevice("host", 512 * kGiB, true), 512), 512);
}

}  // namespace
}  // namespace tandem::engine
