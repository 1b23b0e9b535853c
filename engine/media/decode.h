// Image decoders (PNG, JPEG, WebP, GIF's first frame) on Debian's libpng,
// libjpeg-turbo, libwebp and giflib, producing pixels laid out as Pillow's
// image mode would be, since the K3 preprocessing (VISION.md section 1) resizes
// in that mode before converting to RGB. The format comes from the magic
// bytes; a declared MIME type must agree. Dimensions are checked against the
// limits before any pixel buffer is allocated (decompression bombs). Every
// failure is an InvalidArgument naming the reason.
#ifndef TANDEM_ENGINE_MEDIA_DECODE_H_
#define TANDEM_ENGINE_MEDIA_DECODE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::media {

enum class ImageFormat { kPng, kJpeg, kWebp, kGif };
absl::string_view ImageFormatMime(ImageFormat format);  // "image/png", ...

struct DecodeLimits {
  // Encoded (compressed) size.
  int64_t max_encoded_bytes = 32 << 20;
  // width * height; Pillow's DecompressionBombWarning threshold by default.
  int64_t max_pixels = 89478485;
  // Progressive JPEG scans (libjpeg-turbo's djpeg -maxscans advice): a file
  // with thousands of tiny scans costs minutes of CPU.
  int max_jpeg_scans = 500;
};

// How the pixels are stored; what the resize and the conversion to RGB do
// with them follows Pillow's mode.
enum class PixelKind {
  kRgb,     // 3 bytes/pixel: Pillow "RGB", "L" (replicated), "P" without
            // transparency (expanded), "1" (0/255 replicated).
  kRgba,    // 4 bytes/pixel, straight alpha: "RGBA", "LA", "P" with a
            // transparency (expanded). Resized premultiplied, unless nearest.
  kCmyk,    // 4 bytes/pixel as Pillow holds JPEG CMYK (Adobe-inverted back).
  kGrey32,  // int32/pixel: Pillow "I" (16-bit grey PNG); clipped to 0..255
            // when converted to RGB.
};

struct DecodedImage {
  ImageFormat format = ImageFormat::kPng;
  int width = 0;
  int height = 0;
  PixelKind kind = PixelKind::kRgb;
  // Pillow resizes "P" and "1" images with NEAREST whatever is asked.
  bool nearest_resize = false;
  std::vector<uint8_t> pixels;  // kRgb, kRgba, kCmyk: row-major, interleaved
  std::vector<int32_t> wide;    // kGrey32
};

// The format the magic bytes say, or InvalidArgument.
absl::StatusOr<ImageFormat> DetectImageFormat(absl::string_view bytes);

// Decodes `bytes`. `declared_mime` (e.g. from a data: URL or Content-Type)
// may be empty; otherwise it must name the detected format ("image/jpg" is
// accepted for JPEG).
absl::StatusOr<DecodedImage> DecodeImage(absl::string_view bytes,
                                         absl::string_view declared_mime,
                                         const DecodeLimits& limits = {});

}  // namespace tandem::media

#endif  // TANDEM_ENGINE_MEDIA_DECODE_H_
