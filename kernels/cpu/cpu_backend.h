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
// use_onednn: at the avx512_bf16 level, GEMMs with M >= kOneDnnMinM (prefill) go
// to oneDNN's BF16 matmul (kernels/cpu/onednn_gemm.h), which is faster there.
// A backend instance serves one caller at a time.
absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(CpuIsa isa, int threads,
                                                          bool use_onednn = true);

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_CPU_CPU_BACKEND_H_
