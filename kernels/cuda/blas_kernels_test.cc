// The FP32 -> BF16 row conversion in front of cuBLASLt (blas_kernels.cu), on the
// emulator, under several schedules.
#include "kernels/cuda/blas_kernels.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/vendor.h"

namespace tandem::kernels::cuda {
namespace {

TEST(BlasKernels, F32ToBf16RowsRoundsToNearestEvenAndKeepsStrides) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 10.0f);
  for (uint64_t seed : {1, 7, 1234}) {
    ::cuda_sim::SetSeed(seed);
    for (auto [m, k] :
         {std::pair<int64_t, int64_t>{1, 1}, {3, 1023}, {2, 1025}, {5, 2100}, {4, 7}}) {
      const int64_t ldx = k + 5;
      std::vector<float> x(m * ldx);
      for (float& v : x) v = nd(rng);
      x[0] = std::numeric_limits<float>::quiet_NaN();
      if (x.size() > 1) x[1] = std::numeric_limits<float>::infinity();
      std::vector<uint16_t> out(m * k + 8, 0xBEEF);
      ASSERT_EQ(LaunchF32ToBf16Rows(x.data(), ldx, out.data(), m, k, &out), nullptr);
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t c = 0; c < k; ++c) {
          ASSERT_EQ(out[r * k + c], gpu::F32ToBf16(x[r * ldx + c]))
              << "seed " << seed << " m " << m << " k " << k << " at " << r << "," << c;
        }
      }
      for (int64_t i = m * k; i < m * k + 8; ++i) ASSERT_EQ(out[i], 0xBEEF);
    }
  }
  // Round to nearest even at the halfway point, both directions.
  float half_up, half_even;
  const uint32_t a = 0x3f808000u, b = 0x3f818000u;  // 1.0039062 and 1.0117188
  std::memcpy(&half_even, &a, 4);
  std::memcpy(&half_up, &b, 4);
  float in[2] = {half_even, half_up};
  uint16_t got[2];
  ASSERT_EQ(LaunchF32ToBf16Rows(in, 2, got, 1, 2, got), nullptr);
  EXPECT_EQ(got[0], 0x3f80);
  EXPECT_EQ(got[1], 0x3f82);
  // Empty: no launch.
  EXPECT_EQ(LaunchF32ToBf16Rows(in, 2, got, 0, 2, got), nullptr);
}

TEST(BlasKernels, SplitRowsCarrySixteenBitsAndAddRowPairsSumsThem) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (uint64_t seed : {1, 99}) {
    ::cuda_sim::SetSeed(seed);
    const int64_t m = 3, k = 1030, ldx = k + 2;
    std::vector<float> x(m * ldx);
    for (float& v : x) v = nd(rng);
    x[5] = std::numeric_limits<float>::infinity();
    std::vector<uint16_t> out(2 * m * k + 4, 0xBEEF);
    ASSERT_EQ(LaunchF32ToBf16SplitRows(x.data(), ldx, out.data(), m, k, &out), nullptr);
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = 0; c < k; ++c) {
        const float v = x[r * ldx + c];
        const uint16_t hi = out[r * k + c], lo = out[(m + r) * k + c];
        ASSERT_EQ(hi, gpu::F32ToBf16(v));
        if (!std::isfinite(v)) {
          ASSERT_EQ(lo, 0);
          continue;
        }
        const double sum = static_cast<double>(gpu::Bf16ToF32(hi)) + gpu::Bf16ToF32(lo);
        // 16 significand bits: |v - (hi + lo)| <= 2^-16 |v|.
        ASSERT_LE(std::fabs(sum - v), std::ldexp(std::fabs(v), -16)) << r << "," << c;
      }
    }
    for (int64_t i = 2 * m * k; i < 2 * m * k + 4; ++i) ASSERT_EQ(out[i], 0xBEEF);

    const int64_t n = 1100, ldy = n + 3;
    std::vector<float> pair(2 * m * n), y(m * ldy, 1.5f), y0 = y;
    for (float& v : pair) v = nd(rng);
    ASSERT_EQ(LaunchAddRowPairs(pair.data(), m, n, y.data(), ldy, true, &y), nullptr);
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = 0; c < ldy; ++c) {
        const float want =
            c < n ? y0[r * ldy + c] + (pair[r * n + c] + pair[(m + r) * n + c])
                  : y0[r * ldy + c];
        ASSERT_EQ(y[r * ldy + c], want) << r << "," << c;
      }
    }
    ASSERT_EQ(LaunchAddRowPairs(pair.data(), m, n, y.data(), ldy, false, &y), nullptr);
    EXPECT_EQ(y[0], pair[0] + pair[m * n]);
  }
}

}  // namespace
}  // namespace tandem::kernels::cuda
