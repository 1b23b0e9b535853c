#include "kernels/cpu/cpu_features.h"

#include <algorithm>
#include <cstdlib>

namespace tandem::kernels {

CpuIsa HardwareIsa() {
  static const CpuIsa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
      if (__builtin_cpu_supports("avx512bf16")) return CpuIsa::kAvx512Bf16;
      return CpuIsa::kAvx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      return CpuIsa::kAvx2;
    }
    return CpuIsa::kGeneric;
  }();
  return isa;
}

CpuIsa ActiveIsa() {
  static const CpuIsa isa = [] {
    CpuIsa hw = HardwareIsa();
    const char* env = std::getenv("TANDEM_CPU_ISA");
    CpuIsa cap;
    if (env != nullptr && ParseIsa(env, &cap)) {
      return static_cast<CpuIsa>(std::min(static_cast<int>(hw), static_cast<int>(cap)));
    }
    return hw;
  }();
  return isa;
}

absl::string_view IsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kGeneric:
      return "generic";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx512Bf16:
      return "avx512_bf16";
  }
  return "generic";
}

bool ParseIsa(absl::string_view name, CpuIsa* out) {
  for (CpuIsa isa :
       {CpuIsa::kGeneric, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16}) {
    if (name == IsaName(isa)) {
      *out = isa;
      return true;
    }
  }
  return false;
}

}  // namespace tandem::kernels
