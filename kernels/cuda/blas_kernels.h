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

}  // namespace tandem::kernels::cuda

#endif  // TANDEM_KERNELS_CUDA_BLAS_KERNELS_H_
