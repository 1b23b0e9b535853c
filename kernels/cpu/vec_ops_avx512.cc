// AVX-512 vector primitives. Compiled with AVX-512 F/BW/VL/DQ flags; only reached
// through VecOpsFor() when the CPU has them. Helpers stay in this TU's anonymous
// namespace so that no AVX-512 code can be picked for a shared inline symbol.
#include <immintrin.h>

#include "kernels/cpu/vec_ops.h"

namespace tandem::kernels {
namespace {

const float kE2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

struct ScaleTable {
  float v[256];
  ScaleTable() {
    for (int s = 0; s < 255; ++s) {
      // 2^(s-127); s = 0 is the subnormal 2^-127.
      union {
        uint32_t u;
        float f;
      } c;
      c.u = s == 0 ? 0x00400000u : static_cast<uint32_t>(s) << 23;
      v[s] = c.f;
    }
    union {
      uint32_t u;
      float f;
    } nan;
    nan.u = 0x7fc00000u;
    v[255] = nan.f;
  }
};
const ScaleTable kScales;

inline __mmask16 Tail16(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }

inline __m512 LoadBf16(const uint16_t* p) {
  const __m512i v =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
inline __m512 LoadBf16Masked(const uint16_t* p, __mmask16 m) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

// exp(x) for x <= 0 (clamped at -87: results below 1.7e-38 are not needed).
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

float Dot(const float* x, const float* y, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(y + i + 16), a1);
  }
  for (; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xffff : Tail16(n - i);
    a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + i),
                         _mm512_maskz_loadu_ps(m, y + i), a0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

float DotBf16(const float* x, const uint16_t* w, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), LoadBf16(w + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), LoadBf16(w + i + 16), a1);
  }
  for (; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xffff : Tail16(n - i);
    a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + i), LoadBf16Masked(w + i, m), a0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

void Axpy(float a, const float* x, float* y, int64_t n) {
  const __m512 va = _mm512_set1_ps(a);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xffff : Tail16(n - i);
    _mm512_mask_storeu_ps(y + i, m,
                          _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i),
                                          _mm512_maskz_loadu_ps(m, y + i)));
  }
}

void AxpyBf16(float a, const uint16_t* w, float* y, int64_t n) {
  const __m512 va = _mm512_set1_ps(a);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xffff : Tail16(n - i);
    _mm512_mask_storeu_ps(
        y + i, m,
        _mm512_fmadd_ps(va, LoadBf16Masked(w + i, m), _mm512_maskz_loadu_ps(m, y + i)));
  }
}

float DecayedDot(const float* x, const float* gx, const float* y, const float* gy,
                 int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xffff : Tail16(n - i);
    const __m512 e = Exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, gx + i),
                                       _mm512_maskz_loadu_ps(m, gy + i)));
    const __m512 xy =
        _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
    acc = _mm512_fmadd_ps(xy, e, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

void ExpNonpos(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xffff : Tail16(n - i);
    _mm512_mask_storeu_ps(y + i, m, Exp(_mm512_maskz_loadu_ps(m, x + i)));
  }
}

// RR rows per pass (independent FMA chains and memory streams); each row's
// arithmetic is the same whatever RR and NT.
template <int NT, int RR>
void Mxfp4RowsT(const uint8_t* packed, const uint8_t* scale, int64_t cols,
                const float* xe, const float* xo, int64_t ldx, float* y, int64_t ldy,
                int64_t r0, int64_t r1) {
  const int64_t half = cols / 2, groups = cols / 32;
  const __m512 lut = _mm512_loadu_ps(kE2m1);
  const __m512i low4 = _mm512_set1_epi32(0xf);
  int64_t r = r0;
  for (; r + RR <= r1; r += RR) {
    __m512 acc_lo[RR][NT], acc_hi[RR][NT];
    for (int q = 0; q < RR; ++q)
      for (int t = 0; t < NT; ++t) acc_lo[q][t] = acc_hi[q][t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m512 xev[NT], xov[NT];
      for (int t = 0; t < NT; ++t) {
        xev[t] = _mm512_loadu_ps(xe + t * ldx + g * 16);
        xov[t] = _mm512_loadu_ps(xo + t * ldx + g * 16);
      }
      for (int q = 0; q < RR; ++q) {
        const uint8_t* p = packed + (r + q) * half;
        const __m512i v = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + g * 16)));
        const __m512 sc = _mm512_set1_ps(kScales.v[scale[(r + q) * groups + g]]);
        const __m512 wl =
            _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(v, low4), lut), sc);
        const __m512 wh =
            _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut), sc);
        for (int t = 0; t < NT; ++t) {
          acc_lo[q][t] = _mm512_fmadd_ps(wl, xev[t], acc_lo[q][t]);
          acc_hi[q][t] = _mm512_fmadd_ps(wh, xov[t], acc_hi[q][t]);
        }
      }
    }
    for (int q = 0; q < RR; ++q) {
      for (int t = 0; t < NT; ++t) {
        y[t * ldy + r + q] =
            _mm512_reduce_add_ps(_mm512_add_ps(acc_lo[q][t], acc_hi[q][t]));
      }
    }
  }
  if (RR > 1 && r < r1)
    Mxfp4RowsT<NT, 1>(packed, scale, cols, xe, xo, ldx, y, ldy, r, r1);
}

