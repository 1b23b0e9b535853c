// The router and the routed MoE; the design is described in moe.h.
#include "kernels/cuda/vendor.h"
// (vendor.h first: it maps the CUDA programming model onto this toolchain.)

#include <cmath>

#include "kernels/cuda/device_errors.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/ptx.h"

namespace tandem::kernels::cuda {
namespace {

using ::tandem::gpu::Bf16ToF32;
using ::tandem::gpu::F32ToBf16;
using ::tandem::gpu::kFullMask;
using ::tandem::gpu::kWarpSize;

struct alignas(16) U32x4 {
  uint32_t v[4];
};

constexpr size_t Align256(size_t n) { return (n + 255) / 256 * 256; }

// 16 bytes from global memory: one vector load when aligned, else bytewise.
__device__ __forceinline__ U32x4 Load16(const uint8_t* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
    return *reinterpret_cast<const U32x4*>(p);
  }
  U32x4 r;
  for (int w = 0; w < 4; ++w) {
    r.v[w] = static_cast<uint32_t>(p[4 * w]) |
             (static_cast<uint32_t>(p[4 * w + 1]) << 8) |
             (static_cast<uint32_t>(p[4 * w + 2]) << 16) |
             (static_cast<uint32_t>(p[4 * w + 3]) << 24);
  }
  return r;
}

// ============================ RouterTopK ======================================

constexpr int kRouterSplits = 32;  // contiguous k ranges of a logit (see below)
static_assert(kRouterSplits == kWarpSize, "the GEMV kernel gives lane l range l");
constexpr int kGemvWarps = 8;      // experts per GEMV block (one per warp)
constexpr int kGemvTokens = 8;     // tokens per GEMV block
constexpr int kTiledTokens = 64;   // tiled kernel: 64 tokens x 64 experts per block,
constexpr int kTiledExperts = 64;  //   4 x 4 per thread, k tiles of 32
constexpr int kTiledK = 32;
constexpr int kTiledThreads = 256;
constexpr int kTiledMinTokens = 65;  // below: the GEMV kernel
constexpr int kTopKThreads = 256;

// Both logits kernels compute every logit in one fixed order, so a token's ids do
// not depend on the batch it is in (nor on which kernel ran): hidden is cut into
// kRouterSplits contiguous ranges of split_len (a multiple of 32) elements; each
// range is an fmaf chain in increasing k from 0, and logit = ((0 + p_0) + p_1) +
// ... + p_31 in fp32.
int RouterSplitLen(int64_t hidden) {
  const int64_t per = (hidden + kRouterSplits - 1) / kRouterSplits;
  return static_cast<int>((per + kTiledK - 1) / kTiledK * kTiledK);
}

// Decode / small batches: one warp per expert, lane l = split l, up to 8 tokens.
// The gate (12.8 MiB for K3) is streamed once per 8 tokens by E / 8 blocks. Lane l
// walks its own k range, so x is staged transposed, 32 k of every range at a time
// (xs[n][i][l] = x[n][l * split_len + i0 + i]: coalesced reads, conflict-free
// per-lane reads). kVec: hidden % 8 == 0 and gate 16-byte aligned.
constexpr int kGemvChunk = 32;
template <bool kVec>
__global__ void __launch_bounds__(kGemvWarps * 32)
    RouterGemvKernel(const float* x, int64_t ldx, const uint16_t* gate, int tokens,
                     int hidden, int num_experts, int split_len, float* logits) {
  TANDEM_SHARED(float, xs, [kGemvTokens][kGemvChunk][kRouterSplits + 1]);
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int e = blockIdx.y * kGemvWarps + warp;
  const bool has_e = e < num_experts;  // warp-uniform
  const int t0 = blockIdx.x * kGemvTokens;
  const int nt = std::min(int{kGemvTokens}, tokens - t0);
  const uint16_t* grow = gate + static_cast<int64_t>(has_e ? e : 0) * hidden;
  const int k0 = lane * split_len;  // this lane's range
  float acc[kGemvTokens];
#pragma unroll
  for (int n = 0; n < kGemvTokens; ++n) acc[n] = 0.0f;
  for (int i0 = 0; i0 < split_len; i0 += kGemvChunk) {
    __syncthreads();  // the previous chunk is consumed
    for (int idx = tid; idx < nt * kRouterSplits * kGemvChunk; idx += blockDim.x) {
      const int n = idx / (kRouterSplits * kGemvChunk);
      const int l = (idx / kGemvChunk) % kRouterSplits, i = idx % kGemvChunk;
      const int k = l * split_len + i0 + i;
      xs[n][i][l] = k < hidden ? x[static_cast<int64_t>(t0 + n) * ldx + k] : 0.0f;
    }
    __syncthreads();
    if (!has_e) continue;
    const int kc = k0 + i0;  // k of xs[.][0][lane]
    if (kVec) {
#pragma unroll
      for (int i = 0; i < kGemvChunk; i += 8) {
        if (kc + i >= hidden) break;  // hidden % 8 == 0: whole groups
        const U32x4 q = *reinterpret_cast<const U32x4*>(grow + kc + i);
        float w[8];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          w[2 * j] = Bf16ToF32(static_cast<uint16_t>(q.v[j] & 0xffffu));
          w[2 * j + 1] = Bf16ToF32(static_cast<uint16_t>(q.v[j] >> 16));
        }
#pragma unroll
        for (int n = 0; n < kGemvTokens; ++n) {
          if (n < nt) {
            float a = acc[n];
#pragma unroll
            for (int j = 0; j < 8; ++j) a = fmaf(xs[n][i + j][lane], w[j], a);
            acc[n] = a;
          }
        }
      }
    } else {
      for (int i = 0; i < kGemvChunk && kc + i < hidden; ++i) {
        const float w = Bf16ToF32(grow[kc + i]);
#pragma unroll
        for (int n = 0; n < kGemvTokens; ++n) {
          if (n < nt) acc[n] = fmaf(xs[n][i][lane], w, acc[n]);
        }
      }
    }
  }
  if (!has_e) return;  // no barrier below
  // The 32 range partials of each token, added in range order by lane n.
  TANDEM_SHARED(float, part, [kGemvWarps][kGemvTokens][kWarpSize]);
#pragma unroll
  for (int n = 0; n < kGemvTokens; ++n) {
    if (n < nt) part[warp][n][lane] = acc[n];
  }
  __syncwarp();
  if (lane < nt) {
    float total = 0.0f;
    for (int s = 0; s < kRouterSplits; ++s) total += part[warp][lane][s];
    logits[static_cast<int64_t>(t0 + lane) * num_experts + e] = total;
  }
}

