// Dense GEMMs of the GPU backend behind one thin interface, so that the same
// backend code runs on a GPU (cuBLASLt, blas_cublaslt.cc) and on the emulator
// (host GEMM on the emulated device's host memory, blas_sim.cc).
//
// Math contract: that of Backend::GemmBf16 / GemmF32 (kernels/backend.h),
//   Y[m, n] (+)= sum_k X[m, k] * W[n, k],  row-major with row strides,
// fp32 accumulation. All pointers are device memory; shapes and strides have
// been checked (kernels/op_checks.h CheckGemm) by the caller.
#ifndef TANDEM_KERNELS_CUDA_BLAS_H_
#define TANDEM_KERNELS_CUDA_BLAS_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/device.h"

namespace tandem::kernels::cuda {

class Blas {
 public:
  virtual ~Blas() = default;
  virtual absl::string_view name() const = 0;
  // Counts the moves of device buffers the calls use (staging grown for a larger
  // GEMM): graphs captured before a move are stale (Backend::workspace_generation).
  virtual int64_t buffer_generation() const { return 0; }
  // W BF16. cuBLASLt: exact mode splits X into BF16 hi + lo (fp32-class
  // accuracy, one matmul of 2m rows: the weights are read once), bf16 mode rounds
  // X to BF16 (the contract's 1e-2 bound); the emulator's keeps X in fp32.
  virtual absl::Status GemmBf16(const float* x, int64_t ldx, const uint16_t* w,
                                int64_t ldw, float* y, int64_t ldy, int64_t m,
                                int64_t n, int64_t k, bool accumulate,
                                Stream& stream) = 0;
  // W fp32, fp32 products (no TF32).
  virtual absl::Status GemmF32(const float* x, int64_t ldx, const float* w, int64_t ldw,
                               float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                               bool accumulate, Stream& stream) = 0;
};

// The emulator's GEMM: the exact CPU kernels (kernels/cpu/cpu_backend.h, fp32
// activations) run on the host memory of the emulated device.
std::unique_ptr<Blas> CreateSimBlas();

// cuBLASLt on `device` (a CUDA device, kernels/cuda/cuda_device.h); the device
// must outlive the Blas. `exact`: split-BF16 activations (see GemmBf16). Only in
// --config=cuda builds.
absl::StatusOr<std::unique_ptr<Blas>> CreateCublasLtBlas(Device* device, bool exact);

}  // namespace tandem::kernels::cuda

#endif  // TANDEM_KERNELS_CUDA_BLAS_H_
