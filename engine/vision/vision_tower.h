// Kimi K3's vision tower (MoonViT-V2) and projector (patchmergerv2) on the
// kernels::Backend interface (VISION.md section 2):
//
//   patches [P, 3p²] (BF16-rounded, as the reference casts them)
//     → patch embed GemmBf16 → + position table (bilinear to each image's grid)
//     → L × { x += wo(VisionAttention(Rope2d(wqkv(RmsNorm0 x))));
//             x += fc1(Gelu_tanh(fc0(RmsNorm1 x))) }
//     → final RmsNorm → Merge2x2 per image [N, 4D]
//     → proj.2(Gelu_erf(proj.0 m)) → RmsNorm(post_norm, projector_ln_eps) → [N, Ht]
//
// Attention is block-diagonal: each image attends only within itself, and its
// RoPE positions start at (0, 0), so an image's rows do not depend on the other
// images of the batch. On the host backends the weights are BF16 views into the
// checkpoint mapping (no copy), norm gains fp32 copies; on a device backend
// (cuda, cuda_sim) both are uploaded once at Create and every activation lives
// in device memory: only the patches, positions and position table go in, the
// embeddings come back. Activations fp32. Every vision tensor's shape is
// checked against vision_config at Load.
//
// Images are encoded in groups of at most kMaxPatchesPerCall patches (an image
// larger than that alone), so the activations a call needs are bounded:
// ActivationBytes(kMaxPatchesPerCall), which a GPU worker sets aside from its
// cache budget.
#ifndef TANDEM_ENGINE_VISION_VISION_TOWER_H_
#define TANDEM_ENGINE_VISION_VISION_TOWER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/media/patched_image.h"
#include "engine/model/checkpoint.h"
#include "engine/model/vision_config.h"
#include "kernels/backend.h"
#include "kernels/device.h"

namespace tandem::vision {

struct VisionBlockWeights {
  std::vector<float> norm0, norm1;  // [D]
  const uint16_t* wqkv = nullptr;   // [3Q, D]
  const uint16_t* wo = nullptr;     // [D, Q]
  const uint16_t* fc0 = nullptr;    // [I, D]
  const uint16_t* fc1 = nullptr;    // [D, I]
};

struct VisionWeights {
  model::VisionConfig config;
  const uint16_t* patch_embed = nullptr;  // [D, 3p²]
  std::vector<float> pos_emb;             // [H0, W0, D] fp32
  std::vector<VisionBlockWeights> blocks;
  std::vector<float> final_norm;    // [D]
  const uint16_t* proj0 = nullptr;  // [4M, 4M]
  const uint16_t* proj2 = nullptr;  // [Ht, 4M]
  std::vector<float> post_norm;     // [Ht]
};

// Every vision tensor of `ckpt` checked (dtype BF16, shape from the config; an
// error names the tensor and both shapes), plus vision tensors the table does
// not know. NotFound when config.json has no vision_config.
absl::StatusOr<VisionWeights> LoadVisionWeights(const model::Checkpoint& ckpt);

// The position table resized to a grid_h x grid_w grid (bilinear,
// align_corners=false, no antialias; as is when the grid equals the table):
// [grid_h * grid_w, D] row-major, fp32.
std::vector<float> InterpolatePosEmb(const std::vector<float>& table, int64_t h0,
                                     int64_t w0, int64_t d, int64_t grid_h,
                                     int64_t grid_w);

class VisionTower {
 public:
  // The patches one call of the tower's graph takes at most (the preprocessing's
  // default in_patch_limit), and those of the largest single image it can get:
  // the limit's 256 x 256 grid, each side padded to an even count (258 x 258).
  static constexpr int64_t kMaxPatchesPerCall = 65536;
  static constexpr int64_t kMaxPatchesPerImage = 258 * 258;

