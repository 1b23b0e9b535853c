// Speculative decoding in the Engine (tiny checkpoint): output with speculation
// == without, token for token (greedy, n-gram and draft-model proposers, many
// prompts); seeded sampling with the target as its own draft == without;
// seeded sampling with a mismatched draft is reproducible and keeps the target
// distribution; the KDA/MLA state after a rollback equals a run that never saw
// the rejected drafts; no block or slot leaks through preemption and aborts.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <set>
#include <string>

#include "engine/model/bf16.h"
#include "engine/model/checkpoint.h"
#include "engine/runtime/draft_model_proposer.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/test_util.h"
#include "engine/sampling/sampler.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using testing::Argmax;
using testing::BlockRange;
using testing::Feed;
using testing::MakeBackend;
using testing::MakeCache;
using testing::MakePrompt;
using testing::TestSequence;
using testing::TinyWeights;

// The seed-1 tiny model: same architecture and vocabulary, other weights.
const ModelWeights& OtherDraftWeights() {
  static const ModelWeights* weights = [] {
    auto ckpt = model::Checkpoint::Open("engine/speculative/tiny_draft_checkpoint");
    if (!ckpt.ok()) {
      std::fprintf(stderr, "open draft: %s\n", ckpt.status().ToString().c_str());
      std::abort();
    }
    auto* c = std::move(ckpt).value().release();  // lives for the process
    auto w = LoadModelWeights(*c);
    if (!w.ok()) {
      std::fprintf(stderr, "load draft: %s\n", w.status().ToString().c_str());
      std::abort();
    }
    return std::move(w).value().release();
  }();
  return *weights;
}

struct Rig {
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<Engine> engine;
};

Rig MakeEngine(EngineOptions o) {
  Rig r;
  r.backend = MakeBackend("cpu");
  auto e = Engine::Create(&TinyWeights(), r.backend.get(), nullptr, o);
  EXPECT_TRUE(e.ok()) << e.status();
  if (e.ok()) r.engine = std::move(e).value();
  return r;
}

EngineOptions Spec(SpeculativeMethod method, int k,
                   const ModelWeights* draft = nullptr) {
  EngineOptions o;
  o.num_slots = 16;
  o.max_tokens_per_step = 256;
  o.speculative.method = method;
  o.speculative.num_speculative_tokens = k;
  o.speculative.draft_weights = draft;
  o.speculative.ngram.min_n = 1;
  o.speculative.ngram.max_n = 3;
  return o;
}

EngineOptions Plain() {
  EngineOptions o;
  o.num_slots = 16;
  o.max_tokens_per_step = 256;
  return o;
}

