#include "kernels/cuda/vendor.h"
// The vision tower's kernels (launchers declared in vision.h): Rope2d, Gelu,
// VisionAttention, Merge2x2. fp32 math throughout, the precise cosf/sinf/expf/
// tanhf/erff, as the CPU backend computes them.
//
// Design:
//   - Rope2d: a thread per (token, head, quarter i): it rotates the pairs (4i,
//     4i+1) by col * f_i and (4i+2, 4i+3) by row * f_i. The frequencies come from
//     the host (the CPU backend's fp32 formula) as a kernel argument, so the angles
//     are the CPU's bit for bit; a bad position is recorded once per token.
//   - Gelu, Merge2x2: flat grid-stride loops, an element per thread (Merge2x2 is a
//     permutation copy: coalesced along d on both sides).
//   - VisionAttention (non-causal, within each image; the tower's only attention):
//     a block per (16-query tile, head, image), 4 warps of 4 queries each. Keys and
//     values stream through shared memory in tiles of 32 (a key per lane; the key
//     tile's rows padded to 129 floats so the lanes' column reads hit 32 banks).
//     Each lane scores its key against its warp's 4 queries (query rows in shared
//     memory, read as broadcasts), the warp takes the online-softmax max and sum
//     with shuffles (fp32 running max and denominator, as FlashAttention), writes
//     the 32 probabilities to shared memory, and every lane accumulates its own
//     output columns (d = lane + 32r, r < 4: head_dim <= 128) over the tile's
//     values. CUDA cores, fp32: the tower is a small share of a request's work
//     (K3's: 27 layers of 1024 wide against the text model's 93 of 7168), so
//     this kernel favours exactness (the CPU backend's results within fp32
//     rounding) over tensor cores; docs/ARCHITECTURE.md "Image input on GPUs".
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/device_errors.h"
#include "kernels/cuda/vision.h"

namespace tandem::kernels::cuda {
namespace {

using ::tandem::gpu::kWarpSize;
using ::tandem::gpu::WarpMax;
using ::tandem::gpu::WarpSum;

constexpr int kThreads = 256;
constexpr int64_t kMaxGridBlocks = 16384;  // grid-stride loops beyond this

inline unsigned GridFor(int64_t units, int threads) {
  const int64_t blocks = (units + threads - 1) / threads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(blocks, kMaxGridBlocks)));
}

// ---- Rope2d ----------------------------------------------------------------------
struct RopeFreqs {
  float f[kRope2dMaxHeadDim / 4];
};

__device__ __forceinline__ void Rotate(float* e, float angle) {
  const float c = cosf(angle), s = sinf(angle);
  const float a = e[0], b = e[1];
  e[0] = a * c - b * s;
  e[1] = a * s + b * c;
}

__global__ void Rope2dKernel(float* x, int64_t ldx, const int32_t* pos, int64_t tokens,
                             int heads, int head_dim, RopeFreqs freq,
                             int32_t max_position, int32_t* error_word) {
  const int quarter = head_dim / 4;
  const int64_t total = tokens * heads * quarter;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < total; i += stride) {
    const int qi = static_cast<int>(i % quarter);
    const int64_t th = i / quarter;
    const int h = static_cast<int>(th % heads);
    const int64_t t = th / heads;
    const int32_t row = pos[2 * t], col = pos[2 * t + 1];
    if (row < 0 || row >= max_position || col < 0 || col >= max_position) {
      if (qi == 0 && h == 0) atomicCAS(error_word, 0, kPositionOutOfRange);
      continue;
    }
    const float f = freq.f[qi];
    float* e = x + t * ldx + static_cast<int64_t>(h) * head_dim + 4 * qi;
    Rotate(e, static_cast<float>(col) * f);
    Rotate(e + 2, static_cast<float>(row) * f);
  }
}

// ---- Gelu ------------------------------------------------------------------------
template <bool kTanh>
__global__ void GeluKernel(const float* x, int64_t ldx, float* y, int64_t ldy,
                           int64_t rows, int64_t n) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  constexpr float kInvSqrt2 = 0.7071067811865476f;
  const int64_t total = rows * n;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < total; i += stride) {
    const int64_t r = i / n, c = i % n;
    const float v = x[r * ldx + c];
    float g;
    if constexpr (kTanh) {
      g = 0.5f * v * (1.0f + tanhf(kSqrt2OverPi * (v + 0.044715f * v * v * v)));
    } else {
      g = 0.5f * v * (1.0f + erff(v * kInvSqrt2));
    }
    y[r * ldy + c] = g;
  }
}

// ---- Merge2x2 --------------------------------------------------------------------
__global__ void Merge2x2Kernel(const float* x, int64_t ldx, int64_t grid_w, int64_t d,
                               int64_t merged, float* out, int64_t ldo) {
  const int64_t width = 4 * d, total = merged * width, half_w = grid_w / 2;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < total; i += stride) {
    const int64_t m = i / width, rem = i % width;
    const int64_t part = rem / d, c = rem % d;
    const int64_t r = 2 * (m / half_w) + part / 2, col = 2 * (m % half_w) + part % 2;
    out[m * ldo + rem] = x[(r * grid_w + col) * ldx + c];
  }
}

