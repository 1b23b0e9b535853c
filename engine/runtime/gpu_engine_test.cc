// The engine on the GPU backend ("cuda_sim" everywhere; "cuda" too where this
// binary was built with CUDA and a GPU is visible): the tiny model's weights
// placed in device memory, its cache on the device, every op on the GPU kernels.
//
//   - teacher-forced logits equal the CPU backend's within a stated tolerance,
//     and the greedy token is the CPU's wherever the CPU's top-2 margin exceeds
//     twice that tolerance (nearly every step: checked, so the test cannot pass
//     on near-ties alone); free-running greedy generations equal the CPU's;
//   - chunked prefill == one-shot prefill; a sequence's logits do not depend on
//     what it is batched with;
//   - in the Engine: speculative decoding (n-gram) is lossless and seeded
//     sampling is reproducible, with no block or slot leaked; the in-process
//     hand-off (ExportState -> AddPrefilledRequest) works from a GPU engine to a
//     CPU one and back, its device ranges copied by the device.
//
// Tolerance: |logit_gpu - logit_cpu| <= 1e-3 * (1 + max|logit_cpu|) per row
// (measured: 2.7e-4 at worst over the 24 teacher-forced steps). The
// exact GPU backends feed the tensor cores split-BF16 operands (hi + lo: fp32-class
// products, kernels/cuda/cuda_backend.h GpuPrecision) and keep every other op in
// fp32, so they differ from the CPU backend only in summation order; the tiny
// model's logits are O(1). (The _bf16 variants would not meet this: one BF16
// rounding per MoE layer moves the logits by ~2%, enough to flip greedy tokens
// on the random tiny model.)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "engine/runtime/engine.h"
#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"
#include "kernels/backend_factory.h"

namespace tandem::engine {
namespace {

using testing::Argmax;
using testing::BlockRange;
using testing::Feed;
using testing::MakeBackend;
using testing::MakeCacheOn;
using testing::MakePrompt;
using testing::TestSequence;
using testing::TinyWeightsOn;

constexpr double kLogitTol = 1e-3;

std::vector<std::string> GpuBackends() {
  std::vector<std::string> names;
  for (const char* n : {"cuda_sim", "cuda"}) {
    if (kernels::CreateBackend(n).ok()) names.push_back(n);
  }
  return names;
}

// A runner over its own weights, cache and backend.
struct Rig {
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<ModelWeights> weights;
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<ModelRunner> runner;
};

Rig MakeRig(const std::string& backend, int64_t blocks = 64, int64_t slots = 4) {
  Rig r;
  r.backend = MakeBackend(backend.c_str());
  r.weights = TinyWeightsOn(*r.backend);
  r.cache = MakeCacheOn(*r.weights, *r.backend, blocks, 16, slots);
  r.runner =
      std::make_unique<ModelRunner>(r.weights.get(), r.cache.get(), r.backend.get());
  return r;
}

double MaxAbs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

double MaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(static_cast<double>(a[i]) - b[i]);
    if (!(d <= m)) m = std::isnan(d) ? INFINITY : d;
  }
  return m;
}

// Top-1 minus top-2 of a row.
double Margin(const std::vector<float>& row) {
  float a = -INFINITY, b = -INFINITY;
  for (float x : row) {
    if (x > a) {
      b = a;
      a = x;
    } else if (x > b) {
      b = x;
    }
  }
  return static_cast<double>(a) - b;
}

class GpuEngine : public ::testing::TestWithParam<std::string> {};

