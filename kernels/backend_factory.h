// Chooses a kernel backend by name at start-up.
#ifndef TANDEM_KERNELS_BACKEND_FACTORY_H_
#define TANDEM_KERNELS_BACKEND_FACTORY_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"

namespace tandem::kernels {

// "cpu": optimised, exact mode: the best ISA of this machine up to AVX-512 (capped by
//        $TANDEM_CPU_ISA), fp32 activations, one thread per hardware thread; its
//        results for a row do not depend on the batch shape (batch invariance);
// "cpu_bf16": the fastest kernels: AVX512_BF16 dot products on BF16-rounded
//        activations and oneDNN for prefill-sized GEMMs. Faster, but results then
//        depend on the GEMM shape, so batch invariance holds only within tolerance;
// "cpu_reference": the oracle (plain loops, single thread);
// "cuda_sim": the GPU backend's kernels on the CPU's SIMT emulator (default
//        build; FailedPrecondition in --config=cuda builds);
// "cuda": the GPU backend on GPU 0 (--config=cuda builds; FailedPrecondition
//        elsewhere, or when no GPU is visible); "cuda:N" on GPU N.
// "cuda_bf16" / "cuda_sim_bf16": the same with activations rounded to BF16 once.
// The device backends take device memory (Backend::device()).
// Anything else: InvalidArgument.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(absl::string_view name);

// A backend name split into its kind and device ordinal: "cuda:3" -> {"cuda", 3},
// "cuda" -> {"cuda", 0}, "cpu" -> {"cpu", 0}. An ordinal is accepted only on the
// kinds that have GPUs ("cuda", "cuda_bf16"); a bad or negative one, or one on
// another kind, is InvalidArgument.
struct BackendName {
  std::string kind;
  int ordinal = 0;
};
absl::StatusOr<BackendName> ParseBackendName(absl::string_view name);

// CreateBackend of `kind` (a name without ordinal) on GPU `ordinal`. Kinds
// without GPUs take ordinal 0 only ("cuda_sim": every call is its own emulated
// device whatever the ordinal names, so ordinals there are accepted and unused).
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(absl::string_view kind,
                                                       int ordinal);

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_BACKEND_FACTORY_H_