engine::SamplingParams Greedy(int max_tokens) {
  engine::SamplingParams p;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

engine::SamplingParams Random(int max_tokens, uint64_t seed, int top_k = 0) {
  engine::SamplingParams p = Greedy(max_tokens);
  p.temperature = 1.0f;
  p.top_k = top_k;
  p.seed = seed;
  return p;
}

// A prompt that repeats a short random phrase (so n-gram lookup finds matches)
// and ends with a few other tokens.
std::vector<int32_t> RepetitivePrompt(int i) {
  std::vector<int32_t> phrase = MakePrompt(3 + i % 5, 100 + i);
  std::vector<int32_t> p;
  for (int r = 0; r < 2 + i % 3; ++r) p.insert(p.end(), phrase.begin(), phrase.end());
  std::vector<int32_t> tail = MakePrompt(i % 4, 900 + i);
  p.insert(p.end(), tail.begin(), tail.end());
  return p;
}

// Runs until idle, checking the scheduler after every step.
std::map<RequestId, std::vector<int32_t>> RunAll(Engine* e) {
  std::map<RequestId, std::vector<int32_t>> out;
  for (int step = 0; e->HasWork() && step < 10000; ++step) {
    auto res = e->Step();
    EXPECT_TRUE(res.ok()) << res.status();
    if (!res.ok()) break;
    EXPECT_TRUE(e->scheduler().CheckInvariants().ok());
    for (const RequestOutput& o : *res) {
      auto& v = out[o.id];
      v.insert(v.end(), o.new_tokens.begin(), o.new_tokens.end());
    }
  }
  return out;
}

std::map<RequestId, std::vector<int32_t>> RunPrompts(
    const EngineOptions& o, int n,
    const std::function<engine::SamplingParams(int)>& params,
    SpeculativeStats* stats = nullptr) {
  Rig r = MakeEngine(o);
  const int32_t blocks = r.engine->num_free_blocks();
  for (int i = 0; i < n; ++i) {
    EXPECT_TRUE(r.engine->AddRequest(i, RepetitivePrompt(i), params(i)).ok());
  }
  auto out = RunAll(r.engine.get());
  EXPECT_EQ(r.engine->num_free_blocks(), blocks);
  EXPECT_EQ(r.engine->num_free_slots(), o.num_slots);
  if (stats != nullptr) *stats = r.engine->speculative_stats();
  return out;
}

constexpr int kPrompts = 50;
constexpr int kTokens = 24;

// The random tiny model never repeats itself, so n-gram drafts would never be
// accepted; a repetition penalty below 1 (a boost) makes two thirds of the
// requests loop over their prompt's tokens, where lookups hit and some drafts
// are accepted. It also checks that rows after drafts see them as history.
engine::SamplingParams Looping(int i) {
  engine::SamplingParams p = Greedy(kTokens);
  if (i % 3 != 0) p.repetition_penalty = 0.2f;
  return p;
}

TEST(SpeculativeEngineTest, GreedyNgramEqualsPlain) {
  auto params = [](int i) { return Looping(i); };
  auto want = RunPrompts(Plain(), kPrompts, params);
  for (int k : {1, 4}) {
    SpeculativeStats st;
    auto got = RunPrompts(Spec(SpeculativeMethod::kNgram, k), kPrompts, params, &st);
    for (int i = 0; i < kPrompts; ++i) {
      ASSERT_EQ(want[i].size(), static_cast<size_t>(kTokens));
      EXPECT_EQ(got[i], want[i]) << "prompt " << i << " k " << k;
    }
    // Both outcomes happened: accepted drafts and rollbacks.
    EXPECT_GT(st.drafted_tokens, 0);
    EXPECT_GT(st.accepted_tokens, 0);
    EXPECT_GT(st.rollbacks, 0);
    EXPECT_LE(st.accepted_tokens, st.drafted_tokens);
    EXPECT_EQ(st.emitted_tokens, st.accepted_tokens + st.verifications);
    EXPECT_NEAR(st.mean_accepted_length(),
                static_cast<double>(st.accepted_tokens) / st.verifications, 1e-12);
    std::printf("ngram k=%d: drafted %ld accepted %ld (%.3f) rollbacks %ld\n", k,
                static_cast<long>(st.drafted_tokens),
                static_cast<long>(st.accepted_tokens), st.acceptance_rate(),
                static_cast<long>(st.rollbacks));
  }
}

TEST(SpeculativeEngineTest, GreedyDraftModelEqualsPlain) {
  auto params = [](int) { return Greedy(kTokens); };
  auto want = RunPrompts(Plain(), kPrompts, params);
  // The target as its own draft: every draft is the target's argmax.
  SpeculativeStats self;
  auto got = RunPrompts(Spec(SpeculativeMethod::kDraft, 4, &TinyWeights()), kPrompts,
                        params, &self);
  for (int i = 0; i < kPrompts; ++i) EXPECT_EQ(got[i], want[i]) << "prompt " << i;
  EXPECT_GT(self.drafted_tokens, 0);
  EXPECT_GE(self.acceptance_rate(), 0.99);
  // Another model: nearly every draft is rejected, every step rolls back.
  SpeculativeStats other;
  got = RunPrompts(Spec(SpeculativeMethod::kDraft, 3, &OtherDraftWeights()), kPrompts,
                   params, &other);
  for (int i = 0; i < kPrompts; ++i) EXPECT_EQ(got[i], want[i]) << "prompt " << i;
  EXPECT_GT(other.rollbacks, 0);
  EXPECT_LT(other.acceptance_rate(), 0.5);
  std::printf("draft=self acceptance %.4f; draft=other acceptance %.4f rollbacks %ld\n",
              self.acceptance_rate(), other.acceptance_rate(),
              static_cast<long>(other.rollbacks));
}

TEST(SpeculativeEngineTest, SeededSamplingWithTargetAsDraftEqualsPlain) {
  constexpr int kN = 16;
  auto params = [](int i) { return Random(kTokens, 1000 + i, i % 2 == 0 ? 0 : 40); };
  auto want = RunPrompts(Plain(), kN, params);
  SpeculativeStats st;
  auto got =
      RunPrompts(Spec(SpeculativeMethod::kDraft, 3, &TinyWeights()), kN, params, &st);
  for (int i = 0; i < kN; ++i) {
    ASSERT_EQ(want[i].size(), static_cast<size_t>(kTokens));
    EXPECT_EQ(got[i], want[i]) << "prompt " << i;
  }
  EXPECT_GE(st.acceptance_rate(), 0.99);
}

TEST(SpeculativeEngineTest, SeededSamplingWithMismatchedDraftIsValidAndReproducible) {
  constexpr int kN = 8;
  const int64_t V = TinyWeights().config.text.vocab_size;
  auto params = [](int i) {
    engine::SamplingParams p = Random(kTokens, 77 + i, 50);
    p.repetition_penalty = 1.2f;  // rows after drafts see the drafts as history
    return p;
  };
  for (SpeculativeMethod m : {SpeculativeMethod::kNgram, SpeculativeMethod::kDraft}) {
    const EngineOptions o = Spec(m, 3, &OtherDraftWeights());
    SpeculativeStats st;
    auto a = RunPrompts(o, kN, params, &st);
    auto b = RunPrompts(o, kN, params);
    for (int i = 0; i < kN; ++i) {
      ASSERT_EQ(a[i].size(), static_cast<size_t>(kTokens));
      EXPECT_EQ(a[i], b[i]);
      for (int32_t t : a[i]) EXPECT_TRUE(t >= 0 && t < V);
    }
    if (m == SpeculativeMethod::kDraft) {
      EXPECT_GT(st.drafted_tokens, 0);
    }
  }
}

// The first speculatively verified token (output position 1) has the target's
// distribution: the joint histogram of output positions (0, 1) over many seeds,
// with and without speculation, against the exact joint p(a) p(b | a) computed
// from the bare runner (top-3 at temperature 1: 9 outcomes), by chi-square.
TEST(SpeculativeEngineTest, RejectionSamplingKeepsTheTargetDistribution) {
  constexpr int kSeeds = 256;
  const int64_t V = TinyWeights().config.text.vocab_size;
  const std::vector<int32_t> prompt = MakePrompt(10, 3);
  const engine::SamplingParams params = Random(3, 0, 3);
  // Exact target: p0 after the prompt, p1 after the prompt + each a.
  auto backend = MakeBackend("cpu");
  engine::Sampler sampler(V);
  auto dist = [&](const std::vector<int32_t>& tokens, std::vector<float>* probs) {
    auto cache = MakeCache(TinyWeights(), 4, 16, 1);
    ModelRunner runner(&TinyWeights(), cache.get(), backend.get());
    TestSequence s{BlockRange(0, 4), 0, 0};
    std::vector<float> logits;
    ASSERT_TRUE(Feed(&runner, &s, tokens, false, &logits).ok());
    engine::SampleRequest sr;
    sr.logits = logits;
    sr.params = &params;
    ASSERT_TRUE(sampler.Distribution(sr, probs).ok());
  };
  std::map<std::pair<int32_t, int32_t>, double> exact;
  std::vector<float> p0, p1;
  dist(prompt, &p0);
  for (int32_t a = 0; a < V; ++a) {
    if (p0[a] <= 0) continue;
    std::vector<int32_t> t = prompt;
    t.push_back(a);
    dist(t, &p1);
    for (int32_t b = 0; b < V; ++b) {
      if (p1[b] > 0) exact[{a, b}] = static_cast<double>(p0[a]) * p1[b];
    }
  }
  ASSERT_EQ(exact.size(), 9u);
  auto chi_square = [&](EngineOptions o, int64_t* drafted) {
    o.max_context_tokens = 64;
    std::map<std::pair<int32_t, int32_t>, int> h;
    for (int base = 0; base < kSeeds; base += 16) {
      Rig r = MakeEngine(o);
      for (int i = 0; i < 16; ++i) {
        // 3 tokens: position 0 from the prefill, 1 (and 2) verified together.
        engine::SamplingParams p = params;
        p.seed = 5000 + base + i;
        EXPECT_TRUE(r.engine->AddRequest(i, prompt, p).ok());
      }
      auto out = RunAll(r.engine.get());
      *drafted += r.engine->speculative_stats().drafted_tokens;
      for (auto& [id, toks] : out) h[{toks[0], toks[1]}]++;
    }
    double chi2 = 0;
    for (auto& [k, n] : h) EXPECT_TRUE(exact.contains(k)) << "impossible outcome";
    for (auto& [k, p] : exact) {
      const double e = p * kSeeds;
      chi2 += (h[k] - e) * (h[k] - e) / e;
    }
    return chi2;
  };
  int64_t plain_drafts = 0, spec_drafts = 0;
  const double plain = chi_square(Plain(), &plain_drafts);
  // The other model's drafts are mostly rejected, so residual draws happen.
  const double spec = chi_square(
      Spec(SpeculativeMethod::kDraft, 1, &OtherDraftWeights()), &spec_drafts);
  EXPECT_EQ(plain_drafts, 0);
  EXPECT_EQ(spec_drafts, kSeeds);  // every position 1 was drafted and verified
  // 8 degrees of freedom: P(chi2 > 26.1) = 0.001. A wrong row or position
  // gives values in the hundreds.
  EXPECT_LT(plain, 26.1);
  EXPECT_LT(spec, 26.1);
  std::printf("chi-square (8 dof) plain %.2f speculative %.2f\n", plain, spec);
}

// Runner-level replay of the engine's rollback protocol: snapshot → verify
// [t, d1..d4] → restore → next forward [t, d1, d2, next] gives bit-identical KDA
// state, MLA rows and logits to a cache that only ever saw [t, d1, d2, next].
TEST(SpeculativeEngineTest, RollbackStateEqualsNeverSawTheRejectedDrafts) {
  auto backend = MakeBackend("cpu");
  const int64_t V = TinyWeights().config.text.vocab_size;
  const std::vector<int32_t> prompt = MakePrompt(21, 4);
  auto ca = MakeCache(TinyWeights(), 8, 8, 2);
  auto cb = MakeCache(TinyWeights(), 8, 8, 2);
  ModelRunner ra(&TinyWeights(), ca.get(), backend.get());
  ModelRunner rb(&TinyWeights(), cb.get(), backend.get());
  TestSequence sa{BlockRange(0, 8), 1, 0}, sb{{5, 2, 7, 0, 1, 3, 4, 6}, 0, 0};
  std::vector<float> la, lb;
  ASSERT_TRUE(Feed(&ra, &sa, prompt, false, &la).ok());
  ASSERT_TRUE(Feed(&rb, &sb, prompt, false, &lb).ok());
  const int32_t t = Argmax(absl::MakeConstSpan(la).subspan(0, V));
  const std::vector<int32_t> verify = {t, 11, 22, 33, 44};
  auto snap = ca->SnapshotSlot(sa.slot);
  ASSERT_TRUE(snap.ok());
  ASSERT_TRUE(Feed(&ra, &sa, verify, true, &la).ok());
  ASSERT_TRUE(ca->RestoreSlot(sa.slot, *snap).ok());
  sa.pos -= verify.size();
  const std::vector<int32_t> replay = {t, 11, 22, 55};  // 2 accepted, then 55
  ASSERT_TRUE(Feed(&ra, &sa, replay, true, &la).ok());
  ASSERT_TRUE(Feed(&rb, &sb, replay, true, &lb).ok());
  EXPECT_EQ(la, lb);
  auto ka = ca->SnapshotSlot(sa.slot), kb = cb->SnapshotSlot(sb.slot);
  ASSERT_TRUE(ka.ok() && kb.ok());
  EXPECT_EQ(ka->values, kb->values);
  auto ea = ca->ExportSequence(sa.blocks, sa.pos, sa.slot);
  auto eb = cb->ExportSequence(sb.blocks, sb.pos, sb.slot);
  ASSERT_TRUE(ea.ok() && eb.ok());
  std::string bytes_a, bytes_b;
  for (const StateRange& s : *ea)
    bytes_a.append(reinterpret_cast<char*>(s.data), s.bytes);
  for (const StateRange& s : *eb)
    bytes_b.append(reinterpret_cast<char*>(s.data), s.bytes);
  EXPECT_EQ(bytes_a, bytes_b);
  // And the next decode step agrees bit for bit.
  const int32_t next = 66;
  ASSERT_TRUE(Feed(&ra, &sa, {&next, 1}, false, &la).ok());
  ASSERT_TRUE(Feed(&rb, &sb, {&next, 1}, false, &lb).ok());
  EXPECT_EQ(la, lb);
}

// Engine level: a request whose last step rolled back is exported (the pending
// replay runs first); its state matches a plain engine's at the same tokens,
// and decoding it elsewhere continues with the plain tokens.
TEST(SpeculativeEngineTest, StateAfterRollbackMatchesPlainAndHandsOff) {
  const std::vector<int32_t> prompt = RepetitivePrompt(7);
  constexpr int kN = 20;
  Rig plain = MakeEngine(Plain());
  ASSERT_TRUE(plain.engine->AddRequest(1, prompt, Greedy(kN)).ok());
  const std::vector<int32_t> want = RunAll(plain.engine.get())[1];
  ASSERT_EQ(want.size(), static_cast<size_t>(kN));

  Rig spec = MakeEngine(Spec(SpeculativeMethod::kDraft, 3, &OtherDraftWeights()));
  ASSERT_TRUE(spec.engine->AddRequest(1, prompt, Greedy(kN)).ok());
  std::vector<int32_t> got;
  int64_t rollbacks = 0;
  while (rollbacks == 0 || got.size() < 4) {
    auto res = spec.engine->Step();
    ASSERT_TRUE(res.ok());
    for (const RequestOutput& o : *res)
      got.insert(got.end(), o.new_tokens.begin(), o.new_tokens.end());
    rollbacks = spec.engine->speculative_stats().rollbacks;
    ASSERT_LT(got.size(), static_cast<size_t>(kN - 2));
  }
  auto state = spec.engine->ExportState(1);
  ASSERT_TRUE(state.ok()) << state.status();

  // The plain engine, stepped to the same length.
  Rig ref = MakeEngine(Plain());
  ASSERT_TRUE(ref.engine->AddRequest(1, prompt, Greedy(kN)).ok());
  size_t n = 0;
  while (n < got.size()) {
    auto res = ref.engine->Step();
    ASSERT_TRUE(res.ok());
    for (const RequestOutput& o : *res) n += o.new_tokens.size();
  }
  auto ref_state = ref.engine->ExportState(1);
  ASSERT_TRUE(ref_state.ok());
  ASSERT_EQ(state->num_cached_tokens, ref_state->num_cached_tokens);
  EXPECT_EQ(state->generated, ref_state->generated);
  // Same layers and kinds, values equal up to fp32 rounding between the
  // batched forms (chunked vs recurrent KDA, expanded vs absorbed MLA).
  auto flatten = [](const std::vector<StateRange>& rs, StateKind kind) {
    std::vector<float> v;
    for (const StateRange& s : rs) {
      if (s.kind != kind) continue;
      if (kind == StateKind::kKda) {
        const float* f = reinterpret_cast<const float*>(s.data);
        v.insert(v.end(), f, f + s.bytes / sizeof(float));
      } else {
        const uint16_t* b = reinterpret_cast<const uint16_t*>(s.data);
        for (size_t i = 0; i < s.bytes / 2; ++i) v.push_back(model::Bf16ToFloat(b[i]));
      }
    }
    return v;
  };
  for (StateKind kind : {StateKind::kKda, StateKind::kMla}) {
    const std::vector<float> a = flatten(state->ranges, kind);
    const std::vector<float> b = flatten(ref_state->ranges, kind);
    ASSERT_EQ(a.size(), b.size());
    ASSERT_FALSE(a.empty());
    double max_abs = 0;
    for (float x : b) max_abs = std::max<double>(max_abs, std::abs(x));
    // Relative to the value, with a floor relative to the largest value: fp32
    // rounding in sums of terms of size max_abs leaves ~1e-7 * max_abs per
    // operation even on values near 0, accumulated over a 64-token KDA chunk.
    // A wrong rollback (a rejected token's update left in the state) is off by a
    // large fraction of max_abs.
    const double tol = kind == StateKind::kKda ? 1e-4 : 1e-2;  // fp32 vs BF16 rows
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_LE(std::abs(a[i] - b[i]), tol * (std::abs(b[i]) + max_abs * 1e-2))
          << (kind == StateKind::kKda ? "KDA" : "MLA") << " value " << i;
    }
  }
  // Hand-off from the speculative engine: decoding continues with plain tokens.
  Rig dec = MakeEngine(Plain());
  ASSERT_TRUE(dec.engine->AddPrefilledRequest(1, *state, Greedy(kN)).ok());
  auto rest = RunAll(dec.engine.get())[1];
  got.insert(got.end(), rest.begin(), rest.end());
  EXPECT_EQ(got, want);
}