// Prefill: 64 tokens x 64 experts per block, x and the widened gate staged in
// k tiles of 32 (split_len is a multiple of 32: tiles never straddle a split).
__global__ void __launch_bounds__(kTiledThreads)
    RouterTiledKernel(const float* x, int64_t ldx, const uint16_t* gate, int tokens,
                      int hidden, int num_experts, int split_len, float* logits) {
  TANDEM_SHARED(__align__(16) float, xs, [kTiledK][kTiledTokens + 4]);
  TANDEM_SHARED(__align__(16) float, gs, [kTiledK][kTiledExperts + 4]);
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const int t0 = blockIdx.x * kTiledTokens, e0 = blockIdx.y * kTiledExperts;
  float total[4][4], part[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) total[i][j] = 0.0f;
  }
  for (int s0 = 0; s0 < hidden; s0 += split_len) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) part[i][j] = 0.0f;
    }
    const int s1 = std::min(hidden, s0 + split_len);
    for (int kt = s0; kt < s1; kt += kTiledK) {
      __syncthreads();  // the previous tile is consumed
      for (int idx = tid; idx < kTiledTokens * kTiledK; idx += blockDim.x) {
        const int r = idx / kTiledK, c = idx % kTiledK, k = kt + c;
        const int t = t0 + r, e = e0 + r;
        xs[c][r] = (t < tokens && k < s1) ? x[static_cast<int64_t>(t) * ldx + k] : 0.0f;
        gs[c][r] = (e < num_experts && k < s1)
                       ? Bf16ToF32(gate[static_cast<int64_t>(e) * hidden + k])
                       : 0.0f;
      }
      __syncthreads();
      // Past s1 both tiles hold zeros: fmaf(0, 0, p) == p (a -0 partial may turn
      // +0, which no sigmoid sees).
#pragma unroll 8
      for (int c = 0; c < kTiledK; ++c) {
        float a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          a[i] = xs[c][ty * 4 + i];
          b[i] = gs[c][tx * 4 + i];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
          for (int j = 0; j < 4; ++j) part[i][j] = fmaf(a[i], b[j], part[i][j]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) total[i][j] += part[i][j];
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int t = t0 + ty * 4 + i;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int e = e0 + tx * 4 + j;
      if (t < tokens && e < num_experts) {
        logits[static_cast<int64_t>(t) * num_experts + e] = total[i][j];
      }
    }
  }
}

// (key, id) order of the router: larger key first, ties to the lower id.
__device__ __forceinline__ bool Better(float ka, int ia, float kb, int ib) {
  return ka > kb || (ka == kb && ia < ib);
}

// One block per token: sigmoid, bias, top_k arg-max rounds, weights.
__global__ void __launch_bounds__(kTopKThreads)
    RouterSelectKernel(const float* logits, const float* bias, int num_experts,
                       int top_k, bool renormalize, float scaling, int32_t* ids,
                       float* weights) {
  TANDEM_DYNAMIC_SMEM(float, smem);
  float* key = smem;                                          // [E]
  float* score = smem + num_experts;                          // [E]
  int* sel = reinterpret_cast<int*>(smem + 2 * num_experts);  // [top_k]
  TANDEM_SHARED(float, warp_key, [kTopKThreads / 32]);
  TANDEM_SHARED(int, warp_id, [kTopKThreads / 32]);
  const int t = blockIdx.x, tid = threadIdx.x, lane = tid % kWarpSize,
            warp = tid / kWarpSize;
  const int nwarps = blockDim.x / kWarpSize;
  for (int e = tid; e < num_experts; e += blockDim.x) {
    const float l = logits[static_cast<int64_t>(t) * num_experts + e];
    const float s = 1.0f / (1.0f + expf(-l));
    float k = s + (bias != nullptr ? bias[e] : 0.0f);
    if (k != k) k = -INFINITY;  // NaN keys rank last
    score[e] = s;
    key[e] = k;
  }
  __syncthreads();
  for (int r = 0; r < top_k; ++r) {
    float bk = -INFINITY;
    int bi = 0x7fffffff;
    for (int e = tid; e < num_experts; e += blockDim.x) {
      const float k = key[e];
      // Chosen experts are marked with a NaN key (never Better than anything).
      if (k == k && Better(k, e, bk, bi)) {
        bk = k;
        bi = e;
      }
    }
    for (int o = kWarpSize / 2; o > 0; o >>= 1) {
      const float ok = __shfl_xor_sync(kFullMask, bk, o);
      const int oi = __shfl_xor_sync(kFullMask, bi, o);
      if (Better(ok, oi, bk, bi)) {
        bk = ok;
        bi = oi;
      }
    }
    if (lane == 0) {
      warp_key[warp] = bk;
      warp_id[warp] = bi;
    }
    __syncthreads();
    if (tid == 0) {
      float k = warp_key[0];
      int i = warp_id[0];
      for (int w = 1; w < nwarps; ++w) {
        if (Better(warp_key[w], warp_id[w], k, i)) {
          k = warp_key[w];
          i = warp_id[w];
        }
      }
      sel[r] = i;
      key[i] = NAN;
    }
    __syncthreads();
  }
  if (tid == 0) {
    double sum = 0;
    for (int r = 0; r < top_k; ++r) sum += score[sel[r]];
    for (int r = 0; r < top_k; ++r) {
      double w = score[sel[r]];
      if (renormalize) w /= (sum + 1e-20);
      ids[static_cast<int64_t>(t) * top_k + r] = sel[r];
      weights[static_cast<int64_t>(t) * top_k + r] = static_cast<float>(w * scaling);
    }
  }
}

