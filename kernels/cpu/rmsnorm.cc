#include "kernels/cpu/rmsnorm.h"

#include <cmath>

namespace tandem::kernels {

void RmsNormReference(const float* x, const float* w, float* y, int64_t rows, int64_t n,
                      float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    float scale = 1.0f / std::sqrt(static_cast<float>(ss / n) + eps);
    for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] * scale * w[i];
  }
}

void RmsNormIsa(CpuIsa isa, const float* x, const float* w, float* y, int64_t rows,
                int64_t n, float eps) {
  switch (isa) {
    case CpuIsa::kAvx512:
    case CpuIsa::kAvx512Bf16:
      return internal::RmsNormAvx512(x, w, y, rows, n, eps);
    case CpuIsa::kAvx2:
      return internal::RmsNormAvx2(x, w, y, rows, n, eps);
    case CpuIsa::kGeneric:
      return RmsNormReference(x, w, y, rows, n, eps);
  }
}

void RmsNorm(const float* x, const float* w, float* y, int64_t rows, int64_t n,
             float eps) {
  RmsNormIsa(ActiveIsa(), x, w, y, rows, n, eps);
}

}  // namespace tandem::kernels