// ---- VisionAttention -------------------------------------------------------------
constexpr int kAttnWarps = 4;
constexpr int kAttnQueriesPerWarp = 4;
constexpr int kAttnQueryTile = kAttnWarps * kAttnQueriesPerWarp;  // 16
constexpr int kAttnKeyTile = kWarpSize;                           // a key per lane
constexpr int kAttnDimRegs = static_cast<int>(kVisionMaxHeadDim) / kWarpSize;  // 4
constexpr int kMaxHd = static_cast<int>(kVisionMaxHeadDim);

struct AttnArgs {
  const float* q;
  const float* k;
  const float* v;
  int64_t ld_qkv;
  float* out;
  int64_t ld_out;
  const int32_t* cu_seqlens;
  int64_t num_images;
  int64_t num_tokens;
  int64_t max_seqlen;
  int head_dim;
  float scale;
  int32_t* error_word;
};

__global__ void __launch_bounds__(kAttnWarps* kWarpSize)
    VisionAttentionKernel(AttnArgs a) {
  TANDEM_SHARED(float, ks, [kAttnKeyTile][kMaxHd + 1]);
  TANDEM_SHARED(float, vs, [kAttnKeyTile][kMaxHd]);
  TANDEM_SHARED(float, qs, [kAttnQueryTile][kMaxHd]);
  TANDEM_SHARED(float, ps, [kAttnWarps][kAttnQueriesPerWarp][kAttnKeyTile]);
  const int64_t img = blockIdx.z;
  const int64_t h = blockIdx.y;
  const int hd = a.head_dim;
  const int64_t b = a.cu_seqlens[img], e = a.cu_seqlens[img + 1];
  const int64_t n = e - b;
  const bool bad = (img == 0 && b != 0) || n < 0 || n > a.max_seqlen || b < 0 ||
                   e > a.num_tokens || (img == a.num_images - 1 && e != a.num_tokens);
  if (bad) {
    if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0) {
      atomicCAS(a.error_word, 0, kBadImageTable);
    }
    return;  // the whole block: no barrier is left waiting
  }
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kAttnQueryTile;
  if (q0 >= n) return;
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int64_t col0 = h * hd;

  for (int i = tid; i < kAttnQueryTile * hd; i += blockDim.x) {
    const int r = i / hd, c = i % hd;
    const int64_t t = q0 + r;
    qs[r][c] = t < n ? a.q[(b + t) * a.ld_qkv + col0 + c] : 0.0f;
  }
  float m[kAttnQueriesPerWarp], l[kAttnQueriesPerWarp];
  float acc[kAttnQueriesPerWarp][kAttnDimRegs];
  for (int qq = 0; qq < kAttnQueriesPerWarp; ++qq) {
    m[qq] = -INFINITY;
    l[qq] = 0.0f;
    for (int r = 0; r < kAttnDimRegs; ++r) acc[qq][r] = 0.0f;
  }
  for (int64_t k0 = 0; k0 < n; k0 += kAttnKeyTile) {
    // The previous tile (keys, values and the warps' probabilities) is consumed;
    // on the first pass: the queries are loaded.
    __syncthreads();
    for (int i = tid; i < kAttnKeyTile * hd; i += blockDim.x) {
      const int j = i / hd, c = i % hd;
      const int64_t kk = k0 + j;
      const bool in = kk < n;
      ks[j][c] = in ? a.k[(b + kk) * a.ld_qkv + col0 + c] : 0.0f;
      vs[j][c] = in ? a.v[(b + kk) * a.ld_qkv + col0 + c] : 0.0f;
    }
    __syncthreads();
    const bool valid = k0 + lane < n;
    float s[kAttnQueriesPerWarp] = {};
    for (int c = 0; c < hd; ++c) {
      const float kc = ks[lane][c];
      for (int qq = 0; qq < kAttnQueriesPerWarp; ++qq) {
        s[qq] += qs[warp * kAttnQueriesPerWarp + qq][c] * kc;
      }
    }
    for (int qq = 0; qq < kAttnQueriesPerWarp; ++qq) {
      const float sc = valid ? s[qq] * a.scale : -INFINITY;
      const float m_new = fmaxf(m[qq], WarpMax(sc));  // finite: key k0 is valid
      const float p = valid ? expf(sc - m_new) : 0.0f;
      const float alpha = expf(m[qq] - m_new);  // 0 on the first tile
      l[qq] = l[qq] * alpha + WarpSum(p);
      m[qq] = m_new;
      ps[warp][qq][lane] = p;
      for (int r = 0; r < kAttnDimRegs; ++r) acc[qq][r] *= alpha;
    }
    __syncwarp();
    const int kn = n - k0 < kAttnKeyTile ? static_cast<int>(n - k0) : kAttnKeyTile;
    for (int j = 0; j < kn; ++j) {
      for (int r = 0; r < kAttnDimRegs; ++r) {
        const int c = lane + r * kWarpSize;
        if (c >= hd) break;
        const float vc = vs[j][c];
        for (int qq = 0; qq < kAttnQueriesPerWarp; ++qq) {
          acc[qq][r] += ps[warp][qq][j] * vc;
        }
      }
    }
  }
  for (int qq = 0; qq < kAttnQueriesPerWarp; ++qq) {
    const int64_t t = q0 + warp * kAttnQueriesPerWarp + qq;
    if (t >= n) break;
    const float inv = 1.0f / l[qq];
    float* o = a.out + (b + t) * a.ld_out + col0;
    for (int r = 0; r < kAttnDimRegs; ++r) {
      const int c = lane + r * kWarpSize;
      if (c < hd) o[c] = acc[qq][r] * inv;
    }
  }
}

}  // namespace

