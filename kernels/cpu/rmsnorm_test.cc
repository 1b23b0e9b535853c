// Every RMSNorm implementation this CPU can run, against the reference.
#include "kernels/cpu/rmsnorm.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::kernels {
namespace {

std::vector<CpuIsa> RunnableIsas() {
  std::vector<CpuIsa> out;
  for (CpuIsa isa : {CpuIsa::kGeneric, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (static_cast<int>(isa) <= static_cast<int>(HardwareIsa())) out.push_back(isa);
  }
  return out;
}

TEST(RmsNormTest, KnownValues) {
  // x = [3, 4]: mean(x^2) = 12.5, rsqrt(12.5) = 0.28284...
  std::vector<float> x = {3, 4}, w = {1, 2}, y(2);
  for (CpuIsa isa : RunnableIsas()) {
    RmsNormIsa(isa, x.data(), w.data(), y.data(), 1, 2, 0.0f);
    EXPECT_NEAR(y[0], 3 / std::sqrt(12.5f), 1e-6) << IsaName(isa);
    EXPECT_NEAR(y[1], 8 / std::sqrt(12.5f), 1e-6) << IsaName(isa);
  }
}

TEST(RmsNormTest, EveryIsaMatchesReferenceOnOddSizes) {
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  for (int64_t n : {1, 7, 8, 15, 16, 17, 33, 64, 100, 7168}) {
    const int64_t rows = 3;
    std::vector<float> x(rows * n), w(n), want(rows * n), got(rows * n);
    for (float& v : x) v = dist(rng);
    for (float& v : w) v = 1.0f + 0.1f * dist(rng);
    RmsNormReference(x.data(), w.data(), want.data(), rows, n, 1e-5f);
    for (CpuIsa isa : RunnableIsas()) {
      RmsNormIsa(isa, x.data(), w.data(), got.data(), rows, n, 1e-5f);
      for (int64_t i = 0; i < rows * n; ++i) {
        // fp32 sums in different orders: relative error bound 1e-5.
        ASSERT_NEAR(got[i], want[i], 1e-5f * (1.0f + std::fabs(want[i])))
            << IsaName(isa) << " n=" << n << " i=" << i;
      }
    }
  }
}

TEST(RmsNormTest, InPlaceAndDispatch) {
  std::vector<float> x = {1, -2, 3, -4, 5}, w(5, 1.0f), want(5);
  RmsNormReference(x.data(), w.data(), want.data(), 1, 5, 1e-6f);
  RmsNorm(x.data(), w.data(), x.data(), 1, 5, 1e-6f);
  for (int i = 0; i < 5; ++i) EXPECT_NEAR(x[i], want[i], 1e-6f);
}

}  // namespace
}  // namespace tandem::kernels
