// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq; only called when the
// CPU has them.
#include <immintrin.h>

#include <cmath>

#include "kernels/cpu/rmsnorm.h"

namespace tandem::kernels::internal {

void RmsNormAvx512(const float* x, const float* w, float* y, int64_t rows, int64_t n,
                   float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      __m512 a = _mm512_loadu_ps(xr + i);
      acc = _mm512_fmadd_ps(a, a, acc);
    }
    if (i < n) {
      __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
      __m512 a = _mm512_maskz_loadu_ps(m, xr + i);
      acc = _mm512_fmadd_ps(a, a, acc);
    }
    const float ss = _mm512_reduce_add_ps(acc);
    const float scale = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    const __m512 vs = _mm512_set1_ps(scale);
    for (i = 0; i + 16 <= n; i += 16) {
      __m512 v = _mm512_mul_ps(_mm512_loadu_ps(xr + i), vs);
      _mm512_storeu_ps(yr + i, _mm512_mul_ps(v, _mm512_loadu_ps(w + i)));
    }
    if (i < n) {
      __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
      __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + i), vs);
      _mm512_mask_storeu_ps(yr + i, m,
                            _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i)));
    }
  }
}

}  // namespace tandem::kernels::internal
