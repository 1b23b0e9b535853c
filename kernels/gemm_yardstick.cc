#include "kernels/gemm_yardstick.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <random>
#include <vector>

#include "dnnl.hpp"
#include "kernels/bf16.h"

namespace tandem::kernels {
namespace {

using Clock = std::chrono::steady_clock;

double Best(const std::function<void()>& fn, double min_seconds) {
  fn();  // warm-up (and oneDNN's first-call set-up)
  double best = 1e30, total = 0;
  for (int runs = 0; total < min_seconds || runs < 3; ++runs) {
    const auto t0 = Clock::now();
    fn();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::min(best, s);
    total += s;
  }
  return best;
}

double OneDnnMatmul(int64_t m, int64_t n, int64_t k, dnnl::memory::data_type type,
                    void* x, void* w, float* y, double min_seconds) {
  using tag = dnnl::memory::format_tag;
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(eng);
  // W is [n, k] row-major: a k x n matrix in "ba" layout.
  dnnl::memory::desc a_md({m, k}, type, tag::ab), b_md({k, n}, type, tag::ba),
      c_md({m, n}, dnnl::memory::data_type::f32, tag::ab);
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), eng);
  dnnl::matmul prim(pd);
  dnnl::memory a(a_md, eng, x), b(b_md, eng, w), c(c_md, eng, y);
  return Best(
      [&] {
        prim.execute(stream,
                     {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
        stream.wait();
      },
      min_seconds);
}

}  // namespace

GemmShapeTimes TimeGemmShape(Backend& backend, int64_t m, int64_t n, int64_t k,
                             double min_seconds) {
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
  t.backend_s = Best(
      [&] {
        (void)backend.GemmBf16(x.data(), k, w.data(), k, y.data(), n, m, n, k, false);
      },
      min_seconds);
  try {
    t.onednn_f32_s = OneDnnMatmul(m, n, k, dnnl::memory::data_type::f32, x.data(),
                                  wf.data(), y.data(), min_seconds);
    t.onednn_bf16_s = OneDnnMatmul(m, n, k, dnnl::memory::data_type::bf16, xb.data(),
                                   w.data(), y.data(), min_seconds);
  } catch (const dnnl::error&) {
    // Left at 0: the caller reports the yardstick as missing.
  }
  t.openblas_f32_s = Best(
      [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, x.data(), k,
                    wf.data(), k, 0.0f, y.data(), n);
      },
      min_seconds);
  return t;
}

}  // namespace tandem::kernels
