#include "kernels/backend_factory.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "common/status.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/cuda/cuda_backend.h"

namespace tandem::kernels {
namespace {

bool HasGpus(absl::string_view kind) { return kind == "cuda" || kind == "cuda_bf16"; }
bool IsSim(absl::string_view kind) {
  return kind == "cuda_sim" || kind == "cuda_sim_bf16";
}

}  // namespace

absl::StatusOr<BackendName> ParseBackendName(absl::string_view name) {
  BackendName out;
  const size_t colon = name.find(':');
  out.kind = std::string(name.substr(0, colon));
  if (colon == absl::string_view::npos) return out;
  const absl::string_view digits = name.substr(colon + 1);
  if (!HasGpus(out.kind)) {
    return InvalidArgument("kernel backend \"", name, "\": only cuda and cuda_bf16 ",
                           "take a GPU ordinal (\"cuda:N\")");
  }
  if (digits.empty() || !absl::SimpleAtoi(digits, &out.ordinal) || out.ordinal < 0) {
    return InvalidArgument("kernel backend \"", name,
                           "\": the GPU ordinal after ':' must be an integer >= 0");
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(absl::string_view name) {
  TANDEM_ASSIGN_OR_RETURN(BackendName parsed, ParseBackendName(name));
  return CreateBackend(parsed.kind, parsed.ordinal);
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(absl::string_view name,
                                                       int ordinal) {
  if (ordinal < 0 || (ordinal != 0 && !HasGpus(name) && !IsSim(name))) {
    return InvalidArgument("kernel backend \"", name, "\" has no device ordinal ",
                           ordinal, " (GPU ordinals apply to cuda and cuda_bf16)");
  }
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
  // Every cuda_sim backend is its own emulated device: the ordinal is unused.
  if (name == "cuda_sim") return cuda::CreateCudaSimBackend();
  if (name == "cuda_sim_bf16")
    return cuda::CreateCudaSimBackend(cuda::GpuPrecision::kBf16);
  if (name == "cuda") return cuda::CreateCudaBackend(ordinal);
  if (name == "cuda_bf16") {
    return cuda::CreateCudaBackend(ordinal, cuda::GpuPrecision::kBf16);
  }
  return InvalidArgument("unknown kernel backend \"", name,
                         "\" (known: cpu, cpu_bf16, cpu_reference, cuda_sim and "
                         "cuda_sim_bf16 in the default build, cuda[:N] and "
                         "cuda_bf16[:N] in --config=cuda builds)");
}

}  // namespace tandem::kernels
