// K3 image preprocessing, VISION.md section 1: the resize plan, Pillow BICUBIC
// resize in the decoded image's mode, the alpha chessboard composite after the
// resize, zero padding to whole 2x2 merge blocks, normalisation and patchify
// into a PatchedImage.
#ifndef TANDEM_ENGINE_MEDIA_PREPROCESS_H_
#define TANDEM_ENGINE_MEDIA_PREPROCESS_H_

#include <array>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/media/decode.h"
#include "engine/media/patched_image.h"

namespace tandem::media {

// vision_config and preprocessor_config.json's media_proc_cfg. Defaults are
// the published K3 values.
struct MediaConfig {
  int patch_size = 14;
  int merge_kernel = 2;  // merge_kernel_size [2, 2]
  int64_t in_patch_limit = 65536;
  int patch_limit_on_one_side = 512;
  std::array<float, 3> image_mean = {0.5f, 0.5f, 0.5f};
  std::array<float, 3> image_std = {0.5f, 0.5f, 0.5f};
  // transparent_bg_config "chessboard" (transparent_bg_fill_stage
  // after_resize is the only stage implemented).
  int chessboard_square = 8;
  int chessboard_white = 255;  // the top-left square
  int chessboard_gray = 180;

  absl::Status Validate() const;
};

struct ResizePlan {
  int width = 0;  // w', h': the resized size
  int height = 0;
  int pad_right = 0;  // to a multiple of patch_size * merge_kernel
  int pad_bottom = 0;
  int grid_h = 0;  // patches
  int grid_w = 0;
  int num_tokens() const { return grid_h * grid_w / 4; }
};

// s = min(1, sqrt(in_patch_limit / (max(1, W // p) * max(1, H // p))),
//         L / W, L / H) with L = patch_limit_on_one_side * p;
// w' = min(max(1, floor(W * s)), L), h' alike; padded to multiples of
// p * merge_kernel.
ResizePlan PlanResize(int width, int height, const MediaConfig& config);

// The image at the plan's size as 8-bit RGB (resized in the decoded mode,
// composited on the chessboard when it has alpha), before padding.
std::vector<uint8_t> ResizedRgb(const DecodedImage& image, const ResizePlan& plan,
                                const MediaConfig& config);

// The whole section-1 pipeline.
absl::StatusOr<PatchedImage> Preprocess(const DecodedImage& image,
                                        const MediaConfig& config = {});

}  // namespace tandem::media

#endif  // TANDEM_ENGINE_MEDIA_PREPROCESS_H_
