// Kernel benchmark: GEMM/GEMV at decode and prefill shapes against oneDNN (BF16
// matmul) and OpenBLAS (sgemm) in the same run, a memory-copy bandwidth baseline
// with the GEMV weight-streaming rate as a roofline ratio, lm_head, MXFP4 MoE
// decode, and KDA chunked vs recurrent throughput. Prints a table, then ONE JSON
// line {"bench":"kernels",...}. Runs in well under a minute.
//
//   bazel run -c opt //kernels:kernels_bench            (all hardware threads)
//   TANDEM_CPU_ISA=avx2 bazel-bin/kernels/kernels_bench (cap the ISA)
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dnnl.hpp"
#include "kernels/backend.h"
#include "kernels/backend_factory.h"
#include "kernels/bf16.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/gemm_yardstick.h"

namespace tandem::kernels {
namespace {

using Clock = std::chrono::steady_clock;

// Best-of timing: runs fn until min_seconds have passed (at least 3 times) and
// returns the fastest single run in seconds.
double Time(const std::function<void()>& fn, double min_seconds = 0.25) {
  fn();  // warm-up
  double best = 1e30, total = 0;
  int runs = 0;
  while (total < min_seconds || runs < 3) {
    const auto t0 = Clock::now();
    fn();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::min(best, s);
    total += s;
    ++runs;
  }
  return best;
}

std::vector<uint16_t> RandomBf16(int64_t n, std::mt19937& rng) {
  std::vector<uint16_t> v(n);
  std::uniform_int_distribution<int> d(-1000, 1000);
  for (uint16_t& x : v) x = F32ToBf16(d(rng) * 1e-4f);
  return v;
}
std::vector<float> RandomF32(int64_t n, std::mt19937& rng) {
  std::vector<float> v(n);
  std::uniform_int_distribution<int> d(-1000, 1000);
  for (float& x : v) x = d(rng) * 1e-3f;
  return v;
}

struct OneDnn {
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{eng};

