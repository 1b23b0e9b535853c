// Chooses a kernel backend by name at start-up.
#ifndef TANDEM_KERNELS_BACKEND_FACTORY_H_
#define TANDEM_KERNELS_BACKEND_FACTORY_H_

#include <memory>

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
//        elsewhere, or when no GPU is visible).
// The device backends take device memory (Backend::device()).
// Anything else: InvalidArgument.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(absl::string_view name);

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_BACKEND_FACTORY_H_