// ============================== MoeMxfp4 ======================================

constexpr int kSortThreads = 1024;
constexpr int kGemmWarps = 4;
constexpr int kGemmThreads = kGemmWarps * 32;
constexpr int kRowsPerBlock = kGemmWarps * 16;
// Pairs per tile kN: 32 (4 mma n-groups; a stage of 512 k, 4 x 16 bytes of each
// weight row per lane in flight: decode) or 64 (8 n-groups share each decoded
// weight register; a stage of 256 k: prefill). B rows are staged with a stride of
// stage + 16 BF16 (4 * 264 or 4 * 136 words: conflict-free, see StagePos).
// kSplit (exact mode): B is staged as its BF16 hi and lo rows, in stages of half
// the k, so the shared memory is the same.
template <int kN, bool kSplit = false>
constexpr int StageK() {
  return (kN == 32 ? 512 : 256) / (kSplit ? 2 : 1);
}
constexpr int kLargeTileMinTokens = 128;
constexpr int kReduceThreads = 256;
constexpr int kMaxNSplits = 4;  // blocks sharing one weight slab (grid.x)

// Scratch layout of one launch.
struct MoeScratch {
  int* offsets;     // [E + 1]
  int* active;      // [E] active expert ids, ascending
  int* num_active;  // [1]
  int* sorted;      // [P] pair ids grouped by expert
  uint16_t* zb;     // [T, hidden] BF16 z (split: then [T, hidden] of lo parts)
  uint16_t* act;    // [P, inter] BF16, sorted order (split: then the lo parts)
  float* y;         // [P, hidden] by pair id
  size_t bytes;
};

MoeScratch CarveMoeScratch(void* base, int64_t tokens, int64_t hidden, int64_t inter,
                           int64_t top_k, int64_t num_experts, bool split) {
  const int64_t parts = split ? 2 : 1;
  const int64_t pairs = tokens * top_k;
  char* p = static_cast<char*>(base);
  size_t off = 0;
  auto take = [&](size_t bytes) {
    char* r = p == nullptr ? nullptr : p + off;
    off += Align256(bytes);
    return r;
  };
  MoeScratch s;
  s.offsets = reinterpret_cast<int*>(take((num_experts + 1) * sizeof(int)));
  s.active = reinterpret_cast<int*>(take(num_experts * sizeof(int)));
  s.num_active = reinterpret_cast<int*>(take(sizeof(int)));
  s.sorted = reinterpret_cast<int*>(take(pairs * sizeof(int)));
  s.zb = reinterpret_cast<uint16_t*>(take(parts * tokens * hidden * sizeof(uint16_t)));
  s.act = reinterpret_cast<uint16_t*>(take(parts * pairs * inter * sizeof(uint16_t)));
  s.y = reinterpret_cast<float*>(take(pairs * hidden * sizeof(float)));
  s.bytes = off;
  return s;
}

__device__ __forceinline__ bool ValidExpert(const MoeExpertPtrs* experts, int e,
                                            int num_experts) {
  return e >= 0 && e < num_experts && experts[e].w1_packed != nullptr;
}

// One block: histogram -> exclusive scan -> active list -> scatter.
__global__ void __launch_bounds__(kSortThreads)
    MoeSortKernel(const int32_t* ids, int pairs, const MoeExpertPtrs* experts,
                  int num_experts, int* offsets, int* active, int* num_active,
                  int* sorted, int32_t* error_word) {
  // Counters in shared memory: block-scope atomics, and reads after the barrier
  // see them (global atomics live in L2, plain loads may hit a stale L1 line).
  TANDEM_DYNAMIC_SMEM(int, smem);
  int* counts = smem;                  // [E]
  int* cursor = smem + num_experts;    // [E]
  int* offs = smem + 2 * num_experts;  // [E + 1]
  TANDEM_SHARED(int, warp_sum, [kSortThreads / 32]);
  TANDEM_SHARED(int, warp_act, [kSortThreads / 32]);
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int nthreads = blockDim.x, nwarps = nthreads / kWarpSize;
  for (int e = tid; e < num_experts; e += nthreads) {
    counts[e] = 0;
    cursor[e] = 0;
  }
  __syncthreads();
  for (int p = tid; p < pairs; p += nthreads) {
    const int e = ids[p];
    if (e >= num_experts) {
      atomicCAS(error_word, static_cast<int32_t>(kDeviceOk),
                static_cast<int32_t>(kExpertIdOutOfRange));
    } else if (ValidExpert(experts, e, num_experts)) {
      atomicAdd(&counts[e], 1);
    }
  }
  __syncthreads();
  // Each thread scans a contiguous range of experts.
  const int per = (num_experts + nthreads - 1) / nthreads;
  const int e0 = std::min(num_experts, tid * per), e1 = std::min(num_experts, e0 + per);
  int my_sum = 0, my_act = 0;
  for (int e = e0; e < e1; ++e) {
    my_sum += counts[e];
    my_act += counts[e] > 0;
  }
  int inc_sum = my_sum, inc_act = my_act;
  for (int o = 1; o < kWarpSize; o <<= 1) {
    const int s = __shfl_up_sync(kFullMask, inc_sum, o);
    const int a = __shfl_up_sync(kFullMask, inc_act, o);
    if (lane >= o) {
      inc_sum += s;
      inc_act += a;
    }
  }
  if (lane == kWarpSize - 1) {
    warp_sum[warp] = inc_sum;
    warp_act[warp] = inc_act;
  }
  __syncthreads();
  if (warp == 0) {
    int s = lane < nwarps ? warp_sum[lane] : 0;
    int a = lane < nwarps ? warp_act[lane] : 0;
    for (int o = 1; o < kWarpSize; o <<= 1) {
      const int s2 = __shfl_up_sync(kFullMask, s, o);
      const int a2 = __shfl_up_sync(kFullMask, a, o);
      if (lane >= o) {
        s += s2;
        a += a2;
      }
    }
    if (lane < nwarps) {
      warp_sum[lane] = s;  // inclusive over warps
      warp_act[lane] = a;
    }
  }
  __syncthreads();
  int run_sum = inc_sum - my_sum + (warp > 0 ? warp_sum[warp - 1] : 0);
  int run_act = inc_act - my_act + (warp > 0 ? warp_act[warp - 1] : 0);
  for (int e = e0; e < e1; ++e) {
    offs[e] = offsets[e] = run_sum;
    if (counts[e] > 0) active[run_act++] = e;
    run_sum += counts[e];
  }
  if (tid == 0) {
    offs[num_experts] = offsets[num_experts] = warp_sum[nwarps - 1];
    *num_active = warp_act[nwarps - 1];
  }
  __syncthreads();
  for (int p = tid; p < pairs; p += nthreads) {
    const int e = ids[p];
    if (ValidExpert(experts, e, num_experts)) {
      sorted[offs[e] + atomicAdd(&cursor[e], 1)] = p;
    }
  }
}