TEST_P(GpuEngine, TeacherForcedLogitsAndGreedyTokensMatchTheCpu) {
  Rig cpu = MakeRig("cpu"), gpu = MakeRig(GetParam());
  int steps = 0, decisive = 0;
  double worst = 0;
  int64_t slot = 0;
  // Lengths: one token, within a block, across blocks and KDA chunks (64).
  for (int len : {1, 5, 17, 70}) {
    TestSequence sc{BlockRange(static_cast<int32_t>(slot * 16), 16), slot, 0};
    TestSequence sg = sc;
    const std::vector<int32_t> prompt = MakePrompt(len, 40 + len);
    std::vector<float> lc, lg;
    ASSERT_TRUE(Feed(cpu.runner.get(), &sc, prompt, false, &lc).ok());
    absl::Status st = Feed(gpu.runner.get(), &sg, prompt, false, &lg);
    ASSERT_TRUE(st.ok()) << st;
    for (int step = 0; step < 6; ++step) {
      ASSERT_EQ(lc.size(), lg.size());
      const double tol = kLogitTol * (1 + MaxAbs(lc));
      EXPECT_LE(MaxDiff(lg, lc), tol) << "prompt " << len << " step " << step;
      worst = std::max(worst, MaxDiff(lg, lc) / (1 + MaxAbs(lc)));
      const int32_t next = Argmax(lc);
      ++steps;
      if (Margin(lc) > 2 * tol) {
        ++decisive;
        EXPECT_EQ(Argmax(lg), next) << "prompt " << len << " step " << step;
      }
      ASSERT_TRUE(Feed(cpu.runner.get(), &sc, {&next, 1}, false, &lc).ok());
      st = Feed(gpu.runner.get(), &sg, {&next, 1}, false, &lg);
      ASSERT_TRUE(st.ok()) << st;
    }
    slot = (slot + 1) % 4;
  }
  EXPECT_GE(decisive, steps * 3 / 4) << "too many near-ties to judge the tokens";
  std::printf(
      "max |logit diff| / (1 + max|logit|) = %.3g over %d steps (%d decisive)\n", worst,
      steps, decisive);
}

TEST_P(GpuEngine, FreeRunningGreedyEqualsTheCpu) {
  Rig cpu = MakeRig("cpu"), gpu = MakeRig(GetParam());
  for (int len : {3, 33}) {
    TestSequence sc{BlockRange(0, 8), 0, 0}, sg = sc;
    const std::vector<int32_t> prompt = MakePrompt(len, 7 + len);
    auto want = testing::GreedyGenerate(cpu.runner.get(), &sc, prompt, len, 8);
    auto got = testing::GreedyGenerate(gpu.runner.get(), &sg, prompt, len, 8);
    ASSERT_TRUE(want.ok() && got.ok()) << got.status();
    EXPECT_EQ(*got, *want) << "prompt length " << len;
  }
}

TEST_P(GpuEngine, ChunkedPrefillEqualsOneShot) {
  Rig gpu = MakeRig(GetParam());
  const std::vector<int32_t> prompt = MakePrompt(130, 5);
  std::vector<float> one, chunked;
  TestSequence a{BlockRange(0, 9), 0, 0}, b{BlockRange(9, 9), 1, 0};
  ASSERT_TRUE(Feed(gpu.runner.get(), &a, prompt, false, &one).ok());
  // Chunks at multiples of the KDA chunk (64): the state is bit-identical.
  for (size_t i = 0; i < prompt.size(); i += 64) {
    const size_t n = std::min<size_t>(64, prompt.size() - i);
    ASSERT_TRUE(Feed(gpu.runner.get(), &b, absl::MakeConstSpan(prompt).subspan(i, n),
                     false, &chunked)
                    .ok());
  }
  EXPECT_LE(MaxDiff(chunked, one), 1e-4 * (1 + MaxAbs(one)));
  EXPECT_EQ(Argmax(chunked), Argmax(one));
}

