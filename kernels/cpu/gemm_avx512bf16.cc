// Compiled with AVX-512 + AVX512_BF16 flags; only called when the CPU has them.
// vdpbf16ps: each fp32 lane accumulates the two products of a BF16 pair, so a
// 512-bit step covers 32 K elements of one (row of X, row of W) dot product.
#include <immintrin.h>

#include "kernels/cpu/gemm_kernels.h"
#include "kernels/cpu/gemm_tiling.h"

namespace tandem::kernels::internal {
namespace {

inline __m512bh LoadBh(const uint16_t* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}
inline __m512bh LoadBhMasked(const uint16_t* p, __mmask32 m) {
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(m, p));
}

template <int MR, int NR>
struct Micro {
  static void Run(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw,
                  float* y, int64_t ldy, int64_t kb, bool add) {
    __m512 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
    int64_t kk = 0;
    for (; kk + 32 <= kb; kk += 32) {
      __m512bh wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = LoadBh(w + j * ldw + kk);
      for (int i = 0; i < MR; ++i) {
        const __m512bh xv = LoadBh(x + i * ldx + kk);
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
      }
    }
    if (kk < kb) {
      const __mmask32 m = static_cast<__mmask32>((1ull << (kb - kk)) - 1);
      __m512bh wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = LoadBhMasked(w + j * ldw + kk, m);
      for (int i = 0; i < MR; ++i) {
        const __m512bh xv = LoadBhMasked(x + i * ldx + kk, m);
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
      }
    }
    for (int i = 0; i < MR; ++i) {
      for (int j = 0; j < NR; ++j) {
        const float s = _mm512_reduce_add_ps(acc[i][j]);
        y[i * ldy + j] = add ? y[i * ldy + j] + s : s;
      }
    }
  }
};

}  // namespace

void GemmBf16Avx512Bf16(const uint16_t* xb, int64_t ldxb, const uint16_t* w,
                        int64_t ldw, float* y, int64_t ldy, int64_t m, int64_t n,
                        int64_t k, bool accumulate) {
  BlockedGemm<uint16_t, uint16_t, MicroTable4x4<Micro>>(xb, ldxb, w, ldw, y, ldy, m, n,
                                                        k, accumulate);
}

void ConvertRowsToBf16Avx512Bf16(const float* x, int64_t ldx, uint16_t* xb,
                                 int64_t ldxb, int64_t m, int64_t k) {
  for (int64_t i = 0; i < m; ++i) {
    const float* xr = x + i * ldx;
    uint16_t* out = xb + i * ldxb;
    int64_t c = 0;
    for (; c + 16 <= k; c += 16) {
      const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(xr + c));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c),
                          reinterpret_cast<__m256i>(b));
    }
    if (c < k) {
      const __mmask16 m16 = static_cast<__mmask16>((1u << (k - c)) - 1);
      const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m16, xr + c));
      _mm256_mask_storeu_epi16(out + c, m16, reinterpret_cast<__m256i>(b));
    }
  }
}

}  // namespace tandem::kernels::internal