// ---- MXFP4 -> BF16 in registers ----------------------------------------------
// One 32-bit register (two BF16, lower index low) from one byte of nibbles (low
// nibble = lower index): the byte is spread by a byte permute so that its nibbles
// sit in bits 12..15 and 28..31, then (r & 0x80008000) | ((r & 0x70007000) >> 6)
// places sign and the 3 magnitude bits of each as a BF16 whose value is exactly
// E2M1 * 2^-126 (0.5 becomes the subnormal 2^-127, 0 stays 0), and two BF16x2
// multiplies by powers of two apply 2^126 * 2^(s-127). Exact for every E8M0 byte
// (0xFF: NaN), the same values as the oracle's fp32 dequantisation.

__device__ __forceinline__ uint32_t BytePerm(uint32_t x, uint32_t y, uint32_t sel) {
#if defined(TANDEM_GPU_NVCC)
  return __byte_perm(x, y, sel);
#else
  const uint64_t xy = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    r |= static_cast<uint32_t>((xy >> (8 * ((sel >> (4 * i)) & 7u))) & 0xffu)
         << (8 * i);
  }
  return r;
#endif
}

// Two BF16 products (round to nearest even; exact for the power-of-two factors
// used here, subnormals included).
__device__ __forceinline__ uint32_t MulBf16x2(uint32_t a, uint32_t b) {
#if defined(TANDEM_GPU_NVCC)
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
#else
  const float lo = Bf16ToF32(static_cast<uint16_t>(a & 0xffffu)) *
                   Bf16ToF32(static_cast<uint16_t>(b & 0xffffu));
  const float hi = Bf16ToF32(static_cast<uint16_t>(a >> 16)) *
                   Bf16ToF32(static_cast<uint16_t>(b >> 16));
  return static_cast<uint32_t>(F32ToBf16(lo)) |
         (static_cast<uint32_t>(F32ToBf16(hi)) << 16);
#endif
}

// A lane's 32 weights of one row (one scale group) and their E8M0 scale byte.
struct RowGroup {
  U32x4 q;
  uint32_t s;
};

__device__ __forceinline__ RowGroup LoadRowGroup(const uint8_t* packed,
                                                 const uint8_t* scales, int64_t row,
                                                 int K, int k, bool has) {
  RowGroup r;
  if (has) {
    r.q = Load16(packed + row * (K / 2) + k / 2);
    r.s = scales[row * (K / 32) + k / 32];
  } else {
    r.q.v[0] = r.q.v[1] = r.q.v[2] = r.q.v[3] = 0u;
    r.s = 127u;
  }
  return r;
}

// The two BF16x2 factors of E8M0 scale s: 2^(s-1) and 1 for s <= 128, else 2^126
// and 2^(s-127) (NaN for 0xFF).
struct ScaleFactors {
  uint32_t m1, m2;
};

__device__ __forceinline__ ScaleFactors Factors(uint32_t s) {
  const uint32_t m1 = s <= 128u ? (s + 126u) << 7 : 0x7e80u;
  const uint32_t m2 = s <= 128u ? 0x3f80u : s == 255u ? 0x7fc0u : s << 7;
  return {m1 * 0x10001u, m2 * 0x10001u};
}

// The BF16 pair of byte b (0..15) of a RowGroup.
__device__ __forceinline__ uint32_t DecodePair(const RowGroup& g, const ScaleFactors& f,
                                               int b) {
  const uint32_t w = g.q.v[b >> 2];
  const uint32_t sh = static_cast<uint32_t>(b & 3);
  // Result byte 1 <- byte sh of (w << 4) (low nibble on top), byte 3 <- byte sh of
  // w (high nibble on top); bytes 0 and 2 are masked off below.
  const uint32_t r =
      BytePerm(w, w << 4, (sh << 12) | (sh << 8) | ((4u + sh) << 4) | (4u + sh));
  const uint32_t v = (r & 0x80008000u) | ((r & 0x70007000u) >> 6);
  return MulBf16x2(MulBf16x2(v, f.m1), f.m2);
}

// Where element c (0..StageK) of a staged row lives: inside each 128-element
// chunk, lane t's 32 elements (32t..32t+31) are interleaved so that k-step j of
// every lane reads 8 consecutive bytes at j * 16 + t * 4.
__device__ __forceinline__ int StagePos(int c) {
  const int chunk = c / 128, r = c % 128;
  const int t = r / 32, j = (r % 32) / 4, q = r % 4;
  return chunk * 128 + j * 16 + t * 4 + q;
}

__device__ __forceinline__ float SiTU(float g, float u, float beta, float lbeta) {
  const float sig = 1.0f / (1.0f + expf(-g));
  return beta * tanhf(g / beta) * sig * (lbeta * tanhf(u / lbeta));
}

// An activation as the down GEMM's B operand: BF16, and with kSplit its BF16
// remainder `lo` elements further on (hi + lo carries 16 significand bits).
template <bool kSplit>
__device__ __forceinline__ void StoreAct(uint16_t* act, int64_t lo, int64_t i,
                                         float v) {
  const uint16_t hi = F32ToBf16(v);
  act[i] = hi;
  if (kSplit) act[lo + i] = isfinite(v) ? F32ToBf16(v - Bf16ToF32(hi)) : uint16_t{0};
}

