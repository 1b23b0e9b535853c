// Compiled with -mavx2 -mfma; only called when the CPU has them.
#include <immintrin.h>

#include "kernels/bf16.h"
#include "kernels/cpu/gemm_kernels.h"
#include "kernels/cpu/gemm_tiling.h"

namespace tandem::kernels::internal {
namespace {

inline __m256 LoadW(const uint16_t* p) {
  const __m256i v =
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
inline __m256 LoadW(const float* p) { return _mm256_loadu_ps(p); }
inline float ScalarW(const uint16_t* p) { return Bf16ToF32(*p); }
inline float ScalarW(const float* p) { return *p; }

inline float Reduce(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <typename WT>
struct ForW {
  template <int MR, int NR>
  struct Micro {
    static void Run(const float* x, int64_t ldx, const WT* w, int64_t ldw, float* y,
                    int64_t ldy, int64_t kb, bool add) {
      __m256 acc[MR][NR];
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
      int64_t kk = 0;
      for (; kk + 8 <= kb; kk += 8) {
        __m256 wv[NR];
        for (int j = 0; j < NR; ++j) wv[j] = LoadW(w + j * ldw + kk);
        for (int i = 0; i < MR; ++i) {
          const __m256 xv = _mm256_loadu_ps(x + i * ldx + kk);
          for (int j = 0; j < NR; ++j)
            acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
      }
      for (int i = 0; i < MR; ++i) {
        for (int j = 0; j < NR; ++j) {
          float s = Reduce(acc[i][j]);
          for (int64_t t = kk; t < kb; ++t)
            s += x[i * ldx + t] * ScalarW(w + j * ldw + t);
          y[i * ldy + j] = add ? y[i * ldy + j] + s : s;
        }
      }
    }
  };
};

}  // namespace

void GemmBf16Avx2(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw, float* y,
                  int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate) {
  BlockedGemm<float, uint16_t, MicroTable4x4<ForW<uint16_t>::Micro>>(
      x, ldx, w, ldw, y, ldy, m, n, k, accumulate);
}

void GemmF32Avx2(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                 int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate) {
  BlockedGemm<float, float, MicroTable4x4<ForW<float>::Micro>>(x, ldx, w, ldw, y, ldy,
                                                               m, n, k, accumulate);
}

}  // namespace tandem::kernels::internal
