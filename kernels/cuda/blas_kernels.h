// Launchers of the small kernels the GEMM wrappers need (blas_kernels.cu). Plain
// C++ types; device pointers; `stream` is the native stream handle; each returns
// nullptr on success or the launch error.
#ifndef TANDEM_KERNELS_CUDA_BLAS_KERNELS_H_
#define TANDEM_KERNELS_CUDA_BLAS_KERNELS_H_

#include <cstdint>

namespace tandem::kernels::cuda {

// out[r * k + c] = bf16_rne(x[r * ldx + c]) for r < m, c < k (out contiguous).
const char* LaunchF32ToBf16Rows(const float* x, int64_t ldx, uint16_t* out, int64_t m,
                                int64_t k, void* stream);

// Split BF16: out rows r < m hold hi = bf16_rne(x[r]), rows m + r hold
// lo = bf16_rne(x[r] - hi) (out contiguous, [2m, k]). hi + lo carries 16 of fp32's
// 24 significand bits: X W^T = hi W^T + lo W^T with BF16 W is fp32-accurate to
// ~2^-17 relative per product (a non-finite x gives hi = x, lo = 0).
const char* LaunchF32ToBf16SplitRows(const float* x, int64_t ldx, uint16_t* out,
                                     int64_t m, int64_t k, void* stream);

// y[r, c] = (accumulate ? y[r, c] : 0) + (pair[r, c] + pair[m + r, c]) for r < m,
// c < n; pair contiguous [2m, n]; y row stride ldy. The sum of the hi and lo
// products of a split GEMM.
const char* LaunchAddRowPairs(const float* pair, int64_t m, int64_t n, float* y,
                              int64_t ldy, bool accumulate, void* stream);

}  // namespace tandem::kernels::cuda

#endif  // TANDEM_KERNELS_CUDA_BLAS_KERNELS_H_
