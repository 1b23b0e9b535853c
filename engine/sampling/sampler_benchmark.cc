// Sampler cost per row at the K3 vocabulary (163,840):
//   bazel run -c opt //engine/sampling:sampler_benchmark
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "engine/sampling/sampler.h"

namespace tandem::engine {
namespace {

constexpr int64_t kVocab = 163840;

std::vector<float> Logits(double scale) {
  std::mt19937 rng(1);
  std::normal_distribution<double> d(0.0, scale);
  std::vector<float> out(kVocab);
  for (auto& v : out) v = static_cast<float>(d(rng));
  return out;
}

// A structured-output mask: `allowed` of every `period` tokens (sparse:
// a JSON structure position, a few hundred ids; dense: inside a string).
std::vector<uint32_t> Mask(int period, int allowed) {
  std::vector<uint32_t> m((kVocab + 31) / 32, 0);
  for (int64_t i = 0; i < kVocab; ++i) {
    if (i % period < allowed) m[i >> 5] |= 1u << (i & 31);
  }
  return m;
}

void Run(benchmark::State& state, SamplingParams p, double scale,
         const std::vector<uint32_t>& mask = {}) {
  const std::vector<float> logits = Logits(scale);
  Sampler sampler(kVocab);
  p.seed = 1;
  SampleRequest r;
  r.logits = logits;
  r.params = &p;
  r.allowed_bitmask = mask;
  for (auto _ : state) {
    ++r.position;
    benchmark::DoNotOptimize(sampler.Sample(r));
  }
}

void BM_Greedy(benchmark::State& s) { Run(s, SamplingParams{}, 3.0); }
void BM_Temperature(benchmark::State& s) {
  SamplingParams p;
  p.temperature = 0.8f;
  Run(s, p, 3.0);
}
void BM_TopP(benchmark::State& s) {
  SamplingParams p;
  p.temperature = 0.8f;
  p.top_p = 0.95f;
  Run(s, p, 3.0);
}
void BM_TopKTopPMinP(benchmark::State& s) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 50;
  p.top_p = 0.9f;
  p.min_p = 0.05f;
  Run(s, p, 3.0);
}
void BM_TopPFlat(benchmark::State& s) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_p = 0.9f;
  Run(s, p, 0.3);
}
void BM_Logprobs20(benchmark::State& s) {
  SamplingParams p;
  p.temperature = 0.8f;
  p.logprobs = true;
  p.top_logprobs = 20;
  Run(s, p, 3.0);
}

// Masked rows (structured outputs), beside BM_Greedy / BM_Temperature.
void BM_GreedyMaskSparse(benchmark::State& s) {
  Run(s, SamplingParams{}, 3.0, Mask(1024, 1));
}
void BM_GreedyMaskDense(benchmark::State& s) {
  Run(s, SamplingParams{}, 3.0, Mask(4096, 3900));
}
// Inside a JSON string: nearly every word partly allowed (1 in 37 masked).
std::vector<uint32_t> ScatteredMask() {
  std::vector<uint32_t> m((kVocab + 31) / 32, 0);
  for (int64_t i = 0; i < kVocab; ++i) {
    if (i % 37 != 0) m[i >> 5] |= 1u << (i & 31);
  }
  return m;
}
void BM_GreedyMaskScattered(benchmark::State& s) {
  Run(s, SamplingParams{}, 3.0, ScatteredMask());
}
void BM_TemperatureMaskDense(benchmark::State& s) {
  SamplingParams p;
  p.temperature = 0.8f;
  Run(s, p, 3.0, Mask(4096, 3900));
}

// logit_bias: 300 entries (OpenAI's usual ceiling), beside BM_Temperature.
void BM_TemperatureLogitBias300(benchmark::State& s) {
  SamplingParams p;
  p.temperature = 0.8f;
  for (int32_t i = 0; i < 300; ++i) p.logit_bias.push_back({i * 500, -5.0f});
  Run(s, p, 3.0);
}

// Prompt logprobs: one prompt row scored (ScoreToken), with 1 and 20
// alternatives; a 128-token scored chunk costs 128 of these (beside
// BM_Logprobs20, a sampled row with its alternatives).
void ScoreRow(benchmark::State& state, int top_n) {
  const std::vector<float> logits = Logits(3.0);
  int32_t token = 0;
  for (auto _ : state) {
    token = (token + 7919) % kVocab;
    benchmark::DoNotOptimize(ScoreToken(logits, token, top_n));
  }
}
void BM_ScoreToken1(benchmark::State& s) { ScoreRow(s, 1); }
void BM_ScoreToken20(benchmark::State& s) { ScoreRow(s, 20); }

BENCHMARK(BM_Greedy)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_GreedyMaskSparse)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_GreedyMaskDense)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_GreedyMaskScattered)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TemperatureMaskDense)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Temperature)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TopP)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TopKTopPMinP)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TopPFlat)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Logprobs20)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TemperatureLogitBias300)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ScoreToken1)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ScoreToken20)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace tandem::engine

// main(): //bench:benchmark_main (hyphenated flag names accepted).