// The GEMV path of MoeGemmKernel (one warp's 16 rows, an expert with <= 8 pairs):
// lane (g, t) holds column g (pair g of the expert) of B, read straight from
// global memory (64 bytes per 128-k chunk, L1/L2-resident: z and the activations
// are small), and the weights stream through a ring of 4 chunks of registers, the
// next group's chunk c loaded as soon as chunk c is consumed (warps run free: no
// barrier). Same k order and mma sequence as the tiled path: the same bits.
template <bool kGlu, bool kSplit>
__device__ __forceinline__ void MoeGemvPath(
    const uint8_t* wa, const uint8_t* sa, const uint8_t* wb, const uint8_t* sb,
    const uint16_t* bsrc, int64_t b_lo, const int* pairs, int begin, int count,
    int top_k, int rows, int K, int64_t rg, int64_t rg8, uint16_t* act_out,
    int64_t act_lo, float beta, float lbeta, float* y) {
  const int lane = threadIdx.x % kWarpSize, g = lane / 4, t = lane % 4;
  const bool has_col = g < count;
  const int my_pair = has_col ? pairs[g] : 0;
  const uint16_t* brow =
      bsrc + (kGlu ? static_cast<int64_t>(my_pair / top_k) : begin + g) * K;
  float acc1[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc3[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  RowGroup r1[4][2], r3[4][2];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int k = 128 * c + 32 * t;
    r1[c][0] = LoadRowGroup(wa, sa, rg, K, k, k < K);
    r1[c][1] = LoadRowGroup(wa, sa, rg8, K, k, k < K);
    if (kGlu) {
      r3[c][0] = LoadRowGroup(wb, sb, rg, K, k, k < K);
      r3[c][1] = LoadRowGroup(wb, sb, rg8, K, k, k < K);
    }
  }
  for (int kb = 0; kb < K; kb += 512) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int kc = kb + 128 * c;
      if (kc < K) {  // warp-uniform
        const int k = kc + 32 * t;
        U32x4 bq[4], bl[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if (has_col && k < K) {
            bq[i] = *reinterpret_cast<const U32x4*>(brow + k + 8 * i);
            if (kSplit)
              bl[i] = *reinterpret_cast<const U32x4*>(brow + b_lo + k + 8 * i);
          } else {
            bq[i].v[0] = bq[i].v[1] = bq[i].v[2] = bq[i].v[3] = 0u;
            if (kSplit) bl[i] = bq[i];
          }
        }
        const ScaleFactors f1[2] = {Factors(r1[c][0].s), Factors(r1[c][1].s)};
        ScaleFactors f3[2] = {};
        if (kGlu) {
          f3[0] = Factors(r3[c][0].s);
          f3[1] = Factors(r3[c][1].s);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          uint32_t a[4], a3r[4];
          a[0] = DecodePair(r1[c][0], f1[0], 2 * j);
          a[1] = DecodePair(r1[c][1], f1[1], 2 * j);
          a[2] = DecodePair(r1[c][0], f1[0], 2 * j + 1);
          a[3] = DecodePair(r1[c][1], f1[1], 2 * j + 1);
          // Elements 4j..4j+3 of the lane's 32: bytes 8j..8j+7 of bq.
          const uint32_t b[2] = {bq[j / 2].v[2 * (j % 2)],
                                 bq[j / 2].v[2 * (j % 2) + 1]};
          const uint32_t b2[2] = {kSplit ? bl[j / 2].v[2 * (j % 2)] : 0u,
                                  kSplit ? bl[j / 2].v[2 * (j % 2) + 1] : 0u};
          ::tandem::gpu::MmaBf16M16N8K16(acc1, a, b);
          if (kSplit) ::tandem::gpu::MmaBf16M16N8K16(acc1, a, b2);
          if (kGlu) {
            a3r[0] = DecodePair(r3[c][0], f3[0], 2 * j);
            a3r[1] = DecodePair(r3[c][1], f3[1], 2 * j);
            a3r[2] = DecodePair(r3[c][0], f3[0], 2 * j + 1);
            a3r[3] = DecodePair(r3[c][1], f3[1], 2 * j + 1);
            ::tandem::gpu::MmaBf16M16N8K16(acc3, a3r, b);
            if (kSplit) ::tandem::gpu::MmaBf16M16N8K16(acc3, a3r, b2);
          }
        }
      }
      // Refill slot c with the next group's chunk c.
      const int kn = kb + 512 + 128 * c + 32 * t;
      r1[c][0] = LoadRowGroup(wa, sa, rg, K, kn, kn < K);
      r1[c][1] = LoadRowGroup(wa, sa, rg8, K, kn, kn < K);
      if (kGlu) {
        r3[c][0] = LoadRowGroup(wb, sb, rg, K, kn, kn < K);
        r3[c][1] = LoadRowGroup(wb, sb, rg8, K, kn, kn < K);
      }
    }
  }
  // Epilogue: d[0..1] = D[g][2t..2t+1], d[2..3] = D[g+8][2t..2t+1].
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int col = 2 * t + (i & 1);
    if (col >= count) continue;
    const int64_t row = (i < 2) ? rg : rg8;
    if (kGlu) {
      StoreAct<kSplit>(act_out, act_lo, static_cast<int64_t>(begin + col) * rows + row,
                       SiTU(acc1[i], acc3[i], beta, lbeta));
    } else {
      y[static_cast<int64_t>(pairs[col]) * rows + row] = acc1[i];
    }
  }
}

