// Small vector primitives used by the attention, KDA and MoE loops of the CPU
// backend, one table per ISA (each in its own translation unit with its -m flags).
// The surrounding loops stay plain C++; the inner 64..1024-element work runs here.
#ifndef TANDEM_KERNELS_CPU_VEC_OPS_H_
#define TANDEM_KERNELS_CPU_VEC_OPS_H_

#include <cstdint>

#include "kernels/cpu/cpu_features.h"

namespace tandem::kernels {

struct VecOps {
  // sum_i x[i] * y[i]
  float (*dot)(const float* x, const float* y, int64_t n);
  // sum_i x[i] * bf16(w[i])
  float (*dot_bf16)(const float* x, const uint16_t* w, int64_t n);
  // y[i] += a * x[i]
  void (*axpy)(float a, const float* x, float* y, int64_t n);
  // y[i] += a * bf16(w[i])
  void (*axpy_bf16)(float a, const uint16_t* w, float* y, int64_t n);
  // sum_i x[i] * y[i] * exp(gx[i] - gy[i]); requires gx[i] - gy[i] <= 0 (the KDA
  // decay between two tokens of a chunk), accurate to ~2 ulp.
  float (*decayed_dot)(const float* x, const float* gx, const float* y, const float* gy,
                       int64_t n);
  // y[i] = exp(x[i]) for x[i] <= 0.
  void (*exp_nonpos)(const float* x, float* y, int64_t n);
  // MXFP4 matrix rows times up to 4 vectors: for r in [r0, r1), t < nt:
  //   y[t * ldy + r] = sum_c W[r, c] * x_t[c]
  // W: packed [rows, cols/2], scale [rows, cols/32] (see backend.h Mxfp4Expert).
  // x_t is given de-interleaved: xe[t * ldx + j] = x_t[2j], xo[t * ldx + j] =
  // x_t[2j+1].
  void (*mxfp4_rows)(const uint8_t* packed, const uint8_t* scale, int64_t cols,
                     const float* xe, const float* xo, int64_t ldx, int nt, float* y,
                     int64_t ldy, int64_t r0, int64_t r1);
  // Small single-threaded "NN" GEMM for the KDA chunk products:
  //   Y[m, n] (+)= X[m, k] @ B[k, n], all row-major fp32 with row strides.
  // Register-blocked broadcast form (rows of B streamed as vectors).
  void (*gemm_nn)(const float* x, int64_t ldx, const float* b, int64_t ldb, float* y,
                  int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate);
};

const VecOps& VecOpsFor(CpuIsa isa);

namespace internal {
const VecOps& VecOpsGeneric();
const VecOps& VecOpsAvx2();
const VecOps& VecOpsAvx512();
}  // namespace internal

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_CPU_VEC_OPS_H_