// One long step of prompt tokens (the workers' step budget on a GPU is 2048 or
// 8192): 4096 on a GPU, past the MoE's 2048-token chunk; 1024 on the emulator,
// whose speed bounds it. The kernels' long-step paths (MLA's key tiles over many
// blocks, the MoE's large tiles and chunks, grid-stride loops) against the CPU
// backend, and against the same prompt in four steps.
TEST_P(GpuEngine, LongStepEqualsTheCpuAndChunks) {
  const int kLen = GetParam() == "cuda_sim" ? 1024 : 4096, kChunk = kLen / 4,
            kBlocks = kLen / 16 + 2;
  Rig cpu = MakeRig("cpu", kBlocks, 2), gpu = MakeRig(GetParam(), 2 * kBlocks, 2);
  const std::vector<int32_t> prompt = MakePrompt(kLen, 11);
  TestSequence sc{BlockRange(0, kBlocks), 0, 0}, sg = sc,
                                                 sk{BlockRange(kBlocks, kBlocks), 1, 0};
  std::vector<float> lc, lg, lk;
  ASSERT_TRUE(Feed(cpu.runner.get(), &sc, prompt, false, &lc).ok());
  absl::Status st = Feed(gpu.runner.get(), &sg, prompt, false, &lg);
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_EQ(lc.size(), lg.size());
  EXPECT_LE(MaxDiff(lg, lc), kLogitTol * (1 + MaxAbs(lc)));
  for (int i = 0; i < kLen; i += kChunk) {
    st = Feed(gpu.runner.get(), &sk, absl::MakeConstSpan(prompt).subspan(i, kChunk),
              false, &lk);
    ASSERT_TRUE(st.ok()) << st;
  }
  EXPECT_LE(MaxDiff(lk, lg), 1e-4 * (1 + MaxAbs(lg)));
  EXPECT_EQ(Argmax(lk), Argmax(lg));
  // Two decode steps after it still follow the CPU.
  for (int step = 0; step < 2; ++step) {
    const int32_t next = Argmax(lc);
    if (Margin(lc) > 2 * kLogitTol * (1 + MaxAbs(lc))) EXPECT_EQ(Argmax(lg), next);
    ASSERT_TRUE(Feed(cpu.runner.get(), &sc, {&next, 1}, false, &lc).ok());
    st = Feed(gpu.runner.get(), &sg, {&next, 1}, false, &lg);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_LE(MaxDiff(lg, lc), kLogitTol * (1 + MaxAbs(lc)));
  }
}

TEST_P(GpuEngine, LogitsDoNotDependOnTheBatch) {
  Rig gpu = MakeRig(GetParam());
  const std::vector<int32_t> p0 = MakePrompt(20, 1), p1 = MakePrompt(9, 2),
                             p2 = MakePrompt(33, 3);
  std::vector<float> alone;
  {
    TestSequence s{BlockRange(0, 4), 0, 0};
    ASSERT_TRUE(Feed(gpu.runner.get(), &s, p0, false, &alone).ok());
  }
  // The same prompt in slot 1 between two others, one forward.
  std::vector<int32_t> t1 = BlockRange(4, 4), t0 = BlockRange(8, 4),
                       t2 = BlockRange(12, 4);
  SequenceInput a, b, c;
  a.tokens = p1;
  a.block_table = t1;
  a.kda_slot = 2;
  a.logits_indices = {static_cast<int32_t>(p1.size()) - 1};
  b.tokens = p0;
  b.block_table = t0;
  b.kda_slot = 1;
  b.logits_indices = {static_cast<int32_t>(p0.size()) - 1};
  c.tokens = p2;
  c.block_table = t2;
  c.kda_slot = 3;
  c.logits_indices = {static_cast<int32_t>(p2.size()) - 1};
  std::vector<SequenceInput> batch = {a, b, c};
  std::vector<float> logits;
  ASSERT_TRUE(gpu.runner->Forward(batch, &logits).ok());
  const int64_t V = gpu.weights->config.text.vocab_size;
  std::vector<float> in_batch(logits.begin() + V, logits.begin() + 2 * V);
  EXPECT_LE(MaxDiff(in_batch, alone), 1e-4 * (1 + MaxAbs(alone)));
  EXPECT_EQ(Argmax(in_batch), Argmax(alone));
}

// ---- The Engine on the GPU backend ------------------------------------------------

