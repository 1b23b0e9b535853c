// RMSNorm over rows: y = x * rsqrt(mean(x^2) + eps) * w, computed in fp32.
// A plain reference and AVX2 / AVX-512 versions chosen at run time.
#ifndef TANDEM_KERNELS_CPU_RMSNORM_H_
#define TANDEM_KERNELS_CPU_RMSNORM_H_

#include <cstdint>

#include "kernels/cpu/cpu_features.h"

namespace tandem::kernels {

// x, y: [rows, n] row-major (y may alias x); w: [n].
void RmsNormReference(const float* x, const float* w, float* y, int64_t rows, int64_t n,
                      float eps);

// Dispatches to the best implementation for ActiveIsa().
void RmsNorm(const float* x, const float* w, float* y, int64_t rows, int64_t n,
             float eps);

// A specific implementation (for conformance tests and benchmarks). Requires the
// hardware to support `isa`.
void RmsNormIsa(CpuIsa isa, const float* x, const float* w, float* y, int64_t rows,
                int64_t n, float eps);

namespace internal {
void RmsNormAvx2(const float* x, const float* w, float* y, int64_t rows, int64_t n,
                 float eps);
void RmsNormAvx512(const float* x, const float* w, float* y, int64_t rows, int64_t n,
                   float eps);
}  // namespace internal

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_CPU_RMSNORM_H_
