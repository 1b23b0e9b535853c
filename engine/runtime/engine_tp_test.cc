// The Engine on a tensor-parallel executor (tiny checkpoint, TP 2 and 4):
// batched mixed prefill/decode gives the TP 1 tokens; a TP 2 engine's exported
// state (every rank's KDA heads + MLA rows) imported into another TP 2 engine
// continues identically; the layer-progress callback fires per layer on rank 0
// with every rank's state final; n-gram speculation (snapshot/rollback of every
// rank) gives the plain tokens; a failing rank fails the step (no hang) and
// every later step fails fast naming it.
#include <cstring>
#include <map>
#include <string>

#include "absl/time/clock.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using testing::MakeBackend;
using testing::MakePrompt;
using testing::TinyWeights;

const model::Checkpoint& Tiny() {
  static const model::Checkpoint* c = [] {
    auto ckpt = model::Checkpoint::Open(testing::kTinyCheckpointDir);
    if (!ckpt.ok()) std::abort();
    return ckpt->release();
  }();
  return *c;
}

EngineOptions Options(int tp) {
  EngineOptions o;
  o.num_slots = 6;
  o.max_context_tokens = 256;
  o.max_tokens_per_step = 24;  // prompts are chunked and mixed with decodes
  o.tp.tp_size = tp;
  o.tp.backend = "cpu";
  o.tp.threads_per_rank = 1;
  o.tp.timeout = absl::Seconds(20);
  o.tp_checkpoint = &Tiny();
  return o;
}

struct Rig {
  std::unique_ptr<kernels::Backend> backend;  // TP 1 only
  std::unique_ptr<Engine> engine;
};

Rig MakeEngine(const EngineOptions& o) {
  Rig r;
  if (o.tp.tp_size == 1) r.backend = MakeBackend("cpu");
  auto e = Engine::Create(o.tp.tp_size == 1 ? &TinyWeights() : nullptr, r.backend.get(),
                          nullptr, o);
  EXPECT_TRUE(e.ok()) << e.status();
  if (e.ok()) r.engine = *std::move(e);
  return r;
}