  // Fails (naming the op) on a backend that lacks an op the tower needs;
  // ResourceExhausted (naming the tower) when a device cannot hold its weights.
  static absl::StatusOr<std::unique_ptr<VisionTower>> Create(VisionWeights weights,
                                                             kernels::Backend* backend);
  static absl::StatusOr<std::unique_ptr<VisionTower>> Load(
      const model::Checkpoint& ckpt, kernels::Backend* backend);

  const model::VisionConfig& config() const { return w_.config; }
  // Device memory the uploaded weights take (0 on the host backends).
  int64_t weight_device_bytes() const { return weight_device_bytes_; }
  // Device memory one call over `patches` patches (in `images` images) holds
  // for its inputs and activations (the host backends allocate the same).
  int64_t ActivationBytes(int64_t patches, int64_t images = 1) const;
  // On a device backend: allocates now the buffer that calls of up to `patches`
  // patches in `images` images use (kept, and grown only by a larger call), so
  // the memory is taken at load and a call never waits on the allocator.
  // ResourceExhausted naming the tower when it does not fit. A no-op on the
  // host backends (each call allocates and frees its own). Returns the bytes
  // held.
  absl::StatusOr<int64_t> ReserveActivations(int64_t patches, int64_t images);
  // The group bound Encode uses (kMaxPatchesPerCall unless lowered: a smaller
  // activation peak for more, smaller calls; >= 4).
  int64_t max_patches_per_call() const { return max_patches_per_call_; }
  void set_max_patches_per_call(int64_t patches) {
    max_patches_per_call_ = patches < 4 ? 4 : patches;
  }

  // The embeddings of `images` in order: image i's num_tokens() rows of
  // text_hidden_size floats, concatenated ([sum N_i, Ht] row-major). Images
  // must have patch_size == config().patch_size, even grids, a patches vector
  // of grid_h * grid_w * 3p² values and grids <= 512 per side.
  absl::StatusOr<std::vector<float>> Encode(
      absl::Span<const media::PatchedImage* const> images);

 private:
  // The weights as the backend's ops take them: w_'s own pointers on the host,
  // uploaded copies on a device.
  struct BlockPtrs {
    const float* norm0 = nullptr;
    const float* norm1 = nullptr;
    const uint16_t* wqkv = nullptr;
    const uint16_t* wo = nullptr;
    const uint16_t* fc0 = nullptr;
    const uint16_t* fc1 = nullptr;
  };
  struct WeightPtrs {
    const uint16_t* patch_embed = nullptr;
    std::vector<BlockPtrs> blocks;
    const float* final_norm = nullptr;
    const uint16_t* proj0 = nullptr;
    const uint16_t* proj2 = nullptr;
    const float* post_norm = nullptr;
  };

  VisionTower(VisionWeights w, kernels::Backend* be) : w_(std::move(w)), be_(be) {}
  // Points p_ at w_ (host) or uploads w_ to the backend's device.
  absl::Status Place();
  // The byte sizes of one call's buffers, in the order EncodeGroup carves them.
  std::vector<size_t> BufferBytes(int64_t patches, int64_t images) const;
  const std::vector<float>& PosEmbFor(int64_t grid_h, int64_t grid_w);
  // One group of validated images (their patches within kMaxPatchesPerCall, or
  // one image).
  absl::StatusOr<std::vector<float>> EncodeGroup(
      absl::Span<const media::PatchedImage* const> images);

  VisionWeights w_;
  kernels::Backend* be_;
  WeightPtrs p_;
  std::vector<kernels::DeviceBuffer> uploaded_;
  kernels::DeviceBuffer arena_;  // device backends: the calls' buffers, kept
  int64_t weight_device_bytes_ = 0;
  int64_t max_patches_per_call_ = kMaxPatchesPerCall;
  std::map<std::pair<int64_t, int64_t>, std::vector<float>> pos_cache_;
};

}  // namespace tandem::vision

#endif  // TANDEM_ENGINE_VISION_VISION_TOWER_H_
