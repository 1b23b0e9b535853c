// Run-time CPU feature detection. The default build targets plain x86-64; SIMD
// kernels live in their own translation units compiled with -mavx2 / -mavx512*
// and are chosen here at start-up, so one binary runs on any x86-64 machine.
#ifndef TANDEM_KERNELS_CPU_CPU_FEATURES_H_
#define TANDEM_KERNELS_CPU_CPU_FEATURES_H_

#include "absl/strings/string_view.h"

namespace tandem::kernels {

// Instruction-set levels, each implying the ones before it.
enum class CpuIsa {
  kGeneric = 0,     // SSE2 baseline of x86-64
  kAvx2 = 1,        // AVX2 + FMA
  kAvx512 = 2,      // AVX-512 F/BW/VL/DQ
  kAvx512Bf16 = 3,  // kAvx512 + AVX512_BF16 (vdpbf16ps)
};

// The best level this machine supports, capped by $TANDEM_CPU_ISA
// (generic|avx2|avx512|avx512_bf16) when set, so every path can be forced in tests
// and benchmarks. Computed once.
CpuIsa ActiveIsa();
// The best level the hardware supports, ignoring $TANDEM_CPU_ISA.
CpuIsa HardwareIsa();

absl::string_view IsaName(CpuIsa isa);
// Parses the names above; false on anything else.
bool ParseIsa(absl::string_view name, CpuIsa* out);

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_CPU_CPU_FEATURES_H_
