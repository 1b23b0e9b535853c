#include "engine/model/bf16.h"

#include <cmath>
#include <cstring>

#include "gtest/gtest.h"

namespace tandem::model {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(Bf16Test, ExactValuesRoundTrip) {
  for (float f :
       {0.0f, -0.0f, 1.0f, -2.5f, 65536.0f, 1.0f / 1024, INFINITY, -INFINITY}) {
    EXPECT_EQ(Bits(Bf16ToFloat(FloatToBf16(f))), Bits(f)) << f;
  }
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(Bf16ToFloat(0xc020), -2.5f);
}

TEST(Bf16Test, RoundsToNearestEven) {
  // 1 + 2^-8 is exactly halfway between bf16 1.0 (even) and 1 + 2^-7 (odd).
  EXPECT_EQ(FloatToBf16(FromBits(0x3f808000)), 0x3f80);
  // 1 + 3*2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up.
  EXPECT_EQ(FloatToBf16(FromBits(0x3f818000)), 0x3f82);
  // Just above halfway rounds up; just below rounds down.
  EXPECT_EQ(FloatToBf16(FromBits(0x3f808001)), 0x3f81);
  EXPECT_EQ(FloatToBf16(FromBits(0x3f807fff)), 0x3f80);
  // Largest finite float rounds to infinity in bf16.
  EXPECT_EQ(FloatToBf16(FromBits(0x7f7fffff)), 0x7f80);
}

TEST(Bf16Test, NanStaysNan) {
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(NAN))));
  // A NaN whose payload lives only in the low bits must not become infinity.
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(FromBits(0x7f800001)))));
}

TEST(HalfTest, KnownValues) {
  EXPECT_EQ(HalfToFloat(0x3c00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xc000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(HalfToFloat(0x7c00), INFINITY);
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7e00)));
}

TEST(HalfTest, EveryFiniteHalfRoundTrips) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    if ((h & 0x7c00) == 0x7c00) continue;  // inf/NaN
    EXPECT_EQ(FloatToHalf(HalfToFloat(h)), h) << std::hex << b;
  }
}

TEST(HalfTest, RoundsToNearestEvenAndOverflows) {
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1.0).
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7bff);
  // Smallest subnormal halfway case: 2^-25 ties to 0 (even).
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(FloatToHalf(3 * std::ldexp(1.0f, -25)), 0x0002);
}

}  // namespace
}  // namespace tandem::model