void Mxfp4Rows(const uint8_t* packed, const uint8_t* scale, int64_t cols,
               const float* xe, const float* xo, int64_t ldx, int nt, float* y,
               int64_t ldy, int64_t r0, int64_t r1) {
  switch (nt) {
    case 1:
      return Mxfp4RowsT<1, 4>(packed, scale, cols, xe, xo, ldx, y, ldy, r0, r1);
    case 2:
      return Mxfp4RowsT<2, 2>(packed, scale, cols, xe, xo, ldx, y, ldy, r0, r1);
    case 3:
      return Mxfp4RowsT<3, 1>(packed, scale, cols, xe, xo, ldx, y, ldy, r0, r1);
    default:
      return Mxfp4RowsT<4, 1>(packed, scale, cols, xe, xo, ldx, y, ldy, r0, r1);
  }
}

// Y rows i..i+MR, columns j..j+64 (4 vectors, the last masked): broadcast X[i, l],
// FMA with row l of B.
template <int MR>
void GemmNnTile(const float* x, int64_t ldx, const float* b, int64_t ldb, float* y,
                int64_t ldy, int64_t nv, __mmask16 last, int64_t k, bool accumulate) {
  __m512 acc[MR][4];
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < 4; ++v) {
      const __mmask16 m = v + 1 < nv ? 0xffff : (v + 1 == nv ? last : 0);
      acc[i][v] = accumulate ? _mm512_maskz_loadu_ps(m, y + i * ldy + v * 16)
                             : _mm512_setzero_ps();
    }
  }
  for (int64_t l = 0; l < k; ++l) {
    __m512 bv[4];
    for (int v = 0; v < 4; ++v) {
      const __mmask16 m = v + 1 < nv ? 0xffff : (v + 1 == nv ? last : 0);
      bv[v] = _mm512_maskz_loadu_ps(m, b + l * ldb + v * 16);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(x[i * ldx + l]);
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_fmadd_ps(a, bv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < 4; ++v) {
      const __mmask16 m = v + 1 < nv ? 0xffff : (v + 1 == nv ? last : 0);
      _mm512_mask_storeu_ps(y + i * ldy + v * 16, m, acc[i][v]);
    }
  }
}

void GemmNn(const float* x, int64_t ldx, const float* b, int64_t ldb, float* y,
            int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate) {
  for (int64_t j = 0; j < n; j += 64) {
    const int64_t cols = n - j < 64 ? n - j : 64;
    const int64_t nv = (cols + 15) / 16;
    const int64_t rem = cols - (nv - 1) * 16;
    const __mmask16 last = static_cast<__mmask16>((1u << rem) - 1);
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) {
      GemmNnTile<4>(x + i * ldx, ldx, b + j, ldb, y + i * ldy + j, ldy, nv, last, k,
                    accumulate);
    }
    for (; i < m; ++i) {
      GemmNnTile<1>(x + i * ldx, ldx, b + j, ldb, y + i * ldy + j, ldy, nv, last, k,
                    accumulate);
    }
  }
}

}  // namespace

namespace internal {
const VecOps& VecOpsAvx512() {
  static const VecOps ops = {&Dot,        &DotBf16,   &Axpy,      &AxpyBf16,
                             &DecayedDot, &ExpNonpos, &Mxfp4Rows, &GemmNn};
  return ops;
}
}  // namespace internal

}  // namespace tandem::kernels