std::map<RequestId, std::vector<int32_t>> RunEngine(const std::string& backend,
                                                    const EngineOptions& o,
                                                    const SamplingParams& params,
                                                    int num_prompts) {
  std::map<RequestId, std::vector<int32_t>> out;
  auto be = MakeBackend(backend.c_str());
  auto weights = TinyWeightsOn(*be);
  auto e = Engine::Create(weights.get(), be.get(), nullptr, o);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return out;
  const int32_t blocks = (*e)->num_free_blocks();
  for (int i = 0; i < num_prompts; ++i) {
    // A repeated phrase, so that n-gram drafts find matches.
    std::vector<int32_t> phrase = MakePrompt(3 + i, 100 + i), prompt;
    for (int r = 0; r < 3; ++r)
      prompt.insert(prompt.end(), phrase.begin(), phrase.end());
    SamplingParams p = params;
    if (p.seed.has_value()) p.seed = *p.seed + i;
    EXPECT_TRUE((*e)->AddRequest(i, prompt, p).ok());
  }
  for (int step = 0; (*e)->HasWork() && step < 2000; ++step) {
    auto res = (*e)->Step();
    EXPECT_TRUE(res.ok()) << res.status();
    if (!res.ok()) break;
    for (const RequestOutput& r : *res) {
      out[r.id].insert(out[r.id].end(), r.new_tokens.begin(), r.new_tokens.end());
    }
  }
  EXPECT_EQ((*e)->num_free_blocks(), blocks) << "blocks leaked";
  EXPECT_EQ((*e)->num_free_slots(), o.num_slots) << "slots leaked";
  return out;
}

EngineOptions Options() {
  EngineOptions o;
  o.num_slots = 4;
  o.num_blocks = 64;
  o.max_tokens_per_step = 256;
  o.max_context_tokens = 512;
  return o;
}

TEST_P(GpuEngine, SpeculativeDecodingIsLossless) {
  SamplingParams greedy;
  greedy.max_tokens = 10;
  greedy.ignore_eos = true;
  greedy.repetition_penalty = 0.2f;  // loops over the prompt: drafts get accepted
  const auto plain = RunEngine(GetParam(), Options(), greedy, 3);
  EngineOptions so = Options();
  so.speculative.method = SpeculativeMethod::kNgram;
  so.speculative.num_speculative_tokens = 3;
  so.speculative.ngram.min_n = 1;
  so.speculative.ngram.max_n = 3;
  const auto spec = RunEngine(GetParam(), so, greedy, 3);
  ASSERT_EQ(plain.size(), 3u);
  EXPECT_EQ(spec, plain);
}

TEST_P(GpuEngine, SeededSamplingIsReproducible) {
  SamplingParams p;
  p.max_tokens = 8;
  p.ignore_eos = true;
  p.temperature = 1.0f;
  p.top_p = 0.9f;
  p.seed = 1234;
  const auto a = RunEngine(GetParam(), Options(), p, 3);
  const auto b = RunEngine(GetParam(), Options(), p, 3);
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(a, b);
  for (const auto& [id, tokens] : a) EXPECT_EQ(tokens.size(), 8u) << id;
}

// Sampling where the logits are (EngineOptions::device_sampling, the default on
// a device backend): the same tokens and logprobs as sampling them on the host,
// for greedy, seeded top-k / top-p / min-p, every penalty, logprobs with
// alternatives, min_tokens (the EOS suppressed on the device); every row
// of every step sampled on the device (nothing copied back), and none with
// device_sampling off. With n-gram drafts the verification steps sample on the
// host and the others on the device, still with the same tokens.
struct SampledRun {
  std::map<RequestId, std::vector<int32_t>> tokens;
  std::map<RequestId, std::vector<float>> logprobs;
  std::map<RequestId, std::vector<std::vector<int32_t>>> alternatives;
  StepTimingStats timing;
};

