#include "kernels/conformance_backends.h"

#include <utility>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/staging_backend.h"

namespace tandem::kernels {

std::vector<std::string> ConformanceBackendNames() {
  std::vector<std::string> names = {"cpu_reference"};
  for (CpuIsa isa :
       {CpuIsa::kGeneric, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16}) {
    if (static_cast<int>(isa) <= static_cast<int>(HardwareIsa())) {
      names.push_back(std::string("cpu_") + std::string(IsaName(isa)));
    }
  }
  // The avx512_bf16 level routes M >= 64 GEMMs to oneDNN; also test its own kernel.
  if (HardwareIsa() == CpuIsa::kAvx512Bf16) names.push_back("cpu_avx512_bf16_own");
  // Device backends: whichever this build has (each factory is FailedPrecondition
  // in the other build; "cuda" also without a visible GPU).
  if (cuda::CreateCudaSimBackend().ok()) {
    names.push_back("cuda_sim");
    names.push_back("cuda_sim_bf16");
  }
  if (cuda::CreateCudaBackend().ok()) {
    names.push_back("cuda");
    names.push_back("cuda_bf16");
  }
  return names;
}

bool GpuBf16Operands(const std::string& name) {
  return name == "cuda_sim_bf16" || name == "cuda_bf16";
}

std::unique_ptr<Backend> MakeConformanceBackend(const std::string& name) {
  if (name == "cpu_reference") return CreateReferenceBackend();
  if (absl::StartsWith(name, "cuda")) {
    const auto precision =
        GpuBf16Operands(name) ? cuda::GpuPrecision::kBf16 : cuda::GpuPrecision::kExact;
    auto device = absl::StartsWith(name, "cuda_sim")
                      ? cuda::CreateCudaSimBackend(precision)
                      : cuda::CreateCudaBackend(0, precision);
    EXPECT_TRUE(device.ok()) << name << ": " << device.status();
    if (!device.ok()) return nullptr;
    return std::make_unique<StagingBackend>(std::move(device).value());
  }
  if (!absl::StartsWith(name, "cpu_")) {
    ADD_FAILURE() << "unknown conformance backend " << name;
    return nullptr;
  }
  const bool own = absl::EndsWith(name, "_own");
  CpuIsa isa;
  if (!ParseIsa(name.substr(4, name.size() - 4 - (own ? 4 : 0)), &isa)) {
    ADD_FAILURE() << "unknown ISA in " << name;
    return nullptr;
  }
  // 3 threads: uneven static chunks on any machine.
  auto backend = CreateCpuBackend(isa, /*threads=*/3, /*use_onednn=*/!own);
  EXPECT_TRUE(backend.ok()) << name << ": " << backend.status();
  if (!backend.ok()) return nullptr;
  return std::move(backend).value();
}

}  // namespace tandem::kernels
