// GpuBackend: the vision tower's ops (kernels in vision.cu). Shapes are checked as
// the CPU backends check them (kernels/op_checks.h, the same messages); the
// position and cu_seqlens tables are device memory, checked by the kernels
// (device error word: the next Synchronize() reports a bad entry).
#include <cmath>
#include <cstddef>
#include <initializer_list>

#include "common/status.h"
#include "kernels/cuda/backend_util.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/vision.h"
#include "kernels/op_checks.h"

namespace tandem::kernels::cuda {
namespace {

using backend_util::Done;
using backend_util::kF;
using backend_util::Range;
using backend_util::Resident;
using backend_util::Span;

}  // namespace

absl::Status GpuBackend::Rope2d(float* x, int64_t ldx, const int32_t* pos,
                                int64_t tokens, int64_t heads, int64_t head_dim,
                                float theta) {
  TANDEM_RETURN_IF_ERROR(CheckRope2dShape(x, ldx, pos, tokens, heads, head_dim, theta));
  if (tokens == 0) return absl::OkStatus();
  if (head_dim > kRope2dMaxHeadDim) {
    return InvalidArgument("rope2d: head_dim ", head_dim, " > ", kRope2dMaxHeadDim,
                           ", the widest the ", name(), " kernel takes");
  }
  TANDEM_RETURN_IF_ERROR(Resident(
      *this, {{x, Span(tokens, heads * head_dim, ldx) * kF, "rope2d x"},
              {pos, static_cast<size_t>(2 * tokens) * sizeof(int32_t), "rope2d pos"}}));
  // The CPU backend's frequencies (fp32 pow), so the angles are its own.
  float freq[kRope2dMaxHeadDim / 4];
  for (int64_t i = 0; i < head_dim / 4; ++i) {
    freq[i] = 1.0f /
              std::pow(theta, static_cast<float>(4 * i) / static_cast<float>(head_dim));
  }
  return Done(this,
              LaunchRope2d(x, ldx, pos, tokens, heads, head_dim, freq, kMaxRopePosition,
                           error_word(), stream()),
              "rope2d");
}

absl::Status GpuBackend::Gelu(const float* x, int64_t ldx, float* y, int64_t ldy,
                              int64_t rows, int64_t n, bool tanh_approx) {
  TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldx, "gelu"));
  TANDEM_RETURN_IF_ERROR(CheckRows(rows, n, ldy, "gelu"));
  if (rows == 0 || n == 0) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(Resident(*this, {{x, Span(rows, n, ldx) * kF, "gelu x"},
                                          {y, Span(rows, n, ldy) * kF, "gelu y"}}));
  return Done(this, LaunchGelu(x, ldx, y, ldy, rows, n, tanh_approx, stream()), "gelu");
}

absl::Status GpuBackend::VisionAttention(const VisionAttnArgs& a) {
  TANDEM_RETURN_IF_ERROR(CheckVisionAttentionShape(a));
  if (a.num_images == 0 || a.num_tokens == 0) return absl::OkStatus();
  if (a.max_seqlen <= 0) {  // the grid is sized from it: every image would be skipped
    return InvalidArgument("vision_attention: max_seqlen ", a.max_seqlen, " with ",
                           a.num_tokens, " tokens");
  }
  if (a.head_dim > kVisionMaxHeadDim) {
    return InvalidArgument("vision_attention: head_dim ", a.head_dim, " > ",
                           kVisionMaxHeadDim, ", the widest the ", name(),
                           " kernel takes");
  }
  if (a.heads > 65535 || a.num_images > 65535) {
    return InvalidArgument("vision_attention: ", a.heads, " heads and ", a.num_images,
                           " images in one call (at most 65535 each)");
  }
  const int64_t width = a.heads * a.head_dim;
  TANDEM_RETURN_IF_ERROR(Resident(
      *this, {{a.q, Span(a.num_tokens, width, a.ld_qkv) * kF, "vision_attention q"},
              {a.k, Span(a.num_tokens, width, a.ld_qkv) * kF, "vision_attention k"},
              {a.v, Span(a.num_tokens, width, a.ld_qkv) * kF, "vision_attention v"},
              {a.out, Span(a.num_tokens, width, a.ld_out) * kF, "vision_attention out"},
              {a.cu_seqlens, static_cast<size_t>(a.num_images + 1) * sizeof(int32_t),
               "vision_attention cu_seqlens"}}));
  return Done(this,
              LaunchVisionAttention(
                  a.q, a.k, a.v, a.ld_qkv, a.out, a.ld_out, a.cu_seqlens, a.num_images,
                  a.num_tokens, a.max_seqlen, a.heads, a.head_dim, a.scale,
                  error_word(), stream(), VisionAttnCore::kAuto,
                  /*bf16_operands=*/precision() == GpuPrecision::kBf16),
              "vision_attention");
}

absl::Status GpuBackend::Merge2x2(const float* x, int64_t ldx, int64_t grid_h,
                                  int64_t grid_w, int64_t d, float* out, int64_t ldo) {
  TANDEM_RETURN_IF_ERROR(CheckMerge2x2(x, ldx, grid_h, grid_w, d, out, ldo));
  if (grid_h == 0 || grid_w == 0) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(Resident(
      *this, {{x, Span(grid_h * grid_w, d, ldx) * kF, "merge2x2 x"},
              {out, Span(grid_h * grid_w / 4, 4 * d, ldo) * kF, "merge2x2 out"}}));
  return Done(this, LaunchMerge2x2(x, ldx, grid_h, grid_w, d, out, ldo, stream()),
              "merge2x2");
}

}  // namespace tandem::kernels::cuda
