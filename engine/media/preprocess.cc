#include "engine/media/preprocess.h"

#include <algorithm>
#include <cmath>

#include "common/status.h"
#include "engine/media/pillow_resize.h"
#include "xxhash.h"

namespace tandem::media {
namespace {

inline uint8_t Clip8(int v) { return static_cast<uint8_t>(std::clamp(v, 0, 255)); }

inline uint8_t MulDiv255(int a, int b) {
  const int t = a * b + 128;
  return static_cast<uint8_t>(((t >> 8) + t) >> 8);
}

}  // namespace

absl::Status MediaConfig::Validate() const {
  if (patch_size <= 0) return InvalidArgument("media patch_size must be > 0");
  if (merge_kernel != 2) {
    return InvalidArgument("media merge_kernel_size must be [2, 2], got ",
                           merge_kernel);
  }
  if (in_patch_limit <= 0 || patch_limit_on_one_side <= 0) {
    return InvalidArgument(
        "media in_patch_limit and patch_limit_on_one_side must be > 0");
  }
  for (float s : image_std) {
    if (!(s > 0)) return InvalidArgument("media image_std must be > 0");
  }
  if (chessboard_square <= 0) return InvalidArgument("chessboard square must be > 0");
  return absl::OkStatus();
}

ResizePlan PlanResize(int width, int height, const MediaConfig& config) {
  const int p = config.patch_size;
  const double side_limit = static_cast<double>(config.patch_limit_on_one_side) * p;
  const double patches = static_cast<double>(std::max(1, width / p)) *
                         static_cast<double>(std::max(1, height / p));
  double s = 1.0;
  s = std::min(s, std::sqrt(static_cast<double>(config.in_patch_limit) / patches));
  s = std::min(s, side_limit / width);
  s = std::min(s, side_limit / height);
  ResizePlan plan;
  const int limit = static_cast<int>(side_limit);
  plan.width = std::min(std::max(1, static_cast<int>(std::floor(width * s))), limit);
  plan.height = std::min(std::max(1, static_cast<int>(std::floor(height * s))), limit);
  const int block = p * config.merge_kernel;
  plan.pad_right = (block - plan.width % block) % block;
  plan.pad_bottom = (block - plan.height % block) % block;
  plan.grid_w = (plan.width + plan.pad_right) / p;
  plan.grid_h = (plan.height + plan.pad_bottom) / p;
  return plan;
}

std::vector<uint8_t> ResizedRgb(const DecodedImage& image, const ResizePlan& plan,
                                const MediaConfig& config) {
  const int w = plan.width;
  const int h = plan.height;
  const bool same = w == image.width && h == image.height;
  const size_t n = static_cast<size_t>(w) * h;
  std::vector<uint8_t> rgb(3 * n);
  switch (image.kind) {
    case PixelKind::kRgb: {
      if (same) return image.pixels;
      return image.nearest_resize
                 ? ResizeNearest8(image.pixels, image.width, image.height, 3, w, h)
                 : ResizeBicubic8(image.pixels, image.width, image.height, 3, w, h);
    }
    case PixelKind::kCmyk: {
      const std::vector<uint8_t> cmyk =
          same ? image.pixels
               : ResizeBicubic8(image.pixels, image.width, image.height, 4, w, h);
      for (size_t i = 0; i < n; ++i) {
        const int nk = 255 - cmyk[4 * i + 3];
        for (int c = 0; c < 3; ++c)
          rgb[3 * i + c] = Clip8(nk - MulDiv255(cmyk[4 * i + c], nk));
      }
      return rgb;
    }
    case PixelKind::kGrey32: {
      const std::vector<int32_t> grey =
          same ? image.wide
               : ResizeBicubic32(image.wide, image.width, image.height, w, h);
      for (size_t i = 0; i < n; ++i) {
        // Pillow's "I" -> "RGB" clips (it does not scale 16-bit values).
        const uint8_t v = static_cast<uint8_t>(std::clamp<int32_t>(grey[i], 0, 255));
        rgb[3 * i] = rgb[3 * i + 1] = rgb[3 * i + 2] = v;
      }
      return rgb;
    }
    case PixelKind::kRgba:
      break;
  }
  std::vector<uint8_t> rgba;
  if (same) {
    rgba = image.pixels;
  } else if (image.nearest_resize) {
    rgba = ResizeNearest8(image.pixels, image.width, image.height, 4, w, h);
  } else {
    rgba = image.pixels;
    PremultiplyAlpha(&rgba);
    rgba = ResizeBicubic8(rgba, image.width, image.height, 4, w, h);
    UnpremultiplyAlpha(&rgba);
  }
  // The chessboard composite at the resized size: trunc(a*rgb + (1-a)*bg) in
  // f32 with a = A / 255.
  const int square = config.chessboard_square;
  for (int y = 0; y < h; ++y) {
    for (int x = 0; x < w; ++x) {
      const size_t i = static_cast<size_t>(y) * w + x;
      const bool odd = ((y / square) + (x / square)) % 2 == 1;
      const float bg =
          static_cast<float>(odd ? config.chessboard_gray : config.chessboard_white);
      const float a = static_cast<float>(rgba[4 * i + 3]) / 255.0f;
      const float inv = 1.0f - a;
      for (int c = 0; c < 3; ++c) {
        const float fg = a * static_cast<float>(rgba[4 * i + c]);
        const float back = inv * bg;
        const float v = fg + back;
        rgb[3 * i + c] = static_cast<uint8_t>(std::clamp(v, 0.0f, 255.0f));
      }
    }
  }
  return rgb;
}

absl::StatusOr<PatchedImage> Preprocess(const DecodedImage& image,
                                        const MediaConfig& config) {
  TANDEM_RETURN_IF_ERROR(config.Validate());
  if (image.width <= 0 || image.height <= 0) {
    return InvalidArgument("image has zero size (", image.width, "x", image.height,
                           ")");
  }
  const ResizePlan plan = PlanResize(image.width, image.height, config);
  const std::vector<uint8_t> rgb = ResizedRgb(image, plan, config);
  // f32(f32(f32(v / 255) - mean) / std) per channel.
  float table[3][256];
  for (int c = 0; c < 3; ++c) {
    for (int v = 0; v < 256; ++v) {
      const float x = static_cast<float>(v) / 255.0f;
      const float centred = x - config.image_mean[c];
      table[c][v] = centred / config.image_std[c];
    }
  }
  const int p = config.patch_size;
  PatchedImage out;
  out.grid_h = plan.grid_h;
  out.grid_w = plan.grid_w;
  out.patch_size = p;
  out.original_width = image.width;
  out.original_height = image.height;
  const size_t dim = 3 * static_cast<size_t>(p) * p;
  out.patches.resize(static_cast<size_t>(plan.grid_h) * plan.grid_w * dim);
  float* dst = out.patches.data();
  for (int i = 0; i < plan.grid_h; ++i) {
    for (int j = 0; j < plan.grid_w; ++j) {
      for (int c = 0; c < 3; ++c) {
        for (int ky = 0; ky < p; ++ky) {
          const int y = i * p + ky;
          for (int kx = 0; kx < p; ++kx) {
            const int x = j * p + kx;
            const uint8_t v =
                (y < plan.height && x < plan.width)
                    ? rgb[(static_cast<size_t>(y) * plan.width + x) * 3 + c]
                    : 0;  // padding is black
            *dst++ = table[c][v];
          }
        }
      }
    }
  }
  const uint64_t seed =
      (static_cast<uint64_t>(out.grid_h) << 32) | static_cast<uint32_t>(out.grid_w);
  out.content_hash = XXH3_64bits_withSeed(out.patches.data(),
                                          out.patches.size() * sizeof(float), seed);
  return out;
}

}  // namespace tandem::media
