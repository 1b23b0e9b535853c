// The factories of the default build: "cuda_sim" on the emulated device; "cuda"
// is not compiled in.
#include <memory>

#include "common/status.h"
#include "kernels/cuda/blas.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/sim/sim_device.h"

namespace tandem::kernels::cuda {

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaSimBackend(GpuPrecision precision) {
  auto backend = std::make_unique<GpuBackend>(
      precision == GpuPrecision::kExact ? "cuda_sim" : "cuda_sim_bf16",
      CreateSimDevice(), CreateSimBlas(), precision);
  if (backend->error_word() == nullptr) {
    return Internal("cuda_sim: cannot allocate the device error word");
  }
  return std::unique_ptr<Backend>(std::move(backend));
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int ordinal, GpuPrecision) {
  return FailedPrecondition("kernel backend \"cuda\" (GPU ", ordinal,
                            "): this binary was built without CUDA (--config=cuda)");
}

absl::StatusOr<std::unique_ptr<Blas>> CreateCublasLtBlas(Device*, bool) {
  return FailedPrecondition("cuBLASLt: built without CUDA (--config=cuda)");
}

}  // namespace tandem::kernels::cuda
