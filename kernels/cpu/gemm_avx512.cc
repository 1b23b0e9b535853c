// Compiled with AVX-512 F/BW/VL/DQ flags; only called when the CPU has them.
// fp32 FMA dot products; BF16 weights are widened in registers (exact).
#include <immintrin.h>

#include "kernels/cpu/gemm_kernels.h"
#include "kernels/cpu/gemm_tiling.h"

namespace tandem::kernels::internal {
namespace {

inline __m512 LoadW(const uint16_t* p) {
  const __m512i v =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
inline __m512 LoadWMasked(const uint16_t* p, __mmask16 m) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
inline __m512 LoadW(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 LoadWMasked(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}

template <typename WT>
struct ForW {
  template <int MR, int NR>
  struct Micro {
    static void Run(const float* x, int64_t ldx, const WT* w, int64_t ldw, float* y,
                    int64_t ldy, int64_t kb, bool add) {
      __m512 acc[MR][NR];
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
      int64_t kk = 0;
      for (; kk + 16 <= kb; kk += 16) {
        __m512 wv[NR];
        for (int j = 0; j < NR; ++j) wv[j] = LoadW(w + j * ldw + kk);
        for (int i = 0; i < MR; ++i) {
          const __m512 xv = _mm512_loadu_ps(x + i * ldx + kk);
          for (int j = 0; j < NR; ++j)
            acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
      }
      if (kk < kb) {
        const __mmask16 m = static_cast<__mmask16>((1u << (kb - kk)) - 1);
        __m512 wv[NR];
        for (int j = 0; j < NR; ++j) wv[j] = LoadWMasked(w + j * ldw + kk, m);
        for (int i = 0; i < MR; ++i) {
          const __m512 xv = _mm512_maskz_loadu_ps(m, x + i * ldx + kk);
          for (int j = 0; j < NR; ++j)
            acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
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
};

}  // namespace

void GemmBf16Avx512(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw,
                    float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                    bool accumulate) {
  BlockedGemm<float, uint16_t, MicroTable4x4<ForW<uint16_t>::Micro>>(
      x, ldx, w, ldw, y, ldy, m, n, k, accumulate);
}

void GemmF32Avx512(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                   int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate) {
  BlockedGemm<float, float, MicroTable4x4<ForW<float>::Micro>>(x, ldx, w, ldw, y, ldy,
                                                               m, n, k, accumulate);
}

}  // namespace tandem::kernels::internal
