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

// GEMV path (m <= 3): eight W rows per pass, 32 BF16 weights per 64-byte load.
// Per output it performs exactly the FMA sequence of Micro above (lane l
// accumulates k = l, l + 16, ... of each kGemmKc block in order, masked zero
// tail, _mm512_reduce_add_ps, then += into y), so results are bit-identical to
// the blocked path and never depend on M: only the loads are wider and more rows
// stream at once (about 1.3x the weight bandwidth of 4 rows x 32 bytes).
inline __m512 WidenLo(__m512i v) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
}
inline __m512 WidenHi(__m512i v) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
}

template <int MR, int NR>
void GemvRows(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw, float* y,
              int64_t ldy, int64_t kb, bool add) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_ps();
  int64_t kk = 0;
  for (; kk + 32 <= kb; kk += 32) {
    __m512 x0[MR], x1[MR];
    for (int i = 0; i < MR; ++i) {
      x0[i] = _mm512_loadu_ps(x + i * ldx + kk);
      x1[i] = _mm512_loadu_ps(x + i * ldx + kk + 16);
    }
    for (int r = 0; r < NR; ++r) {
      const __m512i v = _mm512_loadu_si512(w + r * ldw + kk);
      const __m512 lo = WidenLo(v), hi = WidenHi(v);
      for (int i = 0; i < MR; ++i) {
        acc[i][r] = _mm512_fmadd_ps(x0[i], lo, acc[i][r]);
        acc[i][r] = _mm512_fmadd_ps(x1[i], hi, acc[i][r]);
      }
    }
  }
  if (kk + 16 <= kb) {
    for (int r = 0; r < NR; ++r) {
      const __m512 wv = LoadW(w + r * ldw + kk);
      for (int i = 0; i < MR; ++i)
        acc[i][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * ldx + kk), wv, acc[i][r]);
    }
    kk += 16;
  }
  if (kk < kb) {
    const __mmask16 m = static_cast<__mmask16>((1u << (kb - kk)) - 1);
    for (int r = 0; r < NR; ++r) {
      const __m512 wv = LoadWMasked(w + r * ldw + kk, m);
      for (int i = 0; i < MR; ++i) {
        acc[i][r] =
            _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + i * ldx + kk), wv, acc[i][r]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int r = 0; r < NR; ++r) {
      const float sum = _mm512_reduce_add_ps(acc[i][r]);
      y[i * ldy + r] = add ? y[i * ldy + r] + sum : sum;
    }
  }
}

template <int MR>
void Gemv(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw, float* y,
          int64_t ldy, int64_t n, int64_t k, bool accumulate) {
  for (int64_t k0 = 0; k0 < k; k0 += kGemmKc) {
    const int64_t kb = k - k0 < kGemmKc ? k - k0 : kGemmKc;
    const bool add = accumulate || k0 > 0;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      GemvRows<MR, 8>(x + k0, ldx, w + j * ldw + k0, ldw, y + j, ldy, kb, add);
    }
    for (; j < n; ++j) {
      GemvRows<MR, 1>(x + k0, ldx, w + j * ldw + k0, ldw, y + j, ldy, kb, add);
    }
  }
}

}  // namespace

void GemmBf16Avx512(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw,
                    float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                    bool accumulate) {
  if (k > 0 && m <= 3) {
    switch (m) {
      case 1:
        return Gemv<1>(x, ldx, w, ldw, y, ldy, n, k, accumulate);
      case 2:
        return Gemv<2>(x, ldx, w, ldw, y, ldy, n, k, accumulate);
      case 3:
        return Gemv<3>(x, ldx, w, ldw, y, ldy, n, k, accumulate);
    }
  }
  BlockedGemm<float, uint16_t, MicroTable4x4<ForW<uint16_t>::Micro>>(
      x, ldx, w, ldw, y, ldy, m, n, k, accumulate);
}

void GemmF32Avx512(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                   int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate) {
  BlockedGemm<float, float, MicroTable4x4<ForW<float>::Micro>>(x, ldx, w, ldw, y, ldy,
                                                               m, n, k, accumulate);
}

}  // namespace tandem::kernels::internal
