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
//   - VisionAttention (non-causal, within each image; the tower's only attention),
//     two kernels (launcher: VisionAttnCore):
//     * on tensor cores (VisionAttentionMmaKernel; head_dim % 16 == 0: K3's 128,
//       the tiny and mid towers' 48 and 64): FlashAttention-2 on mma.sync
//       m16n8k16, the design of MLA's expanded kernel (mla.cu MlaFlashChunkMma):
//       a block per (64-query tile, head, image), 4 warps of 16 query rows each
//       (a warp's online softmax stays in its registers), key tiles of 32 through
//       shared memory. Every operand is split-BF16 (q scaled, k, v and p as
//       hi + lo), three mma per product (hi.hi + hi.lo + lo.hi): error ~2^-16
//       relative per term, so the results stay within the SIMT kernel's bound of
//       the fp64 oracle (the CPU backend's, within fp32 rounding) at a third of
//       the tensor cores' BF16 rate. With bf16_operands ("cuda_bf16") every
//       operand is rounded to BF16 once instead: one mma a product, BF16 bounds;
//     * on CUDA cores (VisionAttentionKernel, any head_dim <= 128), fp32: a block
//       per (16-query tile, head, image), 4 warps of 4 queries each. Keys and
//       values stream through shared memory in tiles of 32 (a key per lane; the key
//       tile's rows padded to 129 floats so the lanes' column reads hit 32 banks).
//       Each lane scores its key against its warp's 4 queries (query rows in shared
//       memory, read as broadcasts), the warp takes the online-softmax max and sum
//       with shuffles (fp32 running max and denominator, as FlashAttention), writes
//       the 32 probabilities to shared memory, and every lane accumulates its own
//       output columns (d = lane + 32r, r < 4: head_dim <= 128) over the tile's
//       values.
//     docs/ARCHITECTURE.md "Image input on GPUs".
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/device_errors.h"
#include "kernels/cuda/ptx.h"
#include "kernels/cuda/vision.h"

