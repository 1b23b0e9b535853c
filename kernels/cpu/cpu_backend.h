// The optimised CPU backend: AVX-512 (+BF16) / AVX2 / generic kernels chosen by
// the ISA given at construction, multithreaded with a fixed ThreadPool.
#ifndef TANDEM_KERNELS_CPU_CPU_BACKEND_H_
#define TANDEM_KERNELS_CPU_CPU_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_features.h"

namespace tandem::kernels {

// isa must be supported by the hardware (HardwareIsa()), else InvalidArgument.
// threads <= 0: one per hardware thread. Name: "cpu_<isa>" e.g. "cpu_avx512_bf16".
absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(CpuIsa isa, int threads);

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_CPU_CPU_BACKEND_H_
