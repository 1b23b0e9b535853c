#include "kernels/gemm_yardstick.h"

#include <cblas.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "dnnl.hpp"
#include "kernels/bf16.h"

// libgomp (oneDNN's threading runtime here).
extern "C" void omp_set_num_threads(int n);
extern "C" int omp_get_max_threads(void);

namespace tandem::kernels {
namespace {

double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

using Clock = std::chrono::steady_clock;

// Runs the candidates in turn, round after round, until min_seconds have passed
// (at least 3 rounds), and returns each one's fastest run: interleaving exposes
// every candidate to the same load on a shared machine.
std::vector<double> BestInterleaved(const std::vector<std::function<void()>>& fns,
                                    double min_seconds, bool cpu_time) {
  std::vector<double> best(fns.size(), 1e30);
  for (const auto& fn : fns) fn();  // warm-up (and oneDNN's first-call set-up)
  double total = 0;
  for (int round = 0; total < min_seconds * fns.size() || round < 3; ++round) {
    for (size_t i = 0; i < fns.size(); ++i) {
      const auto t0 = Clock::now();
      const double c0 = cpu_time ? ThreadCpuSeconds() : 0;
      fns[i]();
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      best[i] = std::min(best[i], cpu_time ? ThreadCpuSeconds() - c0 : s);
      total += s;
    }
  }
  return best;
}

// A oneDNN matmul Y[m, n] f32 = X[m, k] @ W[n, k]^T in the given input type.
struct OneDnnMatmul {
  OneDnnMatmul(int64_t m, int64_t n, int64_t k, dnnl::memory::data_type type, void* x,
               void* w, float* y)
      : eng(dnnl::engine::kind::cpu, 0), stream(eng) {
    using tag = dnnl::memory::format_tag;
    // W is [n, k] row-major: a k x n matrix in "ba" layout.
    dnnl::memory::desc a_md({m, k}, type, tag::ab), b_md({k, n}, type, tag::ba),
        c_md({m, n}, dnnl::memory::data_type::f32, tag::ab);
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), eng);
    prim = dnnl::matmul(pd);
    a = dnnl::memory(a_md, eng, x);
    b = dnnl::memory(b_md, eng, w);
    c = dnnl::memory(c_md, eng, y);
  }
  void Run() {
    prim.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    stream.wait();
  }
  dnnl::engine eng;
  dnnl::stream stream;
  dnnl::matmul prim;
  dnnl::memory a, b, c;
};

}  // namespace

GemmShapeTimes TimeGemmShape(Backend& backend, int64_t m, int64_t n, int64_t k,
                             double min_seconds, bool single_thread) {
  std::mt19937 rng(static_cast<uint32_t>(m * 131 + n * 7 + k));
  std::uniform_int_distribution<int> d(-1000, 1000);
  std::vector<float> x(m * k), wf(n * k), y(m * n);
  std::vector<uint16_t> xb(m * k), w(n * k);
  for (int64_t i = 0; i < m * k; ++i) {
    x[i] = d(rng) * 1e-3f;
    xb[i] = F32ToBf16(x[i]);
  }
  for (int64_t i = 0; i < n * k; ++i) {
    w[i] = F32ToBf16(d(rng) * 1e-4f);
    wf[i] = Bf16ToF32(w[i]);
  }
  GemmShapeTimes t;
  t.flops = 2.0 * m * n * k;
  std::vector<std::function<void()>> fns;
  fns.push_back([&] {
    (void)backend.GemmBf16(x.data(), k, w.data(), k, y.data(), n, m, n, k, false);
  });
  fns.push_back([&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, x.data(), k,
                wf.data(), k, 0.0f, y.data(), n);
  });
  std::unique_ptr<OneDnnMatmul> f32, bf16;
  try {
    f32 = std::make_unique<OneDnnMatmul>(m, n, k, dnnl::memory::data_type::f32,
                                         x.data(), wf.data(), y.data());
    bf16 = std::make_unique<OneDnnMatmul>(m, n, k, dnnl::memory::data_type::bf16,
                                          xb.data(), w.data(), y.data());
    fns.push_back([&] { f32->Run(); });
    fns.push_back([&] { bf16->Run(); });
  } catch (const dnnl::error&) {
    // Left at 0: the caller reports the oneDNN yardsticks as missing.
  }
  const int omp_threads = omp_get_max_threads();
  const int blas_threads = openblas_get_num_threads();
  if (single_thread) {
    omp_set_num_threads(1);
    openblas_set_num_threads(1);
  }
  const std::vector<double> best = BestInterleaved(fns, min_seconds, single_thread);
  if (single_thread) {
    omp_set_num_threads(omp_threads);
    openblas_set_num_threads(blas_threads);
  }
  t.backend_s = best[0];
  t.openblas_f32_s = best[1];
  if (best.size() == 4) {
    t.onednn_f32_s = best[2];
    t.onednn_bf16_s = best[3];
  }
  return t;
}

}  // namespace tandem::kernels
