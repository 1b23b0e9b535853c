// Portable fp32 GEMM loops (the kGeneric level), 4-way unrolled accumulators.
#include "kernels/bf16.h"
#include "kernels/cpu/gemm_kernels.h"

namespace tandem::kernels::internal {
namespace {

inline float W(const uint16_t* p) { return Bf16ToF32(*p); }
inline float W(const float* p) { return *p; }

template <typename WT>
void Gemm(const float* x, int64_t ldx, const WT* w, int64_t ldw, float* y, int64_t ldy,
          int64_t m, int64_t n, int64_t k, bool accumulate) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const float* xr = x + i * ldx;
      const WT* wr = w + j * ldw;
      float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
      int64_t t = 0;
      for (; t + 4 <= k; t += 4) {
        a0 += xr[t] * W(wr + t);
        a1 += xr[t + 1] * W(wr + t + 1);
        a2 += xr[t + 2] * W(wr + t + 2);
        a3 += xr[t + 3] * W(wr + t + 3);
      }
      for (; t < k; ++t) a0 += xr[t] * W(wr + t);
      const float s = (a0 + a1) + (a2 + a3);
      y[i * ldy + j] = accumulate ? y[i * ldy + j] + s : s;
    }
  }
}

}  // namespace

void GemmBf16Generic(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw,
                     float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                     bool accumulate) {
  Gemm(x, ldx, w, ldw, y, ldy, m, n, k, accumulate);
}

void GemmF32Generic(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                    int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate) {
  Gemm(x, ldx, w, ldw, y, ldy, m, n, k, accumulate);
}

}  // namespace tandem::kernels::internal
