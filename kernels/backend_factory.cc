#include "kernels/backend_factory.h"

#include <algorithm>

#include "common/status.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/cuda/cuda_backend.h"

namespace tandem::kernels {

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(absl::string_view name) {
  if (name == "cpu") {
    // Exact mode: fp32 activations on every path, the same arithmetic whatever the
    // batch shape, so a request's tokens do not depend on what it is batched with
    // (docs/ARCHITECTURE.md, "Numerics"). The BF16-activation kernels and oneDNN
    // round activations differently per GEMM shape: opt in with "cpu_bf16".
    CpuIsa isa = static_cast<CpuIsa>(
        std::min(static_cast<int>(ActiveIsa()), static_cast<int>(CpuIsa::kAvx512)));
    return CreateCpuBackend(isa, /*threads=*/0, /*use_onednn=*/false);
  }
  if (name == "cpu_bf16") return CreateCpuBackend(ActiveIsa(), /*threads=*/0);
  if (name == "cpu_reference") return CreateReferenceBackend();
  // Each is FailedPrecondition in the build that does not have it.
  // "cuda" and "cuda_sim" are exact (split-BF16 tensor-core operands: tokens
  // match the CPU backend's); the _bf16 names round activations to BF16 once.
  if (name == "cuda_sim") return cuda::CreateCudaSimBackend();
  if (name == "cuda_sim_bf16")
    return cuda::CreateCudaSimBackend(cuda::GpuPrecision::kBf16);
  if (name == "cuda") return cuda::CreateCudaBackend(/*ordinal=*/0);
  if (name == "cuda_bf16") {
    return cuda::CreateCudaBackend(/*ordinal=*/0, cuda::GpuPrecision::kBf16);
  }
  return InvalidArgument("unknown kernel backend \"", name,
                         "\" (known: cpu, cpu_bf16, cpu_reference, cuda_sim and "
                         "cuda_sim_bf16 in the default build, cuda and cuda_bf16 in "
                         "--config=cuda builds)");
}

}  // namespace tandem::kernels