SampledRun RunMixed(const std::string& backend, const EngineOptions& o) {
  SampledRun run;
  auto be = MakeBackend(backend.c_str());
  auto weights = TinyWeightsOn(*be);
  auto e = Engine::Create(weights.get(), be.get(), nullptr, o);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return run;
  std::vector<SamplingParams> params(6);
  for (SamplingParams& p : params) {
    p.max_tokens = 7;
    p.ignore_eos = true;
  }
  params[1].temperature = 0.8f;
  params[1].top_k = 30;
  params[1].seed = 5;
  params[1].logit_bias = {{3, 2.0f}, {17, -5.0f}, {1000, 6.0f}};
  params[2].temperature = 1.0f;
  params[2].top_p = 0.9f;
  params[2].min_p = 0.01f;
  params[2].seed = 6;
  params[2].logprobs = true;
  params[2].top_logprobs = 4;
  params[3].repetition_penalty = 1.5f;
  params[3].presence_penalty = 0.5f;
  params[3].frequency_penalty = 0.25f;
  params[3].logprobs = true;
  params[4].ignore_eos = false;  // EOS masked out for the first 5 tokens
  params[4].min_tokens = 5;
  params[4].temperature = 1.2f;
  params[4].seed = 8;
  params[5].repetition_penalty = 0.2f;  // loops over the prompt: n-gram drafts
  for (size_t i = 0; i < params.size(); ++i) {
    std::vector<int32_t> phrase = MakePrompt(4 + i, 60 + i), prompt;
    for (int r = 0; r < 3; ++r)
      prompt.insert(prompt.end(), phrase.begin(), phrase.end());
    EXPECT_TRUE((*e)->AddRequest(i, prompt, params[i]).ok());
  }
  for (int step = 0; (*e)->HasWork() && step < 500; ++step) {
    auto res = (*e)->Step();
    EXPECT_TRUE(res.ok()) << res.status();
    if (!res.ok()) break;
    for (const RequestOutput& r : *res) {
      run.tokens[r.id].insert(run.tokens[r.id].end(), r.new_tokens.begin(),
                              r.new_tokens.end());
      for (const SampleResult& lp : r.logprobs) {
        run.logprobs[r.id].push_back(lp.logprob);
        std::vector<int32_t> alt;
        for (const TopLogprob& t : lp.top) alt.push_back(t.token_id);
        run.alternatives[r.id].push_back(alt);
      }
    }
  }
  run.timing = (*e)->step_timing();
  return run;
}

TEST_P(GpuEngine, DeviceSamplingGivesTheHostSamplersTokens) {
  EngineOptions on = Options();
  EngineOptions off = Options();
  off.device_sampling = false;
  const SampledRun dev = RunMixed(GetParam(), on);
  const SampledRun host = RunMixed(GetParam(), off);
  ASSERT_EQ(dev.tokens.size(), 6u);
  EXPECT_EQ(dev.tokens, host.tokens);
  EXPECT_EQ(dev.alternatives, host.alternatives);
  ASSERT_EQ(dev.logprobs.size(), 2u);
  for (const auto& [id, lps] : host.logprobs) {
    ASSERT_EQ(dev.logprobs.at(id).size(), lps.size()) << id;
    for (size_t k = 0; k < lps.size(); ++k) {
      EXPECT_NEAR(dev.logprobs.at(id)[k], lps[k], 1e-5) << id << "/" << k;
    }
  }
  int64_t emitted = 0;
  for (const auto& [id, t] : dev.tokens) emitted += t.size();
  EXPECT_EQ(dev.timing.device_sampled_rows, emitted);
  EXPECT_EQ(dev.timing.host_sampled_rows, 0);
  EXPECT_EQ(dev.timing.device_sampling_fallbacks, 0);
  EXPECT_EQ(host.timing.device_sampled_rows, 0);
  EXPECT_EQ(host.timing.host_sampled_rows, emitted);

  EngineOptions spec = Options();
  spec.speculative.method = SpeculativeMethod::kNgram;
  spec.speculative.num_speculative_tokens = 2;
  spec.speculative.ngram.min_n = 1;
  spec.speculative.ngram.max_n = 3;
  const SampledRun mixed = RunMixed(GetParam(), spec);
  EXPECT_EQ(mixed.tokens, host.tokens);
  EXPECT_GT(mixed.timing.device_sampled_rows, 0);
  EXPECT_GT(mixed.timing.host_sampled_rows, 0);
}