  // Y[M,N] f32 = Xb[M,K] bf16 @ W[N,K]^T bf16 (W as a K x N matrix in "ba" layout).
  double TimeMatmul(int64_t m, int64_t n, int64_t k, uint16_t* xb, uint16_t* w,
                    float* y) {
    using dt = dnnl::memory::data_type;
    using tag = dnnl::memory::format_tag;
    dnnl::memory::desc a_md({m, k}, dt::bf16, tag::ab), b_md({k, n}, dt::bf16, tag::ba),
        c_md({m, n}, dt::f32, tag::ab);
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), eng);
    dnnl::matmul prim(pd);
    dnnl::memory a(a_md, eng, xb), b(b_md, eng, w), c(c_md, eng, y);
    return Time([&] {
      prim.execute(stream,
                   {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
      stream.wait();
    });
  }
};

struct Row {
  std::string name;
  double ours, onednn, openblas, backend;  // GFLOP/s
};

// The exact "cpu" backend (fp32 activations) against oneDNN f32 (like for like),
// oneDNN bf16 (what "cpu_bf16" computes; not like for like) and OpenBLAS sgemm, on
// prefill shapes of the mid checkpoint (hidden 1024) and the K3-sized ones above.
void ExactGemmSection(std::map<std::string, double>* json) {
  auto exact = CreateBackend("cpu");
  if (!exact.ok()) return;
  // The same kernels on one thread, for the CPU-time table.
  const CpuIsa exact_isa = static_cast<CpuIsa>(
      std::min(static_cast<int>(ActiveIsa()), static_cast<int>(CpuIsa::kAvx512)));
  auto single = CreateCpuBackend(exact_isa, 1, /*use_onednn=*/false);
  if (!single.ok()) return;
  struct Shape {
    const char* name;
    int64_t m, n, k;
  };
  for (bool one_thread : {false, true}) {
    std::printf(
        "exact \"cpu\" GEMM (%s) vs yardsticks, %s; GFLOP/s, ratio = ours / "
        "yardstick\n%-26s %8s %8s %8s %8s %9s %9s %9s\n",
        std::string((*exact)->name()).c_str(),
        one_thread ? "1 thread, thread CPU time" : "all threads, wall time", "shape",
        "ours", "dnn_f32", "dnn_bf16", "blas_f32", "/dnn_f32", "/dnn_bf16",
        "/blas_f32");
    for (Shape s : {Shape{"m128_1024x1024", 128, 1024, 1024},
                    Shape{"m128_5632x1024", 128, 5632, 1024},
                    Shape{"m128_1024x2816", 128, 1024, 2816},
                    Shape{"m1024_1024x1024", 1024, 1024, 1024},
                    Shape{"m256_2048x2048", 256, 2048, 2048},
                    Shape{"m512_4096x1024", 512, 4096, 1024}}) {
      const GemmShapeTimes t = TimeGemmShape(one_thread ? **single : **exact, s.m, s.n,
                                             s.k, 0.2, one_thread);
      auto rate = [&](double sec) { return sec > 0 ? t.flops / sec / 1e9 : 0.0; };
      const double ours = rate(t.backend_s), f32 = rate(t.onednn_f32_s),
                   bf16 = rate(t.onednn_bf16_s), blas = rate(t.openblas_f32_s);
      std::printf("%-26s %8.1f %8.1f %8.1f %8.1f %9.2f %9.2f %9.2f\n", s.name, ours,
                  f32, bf16, blas, f32 > 0 ? ours / f32 : 0, bf16 > 0 ? ours / bf16 : 0,
                  blas > 0 ? ours / blas : 0);
      const std::string key =
          std::string("exact_") + (one_thread ? "1t_" : "") + std::string(s.name);
      (*json)[key + "_gflops"] = ours;
      (*json)[key + "_vs_onednn_f32"] = f32 > 0 ? ours / f32 : 0;
      (*json)[key + "_vs_onednn_bf16"] = bf16 > 0 ? ours / bf16 : 0;
      (*json)[key + "_vs_openblas_f32"] = blas > 0 ? ours / blas : 0;
    }
  }
}

int Main(bool gemm_only) {
  const int threads = static_cast<int>(std::thread::hardware_concurrency());
  const CpuIsa isa = ActiveIsa();
  auto created = CreateCpuBackend(isa, threads);
  if (!created.ok()) {
    std::fprintf(stderr, "%s\n", created.status().ToString().c_str());
    return 1;
  }
  Backend& be = **created;
  // The same ISA without the oneDNN routing, to compare our own GEMM kernel.
  auto own_created = CreateCpuBackend(isa, threads, /*use_onednn=*/false);
  Backend& own = **own_created;
  std::mt19937 rng(1);
  std::map<std::string, double> json;
  std::printf("kernels_bench: backend %s, %d threads, oneDNN %d.%d, OpenBLAS %s\n",
              std::string(be.name()).c_str(), threads, dnnl_version()->major,
              dnnl_version()->minor, openblas_get_config());

  // ---- Memory bandwidth baseline: memcpy of 256 MiB (bytes read + written). ----
  {
    const size_t bytes = size_t{256} << 20;
    std::vector<char> src(bytes, 1), dst(bytes, 0);
    const double s = Time([&] {
      // Split across threads like the kernels do.
      std::vector<std::thread> ts;
      for (int i = 0; i < threads; ++i) {
        ts.emplace_back([&, i] {
          const size_t b = bytes * i / threads, e = bytes * (i + 1) / threads;
          std::memcpy(dst.data() + b, src.data() + b, e - b);
        });
      }
      for (auto& t : ts) t.join();
    });
    json["copy_gbs"] = 2.0 * bytes / s / 1e9;
    // Read-only streaming (what a GEMV does with its weights): sum 64-bit words.
    const uint64_t* words = reinterpret_cast<const uint64_t*>(src.data());
    std::vector<uint64_t> sums(threads);
    const double r = Time([&] {
      std::vector<std::thread> ts;
      for (int i = 0; i < threads; ++i) {
        ts.emplace_back([&, i] {
          const size_t n = bytes / 8, b = n * i / threads, e = n * (i + 1) / threads;
          // One accumulator: GCC vectorises this integer reduction (paddq).
          uint64_t acc = 0;
          for (size_t j = b; j < e; ++j) acc += words[j];
          sums[i] = acc;
        });
      }
      for (auto& t : ts) t.join();
    });
    json["read_gbs"] = bytes / r / 1e9;
    std::printf("memcpy 256 MiB: %.1f GB/s (read + write); read-only sum: %.1f GB/s\n",
                json["copy_gbs"], json["read_gbs"]);
  }

  ExactGemmSection(&json);
  if (gemm_only) return 0;

  OneDnn dnn;
  std::vector<Row> rows;
  struct Shape {
    const char* name;
    int64_t m, n, k;
  };
  for (Shape s : {Shape{"gemv_decode_m1_7168x7168", 1, 7168, 7168},
                  Shape{"gemv_decode_m8_4096x7168", 8, 4096, 7168},
                  Shape{"gemm_prefill_m256_2048x2048", 256, 2048, 2048},
                  Shape{"gemm_prefill_m512_4096x1024", 512, 4096, 1024}}) {
    auto x = RandomF32(s.m * s.k, rng);
    auto w = RandomBf16(s.n * s.k, rng);
    std::vector<float> y(s.m * s.n);
    const double flops = 2.0 * s.m * s.n * s.k;
    const double ours = Time([&] {
      (void)own.GemmBf16(x.data(), s.k, w.data(), s.k, y.data(), s.n, s.m, s.n, s.k,
                         false);
    });
    std::vector<uint16_t> xb(s.m * s.k);
    for (int64_t i = 0; i < s.m * s.k; ++i) xb[i] = F32ToBf16(x[i]);
    const double dnn_s = dnn.TimeMatmul(s.m, s.n, s.k, xb.data(), w.data(), y.data());
    std::vector<float> wf(s.n * s.k);
    for (int64_t i = 0; i < s.n * s.k; ++i) wf[i] = Bf16ToF32(w[i]);
    const double blas_s = Time([&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s.m, s.n, s.k, 1.0f,
                  x.data(), s.k, wf.data(), s.k, 0.0f, y.data(), s.n);
    });
    const double routed = Time([&] {
      (void)be.GemmBf16(x.data(), s.k, w.data(), s.k, y.data(), s.n, s.m, s.n, s.k,
                        false);
    });
    json[std::string(s.name) + "_backend_gflops"] = flops / routed / 1e9;
    rows.push_back({s.name, flops / ours / 1e9, flops / dnn_s / 1e9,
                    flops / blas_s / 1e9, flops / routed / 1e9});
    json[std::string(s.name) + "_gflops"] = flops / ours / 1e9;
    json[std::string(s.name) + "_onednn_gflops"] = flops / dnn_s / 1e9;
    json[std::string(s.name) + "_openblas_gflops"] = flops / blas_s / 1e9;
    if (s.m == 1) {
      json["gemv_weight_gbs"] = 2.0 * s.n * s.k / ours / 1e9;
      json["gemv_roofline_ratio"] = json["gemv_weight_gbs"] / json["read_gbs"];
    }
  }
  std::printf(
      "%-30s %9s %9s %9s %9s  (GFLOP/s; ours = own kernel incl. X->bf16;"
      " oneDNN bf16xbf16->f32, X pre-converted; OpenBLAS fp32 sgemm; backend ="
      " what \"cpu\" runs)\n",
      "shape", "ours", "oneDNN", "OpenBLAS", "backend");
  for (const Row& r : rows) {
    std::printf("%-30s %9.1f %9.1f %9.1f %9.1f  ours/oneDNN %.2f ours/OpenBLAS %.2f\n",
                r.name.c_str(), r.ours, r.onednn, r.openblas, r.backend,
                r.ours / r.onednn, r.ours / r.openblas);
  }
  std::printf(
      "GEMV 1x7168x7168 bf16 weight stream: %.1f GB/s = %.2f of the read-only rate\n",
      json["gemv_weight_gbs"], json["gemv_roofline_ratio"]);

