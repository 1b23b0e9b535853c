// Forward-pass invariants on the tiny generated checkpoint: finite, non-flat
// logits; well-scaled activations at every layer; decode after prefill == full
// recompute; chunked == one-shot prefill; batch invariance; MLA absorbed ==
// expanded; optimised backend == reference backend; KDA snapshot/restore; state
// export/import into a cache with another block size.
#include "engine/runtime/model_runner.h"

#include <cmath>
#include <map>
#include <string>
#include <utility>

#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using testing::Argmax;
using testing::BlockRange;
using testing::Feed;
using testing::GreedyGenerate;
using testing::MakeBackend;
using testing::MakeCache;
using testing::MakePrompt;
using testing::TestSequence;
using testing::TinyWeights;

constexpr int64_t kBlockSize = 16;

struct Rig {
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<ModelRunner> runner;
};

Rig MakeRig(const char* backend = "cpu", int64_t blocks = 256,
            int64_t block_size = kBlockSize, int64_t slots = 20,
            ModelRunnerOptions options = {}) {
  Rig r;
  r.backend = MakeBackend(backend);
  r.cache = MakeCache(TinyWeights(), blocks, block_size, slots);
  r.runner = std::make_unique<ModelRunner>(&TinyWeights(), r.cache.get(),
                                           r.backend.get(), options);
  return r;
}

int64_t Vocab() { return TinyWeights().config.text.vocab_size; }

// Max |a - b| over the rows, and the std of `a` (the scale the difference is
// measured against).
std::pair<double, double> MaxDiffAndScale(const std::vector<float>& a,
                                          const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0, sum = 0, sq = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
    sum += a[i];
    sq += static_cast<double>(a[i]) * a[i];
  }
  const double n = static_cast<double>(a.size());
  return {m, std::sqrt(std::max(0.0, sq / n - (sum / n) * (sum / n)))};
}

// Relative tolerance for forward passes whose kernels differ only in fp32
// rounding (KDA chunked vs recurrent, MLA absorbed vs expanded, batch shapes):
// the optimised backend rounds GEMM inputs to BF16, so one flipped BF16 bit in an
// activation moves a logit by ~0.4% of its scale.
constexpr double kRelTol = 2e-2;

TEST(ModelRunnerTest, LogitsFiniteAndNotFlat) {
  Rig rig = MakeRig();
  for (int p = 0; p < 4; ++p) {
    TestSequence seq{BlockRange(p * 8, 8), p, 0};
    std::vector<int32_t> prompt = MakePrompt(5 + 9 * p, p);
    std::vector<float> logits;
    ASSERT_TRUE(Feed(rig.runner.get(), &seq, prompt, true, &logits).ok());
    ASSERT_EQ(logits.size(), prompt.size() * Vocab());
    for (size_t r = 0; r < prompt.size(); ++r) {
      double sum = 0, sq = 0;
      float lo = 1e30f, hi = -1e30f;
      for (int64_t v = 0; v < Vocab(); ++v) {
        const float x = logits[r * Vocab() + v];
        ASSERT_TRUE(std::isfinite(x)) << "prompt " << p << " row " << r << " id " << v;
        sum += x;
        sq += static_cast<double>(x) * x;
        lo = std::min(lo, x);
        hi = std::max(hi, x);
      }
      const double mean = sum / Vocab();
      const double sd = std::sqrt(sq / Vocab() - mean * mean);
      EXPECT_GT(sd, 0.1) << "prompt " << p << " row " << r;
      EXPECT_LT(sd, 100.0) << "prompt " << p << " row " << r;
      EXPECT_GT(hi - lo, 1.0);
    }
  }
}

TEST(ModelRunnerTest, ActivationsWellScaledAtEveryLayer) {
  Rig rig = MakeRig();
  std::map<std::pair<int, std::string>, double> rms;
  rig.runner->set_activation_hook([&](const ActivationProbe& p) {
    double sq = 0;
    for (int64_t i = 0; i < p.rows * p.cols; ++i)
      sq += static_cast<double>(p.data[i]) * p.data[i];
    rms[{p.layer, std::string(p.name)}] = std::sqrt(sq / (p.rows * p.cols));
  });
  TestSequence seq{BlockRange(0, 8), 0, 0};
  std::vector<float> logits;
  ASSERT_TRUE(Feed(rig.runner.get(), &seq, MakePrompt(40, 7), false, &logits).ok());
  const int layers = TinyWeights().config.text.num_hidden_layers;
  // embed + 5 probes per layer + final.
  ASSERT_EQ(rms.size(), 2u + 5u * layers);
  for (const auto& [key, value] : rms) {
    EXPECT_TRUE(std::isfinite(value)) << key.first << " " << key.second;
    EXPECT_GT(value, 1e-3) << "layer " << key.first << " " << key.second;
    EXPECT_LT(value, 1e3) << "layer " << key.first << " " << key.second;
  }
  // The final norm output has unit RMS up to its gain (1 + N(0, 0.02^2)).
  const double final_rms = rms[std::make_pair(-1, std::string("final"))];
  EXPECT_NEAR(final_rms, 1.0, 0.1);
}