// Prompt logprobs on a device backend: the prompt rows are scored on the device
// beside the step's sampling (DeviceSampler score rows: no logits come back);
// the scores equal the CPU engine's within the logits' tolerance, for the
// prompt's own tokens, with their ranks.
TEST_P(GpuEngine, PromptLogprobsMatchTheCpu) {
  // Two scored prompts and one plain request together: the 150-token prompt
  // passes the step's 128 scored rows, so a chunk of it scores without
  // sampling, and steps mix scored rows, prefill and decode rows.
  const std::map<RequestId, std::vector<int32_t>> prompts = {
      {1, MakePrompt(24, 77)}, {2, MakePrompt(150, 78)}, {3, MakePrompt(9, 79)}};
  SamplingParams p;
  p.max_tokens = 2;
  p.ignore_eos = true;
  p.prompt_logprobs = 2;
  SamplingParams plain = p;
  plain.prompt_logprobs = -1;
  plain.max_tokens = 6;
  std::map<std::string, std::map<RequestId, std::vector<SampleResult>>> scores;
  std::map<std::string, std::map<RequestId, std::vector<int32_t>>> tokens;
  std::map<std::string, StepTimingStats> timing;
  for (const std::string& backend : {std::string("cpu"), GetParam()}) {
    auto be = MakeBackend(backend.c_str());
    auto weights = TinyWeightsOn(*be);
    auto e = Engine::Create(weights.get(), be.get(), nullptr, Options());
    ASSERT_TRUE(e.ok()) << e.status();
    for (const auto& [id, prompt] : prompts) {
      ASSERT_TRUE((*e)->AddRequest(id, prompt, id == 3 ? plain : p).ok());
    }
    for (int step = 0; (*e)->HasWork() && step < 100; ++step) {
      auto res = (*e)->Step();
      ASSERT_TRUE(res.ok()) << res.status();
      for (const RequestOutput& r : *res) {
        std::vector<int32_t>& t = tokens[backend][r.id];
        t.insert(t.end(), r.new_tokens.begin(), r.new_tokens.end());
        if (!r.prompt_logprobs.empty()) scores[backend][r.id] = r.prompt_logprobs;
      }
    }
    timing[backend] = (*e)->step_timing();
  }
  // Every prompt row was scored on the device, every token sampled there.
  EXPECT_EQ(timing[GetParam()].device_scored_rows, 23 + 149);
  EXPECT_EQ(timing[GetParam()].host_sampled_rows, 0);
  EXPECT_EQ(timing[GetParam()].host_scored_rows, 0);
  EXPECT_EQ(timing["cpu"].device_scored_rows, 0);
  EXPECT_EQ(timing["cpu"].host_scored_rows, 23 + 149);
  EXPECT_EQ(scores[GetParam()].count(3), 0u);
  for (RequestId id : {1, 2}) {
    const std::vector<int32_t>& prompt = prompts.at(id);
    const std::vector<SampleResult>& cpu = scores["cpu"][id];
    const std::vector<SampleResult>& gpu = scores[GetParam()][id];
    ASSERT_EQ(cpu.size(), prompt.size() - 1) << id;
    ASSERT_EQ(gpu.size(), prompt.size() - 1) << id;
    for (size_t k = 0; k < gpu.size(); ++k) {
      EXPECT_EQ(gpu[k].token_id, prompt[k + 1]) << id << " " << k;
      EXPECT_NEAR(gpu[k].logprob, cpu[k].logprob, 1e-2) << id << " " << k;
      EXPECT_EQ(gpu[k].top.size(), 2u) << id << " " << k;
      // The rank agrees with the alternatives the same row reports (the tiny
      // model's logits lie close together, so the CPU's ranks may differ by
      // the logits' tolerance: compared within the device's own result).
      size_t at = 0;
      while (at < gpu[k].top.size() && gpu[k].top[at].token_id != prompt[k + 1]) ++at;
      if (at < gpu[k].top.size()) {
        EXPECT_EQ(gpu[k].rank, static_cast<int32_t>(at) + 1) << id << " " << k;
      } else {
        EXPECT_GT(gpu[k].rank, static_cast<int32_t>(gpu[k].top.size()))
            << id << " " << k;
        EXPECT_LT(gpu[k].logprob, gpu[k].top.back().logprob) << id << " " << k;
      }
    }
    EXPECT_EQ(tokens[GetParam()][id].size(), 2u) << id;
  }
  EXPECT_EQ(tokens[GetParam()][3].size(), 6u);
}

