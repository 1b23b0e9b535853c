#include "engine/media/preprocess.h"

#include "gtest/gtest.h"

namespace tandem::media {
namespace {

struct PlanCase {
  int width, height;
  int resized_w, resized_h;
  int grid_h, grid_w, tokens;
};

MediaConfig Tiny() {
  MediaConfig config;
  config.in_patch_limit = 64;
  config.patch_limit_on_one_side = 16;
  return config;
}

void ExpectPlan(const PlanCase& c, const MediaConfig& config) {
  SCOPED_TRACE(testing::Message() << c.width << "x" << c.height);
  const ResizePlan plan = PlanResize(c.width, c.height, config);
  EXPECT_EQ(plan.width, c.resized_w);
  EXPECT_EQ(plan.height, c.resized_h);
  EXPECT_EQ(plan.grid_h, c.grid_h);
  EXPECT_EQ(plan.grid_w, c.grid_w);
  EXPECT_EQ(plan.num_tokens(), c.tokens);
  EXPECT_EQ(plan.grid_h % 2, 0);
  EXPECT_EQ(plan.grid_w % 2, 0);
}

// VISION.md section 1's examples (published config).
TEST(PlanResize, K3Examples) {
  for (const PlanCase& c : {PlanCase{56, 28, 56, 28, 2, 4, 2},
                            PlanCase{1920, 1080, 1920, 1080, 78, 138, 2691},
                            PlanCase{8000, 200, 7168, 179, 14, 512, 1792}}) {
    ExpectPlan(c, MediaConfig{});
  }
}

// VISION.md section 4's examples (tiny media_proc_cfg).
TEST(PlanResize, TinyExamples) {
  for (const PlanCase& c :
       {PlanCase{112, 112, 112, 112, 8, 8, 16}, PlanCase{100, 30, 100, 30, 4, 8, 8},
        PlanCase{300, 200, 139, 93, 8, 10, 20}, PlanCase{28, 500, 12, 224, 16, 2, 8}}) {
    ExpectPlan(c, Tiny());
  }
}

TEST(PlanResize, NeverUpscalesAndKeepsAtLeastOnePixel) {
  ExpectPlan({1, 1, 1, 1, 2, 2, 1}, MediaConfig{});
  ExpectPlan({2000, 3, 224, 1, 2, 16, 8}, Tiny());
  for (int w : {1, 13, 14, 27, 28, 29, 500, 7168, 7169, 20000}) {
    for (int h : {1, 14, 100, 7168, 9000}) {
      const ResizePlan plan = PlanResize(w, h, MediaConfig{});
      EXPECT_LE(plan.width, w);
      EXPECT_LE(plan.height, h);
      EXPECT_GE(plan.width, 1);
      EXPECT_LE(plan.grid_w, 512);
      EXPECT_LE(plan.grid_h, 512);
    }
  }
}

DecodedImage Solid(int w, int h, uint8_t r, uint8_t g, uint8_t b) {
  DecodedImage image;
  image.width = w;
  image.height = h;
  image.kind = PixelKind::kRgb;
  for (int i = 0; i < w * h; ++i) image.pixels.insert(image.pixels.end(), {r, g, b});
  return image;
}

TEST(Preprocess, LayoutNormalisationAndPadding) {
  // 30x16 at the published config: no resize, padded to 56x28 -> grid 2x4.
  DecodedImage image = Solid(30, 16, 255, 0, 51);
  // Mark pixel (y=15, x=29): in patch row 1, column 2, at ky=1, kx=1.
  image.pixels[(15 * 30 + 29) * 3 + 1] = 255;
  auto patched = Preprocess(image);
  ASSERT_TRUE(patched.ok()) << patched.status();
  EXPECT_EQ(patched->grid_h, 2);
  EXPECT_EQ(patched->grid_w, 4);
  EXPECT_EQ(patched->num_tokens(), 2);
  EXPECT_EQ(patched->original_width, 30);
  EXPECT_EQ(patched->original_height, 16);
  ASSERT_EQ(patched->patches.size(), 8u * 588);
  auto at = [&](int patch, int c, int ky, int kx) {
    return patched->patches[patch * 588 + c * 196 + ky * 14 + kx];
  };
  EXPECT_EQ(at(0, 0, 0, 0), 1.0f);   // red 255
  EXPECT_EQ(at(0, 1, 0, 0), -1.0f);  // green 0
  EXPECT_FLOAT_EQ(at(0, 2, 0, 0), (51.0f / 255.0f - 0.5f) / 0.5f);
  EXPECT_EQ(at(1 * 4 + 2, 1, 1, 1), 1.0f);   // the marked pixel
  EXPECT_EQ(at(1 * 4 + 2, 1, 1, 0), -1.0f);  // its neighbour
  EXPECT_EQ(at(1 * 4 + 2, 0, 1, 2), -1.0f);  // x = 30: padding
  EXPECT_EQ(at(3, 0, 0, 0), -1.0f);          // x = 42: padding
  EXPECT_EQ(at(4, 0, 2, 0), -1.0f);          // y = 16: padding
}

TEST(Preprocess, AlphaIsCompositedOnTheChessboard) {
  DecodedImage image;
  image.width = 16;
  image.height = 16;
  image.kind = PixelKind::kRgba;
  image.pixels.assign(16 * 16 * 4, 0);  // fully transparent black
  const ResizePlan plan = PlanResize(16, 16, MediaConfig{});
  auto rgb = ResizedRgb(image, plan, MediaConfig{});
  EXPECT_EQ(rgb[0], 255);                 // (0,0): white square
  EXPECT_EQ(rgb[8 * 3], 180);             // (0,8): gray
  EXPECT_EQ(rgb[(8 * 16 + 8) * 3], 255);  // (8,8): white
  EXPECT_EQ(rgb[(8 * 16 + 0) * 3], 180);  // (8,0): gray
}

TEST(Preprocess, HashFollowsContent) {
  auto a = Preprocess(Solid(40, 40, 1, 2, 3));
  auto b = Preprocess(Solid(40, 40, 1, 2, 3));
  auto c = Preprocess(Solid(40, 40, 1, 2, 4));
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->content_hash, b->content_hash);
  EXPECT_NE(a->content_hash, c->content_hash);
}

TEST(Preprocess, BadInputIsAnError) {
  DecodedImage empty;
  EXPECT_FALSE(Preprocess(empty).ok());
  MediaConfig bad;
  bad.merge_kernel = 3;
  EXPECT_FALSE(Preprocess(Solid(4, 4, 0, 0, 0), bad).ok());
}

}  // namespace
}  // namespace tandem::media
