// Portable versions of the vector primitives, and the ISA dispatch.
#include <cmath>
#include <cstring>

#include "kernels/cpu/vec_ops.h"

namespace tandem::kernels {
namespace {

const float kE2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

float Bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float E8m0(uint8_t s) {
  if (s == 0xff) return NAN;
  return std::ldexp(1.0f, static_cast<int>(s) - 127);
}

float Dot(const float* x, const float* y, int64_t n) {
  float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    a0 += x[i] * y[i];
    a1 += x[i + 1] * y[i + 1];
    a2 += x[i + 2] * y[i + 2];
    a3 += x[i + 3] * y[i + 3];
  }
  for (; i < n; ++i) a0 += x[i] * y[i];
  return (a0 + a1) + (a2 + a3);
}

float DotBf16(const float* x, const uint16_t* w, int64_t n) {
  float acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += x[i] * Bf16(w[i]);
  return acc;
}

void Axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void AxpyBf16(float a, const uint16_t* w, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * Bf16(w[i]);
}

float DecayedDot(const float* x, const float* gx, const float* y, const float* gy,
                 int64_t n) {
  float acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += x[i] * y[i] * std::exp(gx[i] - gy[i]);
  return acc;
}

void ExpNonpos(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = std::exp(x[i]);
}

void Mxfp4Rows(const uint8_t* packed, const uint8_t* scale, int64_t cols,
               const float* xe, const float* xo, int64_t ldx, int nt, float* y,
               int64_t ldy, int64_t r0, int64_t r1) {
  const int64_t half = cols / 2, groups = cols / 32;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* p = packed + r * half;
    const uint8_t* s = scale + r * groups;
    float acc[4] = {0, 0, 0, 0};
    for (int64_t g = 0; g < groups; ++g) {
      float part[4] = {0, 0, 0, 0};
      for (int64_t j = g * 16; j < g * 16 + 16; ++j) {
        const float lo = kE2m1[p[j] & 0xf], hi = kE2m1[p[j] >> 4];
        for (int t = 0; t < nt; ++t)
          part[t] += lo * xe[t * ldx + j] + hi * xo[t * ldx + j];
      }
      const float sc = E8m0(s[g]);
      for (int t = 0; t < nt; ++t) acc[t] += part[t] * sc;
    }
    for (int t = 0; t < nt; ++t) y[t * ldy + r] = acc[t];
  }
}

void GemmNn(const float* x, int64_t ldx, const float* b, int64_t ldb, float* y,
            int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate) {
  for (int64_t i = 0; i < m; ++i) {
    float* yr = y + i * ldy;
    if (!accumulate) {
      for (int64_t j = 0; j < n; ++j) yr[j] = 0.0f;
    }
    for (int64_t l = 0; l < k; ++l) {
      const float a = x[i * ldx + l];
      const float* br = b + l * ldb;
      for (int64_t j = 0; j < n; ++j) yr[j] += a * br[j];
    }
  }
}

}  // namespace

namespace internal {
const VecOps& VecOpsGeneric() {
  static const VecOps ops = {&Dot,        &DotBf16,   &Axpy,      &AxpyBf16,
                             &DecayedDot, &ExpNonpos, &Mxfp4Rows, &GemmNn};
  return ops;
}
}  // namespace internal

const VecOps& VecOpsFor(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512:
    case CpuIsa::kAvx512Bf16:
      return internal::VecOpsAvx512();
    case CpuIsa::kAvx2:
      return internal::VecOpsAvx2();
    case CpuIsa::kGeneric:
      break;
  }
  return internal::VecOpsGeneric();
}

}  // namespace tandem::kernels