  // ---- lm_head: vocab 163840 x hidden 1024 (tiny-model decode), M = 1. ----
  {
    const int64_t n = 163840, k = 1024;
    auto x = RandomF32(k, rng);
    auto w = RandomBf16(n * k, rng);
    std::vector<float> y(n);
    const double s = Time([&] {
      (void)be.GemmBf16(x.data(), k, w.data(), k, y.data(), n, 1, n, k, false);
    });
    json["lm_head_163840x1024_ms"] = s * 1e3;
    json["lm_head_weight_gbs"] = 2.0 * n * k / s / 1e9;
    std::printf("lm_head 163840x1024 (M=1): %.2f ms, %.1f GB/s weights\n", s * 1e3,
                json["lm_head_weight_gbs"]);
  }

  // ---- MXFP4 MoE decode: 1 token, 8 experts of 3584 x 3072. ----
  {
    const int64_t hidden = 3584, inter = 3072, experts = 8;
    std::vector<std::vector<uint8_t>> store;
    std::vector<Mxfp4Expert> ex(experts);
    std::uniform_int_distribution<int> byte(0, 255), sc(118, 122);
    auto make = [&](int64_t rows, int64_t cols) {
      store.emplace_back(rows * cols / 2);
      for (uint8_t& b : store.back()) b = static_cast<uint8_t>(byte(rng));
      store.emplace_back(rows * cols / 32);
      for (uint8_t& b : store.back()) b = static_cast<uint8_t>(sc(rng));
    };
    for (int64_t e = 0; e < experts; ++e) {
      make(inter, hidden);
      make(inter, hidden);
      make(hidden, inter);
    }
    for (int64_t e = 0; e < experts; ++e) {
      ex[e] = {store[6 * e].data(),     store[6 * e + 1].data(),
               store[6 * e + 2].data(), store[6 * e + 3].data(),
               store[6 * e + 4].data(), store[6 * e + 5].data()};
    }
    auto z = RandomF32(hidden, rng);
    std::vector<int32_t> ids(experts);
    std::vector<float> wts(experts, 0.125f), out(hidden);
    for (int64_t e = 0; e < experts; ++e) ids[e] = static_cast<int32_t>(e);
    MoeArgs a;
    a.tokens = 1;
    a.hidden = hidden;
    a.inter = inter;
    a.top_k = experts;
    a.num_experts = experts;
    a.experts = ex.data();
    a.z = z.data();
    a.ld_z = hidden;
    a.ids = ids.data();
    a.weights = wts.data();
    a.out = out.data();
    a.ld_out = hidden;
    const double s = Time([&] { (void)be.MoeMxfp4(a); });
    const double bytes = experts * 3.0 * hidden * inter * (0.5 + 1.0 / 32);
    json["moe_mxfp4_decode_ms"] = s * 1e3;
    json["moe_mxfp4_weight_gbs"] = bytes / s / 1e9;
    std::printf(
        "MoE MXFP4 decode (1 token, 8 experts 3584x3072): %.2f ms, %.1f GB/s packed"
        " weights\n",
        s * 1e3, json["moe_mxfp4_weight_gbs"]);
  }

