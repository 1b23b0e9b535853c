// The backends the conformance suites (conformance_test.cc,
// vision_conformance_test.cc) run, by name, and how each is made:
//   cpu_reference             the fp64-loop oracle itself
//   cpu_<isa>                 the optimised CPU backend at every ISA this machine
//                             supports (forced, not from the environment)
//   cpu_avx512_bf16_own       the avx512_bf16 level without oneDNN (its own kernel)
//   cuda_sim, cuda_sim_bf16   the GPU kernels on the SIMT emulator, exact and with
//                             BF16 operands (GpuPrecision::kBf16)
//   cuda, cuda_bf16           the same on a GPU (--config=cuda builds where one is
//                             visible)
// Device backends are wrapped in a StagingBackend: host vectors uploaded to
// buffers of exactly each op's extents, guard bytes around every output.
#ifndef TANDEM_KERNELS_CONFORMANCE_BACKENDS_H_
#define TANDEM_KERNELS_CONFORMANCE_BACKENDS_H_

#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"

namespace tandem::kernels {

std::vector<std::string> ConformanceBackendNames();

// nullptr (with a gtest failure) if `name` cannot be made here.
std::unique_ptr<Backend> MakeConformanceBackend(const std::string& name);

// The GPU backends whose tensor cores take BF16-rounded operands: "cuda_bf16",
// "cuda_sim_bf16".
bool GpuBf16Operands(const std::string& name);

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_CONFORMANCE_BACKENDS_H_
