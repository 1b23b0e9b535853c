// One preprocessed image as the vision tower consumes it (VISION.md section 1):
// the patch grid after the resize plan and padding, the normalised pixels
// patchified, and a content hash for prefix-cache keys. Produced by
// engine/media/preprocess.h; consumed by engine/vision/ (the tower) and carried
// from the gateway to the prefill worker as proto ImageInput.
#ifndef TANDEM_ENGINE_MEDIA_PATCHED_IMAGE_H_
#define TANDEM_ENGINE_MEDIA_PATCHED_IMAGE_H_

#include <cstdint>
#include <vector>

namespace tandem::media {

struct PatchedImage {
  // Patch grid (grid_thw = [1, grid_h, grid_w]); both even (2x2 merge).
  int grid_h = 0;
  int grid_w = 0;
  // Side of one square patch in pixels (vision_config.patch_size, 14 for K3).
  int patch_size = 0;
  // The decoded image's original size (written into the prompt as
  // "image {W}x{H}").
  int original_width = 0;
  int original_height = 0;
  // [grid_h * grid_w, 3 * patch_size * patch_size] row-major: patch
  // p = i * grid_w + j (patch row i, column j), each flattened (c, ky, kx).
  // Values are normalised f32(f32(f32(v / 255) - 0.5) * 2); padding is -1.
  // (The reference casts these to BF16 before the patch embed; that cast is
  // the tower's.)
  std::vector<float> patches;
  // XXH3-64 of `patches` seeded with the grid: everything the tower's output
  // depends on, so equal pixels give equal hashes whatever their encoding.
  uint64_t content_hash = 0;

  int num_patches() const { return grid_h * grid_w; }
  int patch_dim() const { return 3 * patch_size * patch_size; }
  // Image tokens after the 2x2 merge: one <|media_pad|> each in the prompt.
  int num_tokens() const { return (grid_h / 2) * (grid_w / 2); }
};

}  // namespace tandem::media

#endif  // TANDEM_ENGINE_MEDIA_PATCHED_IMAGE_H_
