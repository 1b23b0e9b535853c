#include "engine/media/pillow_resize.h"

#include "gtest/gtest.h"

namespace tandem::media {
namespace {

TEST(ResizeBicubic8, ConstantStaysConstant) {
  std::vector<uint8_t> in(37 * 23 * 3, 123);
  auto out = ResizeBicubic8(in, 37, 23, 3, 11, 7);
  ASSERT_EQ(out.size(), 11u * 7 * 3);
  for (uint8_t v : out) EXPECT_EQ(v, 123);
}

TEST(ResizeBicubic8, TwoToOneIsTheMean) {
  // 2 -> 1: support 4, both taps weigh 1/2 (rounded half up in 22-bit
  // fixed point): (10 + 21) / 2 = 15.5 -> 16.
  std::vector<uint8_t> in = {10, 21};
  auto out = ResizeBicubic8(in, 2, 1, 1, 1, 1);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0], 16);
}

TEST(ResizeBicubic8, OvershootIsClamped) {
  // A step edge downscaled by 3/4 rings; the ringing clamps at 0 and 255.
  std::vector<uint8_t> in(16);
  for (int i = 0; i < 16; ++i) in[i] = i < 8 ? 0 : 255;
  auto out = ResizeBicubic8(in, 16, 1, 1, 12, 1);
  EXPECT_EQ(out.front(), 0);
  EXPECT_EQ(out.back(), 255);
}

TEST(ResizeBicubic32, KeepsWideValues) {
  std::vector<int32_t> in(8 * 4, 1000);
  auto out = ResizeBicubic32(in, 8, 4, 3, 2);
  for (int32_t v : out) EXPECT_EQ(v, 1000);
}

TEST(ResizeNearest8, PicksCentres) {
  std::vector<uint8_t> in = {0, 1, 2, 3, 4, 5};
  auto out = ResizeNearest8(in, 6, 1, 1, 3, 1);
  // Sampled at 0.5 * 2 = 1, then 3, 5.
  EXPECT_EQ(out, (std::vector<uint8_t>{1, 3, 5}));
}

TEST(Premultiply, RoundTripsOpaqueAndClearsNothing) {
  std::vector<uint8_t> px = {200, 100, 50, 255, 200, 100, 50, 128, 9, 9, 9, 0};
  PremultiplyAlpha(&px);
  EXPECT_EQ(px[0], 200);
  EXPECT_EQ(px[4], 100);  // 200 * 128 / 255 = 100.39 -> 100
  EXPECT_EQ(px[8], 0);
  UnpremultiplyAlpha(&px);
  EXPECT_EQ(px[4], 199);  // 255 * 100 / 128 = 199.2 (truncated)
  EXPECT_EQ(px[7], 128);
}

}  // namespace
}  // namespace tandem::media
