#include "engine/model/mxfp4.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::model {
namespace {

TEST(Mxfp4Test, AllSixteenE2M1Codes) {
  const float expected[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(DecodeE2M1(static_cast<uint8_t>(c)), expected[c]) << c;
    EXPECT_EQ(std::signbit(DecodeE2M1(static_cast<uint8_t>(c))), c >= 8) << c;
    // Every nonzero code is the encoding of its own value.
    if (c != 8) {
      EXPECT_EQ(EncodeE2M1(expected[c]), c) << c;
    }
  }
  EXPECT_EQ(EncodeE2M1(-0.0f), 0);  // no negative zero
}

TEST(Mxfp4Test, E8M0EdgeCases) {
  EXPECT_EQ(DecodeE8M0(127), 1.0f);
  EXPECT_EQ(DecodeE8M0(128), 2.0f);
  EXPECT_EQ(DecodeE8M0(126), 0.5f);
  EXPECT_EQ(DecodeE8M0(0), std::ldexp(1.0f, -127));
  EXPECT_GT(DecodeE8M0(0), 0.0f);
  EXPECT_EQ(DecodeE8M0(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isinf(DecodeE8M0(254)) == false);
  EXPECT_TRUE(std::isnan(DecodeE8M0(255)));
}

TEST(Mxfp4Test, NibbleOrderLowNibbleIsEvenElement) {
  std::vector<uint8_t> packed(16, 0);
  packed[0] = 0x72;     // element 0 = code 2 (1.0), element 1 = code 7 (6.0)
  packed[1] = 0x9b;     // element 2 = code 0xb (-1.5), element 3 = code 9 (-0.5)
  uint8_t scale = 128;  // 2.0
  float out[32];
  DequantizeMxfp4Row(packed.data(), &scale, 32, out);
  EXPECT_EQ(out[0], 2.0f);
  EXPECT_EQ(out[1], 12.0f);
  EXPECT_EQ(out[2], -3.0f);
  EXPECT_EQ(out[3], -1.0f);
  for (int i = 4; i < 32; ++i) EXPECT_EQ(out[i], 0.0f);
}

TEST(Mxfp4Test, ScalesApplyPerGroupOf32) {
  const size_t in = 64;
  std::vector<uint8_t> packed(in / 2, 0x22);  // every element code 2 (1.0)
  std::vector<uint8_t> scales = {127 - 3, 127 + 5};
  std::vector<float> out;
  ASSERT_TRUE(DequantizeMxfp4(packed, scales, 1, in, &out).ok());
  for (size_t i = 0; i < 32; ++i) EXPECT_EQ(out[i], 0.125f);
  for (size_t i = 32; i < 64; ++i) EXPECT_EQ(out[i], 32.0f);
  EXPECT_FALSE(DequantizeMxfp4(packed, scales, 2, in, &out).ok());
  EXPECT_FALSE(DequantizeMxfp4(packed, scales, 1, 48, &out).ok());
}

TEST(Mxfp4Test, RoundHalfEvenOnTheGrid) {
  // Midpoints go to the neighbour with the even code.
  EXPECT_EQ(EncodeE2M1(0.25f), 0);  // 0 | 0.5
  EXPECT_EQ(EncodeE2M1(0.75f), 2);  // 0.5 | 1
  EXPECT_EQ(EncodeE2M1(1.25f), 2);  // 1 | 1.5
  EXPECT_EQ(EncodeE2M1(1.75f), 4);  // 1.5 | 2
  EXPECT_EQ(EncodeE2M1(2.5f), 4);   // 2 | 3
  EXPECT_EQ(EncodeE2M1(3.5f), 6);   // 3 | 4
  EXPECT_EQ(EncodeE2M1(5.0f), 6);   // 4 | 6
  EXPECT_EQ(EncodeE2M1(-2.5f), 0xc);
  // Off-midpoint values go to the nearest.
  EXPECT_EQ(EncodeE2M1(0.26f), 1);
  EXPECT_EQ(EncodeE2M1(5.01f), 7);
  // Saturation.
  EXPECT_EQ(EncodeE2M1(100.0f), 7);
  EXPECT_EQ(EncodeE2M1(-1e30f), 0xf);
}

TEST(Mxfp4Test, GridValuesAreExactlyRepresentable) {
  // A group whose amax is 6*2^k and whose values are all grid points times 2^k
  // quantises without error: scale exponent floor(log2(6*2^k)) - 2 = k.
  const float grid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int k : {-10, -3, 0, 2, 7}) {
    std::vector<float> w(32);
    for (int i = 0; i < 32; ++i) {
      w[i] = std::ldexp(grid[i % 8], k) * ((i / 8) % 2 ? -1.0f : 1.0f);
    }
    std::vector<uint8_t> packed, scales;
    ASSERT_TRUE(QuantizeMxfp4(w, 1, 32, &packed, &scales).ok());
    EXPECT_EQ(scales[0], 127 + k);
    std::vector<float> back;
    ASSERT_TRUE(DequantizeMxfp4(packed, scales, 1, 32, &back).ok());
    for (int i = 0; i < 32; ++i) EXPECT_EQ(back[i], w[i]) << "k=" << k << " i=" << i;
  }
}

TEST(Mxfp4Test, ScaleExponentIsFloorLog2MinusTwo) {
  std::vector<float> w(32, 0.0f);
  w[5] = 5.0f;  // floor(log2 5) = 2 → e = 0, 5 → 4 (tie, even)
  std::vector<uint8_t> packed, scales;
  ASSERT_TRUE(QuantizeMxfp4(w, 1, 32, &packed, &scales).ok());
  EXPECT_EQ(scales[0], 127);
  EXPECT_EQ(packed[2] >> 4, 6);  // element 5 = high nibble of byte 2, code 6 = 4.0
  w[5] = 7.9f;                   // e = 0, 7.9 saturates to 6
  ASSERT_TRUE(QuantizeMxfp4(w, 1, 32, &packed, &scales).ok());
  EXPECT_EQ(scales[0], 127);
  EXPECT_EQ(packed[2] >> 4, 7);
  w[5] = 8.0f;  // e = 1, 8/2 = 4
  ASSERT_TRUE(QuantizeMxfp4(w, 1, 32, &packed, &scales).ok());
  EXPECT_EQ(scales[0], 128);
  EXPECT_EQ(packed[2] >> 4, 6);
}

TEST(Mxfp4Test, AllZeroGroupGetsZeroScale) {
  std::vector<float> w(64, 0.0f);
  w[40] = 1.0f;
  std::vector<uint8_t> packed, scales;
  ASSERT_TRUE(QuantizeMxfp4(w, 1, 64, &packed, &scales).ok());
  EXPECT_EQ(scales[0], 0);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(packed[i], 0);
  EXPECT_EQ(scales[1], 125);  // floor(log2 1) - 2 = -2
}

TEST(Mxfp4Test, QuantiseDequantiseErrorIsBounded) {
  // Pseudo-random values over several magnitudes; per element the error is at
  // most half a grid step at the group's scale: |err| <= 2^e (spacing 2 near 6,
  // i.e. 1 * 2^e), and relative to amax at most 1/4 + saturation (amax/2^e < 8,
  // largest code 6: clipped by < 2 * 2^e).
  uint64_t s = 12345;
  auto next = [&]() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>((s >> 40) & 0xffffff) / 16777216.0f * 2.0f - 1.0f;
  };
  const size_t rows = 8, in = 128;
  std::vector<float> w(rows * in);
  for (size_t i = 0; i < w.size(); ++i)
    w[i] = next() * std::ldexp(1.0f, (int)(i / 64) - 4);
  std::vector<uint8_t> packed, scales;
  ASSERT_TRUE(QuantizeMxfp4(w, rows, in, &packed, &scales).ok());
  std::vector<float> back;
  ASSERT_TRUE(DequantizeMxfp4(packed, scales, rows, in, &back).ok());
  double sq_err = 0, sq = 0;
  for (size_t g = 0; g < w.size() / 32; ++g) {
    const float step = DecodeE8M0(scales[g]);  // 2^e
    for (size_t i = g * 32; i < g * 32 + 32; ++i) {
      EXPECT_LE(std::fabs(back[i] - w[i]), 2.0f * step) << i;
      if (std::fabs(w[i]) <= 6.0f * step) {
        EXPECT_LE(std::fabs(back[i] - w[i]), step)
            << i;  // inside the grid: half spacing
      }
      sq_err += (back[i] - w[i]) * (back[i] - w[i]);
      sq += w[i] * w[i];
    }
  }
  EXPECT_LT(std::sqrt(sq_err / sq), 0.2);  // ~10% relative RMS error for MXFP4
}

TEST(Mxfp4Test, RejectsBadShapesAndNonFinite) {
  std::vector<uint8_t> packed, scales;
  EXPECT_FALSE(QuantizeMxfp4(std::vector<float>(48), 1, 48, &packed, &scales).ok());
  EXPECT_FALSE(QuantizeMxfp4(std::vector<float>(31), 1, 32, &packed, &scales).ok());
  std::vector<float> w(32, 1.0f);
  w[3] = NAN;
  EXPECT_FALSE(QuantizeMxfp4(w, 1, 32, &packed, &scales).ok());
}

}  // namespace
}  // namespace tandem::model