const char* LaunchRope2d(float* x, int64_t ldx, const int32_t* pos, int64_t tokens,
                         int64_t heads, int64_t head_dim, const float* freq,
                         int32_t max_position, int32_t* error_word, void* stream) {
  if (tokens <= 0 || heads <= 0 || head_dim <= 0) return nullptr;
  if (head_dim % 4 != 0 || head_dim > kRope2dMaxHeadDim) {
    return "rope2d: head_dim must be a multiple of 4 and at most kRope2dMaxHeadDim";
  }
  RopeFreqs f = {};
  for (int64_t i = 0; i < head_dim / 4; ++i) f.f[i] = freq[i];
  const int64_t units = tokens * heads * (head_dim / 4);
  TANDEM_LAUNCH(Rope2dKernel, dim3(GridFor(units, kThreads)), dim3(kThreads), 0, stream,
                x, ldx, pos, tokens, static_cast<int>(heads),
                static_cast<int>(head_dim), f, max_position, error_word);
  return ::tandem::gpu::LaunchError();
}

const char* LaunchGelu(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t rows,
                       int64_t n, bool tanh_approx, void* stream) {
  if (rows <= 0 || n <= 0) return nullptr;
  const dim3 grid(GridFor(rows * n, kThreads)), block(kThreads);
  if (tanh_approx) {
    TANDEM_LAUNCH((GeluKernel<true>), grid, block, 0, stream, x, ldx, y, ldy, rows, n);
  } else {
    TANDEM_LAUNCH((GeluKernel<false>), grid, block, 0, stream, x, ldx, y, ldy, rows, n);
  }
  return ::tandem::gpu::LaunchError();
}

const char* LaunchVisionAttention(const float* q, const float* k, const float* v,
                                  int64_t ld_qkv, float* out, int64_t ld_out,
                                  const int32_t* cu_seqlens, int64_t num_images,
                                  int64_t num_tokens, int64_t max_seqlen, int64_t heads,
                                  int64_t head_dim, float scale, int32_t* error_word,
                                  void* stream) {
  if (num_images <= 0 || num_tokens <= 0 || max_seqlen <= 0 || heads <= 0) {
    return nullptr;
  }
  if (head_dim <= 0 || head_dim > kVisionMaxHeadDim) {
    return "vision_attention: head_dim must be in [1, kVisionMaxHeadDim]";
  }
  if (heads > 65535 || num_images > 65535) {
    return "vision_attention: more than 65535 heads or images in one call";
  }
  AttnArgs a = {q,
                k,
                v,
                ld_qkv,
                out,
                ld_out,
                cu_seqlens,
                num_images,
                num_tokens,
                max_seqlen,
                static_cast<int>(head_dim),
                scale,
                error_word};
  const int64_t tiles = (max_seqlen + kAttnQueryTile - 1) / kAttnQueryTile;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(heads),
                  static_cast<unsigned>(num_images));
  TANDEM_LAUNCH(VisionAttentionKernel, grid, dim3(kAttnWarps * kWarpSize), 0, stream,
                a);
  return ::tandem::gpu::LaunchError();
}

const char* LaunchMerge2x2(const float* x, int64_t ldx, int64_t grid_h, int64_t grid_w,
                           int64_t d, float* out, int64_t ldo, void* stream) {
  if (grid_h <= 0 || grid_w <= 0 || d <= 0) return nullptr;
  const int64_t merged = grid_h * grid_w / 4;
  TANDEM_LAUNCH(Merge2x2Kernel, dim3(GridFor(merged * 4 * d, kThreads)), dim3(kThreads),
                0, stream, x, ldx, grid_w, d, merged, out, ldo);
  return ::tandem::gpu::LaunchError();
}

}  // namespace tandem::kernels::cuda