engine::SamplingParams Greedy(int max_tokens) {
  engine::SamplingParams p;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

// Six requests arriving over the first steps (prefill chunks batched with the
// earlier requests' decodes); returns every request's tokens.
std::map<RequestId, std::vector<int32_t>> RunMixed(Engine* e) {
  std::map<RequestId, std::vector<int32_t>> out;
  const int lengths[] = {3, 30, 11, 47, 19, 6};
  int added = 0;
  for (int step = 0; step < 2000 && (e->HasWork() || added < 6); ++step) {
    if (added < 6 && step % 2 == 0) {
      EXPECT_TRUE(
          e->AddRequest(added + 1, MakePrompt(lengths[added], 100 + added), Greedy(8))
              .ok());
      ++added;
    }
    auto res = e->Step();
    EXPECT_TRUE(res.ok()) << res.status();
    if (!res.ok()) break;
    for (const RequestOutput& o : *res) {
      out[o.id].insert(out[o.id].end(), o.new_tokens.begin(), o.new_tokens.end());
    }
  }
  return out;
}

TEST(EngineTpTest, BatchedMixedStepsGiveTheTp1Tokens) {
  Rig one = MakeEngine(Options(1));
  ASSERT_TRUE(one.engine);
  const auto want = RunMixed(one.engine.get());
  ASSERT_EQ(want.size(), 6u);
  for (int tp : {2, 4}) {
    Rig many = MakeEngine(Options(tp));
    ASSERT_TRUE(many.engine);
    EXPECT_EQ(many.engine->executor().tp_size(), tp);
    const auto got = RunMixed(many.engine.get());
    EXPECT_EQ(got, want) << "TP " << tp;
    EXPECT_GT(many.engine->executor().comm_stats().calls, 0);
  }
}

TEST(EngineTpTest, ExportedStateContinuesOnAnotherTp2Engine) {
  const std::vector<int32_t> prompt = MakePrompt(37, 5);
  const int kTokens = 8;
  Rig colocated = MakeEngine(Options(2));
  ASSERT_TRUE(colocated.engine->AddRequest(7, prompt, Greedy(kTokens)).ok());
  std::vector<int32_t> want;
  while (colocated.engine->HasWork()) {
    auto res = colocated.engine->Step();
    ASSERT_TRUE(res.ok()) << res.status();
    for (const RequestOutput& o : *res)
      want.insert(want.end(), o.new_tokens.begin(), o.new_tokens.end());
  }
  ASSERT_EQ(want.size(), static_cast<size_t>(kTokens));

  Rig prefill = MakeEngine(Options(2));
  ASSERT_TRUE(prefill.engine->AddRequest(7, prompt, Greedy(kTokens)).ok());
  std::vector<int32_t> all;
  while (all.empty()) {
    auto res = prefill.engine->Step();
    ASSERT_TRUE(res.ok());
    for (const RequestOutput& o : *res) all = o.new_tokens;
  }
  auto state = prefill.engine->ExportState(7);
  ASSERT_TRUE(state.ok()) << state.status();
  // Both ranks' state, rank-major.
  int kda_ranges[2] = {0, 0};
  for (const StateRange& r : state->ranges) {
    ASSERT_TRUE(r.rank == 0 || r.rank == 1);
    if (r.kind == StateKind::kKda) ++kda_ranges[r.rank];
  }
  EXPECT_EQ(kda_ranges[0], TinyWeights().config.NumKdaLayers());
  EXPECT_EQ(kda_ranges[1], TinyWeights().config.NumKdaLayers());

  EngineOptions dopt = Options(2);
  dopt.block_size = 8;  // another layout: matched by (rank, layer, kind)
  Rig decode = MakeEngine(dopt);
  ASSERT_TRUE(decode.engine->AddRequest(1, MakePrompt(12, 9), Greedy(20)).ok());
  ASSERT_TRUE(decode.engine->Step().ok());
  ASSERT_TRUE(decode.engine->AddPrefilledRequest(7, *state, Greedy(kTokens)).ok());
  ASSERT_TRUE(prefill.engine->Abort(7).ok());
  while (decode.engine->HasWork()) {
    auto res = decode.engine->Step();
    ASSERT_TRUE(res.ok()) << res.status();
    for (const RequestOutput& o : *res) {
      if (o.id == 7) all.insert(all.end(), o.new_tokens.begin(), o.new_tokens.end());
    }
  }
  EXPECT_EQ(all, want);

  // A TP 1 export lacks rank 1's heads: refused at the first step, not garbage.
  Rig tp1 = MakeEngine(Options(1));
  ASSERT_TRUE(tp1.engine->AddRequest(3, prompt, Greedy(kTokens)).ok());
  while (true) {
    auto res = tp1.engine->Step();
    ASSERT_TRUE(res.ok());
    if (!res->empty()) break;
  }
  auto one_rank = tp1.engine->ExportState(3);
  ASSERT_TRUE(one_rank.ok());
  Rig other = MakeEngine(Options(2));
  ASSERT_TRUE(other.engine->AddPrefilledRequest(3, *one_rank, Greedy(kTokens)).ok());
  EXPECT_FALSE(other.engine->Step().ok());
}

// Rank 0 reports each layer after its attention all-reduce: by then rank 1 has
// written its KDA heads of that layer too (its bytes no longer change).
TEST(EngineTpTest, LayerProgressFiresPerLayerWithEveryRankFinal) {
  EngineOptions o = Options(2);
  o.max_tokens_per_step = 64;
  Rig r = MakeEngine(o);
  Engine& e = *r.engine;
  const int num_layers = TinyWeights().config.text.num_hidden_layers;
  std::vector<int> layers;
  std::map<int, std::vector<uint8_t>> rank1_kda;
  e.set_layer_progress_callback(
      [&](int layer, absl::Span<const LayerProgressEntry> en) {
        layers.push_back(layer);
        ASSERT_EQ(en.size(), 1u);
        auto ranges = e.executor().cache(1).ExportSequence(en[0].block_table,
                                                           en[0].end_pos, en[0].slot);
        ASSERT_TRUE(ranges.ok());
        for (const StateRange& sr : *ranges) {
          if (sr.layer == layer && sr.kind == StateKind::kKda)
            rank1_kda[layer].assign(sr.data, sr.data + sr.bytes);
        }
      });
  ASSERT_TRUE(e.AddRequest(4, MakePrompt(30, 2), Greedy(2)).ok());
  auto out = e.Step();
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(layers.size(), static_cast<size_t>(num_layers));
  for (int l = 0; l < num_layers; ++l) EXPECT_EQ(layers[l], l);
  auto loc = e.Locate(4);
  ASSERT_TRUE(loc.ok());
  auto now = e.executor().cache(1).ExportSequence(loc->block_ids, 30, loc->slot);
  ASSERT_TRUE(now.ok());
  int checked = 0;
  for (const StateRange& sr : *now) {
    if (sr.kind != StateKind::kKda) continue;
    EXPECT_EQ(rank1_kda[sr.layer], std::vector<uint8_t>(sr.data, sr.data + sr.bytes))
        << "layer " << sr.layer;
    ++checked;
  }
  EXPECT_EQ(checked, TinyWeights().config.NumKdaLayers());
}

TEST(EngineTpTest, RankFailureFailsTheStepCleanly) {
  EngineOptions o = Options(2);
  o.tp.timeout = absl::Seconds(5);
  o.tp.fail_rank = 1;
  o.tp.fail_rank_at_step = 3;
  Rig r = MakeEngine(o);
  Engine& e = *r.engine;
  ASSERT_TRUE(e.AddRequest(1, MakePrompt(10, 1), Greedy(20)).ok());
  absl::Status failed;
  int steps = 0;
  const absl::Time t0 = absl::Now();
  for (; steps < 10 && failed.ok(); ++steps) failed = e.Step().status();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(10));
  EXPECT_EQ(steps, 4);  // forwards 0..2 succeed, forward 3 fails
  EXPECT_TRUE(absl::IsUnavailable(failed)) << failed;
  EXPECT_NE(failed.message().find("rank 1"), std::string::npos) << failed;
  absl::Status later = e.Step().status();
  EXPECT_TRUE(absl::IsUnavailable(later)) << later;
  EXPECT_NE(later.message().find("rank 1"), std::string::npos) << later;
}

