// engine_bench: forward-pass throughput of the engine on a kernel backend (the
// CPU ones, or a device backend: weights, cache and activations on the device).
//
//   engine_bench [--model DIR] [--prompt_len N] [--decode_steps N]
//                [--batches 1,8,32] [--backend cpu]
//
// For each batch size B: B sequences prefilled with --prompt_len tokens (one
// forward per chunk of up to --chunk tokens per sequence, all B together), then
// --decode_steps decode steps of B tokens. Reports prefill and decode tokens/s,
// the MLA + KDA state bytes per sequence, and the decode step against a memory
// bandwidth roofline: bytes a step must touch (every dense weight, the routed
// experts a uniform router expects the batch to reach, the cache it reads and
// the KDA state it reads and writes; DecodeStepBytesPerRank) over a copy bandwidth
// measured in the same run. The ratio is given for the mean step and for the fastest
// step (the machine is often shared: the fastest step and the best-of-5 copy are both
// "least disturbed" figures). Then (--gemm_yardstick) the prefill GEMMs of the model's
// own shapes (M = --chunk tokens) against oneDNN f32 (like for like with the exact
// "cpu" backend), oneDNN bf16 (what "cpu_bf16" computes: twice the arithmetic rate, not
// like for like) and OpenBLAS sgemm, twice: all threads on wall time, and one thread on
// thread CPU time (the kernels' own efficiency, barely disturbed by other load). On a
// backend that samples on its device (cuda, cuda_sim) the Engine::Step decode also runs
// with --device_sampling off (logits copied back, sampled on the host) as the baseline
// of sampling on the device, and with --overlap_steps off (every step waits for the one
// before) as the baseline of overlapped steps. Ends with ONE JSON line
// {"bench":"engine",...}. Default model: the tiny checkpoint from the runfiles.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/init.h"
#include "common/status.h"
#include "engine/model/checkpoint.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/kv_cache.h"
#include "engine/runtime/model_runner.h"
#include "engine/runtime/projection.h"
#include "engine/runtime/weights.h"
#include "engine/tokenizer/tokenizer.h"
#include "kernels/backend_factory.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/gemm_yardstick.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, model, "",
          "Checkpoint directory (default: the tiny checkpoint)");
ABSL_FLAG(int32_t, prompt_len, 128, "Prompt tokens per sequence");
ABSL_FLAG(int32_t, chunk, 128, "Prefill chunk per sequence per forward");
ABSL_FLAG(int32_t, decode_steps, 16, "Decode steps per batch size");
ABSL_FLAG(std::string, batches, "1,8,32", "Batch sizes");
ABSL_FLAG(std::string, backend, "cpu", "Kernel backend");
ABSL_FLAG(bool, engine_step, true,
          "Also time Engine::Step decode with sampling (temperature 1, every row "
          "sampled over the whole vocabulary), rows sampled one by one and in "
          "parallel (EngineOptions::sampling_threads 1 and 0), in the same run.");
ABSL_FLAG(int32_t, device_copy_mib, 1024,
          "Device backends: MiB per device-to-device copy of the bandwidth yardstick");
ABSL_FLAG(bool, gemm_yardstick, true,
          "Also time the model's prefill GEMM shapes against oneDNN and OpenBLAS");

namespace {

using Clock = std::chrono::steady_clock;
using tandem::engine::KvCache;
using tandem::engine::ModelRunner;
using tandem::engine::SequenceInput;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Copy bandwidth (bytes read + written per second) over a buffer far larger than
// the caches; best of 5.
double CopyBandwidth() {
  const size_t n = size_t{256} << 20;
  std::vector<char> a(n, 1), b(n, 2);
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), n);
    const double s = Seconds(t0, Clock::now());
    best = std::max(best, 2.0 * n / s);
    std::swap(a, b);
  }
  return best;
}

