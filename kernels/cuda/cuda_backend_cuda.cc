// The factories of --config=cuda builds: "cuda" on a GPU. The emulator's kernels
// are not linked into these builds (the same launcher symbols are the nvcc ones).
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda/blas.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_device.h"

namespace tandem::kernels::cuda {

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int ordinal,
                                                           GpuPrecision precision) {
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, CreateCudaDevice(ordinal));
  TANDEM_ASSIGN_OR_RETURN(
      std::unique_ptr<Blas> blas,
      CreateCublasLtBlas(device.get(), precision == GpuPrecision::kExact));
  // The Blas holds a pointer to the device, whose ownership moves into the
  // backend; GpuBackend destroys blas_ before device_.
  auto backend = std::make_unique<GpuBackend>(
      precision == GpuPrecision::kExact ? "cuda" : "cuda_bf16", std::move(device),
      std::move(blas), precision);
  if (backend->error_word() == nullptr) {
    return Internal("cuda: cannot allocate the device error word");
  }
  return std::unique_ptr<Backend>(std::move(backend));
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaSimBackend(GpuPrecision) {
  return FailedPrecondition(
      "kernel backend \"cuda_sim\" is not in --config=cuda builds (use \"cuda\")");
}

}  // namespace tandem::kernels::cuda
