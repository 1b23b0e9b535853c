// libFuzzer harness: DecodeImage and Preprocess must never crash, leak or hit
// UB on arbitrary bytes; an image they accept has buffers of the declared size
// and a patch grid that matches its plan.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "engine/media/decode.h"
#include "engine/media/preprocess.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tandem::media;
  DecodeLimits limits;
  limits.max_pixels = 1 << 20;  // keeps each run fast under ASan
  limits.max_jpeg_scans = 50;
  absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto image = DecodeImage(bytes, "", limits);
  if (!image.ok()) {
    if (image.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  const size_t n = static_cast<size_t>(image->width) * image->height;
  if (n == 0 || n > static_cast<size_t>(limits.max_pixels)) std::abort();
  switch (image->kind) {
    case PixelKind::kRgb:
      if (image->pixels.size() != 3 * n) std::abort();
      break;
    case PixelKind::kRgba:
    case PixelKind::kCmyk:
      if (image->pixels.size() != 4 * n) std::abort();
      break;
    case PixelKind::kGrey32:
      if (image->wide.size() != n) std::abort();
      break;
  }
  MediaConfig config;
  config.in_patch_limit = 64;
  config.patch_limit_on_one_side = 16;
  auto patched = Preprocess(*image, config);
  if (!patched.ok()) std::abort();
  const ResizePlan plan = PlanResize(image->width, image->height, config);
  if (patched->grid_h != plan.grid_h || patched->grid_w != plan.grid_w ||
      patched->patches.size() !=
          static_cast<size_t>(plan.grid_h) * plan.grid_w * patched->patch_dim()) {
    std::abort();
  }
  return 0;
}
