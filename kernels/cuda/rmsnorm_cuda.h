// RMSNorm on the GPU (the same math as kernels/cpu/rmsnorm.h). Plain C++ interface
// so that nvcc-compiled code needs no project headers; built under --config=cuda.
#ifndef TANDEM_KERNELS_CUDA_RMSNORM_CUDA_H_
#define TANDEM_KERNELS_CUDA_RMSNORM_CUDA_H_

#include <cstdint>
#include <string>

namespace tandem::kernels::cuda {

// Device pointers; x, y: [rows, n]; w: [n]. Launches on `stream` (a cudaStream_t,
// nullptr = default stream). Returns "" on success, else the CUDA error string.
std::string RmsNormDevice(const float* x, const float* w, float* y, int64_t rows,
                          int64_t n, float eps, void* stream);

// Host convenience for tests: copies in, runs, copies out, synchronises.
std::string RmsNormHost(const float* x, const float* w, float* y, int64_t rows,
                        int64_t n, float eps);

// Number of visible CUDA devices (0 when none or no driver).
int DeviceCount();

}  // namespace tandem::kernels::cuda

#endif  // TANDEM_KERNELS_CUDA_RMSNORM_CUDA_H_