  // ---- KDA: 4 heads of 128, 1024 tokens: chunked vs recurrent. ----
  {
    const int64_t t = 1024, h = 4, d = 128;
    auto q = RandomF32(t * h * d, rng), k = RandomF32(t * h * d, rng),
         v = RandomF32(t * h * d, rng);
    (void)be.L2NormHeads(q.data(), h * d, q.data(), h * d, t, h, d, 1e-6f, 0.088f);
    (void)be.L2NormHeads(k.data(), h * d, k.data(), h * d, t, h, d, 1e-6f, 1.0f);
    std::vector<float> g(t * h * d, -0.3f), beta(t * h, 0.5f), state(h * d * d, 0.0f),
        out(t * h * d);
    KdaArgs a;
    a.tokens = t;
    a.heads = h;
    a.head_dim_k = d;
    a.head_dim_v = d;
    a.q = q.data();
    a.k = k.data();
    a.ld_qk = h * d;
    a.v = v.data();
    a.ld_v = h * d;
    a.g = g.data();
    a.beta = beta.data();
    a.state = state.data();
    a.out = out.data();
    a.ld_out = h * d;
    const double chunked = Time([&] { (void)be.KdaChunked(a); });
    const double recurrent = Time([&] { (void)be.KdaRecurrent(a); });
    json["kda_chunked_tok_s"] = t / chunked;
    json["kda_recurrent_tok_s"] = t / recurrent;
    std::printf(
        "KDA 4 heads x 128, 1024 tokens: chunked %.0f tok/s, recurrent %.0f tok/s\n",
        t / chunked, t / recurrent);
  }

  std::string line = "{\"bench\":\"kernels\",\"backend\":\"" + std::string(be.name()) +
                     "\",\"threads\":" + std::to_string(threads);
  for (const auto& [key, value] : json) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.4g", value);
    line += ",\"" + key + "\":" + buf;
  }
  line += "}";
  std::printf("%s\n", line.c_str());
  return 0;
}

}  // namespace
}  // namespace tandem::kernels

// kernels_bench [gemm]: "gemm" runs only the copy baseline and the exact GEMM table.
int main(int argc, char** argv) {
  return tandem::kernels::Main(argc > 1 && std::string(argv[1]) == "gemm");
}
