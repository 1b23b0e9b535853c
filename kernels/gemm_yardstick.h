// Times one GEMM shape Y[m, n] = X[m, k] @ W[n, k]^T (fp32 X, BF16 W, fp32 Y) on a
// kernel backend and on the library yardsticks, in the same process and sitting,
// so that benchmarks can print ratios that survive a noisy, shared machine:
//   - oneDNN matmul f32 x f32 (W widened to fp32 beforehand): like for like with
//     the exact "cpu" backend (fp32 activations, exact BF16 -> fp32 weights, fp32
//     products and sums);
//   - oneDNN matmul bf16 x bf16 -> f32 (X rounded to BF16 beforehand, not timed):
//     what the opt-in "cpu_bf16" backend computes; twice the arithmetic rate of
//     fp32 on AVX512_BF16 hardware, so NOT like for like with the exact backend;
//   - OpenBLAS cblas_sgemm (W widened to fp32 beforehand).
// The four run in turn, round after round (at least 3 rounds, at least
// min_seconds each), and each figure is that candidate's fastest run, so that
// all of them see the same load on a shared machine.
#ifndef TANDEM_KERNELS_GEMM_YARDSTICK_H_
#define TANDEM_KERNELS_GEMM_YARDSTICK_H_

#include <cstdint>

#include "kernels/backend.h"

namespace tandem::kernels {

struct GemmShapeTimes {
  double backend_s = 0;      // Backend::GemmBf16 on fp32 X
  double onednn_f32_s = 0;   // oneDNN f32 x f32
  double onednn_bf16_s = 0;  // oneDNN bf16 x bf16 -> f32
  double openblas_f32_s = 0;
  double flops = 0;  // 2 m n k
};

// Random data. single_thread: the libraries run on one thread (the caller passes
// a one-thread backend) and times are the calling thread's CPU time, which a
// busy, shared machine barely disturbs: the kernels' own efficiency.
GemmShapeTimes TimeGemmShape(Backend& backend, int64_t m, int64_t n, int64_t k,
                             double min_seconds = 0.2, bool single_thread = false);

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_GEMM_YARDSTICK_H_