TEST(ModelRunnerTest, DecodeAfterPrefillEqualsFullRecompute) {
  const std::vector<int32_t> prompt = MakePrompt(29, 3);
  const int prefix = 17;
  // Full recompute: every position's logits in one forward.
  Rig full = MakeRig();
  TestSequence a{BlockRange(0, 4), 0, 0};
  std::vector<float> want;
  ASSERT_TRUE(Feed(full.runner.get(), &a, prompt, true, &want).ok());
  // Prefill the prefix, then decode the rest one token at a time.
  Rig inc = MakeRig();
  TestSequence b{BlockRange(10, 4), 3, 0};
  std::vector<float> got, step;
  ASSERT_TRUE(Feed(inc.runner.get(), &b, absl::MakeConstSpan(prompt).subspan(0, prefix),
                   true, &got)
                  .ok());
  for (size_t i = prefix; i < prompt.size(); ++i) {
    ASSERT_TRUE(Feed(inc.runner.get(), &b, {&prompt[i], 1}, true, &step).ok());
    got.insert(got.end(), step.begin(), step.end());
  }
  auto [diff, scale] = MaxDiffAndScale(want, got);
  EXPECT_LT(diff, kRelTol * scale) << "scale " << scale;
  for (size_t r = 0; r < prompt.size(); ++r) {
    EXPECT_EQ(Argmax(absl::MakeConstSpan(want).subspan(r * Vocab(), Vocab())),
              Argmax(absl::MakeConstSpan(got).subspan(r * Vocab(), Vocab())))
        << "row " << r;
  }
}

TEST(ModelRunnerTest, ChunkedPrefillEqualsOneShot) {
  const std::vector<int32_t> prompt = MakePrompt(150, 11);
  Rig one = MakeRig();
  TestSequence base{BlockRange(0, 12), 0, 0};
  auto want = GreedyGenerate(one.runner.get(), &base, prompt, prompt.size(), 6);
  ASSERT_TRUE(want.ok()) << want.status();
  std::vector<float> want_logits;
  {
    Rig r = MakeRig();
    TestSequence s{BlockRange(0, 12), 0, 0};
    ASSERT_TRUE(Feed(r.runner.get(), &s, prompt, false, &want_logits).ok());
  }
  for (int64_t chunk : {1, 7, 64}) {
    Rig r = MakeRig();
    TestSequence s{BlockRange(20, 12), 1, 0};
    std::vector<float> logits;
    for (size_t i = 0; i < prompt.size(); i += chunk) {
      const size_t n = std::min<size_t>(chunk, prompt.size() - i);
      ASSERT_TRUE(Feed(r.runner.get(), &s, absl::MakeConstSpan(prompt).subspan(i, n),
                       false, &logits)
                      .ok());
    }
    auto [diff, scale] = MaxDiffAndScale(want_logits, logits);
    EXPECT_LT(diff, kRelTol * scale) << "chunk " << chunk;
    Rig g = MakeRig();
    TestSequence gs{BlockRange(20, 12), 1, 0};
    auto got = GreedyGenerate(g.runner.get(), &gs, prompt, chunk, 6);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*want, *got) << "chunk " << chunk;
  }
}