// Speculative decoding on a TP 2 engine: the KDA snapshot and rollback cover
// both ranks, so greedy n-gram speculation gives the plain TP 1 tokens. Prompts
// repeat a phrase and a repetition boost (penalty < 1) makes the random model
// loop, so drafts are proposed, some accepted and some rolled back.
TEST(EngineTpTest, SpeculativeNgramOnTp2GivesThePlainTokens) {
  auto run = [](const EngineOptions& o, SpeculativeStats* stats) {
    Rig r = MakeEngine(o);
    std::map<RequestId, std::vector<int32_t>> out;
    for (int i = 0; i < 6; ++i) {
      std::vector<int32_t> phrase = MakePrompt(3 + i % 4, 300 + i), prompt;
      for (int k = 0; k < 3; ++k)
        prompt.insert(prompt.end(), phrase.begin(), phrase.end());
      engine::SamplingParams p = Greedy(16);
      p.repetition_penalty = 0.2f;
      EXPECT_TRUE(r.engine->AddRequest(i, prompt, p).ok());
    }
    while (r.engine->HasWork()) {
      auto res = r.engine->Step();
      EXPECT_TRUE(res.ok()) << res.status();
      if (!res.ok()) break;
      for (const RequestOutput& o : *res)
        out[o.id].insert(out[o.id].end(), o.new_tokens.begin(), o.new_tokens.end());
    }
    if (stats != nullptr) *stats = r.engine->speculative_stats();
    return out;
  };
  const auto want = run(Options(1), nullptr);
  EngineOptions o = Options(2);
  o.speculative.method = SpeculativeMethod::kNgram;
  o.speculative.num_speculative_tokens = 3;
  SpeculativeStats st;
  const auto got = run(o, &st);
  EXPECT_EQ(got, want);
  EXPECT_GT(st.accepted_tokens, 0);
  EXPECT_GT(st.rollbacks, 0);
}

TEST(EngineTpTest, CreateRefusesBadTpSettings) {
  EngineOptions o = Options(2);
  o.tp_checkpoint = nullptr;
  EXPECT_FALSE(Engine::Create(nullptr, nullptr, nullptr, o).ok());
  o = Options(8);
  auto e = Engine::Create(nullptr, nullptr, nullptr, o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("num_heads = 4"), std::string::npos)
      << e.status();
  o = Options(2);
  o.tp.fail_rank = 0;  // rank 0 is the caller's thread: not injectable
  o.tp.fail_rank_at_step = 1;
  EXPECT_FALSE(Engine::Create(nullptr, nullptr, nullptr, o).ok());
}

}  // namespace
}  // namespace tandem::engine
