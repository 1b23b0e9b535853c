#include "kernels/cuda/rmsnorm_cuda.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/rmsnorm.h"

namespace tandem::kernels {
namespace {

TEST(RmsNormCudaTest, MatchesCpuReference) {
  ASSERT_GT(cuda::DeviceCount(), 0) << "no CUDA device visible";
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  for (int64_t n : {1, 100, 7168}) {
    const int64_t rows = 37;
    std::vector<float> x(rows * n), w(n), want(rows * n), got(rows * n);
    for (float& v : x) v = dist(rng);
    for (float& v : w) v = 1.0f + 0.1f * dist(rng);
    RmsNormReference(x.data(), w.data(), want.data(), rows, n, 1e-5f);
    ASSERT_EQ(cuda::RmsNormHost(x.data(), w.data(), got.data(), rows, n, 1e-5f), "");
    for (int64_t i = 0; i < rows * n; ++i) {
      ASSERT_NEAR(got[i], want[i], 1e-5f * (1.0f + std::fabs(want[i]))) << i;
    }
  }
}

}  // namespace
}  // namespace tandem::kernels