// The grouped GEMM of one (n-split, kRowsPerBlock rows, active expert) block over
// the expert's pair tiles n-split, n-split + gridDim.x, ... (kN pairs each):
// D[row, pair] = sum_k W[row, k] B[k, pair]. The n-splits of one weight slab are
// adjacent in launch order, so they run together and share its reads in L2.
// kGlu: W = w1 and w3 (rows = inter, K = hidden), B = zb[pair / top_k] (z in
//   BF16), act[pos, row] = bf16(SiTU(D1, D3)).
// !kGlu: W = w2 (rows = hidden, K = inter), B = act[pos], y[pair, row] = D.
// B rows are K long in both. An expert with at most 8 pairs (decode) takes the
// GEMV path instead (MoeGemvPath): one n-group, no shared memory, no barriers.
template <bool kGlu, int kN, bool kSplit>
__global__ void __launch_bounds__(kGemmThreads)
    MoeGemmKernel(const MoeExpertPtrs* experts, const int* active,
                  const int* num_active, const int* offsets, const int* sorted,
                  const uint16_t* bsrc, int64_t b_lo, int top_k, int rows, int K,
                  bool allow_gemv, uint16_t* act_out, int64_t act_lo, float beta,
                  float lbeta, float* y) {
  constexpr int kStageK = StageK<kN, kSplit>(), kZStride = kStageK + 16,
                kChunks = kStageK / 128, kParts = kSplit ? 2 : 1;
  // [part][pair][k]: the hi rows, then (kSplit) the lo rows.
  TANDEM_SHARED(__align__(16) uint16_t, bs, [kParts * kN * kZStride]);
  TANDEM_SHARED(int, tile_pair, [kN]);
  const int slot = blockIdx.z;
  if (slot >= *num_active) return;  // block-uniform, before any barrier
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int e = active[slot];
  const int begin = offsets[e], count = offsets[e + 1] - begin;
  const MoeExpertPtrs ex = experts[e];
  const uint8_t* wa = kGlu ? ex.w1_packed : ex.w2_packed;
  const uint8_t* sa = kGlu ? ex.w1_scale : ex.w2_scale;
  const uint8_t* wb = ex.w3_packed;
  const uint8_t* sb = ex.w3_scale;
  const int row0 = blockIdx.y * kRowsPerBlock + warp * 16;
  const bool warp_rows = row0 < rows;  // rows % 16 == 0: the whole 16 or none
  const int64_t rg = row0 + g, rg8 = row0 + g + 8;
  if (allow_gemv && count <= 8) {  // block-uniform
    if (blockIdx.x != 0 || !warp_rows) return;
    MoeGemvPath<kGlu, kSplit>(wa, sa, wb, sb, bsrc, b_lo, sorted + begin, begin, count,
                              top_k, rows, K, rg, rg8, act_out, act_lo, beta, lbeta, y);
    return;
  }

  for (int n0 = blockIdx.x * kN; n0 < count; n0 += gridDim.x * kN) {
    const int nt = std::min(kN, count - n0);
    const int groups = (nt + 7) / 8;  // mma n-groups in use
    const int staged_rows = groups * 8;
    __syncthreads();  // the previous tile's tile_pair / bs are consumed
    for (int i = tid; i < kN; i += blockDim.x) {
      tile_pair[i] = i < nt ? sorted[begin + n0 + i] : 0;
    }
    float acc1[kN / 8][4], acc3[kN / 8][4];
#pragma unroll
    for (int n = 0; n < kN / 8; ++n) {
      for (int i = 0; i < 4; ++i) acc1[n][i] = acc3[n][i] = 0.0f;
    }
    for (int kc0 = 0; kc0 < K; kc0 += kStageK) {
      // This stage's weights, issued before the staging barrier (in flight while B
      // is staged): up to 4 chunks of 128 k, rows g and g+8 (of w1 and w3).
      RowGroup a1[kChunks][2], a3[kChunks][2];
      if (warp_rows) {
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          const int k = kc0 + 128 * c + 32 * t;
          const bool has = k < K;
          a1[c][0] = LoadRowGroup(wa, sa, rg, K, k, has);
          a1[c][1] = LoadRowGroup(wa, sa, rg8, K, k, has);
          if (kGlu) {
            a3[c][0] = LoadRowGroup(wb, sb, rg, K, k, has);
            a3[c][1] = LoadRowGroup(wb, sb, rg8, K, k, has);
          }
        }
      }
      __syncthreads();  // tile_pair written; the previous stage's bs consumed
      for (int idx = tid; idx < kParts * staged_rows * kStageK; idx += blockDim.x) {
        const int part = idx / (staged_rows * kStageK);
        const int rem = idx % (staged_rows * kStageK);
        const int n = rem / kStageK, c = rem % kStageK, k = kc0 + c;
        uint16_t v = 0;
        if (n < nt && k < K) {
          const int64_t brow = kGlu ? tile_pair[n] / top_k : begin + n0 + n;
          v = bsrc[(part != 0 ? b_lo : 0) + brow * K + k];
        }
        bs[(part * kN + n) * kZStride + StagePos(c)] = v;
      }
      __syncthreads();
      if (!warp_rows) continue;  // warp-uniform; barriers are outside
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        if (kc0 + 128 * c >= K) continue;  // block-uniform
        const ScaleFactors f1[2] = {Factors(a1[c][0].s), Factors(a1[c][1].s)};
        ScaleFactors f3[2] = {};
        if (kGlu) {
          f3[0] = Factors(a3[c][0].s);
          f3[1] = Factors(a3[c][1].s);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          uint32_t a[4], a3r[4];
          a[0] = DecodePair(a1[c][0], f1[0], 2 * j);
          a[1] = DecodePair(a1[c][1], f1[1], 2 * j);
          a[2] = DecodePair(a1[c][0], f1[0], 2 * j + 1);
          a[3] = DecodePair(a1[c][1], f1[1], 2 * j + 1);
          if (kGlu) {
            a3r[0] = DecodePair(a3[c][0], f3[0], 2 * j);
            a3r[1] = DecodePair(a3[c][1], f3[1], 2 * j);
            a3r[2] = DecodePair(a3[c][0], f3[0], 2 * j + 1);
            a3r[3] = DecodePair(a3[c][1], f3[1], 2 * j + 1);
          }
#pragma unroll
          for (int n = 0; n < kN / 8; ++n) {
            if (n >= groups) continue;  // block-uniform
            const uint32_t* src = reinterpret_cast<const uint32_t*>(
                bs + (n * 8 + g) * kZStride + c * 128 + j * 16 + t * 4);
            const uint32_t b[2] = {src[0], src[1]};
            uint32_t b2[2] = {0u, 0u};
            if (kSplit) {
              const uint32_t* lo = src + kN * kZStride / 2;  // the lo rows' copy
              b2[0] = lo[0];
              b2[1] = lo[1];
            }
            ::tandem::gpu::MmaBf16M16N8K16(acc1[n], a, b);
            if (kSplit) ::tandem::gpu::MmaBf16M16N8K16(acc1[n], a, b2);
            if (kGlu) {
              ::tandem::gpu::MmaBf16M16N8K16(acc3[n], a3r, b);
              if (kSplit) ::tandem::gpu::MmaBf16M16N8K16(acc3[n], a3r, b2);
            }
          }
        }
      }
    }
    if (!warp_rows) continue;
      // Epilogue: d[0..1] = D[g][2t..2t+1], d[2..3] = D[g+8][2t..2t+1].