TEST(ModelRunnerTest, BatchOfSixteenMixedEqualsEachAlone) {
  constexpr int kSeqs = 16, kSteps = 5;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < kSeqs; ++i)
    prompts.push_back(MakePrompt(1 + (i * 7) % 23, 100 + i));
  // Alone: the same per-sequence schedule (prefill chunks of 4, then decode).
  std::vector<std::vector<int32_t>> alone;
  for (int i = 0; i < kSeqs; ++i) {
    Rig r = MakeRig();
    TestSequence s{BlockRange(0, 4), 0, 0};
    auto out = GreedyGenerate(r.runner.get(), &s, prompts[i], 4, kSteps);
    ASSERT_TRUE(out.ok()) << out.status();
    alone.push_back(*out);
  }
  // Together: each step, sequences still in prefill feed up to 4 prompt tokens,
  // the others decode one token; sequence i joins at step i % 3.
  Rig r = MakeRig();
  std::vector<TestSequence> seqs;
  std::vector<size_t> fed(kSeqs, 0);
  std::vector<std::vector<int32_t>> out(kSeqs);
  for (int i = 0; i < kSeqs; ++i) seqs.push_back({BlockRange(i * 4, 4), 19 - i, 0});
  for (int step = 0; step < 200; ++step) {
    std::vector<SequenceInput> batch;
    std::vector<int> who;
    std::vector<std::vector<int32_t>> toks(kSeqs);
    for (int i = 0; i < kSeqs; ++i) {
      if (step < i % 3 || static_cast<int>(out[i].size()) == kSteps) continue;
      if (fed[i] < prompts[i].size()) {
        const size_t n = std::min<size_t>(4, prompts[i].size() - fed[i]);
        toks[i].assign(prompts[i].begin() + fed[i], prompts[i].begin() + fed[i] + n);
      } else {
        toks[i] = {out[i].back()};
      }
      SequenceInput in;
      in.tokens = toks[i];
      in.start_pos = seqs[i].pos;
      in.block_table = seqs[i].blocks;
      in.kda_slot = seqs[i].slot;
      const bool ends_prompt = fed[i] + toks[i].size() >= prompts[i].size();
      if (ends_prompt) in.logits_indices = {static_cast<int32_t>(toks[i].size()) - 1};
      batch.push_back(std::move(in));
      who.push_back(i);
    }
    if (batch.empty()) break;
    std::vector<float> logits;
    ASSERT_TRUE(r.runner->Forward(batch, &logits).ok());
    int64_t row = 0;
    for (size_t j = 0; j < batch.size(); ++j) {
      const int i = who[j];
      seqs[i].pos += toks[i].size();
      if (fed[i] < prompts[i].size()) fed[i] += toks[i].size();
      if (!batch[j].logits_indices.empty()) {
        out[i].push_back(
            Argmax(absl::MakeConstSpan(logits).subspan(row * Vocab(), Vocab())));
        ++row;
      }
    }
  }
  for (int i = 0; i < kSeqs; ++i) EXPECT_EQ(alone[i], out[i]) << "sequence " << i;
}

TEST(ModelRunnerTest, MlaAbsorbedEqualsExpanded) {
  const std::vector<int32_t> prompt = MakePrompt(33, 5);
  std::vector<float> logits[2];
  const MlaMode modes[2] = {MlaMode::kExpanded, MlaMode::kAbsorbed};
  for (int m = 0; m < 2; ++m) {
    ModelRunnerOptions o;
    o.mla_mode = modes[m];
    Rig r = MakeRig("cpu", 16, kBlockSize, 2, o);
    TestSequence s{BlockRange(0, 3), 0, 0};
    ASSERT_TRUE(Feed(r.runner.get(), &s, prompt, true, &logits[m]).ok());
  }
  auto [diff, scale] = MaxDiffAndScale(logits[0], logits[1]);
  EXPECT_LT(diff, kRelTol * scale) << "scale " << scale;
  EXPECT_GT(scale, 0.1);
}

TEST(ModelRunnerTest, OptimisedBackendMatchesReference) {
  const std::vector<int32_t> prompt = MakePrompt(9, 21);
  std::vector<float> logits[2];
  const char* names[2] = {"cpu_reference", "cpu"};
  for (int b = 0; b < 2; ++b) {
    Rig r = MakeRig(names[b], 8, kBlockSize, 1);
    TestSequence s{BlockRange(0, 1), 0, 0};
    std::vector<float> step;
    ASSERT_TRUE(Feed(r.runner.get(), &s, absl::MakeConstSpan(prompt).subspan(0, 7),
                     true, &logits[b])
                    .ok());
    for (int i = 7; i < 9; ++i) {
      ASSERT_TRUE(Feed(r.runner.get(), &s, {&prompt[i], 1}, true, &step).ok());
      logits[b].insert(logits[b].end(), step.begin(), step.end());
    }
  }
  auto [diff, scale] = MaxDiffAndScale(logits[0], logits[1]);
  EXPECT_LT(diff, kRelTol * scale) << "scale " << scale;
  for (int r = 0; r < 9; ++r) {
    EXPECT_EQ(Argmax(absl::MakeConstSpan(logits[0]).subspan(r * Vocab(), Vocab())),
              Argmax(absl::MakeConstSpan(logits[1]).subspan(r * Vocab(), Vocab())));
  }
}

