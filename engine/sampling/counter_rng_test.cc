#include "engine/sampling/counter_rng.h"

#include <cmath>
#include <set>

#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

// Random123's kat_vectors for philox4x32 10.
TEST(CounterRngTest, PhiloxMatchesKnownAnswers) {
  using A4 = std::array<uint32_t, 4>;
  EXPECT_EQ(Philox4x32({0, 0, 0, 0}, {0, 0}),
            (A4{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(Philox4x32({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
                       {0xffffffff, 0xffffffff}),
            (A4{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(Philox4x32({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
                       {0xa4093822, 0x299f31d0}),
            (A4{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(CounterRngTest, UniformIsAPureFunctionOfItsInputs) {
  const double a = CounterUniform(42, 7, RngStream::kSample);
  EXPECT_EQ(a, CounterUniform(42, 7, RngStream::kSample));
  // Each input changes the value.
  EXPECT_NE(a, CounterUniform(43, 7, RngStream::kSample));
  EXPECT_NE(a, CounterUniform(42, 8, RngStream::kSample));
  EXPECT_NE(a, CounterUniform(42, 7, RngStream::kSpecAccept));
  EXPECT_NE(a, CounterUniform(42, 7, RngStream::kSample, 1));
  // High seed and position bits matter too.
  EXPECT_NE(a, CounterUniform(42 + (1ull << 40), 7, RngStream::kSample));
  EXPECT_NE(a, CounterUniform(42, 7 + (1ll << 33), RngStream::kSample));
}

TEST(CounterRngTest, UniformsAreUniformAndPositionsUncorrelated) {
  constexpr int kN = 200000;
  double sum = 0.0, sum_sq = 0.0, lag = 0.0;
  double prev = CounterUniform(9, 0, RngStream::kSample);
  std::set<double> distinct;
  for (int i = 1; i <= kN; ++i) {
    const double u = CounterUniform(9, i, RngStream::kSample);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    sum_sq += u * u;
    lag += (u - 0.5) * (prev - 0.5);
    prev = u;
    if (i <= 1000) distinct.insert(u);
  }
  EXPECT_NEAR(sum / kN, 0.5, 0.005);
  EXPECT_NEAR(sum_sq / kN - 0.25, 1.0 / 12.0, 0.002);
  // Lag-1 correlation of consecutive positions: ~N(0, 1/sqrt(n)).
  EXPECT_LT(std::abs(lag / kN * 12.0), 0.01);
  EXPECT_EQ(distinct.size(), 1000u);
}

}  // namespace
}  // namespace tandem::engine