#pragma unroll
    for (int n = 0; n < kN / 8; ++n) {
      if (n >= groups) continue;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int col = n * 8 + 2 * t + (i & 1);
        if (col >= nt) continue;
        const int64_t row = (i < 2) ? rg : rg8;
        if (kGlu) {
          StoreAct<kSplit>(act_out, act_lo,
                           static_cast<int64_t>(begin + n0 + col) * rows + row,
                           SiTU(acc1[n][i], acc3[n][i], beta, lbeta));
        } else {
          y[static_cast<int64_t>(tile_pair[col]) * rows + row] = acc1[n][i];
        }
      }
    }
  }
}

// zb[t, i] = bf16(z[t, i]): the B operand of the gate/up GEMM, converted once
// (split: and its remainder, `lo` elements further on).
template <bool kSplit>
__global__ void __launch_bounds__(kReduceThreads)
    MoeZToBf16Kernel(const float* z, int64_t ld_z, int hidden, uint16_t* zb,
                     int64_t lo) {
  const int t = blockIdx.x;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    StoreAct<kSplit>(zb, lo, static_cast<int64_t>(t) * hidden + i,
                     z[static_cast<int64_t>(t) * ld_z + i]);
  }
}

// out[t, c] = sum over valid slots, in slot order, of weights[t, s] * y[t*K+s, c].
__global__ void __launch_bounds__(kReduceThreads)
    MoeReduceKernel(const int32_t* ids, const float* weights,
                    const MoeExpertPtrs* experts, int num_experts, int top_k,
                    const float* y, int hidden, float* out, int64_t ld_out) {
  TANDEM_DYNAMIC_SMEM(float, w);  // [top_k], 0 weight + flag for skipped slots
  int* valid = reinterpret_cast<int*>(w + top_k);
  const int t = blockIdx.x;
  for (int s = threadIdx.x; s < top_k; s += blockDim.x) {
    const int64_t p = static_cast<int64_t>(t) * top_k + s;
    valid[s] = ValidExpert(experts, ids[p], num_experts);
    w[s] = weights[p];
  }
  __syncthreads();
  for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < top_k; ++s) {
      if (valid[s])
        acc = fmaf(w[s], y[(static_cast<int64_t>(t) * top_k + s) * hidden + c], acc);
    }
    out[static_cast<int64_t>(t) * ld_out + c] = acc;
  }
}

}  // namespace

// ---- Launchers ----------------------------------------------------------------

size_t RouterScratchBytes(int64_t tokens, int64_t num_experts) {
  return Align256(static_cast<size_t>(tokens * num_experts) * sizeof(float));
}

const char* LaunchRouterTopK(const float* x, int64_t ldx, const uint16_t* gate,
                             const float* bias, int64_t tokens, int64_t hidden,
                             int64_t num_experts, int64_t top_k, bool renormalize,
                             float scaling, int32_t* ids, float* weights, void* scratch,
                             void* stream) {
  if (tokens == 0 || top_k == 0) return nullptr;
  float* logits = static_cast<float*>(scratch);
  const int split_len = RouterSplitLen(hidden);
  const int T = static_cast<int>(tokens), H = static_cast<int>(hidden),
            E = static_cast<int>(num_experts);
  if (tokens >= kTiledMinTokens) {
    const dim3 grid(
        static_cast<unsigned>((tokens + kTiledTokens - 1) / kTiledTokens),
        static_cast<unsigned>((num_experts + kTiledExperts - 1) / kTiledExperts));
    TANDEM_LAUNCH(RouterTiledKernel, grid, dim3(kTiledThreads), 0, stream, x, ldx, gate,
                  T, H, E, split_len, logits);
  } else {
    const dim3 grid(static_cast<unsigned>((tokens + kGemvTokens - 1) / kGemvTokens),
                    static_cast<unsigned>((num_experts + kGemvWarps - 1) / kGemvWarps));
    const bool vec = hidden % 8 == 0 && (reinterpret_cast<uintptr_t>(gate) & 15u) == 0;
    if (vec) {
      TANDEM_LAUNCH(RouterGemvKernel<true>, grid, dim3(kGemvWarps * 32), 0, stream, x,
                    ldx, gate, T, H, E, split_len, logits);
    } else {
      TANDEM_LAUNCH(RouterGemvKernel<false>, grid, dim3(kGemvWarps * 32), 0, stream, x,
                    ldx, gate, T, H, E, split_len, logits);
    }
  }
  if (const char* err = ::tandem::gpu::LaunchError()) return err;
  const size_t smem = static_cast<size_t>(2 * num_experts + top_k) * sizeof(float);
  // Opted in below 48 KiB already: without it, static and dynamic shared memory
  // together may not pass 48 KiB (the kernel's static part is under 4 KiB).
  if (smem > 44 * 1024) {
    if (const char* err = ::tandem::gpu::AllowDynamicSmem(RouterSelectKernel, smem)) {
      return err;
    }
  }
  TANDEM_LAUNCH(RouterSelectKernel, dim3(static_cast<unsigned>(tokens)),
                dim3(kTopKThreads), smem, stream, logits, bias,
                static_cast<int>(num_experts), static_cast<int>(top_k), renormalize,
                scaling, ids, weights);
  return ::tandem::gpu::LaunchError();
}

