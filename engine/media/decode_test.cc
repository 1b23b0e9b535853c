#include "engine/media/decode.h"

#include <fstream>
#include <sstream>
#include <string>

#include "gtest/gtest.h"

namespace tandem::media {
namespace {

std::string Read(const std::string& name) {
  std::ifstream in("engine/media/testdata/" + name, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_FALSE(ss.str().empty()) << name;
  return ss.str();
}

// rgb_3x2.*: rows (255,0,0) (0,255,0) (0,0,255) / (10,20,30) (40,50,60) (70,80,90).
const uint8_t kPixels[18] = {255, 0,  0,  0,  255, 0,  0,  0,  255,
                             10,  20, 30, 40, 50,  60, 70, 80, 90};

TEST(DetectImageFormat, MagicBytes) {
  EXPECT_EQ(*DetectImageFormat(Read("rgb_3x2.png")), ImageFormat::kPng);
  EXPECT_EQ(*DetectImageFormat(Read("rgb_3x2.jpg")), ImageFormat::kJpeg);
  EXPECT_EQ(*DetectImageFormat(Read("rgb_3x2.webp")), ImageFormat::kWebp);
  EXPECT_EQ(*DetectImageFormat(Read("rgb_3x2.gif")), ImageFormat::kGif);
  EXPECT_FALSE(DetectImageFormat("").ok());
  EXPECT_FALSE(DetectImageFormat("BM\x36\0\0\0").ok());
  EXPECT_FALSE(DetectImageFormat("RIFF\0\0\0\0WAVE").ok());
}

TEST(DecodeImage, LosslessFormatsGiveThePixels) {
  for (const char* name : {"rgb_3x2.png", "rgb_3x2.webp", "rgb_3x2.gif"}) {
    SCOPED_TRACE(name);
    auto image = DecodeImage(Read(name), "");
    ASSERT_TRUE(image.ok()) << image.status();
    EXPECT_EQ(image->width, 3);
    EXPECT_EQ(image->height, 2);
    EXPECT_EQ(image->kind, PixelKind::kRgb);
    ASSERT_EQ(image->pixels.size(), 18u);
    for (int i = 0; i < 18; ++i) EXPECT_EQ(image->pixels[i], kPixels[i]) << i;
  }
  // GIF is a palette image: Pillow resizes it NEAREST.
  EXPECT_TRUE(DecodeImage(Read("rgb_3x2.gif"), "")->nearest_resize);
  EXPECT_FALSE(DecodeImage(Read("rgb_3x2.png"), "")->nearest_resize);
}

TEST(DecodeImage, JpegIsClose) {
  auto image = DecodeImage(Read("rgb_3x2.jpg"), "image/jpeg");
  ASSERT_TRUE(image.ok()) << image.status();
  ASSERT_EQ(image->pixels.size(), 18u);
  EXPECT_EQ(image->kind, PixelKind::kRgb);
}

TEST(DecodeImage, DeclaredMimeMustMatch) {
  EXPECT_TRUE(DecodeImage(Read("rgb_3x2.png"), "image/png").ok());
  EXPECT_TRUE(DecodeImage(Read("rgb_3x2.jpg"), "IMAGE/JPG; q=1").ok());
  auto wrong = DecodeImage(Read("rgb_3x2.png"), "image/jpeg");
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.status().message().find("does not match"), std::string::npos);
  EXPECT_FALSE(DecodeImage(Read("rgb_3x2.gif"), "text/html").ok());
}

TEST(DecodeImage, BombDimensionsRefusedBeforeAllocating) {
  auto png = DecodeImage(Read("bomb_100000x100000.png"), "");
  ASSERT_FALSE(png.ok());
  EXPECT_EQ(png.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(png.status().message().find("over the limit"), std::string::npos)
      << png.status();
  auto gif = DecodeImage(Read("bomb_screen.gif"), "");
  ASSERT_FALSE(gif.ok());
  EXPECT_NE(gif.status().message().find("over the limit"), std::string::npos)
      << gif.status();
  DecodeLimits small;
  small.max_pixels = 5;
  EXPECT_FALSE(DecodeImage(Read("rgb_3x2.webp"), "", small).ok());
  EXPECT_FALSE(DecodeImage(Read("rgb_3x2.jpg"), "", small).ok());
  small.max_pixels = 6;
  EXPECT_TRUE(DecodeImage(Read("rgb_3x2.jpg"), "", small).ok());
}

TEST(DecodeImage, EncodedSizeLimit) {
  DecodeLimits limits;
  limits.max_encoded_bytes = 50;
  auto image = DecodeImage(Read("rgb_3x2.png"), "", limits);
  ASSERT_FALSE(image.ok());
  EXPECT_NE(image.status().message().find("over the limit of 50"), std::string::npos);
}

TEST(DecodeImage, TruncatedAndCorruptDataIsAnError) {
  for (const char* name :
       {"rgb_3x2.png", "rgb_3x2.jpg", "rgb_3x2.webp", "rgb_3x2.gif"}) {
    const std::string data = Read(name);
    for (size_t keep : {size_t{12}, data.size() / 2, data.size() - 3}) {
      auto image = DecodeImage(data.substr(0, keep), "");
      if (!image.ok()) {
        EXPECT_EQ(image.status().code(), absl::StatusCode::kInvalidArgument)
            << name << " " << keep << ": " << image.status();
      }
    }
    std::string corrupt = data;
    for (size_t i = 16; i < corrupt.size(); i += 3) corrupt[i] ^= 0x5a;
    auto image = DecodeImage(corrupt, "");
    if (!image.ok()) {
      EXPECT_EQ(image.status().code(), absl::StatusCode::kInvalidArgument) << name;
    }
  }
  // A PNG signature alone has no IHDR.
  EXPECT_FALSE(DecodeImage(std::string("\x89PNG\r\n\x1a\n", 8), "").ok());
}

TEST(DecodeImage, ZeroSizedRefused) {
  // GIF with a 0x0 frame.
  std::string gif = Read("rgb_3x2.gif");
  const size_t desc = gif.find(',');
  ASSERT_NE(desc, std::string::npos);
  gif[desc + 5] = gif[desc + 6] = gif[desc + 7] = gif[desc + 8] = 0;
  auto image = DecodeImage(gif, "");
  ASSERT_FALSE(image.ok());
  EXPECT_NE(image.status().message().find("zero size"), std::string::npos)
      << image.status();
}

}  // namespace
}  // namespace tandem::media
