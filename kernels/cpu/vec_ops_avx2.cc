// AVX2 + FMA vector primitives. Compiled with -mavx2 -mfma; only reached through
// VecOpsFor() when the CPU has them. Helpers stay in this TU's anonymous namespace.
#include <immintrin.h>
#include <math.h>

#include "kernels/cpu/vec_ops.h"

namespace tandem::kernels {
namespace {

const float kE2m1Mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

float ScaleOf(uint8_t s) {
  if (s == 0xff) return NAN;
  return ldexpf(1.0f, static_cast<int>(s) - 127);
}

inline float Bf16(uint16_t b) {
  union {
    uint32_t u;
    float f;
  } c;
  c.u = static_cast<uint32_t>(b) << 16;
  return c.f;
}

inline __m256 LoadBf16(const uint16_t* p) {
  const __m256i v =
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

inline float Reduce(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 Exp(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

float Dot(const float* x, const float* y, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8), a1);
  }
  for (; i + 8 <= n; i += 8)
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), a0);
  float s = Reduce(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) s += x[i] * y[i];
  return s;
}

float DotBf16(const float* x, const uint16_t* w, int64_t n) {
  __m256 a0 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), LoadBf16(w + i), a0);
  float s = Reduce(a0);
  for (; i < n; ++i) s += x[i] * Bf16(w[i]);
  return s;
}

void Axpy(float a, const float* x, float* y, int64_t n) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(
        y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += a * x[i];
}

void AxpyBf16(float a, const uint16_t* w, float* y, int64_t n) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i,
                     _mm256_fmadd_ps(va, LoadBf16(w + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += a * Bf16(w[i]);
}

float DecayedDot(const float* x, const float* gx, const float* y, const float* gy,
                 int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e =
        Exp(_mm256_sub_ps(_mm256_loadu_ps(gx + i), _mm256_loadu_ps(gy + i)));
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)),
                          e, acc);
  }
  float s = Reduce(acc);
  for (; i < n; ++i) s += x[i] * y[i] * expf(gx[i] - gy[i]);
  return s;
}

void ExpNonpos(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, Exp(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) y[i] = expf(x[i]);
}

// 8 codes (low or high nibbles of 8 bytes, as int32 lanes) -> E2M1 values.
inline __m256 Decode(__m256i codes, __m256 mag) {
  const __m256 v =
      _mm256_permutevar8x32_ps(mag, _mm256_and_si256(codes, _mm256_set1_epi32(7)));
  const __m256i sign =
      _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(8)), 28);
  return _mm256_xor_ps(v, _mm256_castsi256_ps(sign));
}

template <int NT>
void Mxfp4RowsT(const uint8_t* packed, const uint8_t* scale, int64_t cols,
                const float* xe, const float* xo, int64_t ldx, float* y, int64_t ldy,
                int64_t r0, int64_t r1) {
  const int64_t half = cols / 2, groups = cols / 32;
  const __m256 mag = _mm256_loadu_ps(kE2m1Mag);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* p = packed + r * half;
    const uint8_t* s = scale + r * groups;
    __m256 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 sc = _mm256_set1_ps(ScaleOf(s[g]));
      for (int h = 0; h < 2; ++h) {
        const int64_t j = g * 16 + h * 8;
        const __m256i v = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + j)));
        const __m256 wl = _mm256_mul_ps(Decode(v, mag), sc);
        const __m256 wh = _mm256_mul_ps(Decode(_mm256_srli_epi32(v, 4), mag), sc);
        for (int t = 0; t < NT; ++t) {
          acc[t] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(xe + t * ldx + j), acc[t]);
          acc[t] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(xo + t * ldx + j), acc[t]);
        }
      }
    }
    for (int t = 0; t < NT; ++t) y[t * ldy + r] = Reduce(acc[t]);
  }
}

void Mxfp4Rows(const uint8_t* packed, const uint8_t* scale, int64_t cols,
               const float* xe, const float* xo, int64_t ldx, int nt, float* y,
               int64_t ldy, int64_t r0, int64_t r1) {
  switch (nt) {
    case 1:
      return Mxfp4RowsT<1>(packed, scale, cols, xe, xo, ldx, y, ldy, r0, r1);
    case 2:
      return Mxfp4RowsT<2>(packed, scale, cols, xe, xo, ldx, y, ldy, r0, r1);
    case 3:
      return Mxfp4RowsT<3>(packed, scale, cols, xe, xo, ldx, y, ldy, r0, r1);
    default:
      return Mxfp4RowsT<4>(packed, scale, cols, xe, xo, ldx, y, ldy, r0, r1);
  }
}

// Y rows i..i+MR, columns j..j+32 (4 vectors of 8; full tiles only).
template <int MR>
void GemmNnTile(const float* x, int64_t ldx, const float* b, int64_t ldb, float* y,
                int64_t ldy, int64_t k, bool accumulate) {
  __m256 acc[MR][4];
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < 4; ++v) {
      acc[i][v] =
          accumulate ? _mm256_loadu_ps(y + i * ldy + v * 8) : _mm256_setzero_ps();
    }
  }
  for (int64_t l = 0; l < k; ++l) {
    __m256 bv[4];
    for (int v = 0; v < 4; ++v) bv[v] = _mm256_loadu_ps(b + l * ldb + v * 8);
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_set1_ps(x[i * ldx + l]);
      for (int v = 0; v < 4; ++v) acc[i][v] = _mm256_fmadd_ps(a, bv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(y + i * ldy + v * 8, acc[i][v]);
  }
}

void GemmNn(const float* x, int64_t ldx, const float* b, int64_t ldb, float* y,
            int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate) {
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    int64_t i = 0;
    for (; i + 3 <= m; i += 3) {
      GemmNnTile<3>(x + i * ldx, ldx, b + j, ldb, y + i * ldy + j, ldy, k, accumulate);
    }
    for (; i < m; ++i) {
      GemmNnTile<1>(x + i * ldx, ldx, b + j, ldb, y + i * ldy + j, ldy, k, accumulate);
    }
  }
  if (j < n) {  // remaining columns: plain loops
    for (int64_t i = 0; i < m; ++i) {
      float* yr = y + i * ldy;
      if (!accumulate) {
        for (int64_t c = j; c < n; ++c) yr[c] = 0.0f;
      }
      for (int64_t l = 0; l < k; ++l) {
        const float a = x[i * ldx + l];
        for (int64_t c = j; c < n; ++c) yr[c] += a * b[l * ldb + c];
      }
    }
  }
}

}  // namespace

namespace internal {
const VecOps& VecOpsAvx2() {
  static const VecOps ops = {&Dot,        &DotBf16,   &Axpy,      &AxpyBf16,
                             &DecayedDot, &ExpNonpos, &Mxfp4Rows, &GemmNn};
  return ops;
}
}  // namespace internal

}  // namespace tandem::kernels
