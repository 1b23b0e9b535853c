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

// Sums each of eight 16-lane accumulators to one float, bit for bit as
// _mm512_reduce_add_ps does one at a time (GCC's tree: lanes i + i+8, then
// i + i+4, then i + i+2, then the last pair; fp addition is commutative, so only
// the pairing matters), in about a fifth of the instructions: the accumulators
// are halved two at a time. Returns sums 0..7 in order.
inline __m256 Reduce8(const __m512* a) {
  __m512 b[4], c[2];
  for (int p = 0; p < 4; ++p) {  // i + i+8: lower 256 bits + upper 256 bits
    b[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
  }
  for (int p = 0; p < 2; ++p) {  // i + i+4: 128-bit lanes 0 + 1 and 2 + 3
    c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0xDD));
  }
  // c[0] lane L holds the four partials of sum L, c[1] lane L those of sum L + 4.
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x44),  // i + i+2
                                 _mm512_shuffle_ps(c[0], c[1], 0xEE));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d, d, 0x88),  // the last pair
                                 _mm512_shuffle_ps(d, d, 0xDD));
  // e lane L = [sum L, sum L + 4, sum L, sum L + 4].
  const __m512i order =
      _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, e));
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
      int i0 = 0;
      if constexpr (NR == 4) {
        for (; i0 + 2 <= MR; i0 += 2) {
          const __m512 pair[8] = {acc[i0][0],     acc[i0][1],     acc[i0][2],
                                  acc[i0][3],     acc[i0 + 1][0], acc[i0 + 1][1],
                                  acc[i0 + 1][2], acc[i0 + 1][3]};
          const __m256 s = Reduce8(pair);
          const __m128 s0 = _mm256_castps256_ps128(s), s1 = _mm256_extractf128_ps(s, 1);
          float* y0 = y + i0 * ldy;
          float* y1 = y0 + ldy;
          _mm_storeu_ps(y0, add ? _mm_add_ps(_mm_loadu_ps(y0), s0) : s0);
          _mm_storeu_ps(y1, add ? _mm_add_ps(_mm_loadu_ps(y1), s1) : s1);
        }
      }
      for (int i = i0; i < MR; ++i) {
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
    if constexpr (NR == 8) {
      const __m256 sum = Reduce8(acc[i]);
      float* yi = y + i * ldy;
      _mm256_storeu_ps(yi, add ? _mm256_add_ps(_mm256_loadu_ps(yi), sum) : sum);
    } else {
      for (int r = 0; r < NR; ++r) {
        const float sum = _mm512_reduce_add_ps(acc[i][r]);
        y[i * ldy + r] = add ? y[i * ldy + r] + sum : sum;
      }
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