TEST(ModelRunnerTest, KdaSnapshotRestoreReplaysIdentically) {
  Rig r = MakeRig();
  TestSequence s{BlockRange(0, 4), 2, 0};
  std::vector<float> logits;
  ASSERT_TRUE(Feed(r.runner.get(), &s, MakePrompt(20, 9), false, &logits).ok());
  auto snap = r.cache->SnapshotSlot(s.slot);
  ASSERT_TRUE(snap.ok());
  const std::vector<int32_t> draft = {11, 22, 33};
  std::vector<float> first;
  ASSERT_TRUE(Feed(r.runner.get(), &s, draft, true, &first).ok());
  auto after = r.cache->SnapshotSlot(s.slot);
  ASSERT_TRUE(after.ok());
  EXPECT_NE(after->values, snap->values);  // the state moved
  // Roll back three tokens and replay them: the same logits, bit for bit.
  ASSERT_TRUE(r.cache->RestoreSlot(s.slot, *snap).ok());
  s.pos -= draft.size();
  std::vector<float> again;
  ASSERT_TRUE(Feed(r.runner.get(), &s, draft, true, &again).ok());
  EXPECT_EQ(first, again);
  // A wrong-sized snapshot is refused.
  KdaSnapshot bad;
  bad.values.resize(3);
  EXPECT_FALSE(r.cache->RestoreSlot(s.slot, bad).ok());
}

TEST(ModelRunnerTest, ExportImportIntoOtherBlockSizeContinuesIdentically) {
  const std::vector<int32_t> prompt = MakePrompt(37, 13);
  Rig src = MakeRig("cpu", 32, 16, 4);
  TestSequence a{{5, 9, 2}, 3, 0};
  std::vector<float> logits;
  ASSERT_TRUE(Feed(src.runner.get(), &a, prompt, false, &logits).ok());
  const int32_t first = Argmax(absl::MakeConstSpan(logits).subspan(0, Vocab()));

  Rig dst = MakeRig("cpu", 64, 8, 2);
  TestSequence b{{40, 3, 17, 8, 60, 1, 30}, 1, 0};  // scattered blocks of 8
  auto from = src.cache->ExportSequence(a.blocks, prompt.size(), a.slot);
  auto to = dst.cache->ExportSequence(b.blocks, prompt.size(), b.slot);
  ASSERT_TRUE(from.ok() && to.ok());
  ASSERT_TRUE(CopyStateRanges(*from, *to).ok());
  b.pos = prompt.size();

  // Continue greedy decode on both; the tokens and logits must agree exactly.
  a.blocks = {5, 9, 2, 7};
  b.blocks.push_back(50);
  int32_t ta = first, tb = first;
  for (int step = 0; step < 8; ++step) {
    std::vector<float> la, lb;
    ASSERT_TRUE(Feed(src.runner.get(), &a, {&ta, 1}, false, &la).ok());
    ASSERT_TRUE(Feed(dst.runner.get(), &b, {&tb, 1}, false, &lb).ok());
    EXPECT_EQ(la, lb) << "step " << step;
    ta = Argmax(la);
    tb = Argmax(lb);
    ASSERT_EQ(ta, tb) << "step " << step;
  }
}

TEST(ModelRunnerTest, RejectsBadInputs) {
  Rig r = MakeRig("cpu", 4, kBlockSize, 2);
  std::vector<float> logits;
  const std::vector<int32_t> toks = {1, 2, 3};
  const std::vector<int32_t> blocks = {0};
  SequenceInput in;
  in.tokens = toks;
  in.block_table = blocks;
  in.logits_indices = {2};
  in.start_pos = 14;  // 17 tokens need 2 blocks
  EXPECT_FALSE(r.runner->Forward({&in, 1}, &logits).ok());
  in.start_pos = 0;
  in.kda_slot = 2;
  EXPECT_FALSE(r.runner->Forward({&in, 1}, &logits).ok());
  in.kda_slot = 0;
  in.logits_indices = {3};
  EXPECT_FALSE(r.runner->Forward({&in, 1}, &logits).ok());
  in.logits_indices = {2};
  const std::vector<int32_t> bad_id = {1, static_cast<int32_t>(Vocab()), 3};
  in.tokens = bad_id;
  EXPECT_FALSE(r.runner->Forward({&in, 1}, &logits).ok());
  in.tokens = toks;
  SequenceInput twice[2] = {in, in};
  EXPECT_FALSE(r.runner->Forward(twice, &logits).ok());
  EXPECT_TRUE(r.runner->Forward({&in, 1}, &logits).ok());
}

}  // namespace
}  // namespace tandem::engine
