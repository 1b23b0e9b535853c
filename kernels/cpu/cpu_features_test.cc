#include "kernels/cpu/cpu_features.h"

#include <cstdlib>

#include "gtest/gtest.h"

namespace tandem::kernels {
namespace {

TEST(CpuFeaturesTest, NamesRoundTrip) {
  for (CpuIsa isa :
       {CpuIsa::kGeneric, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16}) {
    CpuIsa back;
    ASSERT_TRUE(ParseIsa(IsaName(isa), &back));
    EXPECT_EQ(back, isa);
  }
  CpuIsa out;
  EXPECT_FALSE(ParseIsa("sse9", &out));
}

TEST(CpuFeaturesTest, ActiveNeverExceedsHardwareAndHonoursCap) {
  EXPECT_LE(static_cast<int>(ActiveIsa()), static_cast<int>(HardwareIsa()));
  const char* env = std::getenv("TANDEM_CPU_ISA");
  CpuIsa cap;
  if (env != nullptr && ParseIsa(env, &cap)) {
    EXPECT_LE(static_cast<int>(ActiveIsa()), static_cast<int>(cap));
  } else {
    EXPECT_EQ(ActiveIsa(), HardwareIsa());
  }
}

TEST(CpuFeaturesTest, HardwareMatchesCompilerBuiltins) {
  __builtin_cpu_init();
  bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  EXPECT_EQ(HardwareIsa() >= CpuIsa::kAvx2, avx2);
  if (HardwareIsa() >= CpuIsa::kAvx512) {
    EXPECT_TRUE(__builtin_cpu_supports("avx512f"));
  }
}

}  // namespace
}  // namespace tandem::kernels