// The same on a device backend: device-to-device copies (cudaMemcpyAsync on a
// GPU, what the decode step's HBM reads are compared with), best of 5.
absl::StatusOr<double> DeviceCopyBandwidth(tandem::kernels::Device& d, size_t n) {
  TANDEM_ASSIGN_OR_RETURN(auto a, tandem::kernels::DeviceBuffer::Allocate(&d, n));
  TANDEM_ASSIGN_OR_RETURN(auto b, tandem::kernels::DeviceBuffer::Allocate(&d, n));
  TANDEM_RETURN_IF_ERROR(d.Memset(a.data(), 1, n));
  TANDEM_RETURN_IF_ERROR(d.Synchronize());
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = Clock::now();
    TANDEM_RETURN_IF_ERROR(d.CopyOnDevice(b.data(), a.data(), n));
    TANDEM_RETURN_IF_ERROR(d.Synchronize());
    const double s = Seconds(t0, Clock::now());
    best = std::max(best, 2.0 * n / s);
    std::swap(a, b);
  }
  return best;
}

int Fail(const absl::Status& s) {
  std::cerr << "engine_bench: " << s << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  tandem::InitProgram(argc, argv, "engine_bench",
                      "engine_bench [--model DIR] [--prompt_len N] [--decode_steps N] "
                      "[--batches 1,8,32]");
  std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty())
    dir = std::string(argv[0]) + ".runfiles/tandem/engine/model/tiny_checkpoint";
  auto ckpt = tandem::model::Checkpoint::Open(dir);
  if (!ckpt.ok()) return Fail(ckpt.status());
  // The Engine::Step runs detokenise what they generate, as a worker does (host
  // work between steps); a checkpoint without a tokenizer runs without.
  auto tokenizer = tandem::tokenizer::Tokenizer::Load(dir);
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "no tokenizer (%s): Engine::Step runs do not detokenise\n",
                 std::string(tokenizer.status().message()).c_str());
  }
  auto backend = tandem::kernels::CreateBackend(absl::GetFlag(FLAGS_backend));
  if (!backend.ok()) return Fail(backend.status());
  tandem::kernels::Device& device = (*backend)->device();
  const bool on_host = device.name() == "host";
  auto weights = tandem::engine::LoadModelWeights(**ckpt);
  if (!weights.ok()) return Fail(weights.status());
  // Uploaded once to the backend's device (a no-op on the host).
  weights = tandem::engine::PlaceModelWeights(*std::move(weights), device);
  if (!weights.ok()) return Fail(weights.status());
  const auto& w = **weights;
  const auto& cfg = w.config;
  std::vector<int> batches;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_batches), ',')) {
    int b;
    if (!absl::SimpleAtoi(s, &b) || b <= 0) {
      return Fail(absl::InvalidArgumentError("--batches: bad entry"));
    }
    batches.push_back(b);
  }
  const int prompt_len = absl::GetFlag(FLAGS_prompt_len);
  const int steps = absl::GetFlag(FLAGS_decode_steps);
  const int chunk = std::max(1, absl::GetFlag(FLAGS_chunk));
  const int64_t block_size = 16;
  const int64_t ctx = prompt_len + steps + 1;
  const int64_t blocks_per_seq = (ctx + block_size - 1) / block_size;
  // The best copy bandwidth seen so far in the run: measured here and again after
  // each batch size's decode, so a busy moment at start-up does not flatter the
  // ratio (a higher bandwidth only makes the roofline stricter).
  // On a device backend the yardstick is the device's own copy bandwidth (HBM on a
  // GPU; the emulator's host memory under cuda_sim), over --device_copy_mib.
  auto measure_bw = [&]() -> absl::StatusOr<double> {
    if (on_host) return CopyBandwidth();
    return DeviceCopyBandwidth(device,
                               size_t{absl::GetFlag(FLAGS_device_copy_mib)} << 20);
  };
  auto bw0 = measure_bw();
  if (!bw0.ok()) return Fail(bw0.status());
  double bw = *bw0;
  std::fprintf(stderr, "model %s, backend %s (device %s), copy bandwidth %.1f GB/s\n",
               dir.c_str(), (*backend)->name().data(),
               std::string(device.name()).c_str(), bw / 1e9);

  nlohmann::json results = nlohmann::json::array();
  const int64_t V = cfg.text.vocab_size;
  for (int B : batches) {
    tandem::engine::KvCacheOptions co;
    co.block_size = block_size;
    co.num_blocks = B * blocks_per_seq;
    co.num_slots = B;
    if (!on_host) co.device = &device;
    auto cache = KvCache::Create(cfg, co);
    if (!cache.ok()) return Fail(cache.status());
    ModelRunner runner(&w, cache->get(), backend->get());
    std::vector<std::vector<int32_t>> prompts(B), tables(B);
    for (int s = 0; s < B; ++s) {
      for (int i = 0; i < prompt_len; ++i)
        prompts[s].push_back((s * 7919 + i * 104729) % 100000);
      for (int64_t b = 0; b < blocks_per_seq; ++b)
        tables[s].push_back(s * blocks_per_seq + b);
    }
    std::vector<float> logits;
    std::vector<int32_t> next(B, 0);
    // Prefill.
    const auto t0 = Clock::now();
    for (int pos = 0; pos < prompt_len; pos += chunk) {
      const int n = std::min(chunk, prompt_len - pos);
      std::vector<SequenceInput> in(B);
      for (int s = 0; s < B; ++s) {
        in[s].tokens = absl::MakeConstSpan(prompts[s]).subspan(pos, n);
        in[s].start_pos = pos;
        in[s].block_table = tables[s];
        in[s].kda_slot = s;
        if (pos + n == prompt_len) in[s].logits_indices = {n - 1};
      }
      if (auto st = runner.Forward(in, &logits); !st.ok()) return Fail(st);
    }
    const double prefill_s = Seconds(t0, Clock::now());
    for (int s = 0; s < B; ++s) {
      next[s] = static_cast<int32_t>(
          std::max_element(logits.begin() + s * V, logits.begin() + (s + 1) * V) -
          (logits.begin() + s * V));
    }
    // Decode.
    std::vector<double> step_times;
    const auto t1 = Clock::now();
    for (int step = 0; step < steps; ++step) {
      const auto ts = Clock::now();
      std::vector<SequenceInput> in(B);
      for (int s = 0; s < B; ++s) {
        in[s].tokens = {&next[s], 1};
        in[s].start_pos = prompt_len + step;
        in[s].block_table = tables[s];
        in[s].kda_slot = s;
        in[s].logits_indices = {0};
      }
      if (auto st = runner.Forward(in, &logits); !st.ok()) return Fail(st);
      for (int s = 0; s < B; ++s) {
        next[s] = static_cast<int32_t>(
            std::max_element(logits.begin() + s * V, logits.begin() + (s + 1) * V) -
            (logits.begin() + s * V));
      }
      step_times.push_back(Seconds(ts, Clock::now()));
    }
    const double decode_s = Seconds(t1, Clock::now());
    std::sort(step_times.begin(), step_times.end());
    const double best_step_s = step_times.empty() ? 0 : step_times.front();
    const double median_step_s =
        step_times.empty() ? 0 : step_times[step_times.size() / 2];
    const double step_s = decode_s / std::max(1, steps);
    // Roofline bytes of one decode step at mid context (the projection's
    // definition, engine/runtime/projection.h: routed experts as a uniform
    // router reaches them).
    const double mid_ctx = prompt_len + steps / 2.0;
    const tandem::engine::DecodeStepBytes step_bytes =
        tandem::engine::DecodeStepBytesPerRank(w, B, mid_ctx);
    const double bytes = step_bytes.total();
    // Copy bandwidth counts read + write; a step mostly reads: compare with it as is.
    auto bw_now = measure_bw();
    if (!bw_now.ok()) return Fail(bw_now.status());
    bw = std::max(bw, *bw_now);
    const double roofline_s = bytes / bw;
    const int64_t mem_per_seq = ctx * cfg.MlaCacheBytesPerToken() * cfg.NumMlaLayers() +
                                cfg.KdaStateBytesPerSequence() * cfg.NumKdaLayers();
    nlohmann::json r;
    r["batch"] = B;
    r["prefill_tokens_per_s"] = B * prompt_len / prefill_s;
    r["decode_tokens_per_s"] = B * steps / decode_s;
    r["decode_step_ms"] = step_s * 1e3;
    r["decode_roofline_ms"] = roofline_s * 1e3;
    r["copy_bandwidth_gb_per_s"] = bw / 1e9;
    r["decode_bandwidth_efficiency"] = roofline_s / step_s;
    r["decode_step_best_ms"] = best_step_s * 1e3;
    r["decode_step_median_ms"] = median_step_s * 1e3;
    r["decode_bandwidth_efficiency_best_step"] =
        best_step_s > 0 ? roofline_s / best_step_s : 0;
    r["bytes_per_decode_step"] = bytes;
    r["decode_step_bytes"] = {{"dense", step_bytes.dense},
                              {"experts", step_bytes.experts},
                              {"experts_touched_per_layer", step_bytes.experts_touched},
                              {"mla_cache", step_bytes.mla_cache},
                              {"kda_state", step_bytes.kda_state}};
    r["state_bytes_per_sequence"] = mem_per_seq;
    if (absl::GetFlag(FLAGS_engine_step)) {
      // Decode tokens/s through Engine::Step (forward + sampling + stop
      // checks) with `threads` sampling threads.
      tandem::engine::StepTimingStats timing;
      auto engine_decode = [&](int threads, bool device_sampling = true,
                               bool overlap = true) -> absl::StatusOr<double> {
        tandem::engine::EngineOptions eo;
        eo.device_sampling = device_sampling;
        eo.overlap_steps = overlap;
        eo.num_slots = B;
        eo.max_context_tokens = ctx + 1;
        eo.max_tokens_per_step = std::max<int64_t>(256, B * prompt_len);
        eo.sampling_threads = threads;
        TANDEM_ASSIGN_OR_RETURN(
            auto engine,
            tandem::engine::Engine::Create(
                &w, backend->get(), tokenizer.ok() ? tokenizer->get() : nullptr, eo));
        for (int q = 0; q < B; ++q) {
          tandem::engine::SamplingParams p;
          p.temperature = 1.0f;
          p.seed = 1000 + q;
          p.max_tokens = steps + 1;
          p.ignore_eos = true;
          TANDEM_RETURN_IF_ERROR(engine->AddRequest(q, prompts[q], p));
        }
        // The first step prefills (and samples each first token); time the rest.
        TANDEM_RETURN_IF_ERROR(engine->Step().status());
        int64_t tokens = 0;
        const auto e0 = Clock::now();
        while (engine->HasWork()) {
          TANDEM_ASSIGN_OR_RETURN(auto outs, engine->Step());
          for (const auto& o : outs)
            tokens += static_cast<int64_t>(o.new_tokens.size());
        }
        const double tok_s = tokens / Seconds(e0, Clock::now());
        timing = engine->step_timing();
        return tok_s;
      };
      // On a backend that samples on its device: the same decode with the logits
      // copied back and sampled on the host (the baseline of device sampling).
      const bool device_samples = (*backend)->SupportsSampling();
      tandem::engine::StepTimingStats host_timing;
      absl::StatusOr<double> host = 0.0;
      if (device_samples) {
        host = engine_decode(0, /*device_sampling=*/false);
        if (!host.ok()) return Fail(host.status());
        host_timing = timing;
      }
      tandem::engine::StepTimingStats sync_timing;
      absl::StatusOr<double> sync = 0.0;
      if (device_samples) {
        sync = engine_decode(0, /*device_sampling=*/true, /*overlap=*/false);
        if (!sync.ok()) return Fail(sync.status());
        sync_timing = timing;
      }
      auto seq = engine_decode(1);
      auto par = engine_decode(0);
      if (!seq.ok()) return Fail(seq.status());
      if (!par.ok()) return Fail(par.status());
      if (device_samples) {
        const double sync_gap_ms =
            sync_timing.gaps > 0 ? sync_timing.host_gap_seconds / sync_timing.gaps * 1e3
                                 : 0.0;
        const double gap_ms =
            timing.gaps > 0 ? timing.host_gap_seconds / timing.gaps * 1e3 : 0.0;
        r["engine_decode_tokens_per_s_no_overlap"] = *sync;
        r["engine_host_gap_ms_no_overlap"] = sync_gap_ms;
        r["engine_host_gap_fraction_no_overlap"] = sync_timing.host_gap_fraction();
        r["engine_overlapped_steps"] = timing.overlapped_steps;
        r["engine_idle_gap_ms"] = timing.idle_gap_seconds_per_step() * 1e3;
        r["engine_idle_gap_ms_no_overlap"] =
            sync_timing.idle_gap_seconds_per_step() * 1e3;
        r["overlap_vs_sync_decode"] = *sync > 0 ? *par / *sync : 0.0;
        std::fprintf(
            stderr,
            "batch %3d: overlapped steps %.1f tok/s (host gap %.3f ms, %lld of "
            "%lld steps overlapped; %.3f ms of it not device sampling), each "
            "step waiting for the one before %.1f tok/s (host gap %.3f ms; "
            "%.3f ms not device sampling): x%.2f\n",
            B, *par, gap_ms, static_cast<long long>(timing.overlapped_steps),
            static_cast<long long>(timing.steps),
            timing.idle_gap_seconds_per_step() * 1e3, *sync, sync_gap_ms,
            sync_timing.idle_gap_seconds_per_step() * 1e3,
            *sync > 0 ? *par / *sync : 0.0);
      }
      if (device_samples) {
        const double host_gap_ms =
            host_timing.gaps > 0 ? host_timing.host_gap_seconds / host_timing.gaps * 1e3
                                 : 0.0;
        const double dev_gap_ms =
            timing.gaps > 0 ? timing.host_gap_seconds / timing.gaps * 1e3 : 0.0;
        r["engine_decode_tokens_per_s_host_sampling"] = *host;
        r["engine_host_gap_ms_host_sampling"] = host_gap_ms;
        r["engine_device_sampled_rows"] = timing.device_sampled_rows;
        r["device_vs_host_sampling_decode"] = *host > 0 ? *par / *host : 0.0;
        std::fprintf(stderr,
                     "batch %3d: sampling on the device %.1f tok/s (host gap %.3f ms), "
                     "logits copied back and sampled on the host %.1f tok/s (host gap "
                     "%.3f ms): x%.2f\n",
                     B, *par, dev_gap_ms, *host, host_gap_ms,
                     *host > 0 ? *par / *host : 0.0);
      }
      r["engine_decode_tokens_per_s_sequential_sampling"] = *seq;
      r["engine_decode_tokens_per_s"] = *par;
      // Host gap of the parallel-sampling run (StepTimingStats): device idle
      // time between forwards, against the step.
      const double mean_gap_ms =
          timing.gaps > 0 ? timing.host_gap_seconds / timing.gaps * 1e3 : 0.0;
      const double mean_fwd_ms =
          timing.steps > 0 ? timing.forward_seconds / timing.steps * 1e3 : 0.0;
      r["engine_host_gap_ms"] = mean_gap_ms;
      r["engine_forward_ms"] = mean_fwd_ms;
      r["engine_host_gap_fraction"] = timing.host_gap_fraction();
      std::fprintf(
          stderr,
          "batch %3d: Engine::Step host gap %.3f ms per step (max %.3f) beside a "
          "%.3f ms forward: %.1f%% of the step\n",
          B, mean_gap_ms, timing.max_host_gap_seconds * 1e3, mean_fwd_ms,
          100 * timing.host_gap_fraction());
      std::fprintf(stderr,
                   "batch %3d: Engine::Step decode with sampling (temperature 1): %.1f "
                   "tok/s with rows sampled in parallel, %.1f one by one (x%.2f)\n",
                   B, *par, *seq, *seq > 0 ? *par / *seq : 0.0);
    }
    std::fprintf(stderr,
                 "batch %3d: prefill %9.1f tok/s, decode %9.1f tok/s, step %.2f ms "
                 "(median %.2f, best %.2f; roofline %.3f ms: %.2f of the mean step, "
                 "%.2f of the best), state %.2f MB/seq\n",
                 B, B * prompt_len / prefill_s, B * steps / decode_s, step_s * 1e3,
                 median_step_s * 1e3, best_step_s * 1e3, roofline_s * 1e3,
                 roofline_s / step_s, best_step_s > 0 ? roofline_s / best_step_s : 0,
                 mem_per_seq / 1e6);
    results.push_back(r);
  }
  nlohmann::json gemm = nlohmann::json::object();
  if (absl::GetFlag(FLAGS_gemm_yardstick) && !on_host) {
    std::fprintf(stderr,
                 "prefill GEMM yardstick skipped: it compares CPU kernels (backend "
                 "%s computes on %s)\n",
                 (*backend)->name().data(), std::string(device.name()).c_str());
  } else if (absl::GetFlag(FLAGS_gemm_yardstick)) {
    // The dense prefill GEMMs of one forward of --chunk tokens, by shape [N, K].
    const auto& t = cfg.text;
    const int64_t H = t.hidden_size;
    struct Shape {
      const char* name;
      int64_t n, k;
    };
    std::vector<Shape> shapes = {
        {"kda_qkv_proj", cfg.KdaProjectionSize(), H},
        {"kda_o_proj", H, cfg.KdaProjectionSize()},
        {"mla_q_a_proj", t.q_lora_rank, H},
        {"mla_q_b_proj", t.num_attention_heads * cfg.QHeadDim(), t.q_lora_rank},
        {"mla_kv_a_proj", t.kv_lora_rank + t.qk_rope_head_dim, H},
        {"mlp_gate_up", t.intermediate_size, H},
        {"mlp_down", H, t.intermediate_size}};
    const int64_t m = chunk;
    const tandem::kernels::CpuIsa isa = static_cast<tandem::kernels::CpuIsa>(
        std::min(static_cast<int>(tandem::kernels::ActiveIsa()),
                 static_cast<int>(tandem::kernels::CpuIsa::kAvx512)));
    auto single = tandem::kernels::CreateCpuBackend(isa, 1, /*use_onednn=*/false);
    if (!single.ok()) return Fail(single.status());
    std::fprintf(stderr,
                 "prefill GEMMs, M = %lld, %s vs oneDNN f32 / oneDNN bf16 / OpenBLAS "
                 "f32 (ratio = ours / yardstick):\n",
                 static_cast<long long>(m), (*backend)->name().data());
    for (bool one_thread : {false, true}) {
      double flops = 0, ours = 0, f32 = 0, bf16 = 0, blas = 0;
      nlohmann::json per_shape = nlohmann::json::object();
      for (const Shape& s : shapes) {
        if (s.n <= 0 || s.k <= 0) continue;
        const auto tm = tandem::kernels::TimeGemmShape(
            one_thread ? **single : **backend, m, s.n, s.k, 0.15, one_thread);
        flops += tm.flops;
        ours += tm.backend_s;
        f32 += tm.onednn_f32_s;
        bf16 += tm.onednn_bf16_s;
        blas += tm.openblas_f32_s;
        per_shape[s.name] = {{"n", s.n},
                             {"k", s.k},
                             {"gflops", tm.flops / tm.backend_s / 1e9},
                             {"vs_onednn_f32", tm.onednn_f32_s / tm.backend_s},
                             {"vs_onednn_bf16", tm.onednn_bf16_s / tm.backend_s},
                             {"vs_openblas_f32", tm.openblas_f32_s / tm.backend_s}};
        std::fprintf(stderr,
                     "  %-4s %-14s %5lld x %5lld: %7.1f GFLOP/s  %.2f / %.2f / %.2f\n",
                     one_thread ? "1t" : "all", s.name, static_cast<long long>(s.n),
                     static_cast<long long>(s.k), tm.flops / tm.backend_s / 1e9,
                     tm.onednn_f32_s / tm.backend_s, tm.onednn_bf16_s / tm.backend_s,
                     tm.openblas_f32_s / tm.backend_s);
      }
      // Over the whole set (time-weighted): sum of yardstick times / sum of ours.
      nlohmann::json total = {{"gflops", ours > 0 ? flops / ours / 1e9 : 0},
                              {"vs_onednn_f32", ours > 0 ? f32 / ours : 0},
                              {"vs_onednn_bf16", ours > 0 ? bf16 / ours : 0},
                              {"vs_openblas_f32", ours > 0 ? blas / ours : 0},
                              {"shapes", per_shape}};
      std::fprintf(stderr, "  %-4s all shapes: %.1f GFLOP/s  %.2f / %.2f / %.2f\n",
                   one_thread ? "1t" : "all", flops / ours / 1e9, f32 / ours,
                   bf16 / ours, blas / ours);
      gemm[one_thread ? "one_thread_cpu_time" : "all_threads_wall"] = total;
    }
    gemm["m"] = m;
  }
  nlohmann::json out;
  out["bench"] = "engine";
  out["prefill_gemm"] = gemm;
  out["model"] = dir;
  out["backend"] = std::string((*backend)->name());
  out["prompt_len"] = prompt_len;
  out["decode_steps"] = steps;
  out["copy_bandwidth_gb_per_s"] = bw / 1e9;  // the best seen in the run
  out["kda_state_bytes_per_sequence"] =
      cfg.KdaStateBytesPerSequence() * cfg.NumKdaLayers();
  out["mla_cache_bytes_per_token"] = cfg.MlaCacheBytesPerToken() * cfg.NumMlaLayers();
  out["results"] = results;
  std::cout << out.dump() << "\n";
  return 0;
}