// The in-process hand-off (ExportState -> AddPrefilledRequest) across memories:
// a GPU engine's exported ranges are device memory, copied out by its device;
// a CPU engine's ranges land in a GPU engine's cache by host-to-device copies.
// Both ways the decoded tokens equal the CPU's colocated run (greedy, so the
// tolerance argument of FreeRunningGreedyEqualsTheCpu applies).
TEST_P(GpuEngine, InProcessHandOffCrossesTheDevice) {
  const std::vector<int32_t> prompt = MakePrompt(23, 5);
  const int kTokens = 5;
  SamplingParams greedy;
  greedy.max_tokens = kTokens;
  greedy.ignore_eos = true;
  auto cpu_be = MakeBackend("cpu");
  auto cpu_w = TinyWeightsOn(*cpu_be);
  auto gpu_be = MakeBackend(GetParam().c_str());
  auto gpu_w = TinyWeightsOn(*gpu_be);
  auto make = [&](bool gpu) {
    auto e = gpu ? Engine::Create(gpu_w.get(), gpu_be.get(), nullptr, Options())
                 : Engine::Create(cpu_w.get(), cpu_be.get(), nullptr, Options());
    EXPECT_TRUE(e.ok()) << e.status();
    return std::move(e).value();
  };
  auto step_all = [](Engine* e, std::vector<int32_t>* out, bool until_first) {
    for (int step = 0; e->HasWork() && step < 200; ++step) {
      auto res = e->Step();
      ASSERT_TRUE(res.ok()) << res.status();
      for (const RequestOutput& r : *res)
        out->insert(out->end(), r.new_tokens.begin(), r.new_tokens.end());
      if (until_first && !out->empty()) return;
    }
  };
  std::vector<int32_t> want;
  {
    auto colocated = make(false);
    ASSERT_TRUE(colocated->AddRequest(1, prompt, greedy).ok());
    step_all(colocated.get(), &want, false);
  }
  ASSERT_EQ(want.size(), static_cast<size_t>(kTokens));
  for (const bool prefill_on_gpu : {true, false}) {
    auto prefill = make(prefill_on_gpu);
    auto decode = make(!prefill_on_gpu);
    ASSERT_TRUE(prefill->AddRequest(1, prompt, greedy).ok());
    std::vector<int32_t> got;
    step_all(prefill.get(), &got, true);
    ASSERT_EQ(got.size(), 1u);
    auto state = prefill->ExportState(1);
    ASSERT_TRUE(state.ok()) << state.status();
    for (const StateRange& r : state->ranges) {
      EXPECT_EQ(r.device != nullptr, prefill_on_gpu);
      if (prefill_on_gpu) EXPECT_TRUE(gpu_be->device().Owns(r.data, r.bytes));
    }
    ASSERT_TRUE(decode->AddPrefilledRequest(1, *state, greedy).ok());
    ASSERT_TRUE(prefill->Abort(1).ok());
    step_all(decode.get(), &got, false);
    EXPECT_EQ(got, want) << (prefill_on_gpu ? "gpu -> cpu" : "cpu -> gpu");
  }
}

TEST(GpuEngineLoad, WeightsOnAnotherDeviceAreRefused) {
  auto gpu = MakeBackend("cuda_sim");
  auto host_weights = TinyWeightsOn(*MakeBackend("cpu"));  // host pointers
  auto cache = MakeCacheOn(*host_weights, *gpu, 4, 16, 1);
  ModelRunner runner(host_weights.get(), cache.get(), gpu.get());
  TestSequence s{BlockRange(0, 4), 0, 0};
  std::vector<float> logits;
  const int32_t tok = 1;
  absl::Status st = Feed(&runner, &s, {&tok, 1}, false, &logits);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("PlaceModelWeights"), absl::string_view::npos) << st;
}

INSTANTIATE_TEST_SUITE_P(Backends, GpuEngine, ::testing::ValuesIn(GpuBackends()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace tandem::engine