namespace tandem::kernels::cuda {
namespace {

using ::tandem::gpu::FlashPvTile;
using ::tandem::gpu::FlashSoftmaxTile;
using ::tandem::gpu::kWarpSize;
using ::tandem::gpu::MmaBf16M16N8K16;
using ::tandem::gpu::MmaStride;
using ::tandem::gpu::ToBf16x2;
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
  bool pairs;  // q, k, v 8-byte aligned and ld_qkv even: float2 loads (mma kernel)
};

// Image img's tokens [*b, *b + *n) from cu_seqlens. A bad entry (the table not
// starting at 0 or not ending at num_tokens, a negative count, one above
// max_seqlen) is recorded once (by the image's first block) and the block
// returns false: the condition is the same for all its threads, so no barrier
// is left waiting.
__device__ __forceinline__ bool ImageRange(const AttnArgs& a, int64_t img, int64_t* b,
                                           int64_t* n) {
  const int64_t s = a.cu_seqlens[img], e = a.cu_seqlens[img + 1];
  *b = s;
  *n = e - s;
  const bool bad = (img == 0 && s != 0) || *n < 0 || *n > a.max_seqlen || s < 0 ||
                   e > a.num_tokens || (img == a.num_images - 1 && e != a.num_tokens);
  if (bad && threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0) {
    atomicCAS(a.error_word, 0, kBadImageTable);
  }
  return !bad;
}

__global__ void __launch_bounds__(kAttnWarps* kWarpSize)
    VisionAttentionKernel(AttnArgs a) {
  TANDEM_SHARED(float, ks, [kAttnKeyTile][kMaxHd + 1]);
  TANDEM_SHARED(float, vs, [kAttnKeyTile][kMaxHd]);
  TANDEM_SHARED(float, qs, [kAttnQueryTile][kMaxHd]);
  TANDEM_SHARED(float, ps, [kAttnWarps][kAttnQueriesPerWarp][kAttnKeyTile]);
  const int64_t h = blockIdx.y;
  const int hd = a.head_dim;
  int64_t b = 0, n = 0;
  if (!ImageRange(a, blockIdx.z, &b, &n)) return;
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

// ---- VisionAttention on tensor cores ---------------------------------------------
constexpr int kMmaWarps = 4;
constexpr int kMmaRows = kMmaWarps * 16;  // queries a block
constexpr int kMmaKeys = 32;              // keys a tile: 4 n8 tiles of scores
constexpr int kMmaMaxTiles = kMaxHd / 8;  // n8 tiles of output columns

// Shared memory: q hi/lo [64][s], k hi/lo and v hi/lo [32][s] (s = MmaStride(hd)
// words a row): 68 KiB at head_dim 128; half without the lo parts.
size_t MmaSmemBytes(int64_t head_dim, bool split) {
  return sizeof(uint32_t) * (split ? 2 : 1) * (kMmaRows + 2 * kMmaKeys) *
         MmaStride(head_dim);
}

// Elements p[0], p[1]: one 8-byte load where the launcher found them aligned.
__device__ __forceinline__ float2 Load2(const float* p, bool pairs) {
  return pairs ? *reinterpret_cast<const float2*>(p) : make_float2(p[0], p[1]);
}

// kSplit: every operand split-BF16, three mma a product (the exact backends);
// else rounded to BF16 once, one mma a product ("cuda_bf16": GpuPrecision::kBf16).
template <bool kSplit>
__global__ void __launch_bounds__(kMmaWarps* kWarpSize)
    VisionAttentionMmaKernel(AttnArgs a) {
  int64_t b = 0, n = 0;
  if (!ImageRange(a, blockIdx.z, &b, &n)) return;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kMmaRows;
  if (q0 >= n) return;
  const int hd = a.head_dim, half = hd / 2, steps = hd / 16, vt = hd / 8;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * hd;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int g = lane / 4, tq = lane % 4;
  const int64_t s = MmaStride(hd);
  TANDEM_DYNAMIC_SMEM(uint32_t, smem);
  // The lo parts (split only) follow the hi parts: [64][s] q, [32][s] k, v each.
  uint32_t* qh = smem;
  uint32_t* kh = qh + kMmaRows * s;
  uint32_t* vh = kh + kMmaKeys * s;
  uint32_t *ql = nullptr, *kl = nullptr, *vl = nullptr;
  if constexpr (kSplit) {
    ql = vh + kMmaKeys * s;
    kl = ql + kMmaRows * s;
    vl = kl + kMmaKeys * s;
  }
  const uint16_t* vh16 = reinterpret_cast<const uint16_t*>(vh);
  const uint16_t* vl16 = reinterpret_cast<const uint16_t*>(vl);

  // The tile's queries, scaled, split (rows past the image: zeros).
  for (int i = threadIdx.x; i < kMmaRows * half; i += blockDim.x) {
    const int r = i / half, w = i % half;
    const int64_t t = q0 + r;
    float x0 = 0.0f, x1 = 0.0f;
    if (t < n) {
      const float2 x = Load2(a.q + (b + t) * a.ld_qkv + col0 + 2 * w, a.pairs);
      x0 = a.scale * x.x;
      x1 = a.scale * x.y;
    }
    uint32_t lo;
    qh[r * s + w] = ToBf16x2<kSplit>(x0, x1, &lo);
    if constexpr (kSplit) ql[r * s + w] = lo;
  }
  // This lane's rows: 16 warp + g (hr 0) and + 8 (hr 1).
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float acc[kMmaMaxTiles][4];
#pragma unroll
  for (int j = 0; j < kMmaMaxTiles; ++j)
    acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0;
  const bool warp_live = q0 + 16 * warp < n;  // warp-uniform
  for (int64_t k0 = 0; k0 < n; k0 += kMmaKeys) {
    // The previous tile is consumed (first pass: the queries are stored).
    __syncthreads();
    for (int i = threadIdx.x; i < kMmaKeys * half; i += blockDim.x) {
      const int j = i / half, w = i % half;
      const int64_t kk = k0 + j;
      uint32_t khi = 0, klo = 0, vhi = 0, vlo = 0;
      if (kk < n) {
        const int64_t off = (b + kk) * a.ld_qkv + col0 + 2 * w;
        const float2 kx = Load2(a.k + off, a.pairs), vx = Load2(a.v + off, a.pairs);
        khi = ToBf16x2<kSplit>(kx.x, kx.y, &klo);
        vhi = ToBf16x2<kSplit>(vx.x, vx.y, &vlo);
      }
      kh[j * s + w] = khi;
      vh[j * s + w] = vhi;
      if constexpr (kSplit) {
        kl[j * s + w] = klo;
        vl[j * s + w] = vlo;
      }
    }
    __syncthreads();
    if (!warp_live) continue;  // every row of this warp lies past the image
    // S = Q K^T over 4 n8 tiles of keys: k-steps outside, so a step's Q
    // fragments are read once for the 4 tiles.
    float sc[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
    const uint32_t* q0h = qh + (16 * warp + g) * s;
    const uint32_t* q1h = q0h + 8 * s;
    for (int ks = 0; ks < steps; ++ks) {
      const int w0 = ks * 8 + tq;
      const uint32_t ah[4] = {q0h[w0], q1h[w0], q0h[w0 + 4], q1h[w0 + 4]};
      uint32_t al[4] = {0, 0, 0, 0};
      if constexpr (kSplit) {
        const uint32_t* q0l = ql + (16 * warp + g) * s;
        const uint32_t* q1l = q0l + 8 * s;
        al[0] = q0l[w0];
        al[1] = q1l[w0];
        al[2] = q0l[w0 + 4];
        al[3] = q1l[w0 + 4];
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const uint32_t* kbh = kh + (8 * nt + g) * s;
        const uint32_t bh[2] = {kbh[w0], kbh[w0 + 4]};
        MmaBf16M16N8K16(sc[nt], ah, bh);
        if constexpr (kSplit) {
          const uint32_t* kbl = kl + (8 * nt + g) * s;
          const uint32_t bl[2] = {kbl[w0], kbl[w0 + 4]};
          MmaBf16M16N8K16(sc[nt], ah, bl);
          MmaBf16M16N8K16(sc[nt], al, bh);
        }
      }
    }
    // Keys past the image: row hr's scores are sc[nt][2 hr + e], key
    // k0 + 8 nt + 2 tq + e. Key k0 is in the image: every row's maximum is finite.
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (k0 + 8 * nt + 2 * tq + e >= n) sc[nt][e] = sc[nt][2 + e] = -INFINITY;
      }
    }
    FlashSoftmaxTile<kMmaMaxTiles>(sc, m, l, acc);
    FlashPvTile<kSplit, kMmaMaxTiles>(sc, vh16, vl16, 2 * s, vt, g, tq, acc);
  }
  for (int hr = 0; hr < 2; ++hr) {
    const int64_t t = q0 + 16 * warp + g + 8 * hr;
    if (t >= n) continue;
    const float inv = 1.0f / l[hr];  // l >= 1: the row's maximum contributes exp(0)
    float* o = a.out + (b + t) * a.ld_out + col0 + 2 * tq;
#pragma unroll
    for (int j = 0; j < kMmaMaxTiles; ++j) {
      if (j >= vt) break;
      o[8 * j] = acc[j][2 * hr] * inv;
      o[8 * j + 1] = acc[j][2 * hr + 1] * inv;
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
                                  void* stream, VisionAttnCore core,
                                  bool bf16_operands) {
  if (num_images <= 0 || num_tokens <= 0 || max_seqlen <= 0 || heads <= 0) {
    return nullptr;
  }
  if (head_dim <= 0 || head_dim > kVisionMaxHeadDim) {
    return "vision_attention: head_dim must be in [1, kVisionMaxHeadDim]";
  }
  if (heads > 65535 || num_images > 65535) {
    return "vision_attention: more than 65535 heads or images in one call";
  }
  const bool mma_fits = head_dim % 16 == 0;
  if (core == VisionAttnCore::kTensorCore && !mma_fits) {
    return "vision_attention: the tensor-core kernel needs head_dim % 16 == 0";
  }
  const bool mma = core == VisionAttnCore::kTensorCore ||
                   (core == VisionAttnCore::kAuto && mma_fits);
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
                error_word,
                false};
  const auto aligned8 = [](const float* p) {
    return reinterpret_cast<uintptr_t>(p) % 8 == 0;
  };
  a.pairs = aligned8(q) && aligned8(k) && aligned8(v) && ld_qkv % 2 == 0;
  const int64_t rows = mma ? kMmaRows : kAttnQueryTile;
  const int64_t tiles = (max_seqlen + rows - 1) / rows;
  if (tiles > 0x7fffffff) return "vision_attention: max_seqlen too large";
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(heads),
                  static_cast<unsigned>(num_images));
  if (mma) {
    const size_t smem = MmaSmemBytes(head_dim, !bf16_operands);
    const dim3 block(kMmaWarps * kWarpSize);
    if (bf16_operands) {
      if (const char* e =
              ::tandem::gpu::AllowDynamicSmem(VisionAttentionMmaKernel<false>, smem)) {
        return e;
      }
      TANDEM_LAUNCH((VisionAttentionMmaKernel<false>), grid, block, smem, stream, a);
    } else {
      if (const char* e =
              ::tandem::gpu::AllowDynamicSmem(VisionAttentionMmaKernel<true>, smem)) {
        return e;
      }
      TANDEM_LAUNCH((VisionAttentionMmaKernel<true>), grid, block, smem, stream, a);
    }
  } else {
    TANDEM_LAUNCH(VisionAttentionKernel, grid, dim3(kAttnWarps * kWarpSize), 0, stream,
                  a);
  }
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