TEST(SpeculativeEngineTest, NoLeaksThroughPreemptionAndAborts) {
  auto params = [](int i) { return i % 4 == 0 ? Random(30, i) : Looping(i); };
  auto want = RunPrompts(Plain(), 30, params);
  for (SpeculativeMethod m : {SpeculativeMethod::kNgram, SpeculativeMethod::kDraft}) {
    EngineOptions o = Spec(m, 4, &OtherDraftWeights());
    o.num_slots = 6;
    o.block_size = 8;
    o.num_blocks = 20;  // 160 positions for 6 sequences of up to 65: preemption
    o.max_tokens_per_step = 48;
    Rig r = MakeEngine(o);
    const int32_t blocks = r.engine->num_free_blocks();
    std::map<RequestId, std::vector<int32_t>> out;
    std::set<RequestId> finished;
    int next_id = 0;
    for (int step = 0; step < 400 && (next_id < 30 || r.engine->HasWork()); ++step) {
      if (next_id < 30 && step % 3 == 0) {
        ASSERT_TRUE(
            r.engine->AddRequest(next_id, RepetitivePrompt(next_id), params(next_id))
                .ok());
        ++next_id;
      }
      if (step % 7 == 6) r.engine->Abort(step % next_id).IgnoreError();
      auto res = r.engine->Step();
      ASSERT_TRUE(res.ok()) << res.status();
      ASSERT_TRUE(r.engine->scheduler().CheckInvariants().ok());
      for (const RequestOutput& ro : *res) {
        out[ro.id].insert(out[ro.id].end(), ro.new_tokens.begin(), ro.new_tokens.end());
        if (ro.finished) finished.insert(ro.id);
      }
    }
    EXPECT_FALSE(r.engine->HasWork());
    // Greedy requests that ran to the end (not aborted) produced the plain
    // tokens, through preemption and recompute. (Seeded sampling with drafts
    // is exact in distribution only: which uniforms a position uses depends on
    // whether it was drafted.)
    int compared = 0;
    for (RequestId id : finished) {
      ASSERT_EQ(out[id].size(), want[id].size()) << "request " << id;
      if (id % 4 == 0) continue;  // seeded sampling
      ASSERT_EQ(out[id], want[id]) << "request " << id;
      ++compared;
    }
    EXPECT_GT(compared, 10);
    EXPECT_GT(r.engine->scheduler().num_preemptions(), 0);
    EXPECT_GT(r.engine->speculative_stats().verifications, 0);
    EXPECT_EQ(r.engine->num_free_blocks(), blocks);
    EXPECT_EQ(r.engine->num_free_slots(), o.num_slots);
    if (m == SpeculativeMethod::kDraft) {
      auto* d = static_cast<DraftModelProposer*>(r.engine->proposer());
      EXPECT_EQ(d->num_sequences(), 0);
      EXPECT_EQ(d->num_free_slots(), o.num_slots);
    }
  }
}

TEST(SpeculativeEngineTest, RejectsBadOptions) {
  auto backend = MakeBackend("cpu");
  EngineOptions o = Spec(SpeculativeMethod::kNgram, 0);
  EXPECT_FALSE(Engine::Create(&TinyWeights(), backend.get(), nullptr, o).ok());
  o = Spec(SpeculativeMethod::kDraft, 2, nullptr);
  EXPECT_FALSE(Engine::Create(&TinyWeights(), backend.get(), nullptr, o).ok());
  o = Spec(SpeculativeMethod::kNgram, 8);
  o.max_tokens_per_step = 8;  // 1 + 8 tokens do not fit a step
  EXPECT_FALSE(Engine::Create(&TinyWeights(), backend.get(), nullptr, o).ok());
  o = Spec(SpeculativeMethod::kNgram, 2);
  o.speculative.ngram.min_n = 0;
  EXPECT_FALSE(Engine::Create(&TinyWeights(), backend.get(), nullptr, o).ok());
}

}  // namespace
}  // namespace tandem::engine