size_t MoeScratchBytes(int64_t tokens, int64_t hidden, int64_t inter, int64_t top_k,
                       int64_t num_experts, bool split) {
  return CarveMoeScratch(nullptr, tokens, hidden, inter, top_k, num_experts, split)
      .bytes;
}

namespace {

// The two grouped GEMMs with kN-pair tiles.
template <int kN, bool kSplit>
const char* LaunchGemms(const MoeLaunchArgs& a, const MoeScratch& s, int64_t max_active,
                        void* stream) {
  const int K = static_cast<int>(a.top_k);
  const int64_t z_lo = kSplit ? a.tokens * a.hidden : 0;
  const int64_t act_lo = kSplit ? a.tokens * a.top_k * a.inter : 0;
  // n-splits: an expert rarely has more pairs than tokens (decode: 1 split).
  const unsigned splits =
      static_cast<unsigned>(std::min<int64_t>(kMaxNSplits, (a.tokens + kN - 1) / kN));
  const dim3 grid1(splits,
                   static_cast<unsigned>((a.inter + kRowsPerBlock - 1) / kRowsPerBlock),
                   static_cast<unsigned>(max_active));
  TANDEM_LAUNCH((MoeGemmKernel<true, kN, kSplit>), grid1, dim3(kGemmThreads), 0, stream,
                a.experts, s.active, s.num_active, s.offsets, s.sorted,
                static_cast<const uint16_t*>(s.zb), z_lo, K, static_cast<int>(a.inter),
                static_cast<int>(a.hidden), a.allow_gemv, s.act, act_lo, a.situ_beta,
                a.situ_linear_beta, static_cast<float*>(nullptr));
  if (const char* err = ::tandem::gpu::LaunchError()) return err;
  const dim3 grid2(
      splits, static_cast<unsigned>((a.hidden + kRowsPerBlock - 1) / kRowsPerBlock),
      static_cast<unsigned>(max_active));
  TANDEM_LAUNCH((MoeGemmKernel<false, kN, kSplit>), grid2, dim3(kGemmThreads), 0,
                stream, a.experts, s.active, s.num_active, s.offsets, s.sorted,
                static_cast<const uint16_t*>(s.act), act_lo, K,
                static_cast<int>(a.hidden), static_cast<int>(a.inter), a.allow_gemv,
                static_cast<uint16_t*>(nullptr), int64_t{0}, 0.0f, 0.0f, s.y);
  return ::tandem::gpu::LaunchError();
}

}  // namespace

const char* LaunchMoeMxfp4(const MoeLaunchArgs& a, void* scratch, int32_t* error_word,
                           void* stream) {
  if (a.tokens == 0) return nullptr;
  if (a.tokens > kMoeChunkTokens) return "moe: launch over kMoeChunkTokens tokens";
  const int64_t pairs = a.tokens * a.top_k;
  const MoeScratch s = CarveMoeScratch(scratch, a.tokens, a.hidden, a.inter, a.top_k,
                                       a.num_experts, a.split_bf16);
  const int E = static_cast<int>(a.num_experts), K = static_cast<int>(a.top_k);
  if (pairs > 0 && E > 0) {
    const size_t sort_smem = (3 * static_cast<size_t>(E) + 1) * sizeof(int);
    if (sort_smem > 44 * 1024) {  // as RouterSelect: room for the static part
      if (const char* err = ::tandem::gpu::AllowDynamicSmem(MoeSortKernel, sort_smem)) {
        return err;
      }
    }
    TANDEM_LAUNCH(MoeSortKernel, dim3(1), dim3(kSortThreads), sort_smem, stream, a.ids,
                  static_cast<int>(pairs), a.experts, E, s.offsets, s.active,
                  s.num_active, s.sorted, error_word);
    if (const char* err = ::tandem::gpu::LaunchError()) return err;
    const int64_t max_active = std::min<int64_t>(a.num_experts, pairs);
    if (max_active > 65535) return "moe: more than 65535 active experts per launch";
    const int64_t z_lo = a.tokens * a.hidden;
    if (a.split_bf16) {
      TANDEM_LAUNCH(MoeZToBf16Kernel<true>, dim3(static_cast<unsigned>(a.tokens)),
                    dim3(kReduceThreads), 0, stream, a.z, a.ld_z,
                    static_cast<int>(a.hidden), s.zb, z_lo);
    } else {
      TANDEM_LAUNCH(MoeZToBf16Kernel<false>, dim3(static_cast<unsigned>(a.tokens)),
                    dim3(kReduceThreads), 0, stream, a.z, a.ld_z,
                    static_cast<int>(a.hidden), s.zb, z_lo);
    }
    if (const char* err = ::tandem::gpu::LaunchError()) return err;
    const int tile_n =
        a.tile_n != 0 ? a.tile_n : (a.tokens >= kLargeTileMinTokens ? 64 : 32);
    const char* err =
        a.split_bf16
            ? (tile_n == 64 ? LaunchGemms<64, true>(a, s, max_active, stream)
                            : LaunchGemms<32, true>(a, s, max_active, stream))
            : (tile_n == 64 ? LaunchGemms<64, false>(a, s, max_active, stream)
                            : LaunchGemms<32, false>(a, s, max_active, stream));
    if (err != nullptr) return err;
  }
  const size_t smem = static_cast<size_t>(K) * (sizeof(float) + sizeof(int));
  TANDEM_LAUNCH(MoeReduceKernel, dim3(static_cast<unsigned>(a.tokens)),
                dim3(kReduceThreads), smem, stream, a.ids, a.weights, a.experts, E, K,
                static_cast<const float*>(s.y), static_cast<int>(a.hidden), a.out,
                a.ld_out);
  return ::tandem::gpu::LaunchError();
}

}  // namespace tandem::kernels::cuda
