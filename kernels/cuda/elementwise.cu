#include "kernels/cuda/vendor.h"
// The element-wise, norm, conv, gate, cache-write and residual-mix kernels of the
// GPU backend (launchers declared in elementwise.h).
//
// Design (all memory-bound; fp32 math, the precise expf/tanhf):
//   - norms (RmsNorm, L2NormHeads, KdaOutputGate, the fused add+RMSNorm): one
//     kernel template over a "segment" (a row, or one head of a row). Segments of
//     <= 1024 elements get a warp each (shuffle reduction, no barrier); longer ones
//     a block (warp sums -> shared memory -> every warp reduces the partials). Two
//     passes over the segment: the sum of squares, then the scaled output. Each
//     element is read and written by the same thread in both passes, so y == x is
//     safe once the reduction (which every thread of the segment joins) is done.
//     float4 loads/stores when every pointer is 16-byte aligned and the width and
//     strides are multiples of 4; scalar (still coalesced) otherwise.
//   - binary element-wise ops (SiTU-GLU, MulSigmoid, KDA gates): a 2-D grid of
//     column chunks x rows (float4 units where aligned), no per-element division;
//     AddInPlace: a flat grid-stride loop (float4 body, scalar tail).
//   - row copies (EmbeddingGather, PagedCacheWrite): a block per token; the index
//     is checked once per block and a bad one is recorded in the error word.
//   - CausalConv1dSilu: a thread per channel and chunk of >= kernel-1 tokens, with a
//     sliding window in registers (kernel 2..4; any other size reads its taps from
//     memory). Only the first chunk reads the old state, and that same thread writes
//     the new state afterwards (ascending rows: a row is read before it is
//     overwritten), so blocks never race on the state.
//   - AttnResMix: (1) a block per (token, bank entry) reduces sum(V^2) and
//     sum(V * norm_w * proj_w) into a score in scratch; (2) blocks over (hidden
//     chunk, token) take the softmax of the token's scores and write the weighted sum.
//     The second kernel only starts after the first has read all of p, so out == p
//     is safe; within it each element is read and written by one thread.
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/device_errors.h"
#include "kernels/cuda/elementwise.h"

namespace tandem::kernels::cuda {
namespace {

using ::tandem::gpu::kWarpSize;
using ::tandem::gpu::WarpSum;

#if defined(TANDEM_GPU_NVCC)
using F4 = float4;
using U32x2 = uint2;
#else
struct alignas(16) F4 {
  float x, y, z, w;
};
struct alignas(8) U32x2 {
  uint32_t x, y;
};
#endif

constexpr int kElementwiseThreads = 256;
constexpr int64_t kMaxGridBlocks = 16384;  // grid-stride loops beyond this
constexpr int64_t kWarpSegmentMax = 1024;  // longer norm segments get a block
constexpr int kWarpsPerNormBlock = 4;
constexpr int kNormWarpModeThreads = kWarpsPerNormBlock * kWarpSize;

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

inline bool Aligned(const void* p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}
// Row r of a [rows, n] array with stride ld starts 16-byte aligned for every r.
inline bool RowsAligned16(const void* p, int64_t ld, int64_t rows) {
  return Aligned(p, 16) && (rows <= 1 || ld % 4 == 0);
}

inline unsigned GridFor(int64_t units, int threads) {
  const int64_t blocks = (units + threads - 1) / threads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(blocks, kMaxGridBlocks)));
}

// Sum over the block (blockDim.x a multiple of the warp size, <= 1024). `sh` holds
// kWarpSize floats; one use per kernel (no barrier before the partials are written).
__device__ __forceinline__ float BlockSum(float v, float* sh) {
  v = WarpSum(v);
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  return WarpSum(lane < warps ? sh[lane] : 0.0f);
}

// ---- Norms -----------------------------------------------------------------------
enum NormMode : int {
  kRms = 0,      // y = x * rsqrt(mean(x^2) + eps) * w
  kL2 = 1,       // y = x * rsqrt(sum(x^2) + eps) * scale
  kRmsGate = 2,  // y = x * rsqrt(mean(x^2) + eps) * w * sigmoid(gate)
  kAddRms = 3,   // x += res; y = x * rsqrt(mean(x^2) + eps) * w
};

struct NormArgs {
  const float* x;  // kAddRms: read and written (x_out == x)
  float* x_out;
  int64_t ldx;
  const float* res;  // kAddRms
  int64_t ldr;
  const float* w;  // [d]; kRms, kRmsGate, kAddRms
  const float* gate;
  int64_t ldg;
  float* y;
  int64_t ldy;
  int64_t segments;  // rows * heads
  int64_t heads;
  int64_t d;
  float eps;
  float scale;
};

template <int kMode>
__device__ __forceinline__ float NormOut(float v, float f, const float* w,
                                         const float* gate, int64_t i) {
  if constexpr (kMode == kL2) {
    return v * f;
  } else if constexpr (kMode == kRmsGate) {
    return v * f * w[i] * Sigmoid(gate[i]);
  } else {
    return v * f * w[i];
  }
}

template <int kMode, bool kVec, bool kBlock>
__global__ void __launch_bounds__(kBlock ? 1024 : kNormWarpModeThreads)
    NormKernel(NormArgs a) {
  TANDEM_SHARED(float, partials, [kWarpSize]);
  int64_t seg;
  int tid, stride;
  if constexpr (kBlock) {
    seg = blockIdx.x;
    tid = threadIdx.x;
    stride = blockDim.x;
  } else {
    seg = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarpSize) +
          threadIdx.x / kWarpSize;
    tid = threadIdx.x % kWarpSize;
    stride = kWarpSize;
    if (seg >= a.segments) return;  // the whole warp leaves together
  }
  const int64_t row = seg / a.heads, col = (seg % a.heads) * a.d;
  const float* x = a.x + row * a.ldx + col;
  float* y = a.y + row * a.ldy + col;
  const float* gate = nullptr;
  if constexpr (kMode == kRmsGate) gate = a.gate + row * a.ldg + col;
  const float* res = nullptr;
  float* xo = nullptr;
  if constexpr (kMode == kAddRms) {
    res = a.res + row * a.ldr + col;
    xo = a.x_out + row * a.ldx + col;
  }
  const float* w = a.w;

  // Pass 1: sum of squares (kAddRms: of x + res, written back to x).
  float ss = 0.0f;
  if constexpr (kVec) {
    const int64_t nv = a.d / 4;
    for (int64_t i = tid; i < nv; i += stride) {
      F4 v = reinterpret_cast<const F4*>(x)[i];
      if constexpr (kMode == kAddRms) {
        const F4 r = reinterpret_cast<const F4*>(res)[i];
        v.x += r.x;
        v.y += r.y;
        v.z += r.z;
        v.w += r.w;
        reinterpret_cast<F4*>(xo)[i] = v;
      }
      ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
  } else {
    for (int64_t i = tid; i < a.d; i += stride) {
      float v = x[i];
      if constexpr (kMode == kAddRms) {
        v += res[i];
        xo[i] = v;
      }
      ss += v * v;
    }
  }
  if constexpr (kBlock) {
    ss = BlockSum(ss, partials);
  } else {
    ss = WarpSum(ss);
  }
  const float f = kMode == kL2 ? a.scale * rsqrtf(ss + a.eps)
                               : rsqrtf(ss / static_cast<float>(a.d) + a.eps);

  // Pass 2: the output. Every element is re-read by the thread that read (or, for
  // kAddRms, wrote) it in pass 1; all reads of the segment precede the reduction.
  const float* src = kMode == kAddRms ? xo : x;
  if constexpr (kVec) {
    const int64_t nv = a.d / 4;
    for (int64_t i = tid; i < nv; i += stride) {
      const F4 v = reinterpret_cast<const F4*>(src)[i];
      F4 o;
      if constexpr (kMode == kL2) {
        o = {v.x * f, v.y * f, v.z * f, v.w * f};
      } else {
        const F4 wv = reinterpret_cast<const F4*>(w)[i];
        o = {v.x * f * wv.x, v.y * f * wv.y, v.z * f * wv.z, v.w * f * wv.w};
        if constexpr (kMode == kRmsGate) {
          const F4 gv = reinterpret_cast<const F4*>(gate)[i];
          o.x *= Sigmoid(gv.x);
          o.y *= Sigmoid(gv.y);
          o.z *= Sigmoid(gv.z);
          o.w *= Sigmoid(gv.w);
        }
      }
      reinterpret_cast<F4*>(y)[i] = o;
    }
  } else {
    for (int64_t i = tid; i < a.d; i += stride) {
      y[i] = NormOut<kMode>(src[i], f, w, gate, i);
    }
  }
}

template <int kMode, bool kVec>
const char* LaunchNormMode(const NormArgs& a, void* stream) {
  if (a.d <= kWarpSegmentMax) {
    const int threads = kNormWarpModeThreads;
    const int64_t blocks = (a.segments + kWarpsPerNormBlock - 1) / kWarpsPerNormBlock;
    TANDEM_LAUNCH((NormKernel<kMode, kVec, false>), dim3(static_cast<unsigned>(blocks)),
                  dim3(threads), 0, stream, a);
  } else {
    // About 4 units (float4 or float) per thread, 128..1024 threads.
    const int64_t units = kVec ? a.d / 4 : a.d;
    int64_t threads = (units + 3) / 4;
    threads = (threads + kWarpSize - 1) / kWarpSize * kWarpSize;
    threads = std::min<int64_t>(1024, std::max<int64_t>(128, threads));
    TANDEM_LAUNCH((NormKernel<kMode, kVec, true>),
                  dim3(static_cast<unsigned>(a.segments)),
                  dim3(static_cast<unsigned>(threads)), 0, stream, a);
  }
  return ::tandem::gpu::LaunchError();
}

template <int kMode>
const char* LaunchNorm(const NormArgs& a, void* stream) {
  if (a.segments <= 0 || a.d <= 0) return nullptr;
  const int64_t rows = a.segments / a.heads;
  bool vec = a.d % 4 == 0 && RowsAligned16(a.x, a.ldx, rows) &&
             RowsAligned16(a.y, a.ldy, rows);
  if (kMode != kL2) vec = vec && Aligned(a.w, 16);
  if (kMode == kRmsGate) vec = vec && RowsAligned16(a.gate, a.ldg, rows);
  if (kMode == kAddRms) vec = vec && RowsAligned16(a.res, a.ldr, rows);
  return vec ? LaunchNormMode<kMode, true>(a, stream)
             : LaunchNormMode<kMode, false>(a, stream);
}

// ---- Binary element-wise ops -------------------------------------------------------
struct SituOp {
  float beta, lbeta;
  __device__ __forceinline__ float operator()(float g, float u) const {
    return beta * tanhf(g / beta) * Sigmoid(g) * (lbeta * tanhf(u / lbeta));
  }
};
struct MulSigmoidOp {
  __device__ __forceinline__ float operator()(float x, float g) const {
    return x * Sigmoid(g);
  }
};

// Blocks (column chunk, row group): no per-element division; rows beyond the grid's
// 65535 loop.
template <typename Op, bool kVec>
__global__ void BinaryKernel(const float* a, int64_t lda, const float* b, int64_t ldb,
                             float* out, int64_t ldo, int64_t rows, int64_t n, Op op) {
  const int64_t units = kVec ? n / 4 : n;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= units) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    if constexpr (kVec) {
      const F4 av = reinterpret_cast<const F4*>(a + r * lda)[c];
      const F4 bv = reinterpret_cast<const F4*>(b + r * ldb)[c];
      F4 o;
      o.x = op(av.x, bv.x);
      o.y = op(av.y, bv.y);
      o.z = op(av.z, bv.z);
      o.w = op(av.w, bv.w);
      reinterpret_cast<F4*>(out + r * ldo)[c] = o;
    } else {
      out[r * ldo + c] = op(a[r * lda + c], b[r * ldb + c]);
    }
  }
}

// A 2-D grid over `rows` x `units` columns: x column chunks, y rows (looped past
// 65535).
inline dim3 RowGrid(int64_t rows, int64_t units, int threads) {
  return dim3(static_cast<unsigned>((units + threads - 1) / threads),
              static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
}

template <typename Op>
const char* LaunchBinary(const float* a, int64_t lda, const float* b, int64_t ldb,
                         float* out, int64_t ldo, int64_t rows, int64_t n, Op op,
                         void* stream) {
  if (rows <= 0 || n <= 0) return nullptr;
  const bool vec = n % 4 == 0 && RowsAligned16(a, lda, rows) &&
                   RowsAligned16(b, ldb, rows) && RowsAligned16(out, ldo, rows);
  constexpr int kThreads = 128;
  const dim3 grid = RowGrid(rows, vec ? n / 4 : n, kThreads), block(kThreads);
  if (vec) {
    TANDEM_LAUNCH((BinaryKernel<Op, true>), grid, block, 0, stream, a, lda, b, ldb, out,
                  ldo, rows, n, op);
  } else {
    TANDEM_LAUNCH((BinaryKernel<Op, false>), grid, block, 0, stream, a, lda, b, ldb,
                  out, ldo, rows, n, op);
  }
  return ::tandem::gpu::LaunchError();
}

template <bool kVec>
__global__ void AddInPlaceKernel(float* y, const float* x, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if constexpr (kVec) {
    const int64_t nv = n / 4;
    for (int64_t i = first; i < nv; i += step) {
      F4 v = reinterpret_cast<F4*>(y)[i];
      const F4 u = reinterpret_cast<const F4*>(x)[i];
      v.x += u.x;
      v.y += u.y;
      v.z += u.z;
      v.w += u.w;
      reinterpret_cast<F4*>(y)[i] = v;
    }
    if (first < n - 4 * nv) y[4 * nv + first] += x[4 * nv + first];  // the tail
  } else {
    for (int64_t i = first; i < n; i += step) y[i] += x[i];
  }
}

__global__ void KdaGatesKernel(const float* graw, int64_t ld_graw, const float* a_log,
                               const float* dt_bias, const float* braw, int64_t ld_braw,
                               float lower_bound, int64_t tokens, int64_t heads,
                               int64_t d, float* g, float* beta) {
  // Blocks (column chunk, token group); the columns (h * d + c) fit in 32 bits.
  const int width = static_cast<int>(heads * d);
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= width) return;
  const float bias = dt_bias[j], a = expf(a_log[j / static_cast<int>(d)]);
  for (int64_t t = blockIdx.y; t < tokens; t += gridDim.y) {
    g[t * width + j] = lower_bound * Sigmoid(a * (graw[t * ld_graw + j] + bias));
    if (j < heads) beta[t * heads + j] = Sigmoid(braw[t * ld_braw + j]);
  }
}

// ---- Row copies with device indices
// --------------------------------------------------
template <bool kVec>
__global__ void EmbeddingKernel(const uint16_t* table, int64_t vocab, int64_t first,
                                int64_t rows, int64_t hidden, const int32_t* ids,
                                int64_t tokens, float* out, int32_t* error_word) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int32_t id = ids[t];
    if ((id < 0 || id >= vocab) && threadIdx.x == 0) {
      atomicCAS(error_word, 0, kTokenIdOutOfRange);
    }
    // Another rank's row (vocabulary parallelism) or a bad id: zeros.
    const bool ok = id >= first && id < first + rows;
    const uint16_t* src =
        table + (ok ? (static_cast<int64_t>(id) - first) * hidden : 0);
    float* dst = out + t * hidden;
    if constexpr (kVec) {
      for (int64_t i = threadIdx.x; i < hidden / 4; i += blockDim.x) {
        F4 o = {0.0f, 0.0f, 0.0f, 0.0f};
        if (ok) {
          const U32x2 b = reinterpret_cast<const U32x2*>(src)[i];
          o.x = __uint_as_float(b.x << 16);
          o.y = __uint_as_float(b.x & 0xffff0000u);
          o.z = __uint_as_float(b.y << 16);
          o.w = __uint_as_float(b.y & 0xffff0000u);
        }
        reinterpret_cast<F4*>(dst)[i] = o;
      }
    } else {
      for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
        dst[i] = ok ? ::tandem::gpu::Bf16ToF32(src[i]) : 0.0f;
      }
    }
  }
}

template <bool kVec>
__global__ void CacheWriteKernel(const float* src, int64_t ld_src, const int32_t* slots,
                                 int64_t tokens, int64_t width, uint16_t* cache,
                                 int64_t num_slots, int32_t* error_word) {
  using ::tandem::gpu::F32ToBf16;
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int32_t slot = slots[t];
    if (slot < 0) continue;  // padding
    if (slot >= num_slots) {
      if (threadIdx.x == 0) atomicCAS(error_word, 0, kSlotOutOfRange);
      continue;
    }
    const float* s = src + t * ld_src;
    uint16_t* dst = cache + static_cast<int64_t>(slot) * width;
    if constexpr (kVec) {
      for (int64_t i = threadIdx.x; i < width / 4; i += blockDim.x) {
        const F4 v = reinterpret_cast<const F4*>(s)[i];
        U32x2 o;
        o.x = ::tandem::gpu::PackBf16x2(F32ToBf16(v.x), F32ToBf16(v.y));
        o.y = ::tandem::gpu::PackBf16x2(F32ToBf16(v.z), F32ToBf16(v.w));
        reinterpret_cast<U32x2*>(dst)[i] = o;
      }
    } else {
      for (int64_t i = threadIdx.x; i < width; i += blockDim.x)
        dst[i] = F32ToBf16(s[i]);
    }
  }
}

// ---- Causal conv
// ---------------------------------------------------------------------- kK > 0: the
// kernel size at compile time (register window); 0: `kernel` at run time.
// Grid z: the sequence of a batched launch (`tokens` rows each; with `slots`, its
// state at state + slots[z] * state_stride, slot < 0: padding, zero y rows and
// no state).
template <int kK>
__global__ void Conv1dSiluKernel(const float* x, int64_t ldx, const float* w,
                                 int64_t kernel, float* state, float* y, int64_t ldy,
                                 int64_t tokens, int64_t channels, int64_t chunk,
                                 const int32_t* slots, int64_t state_stride) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const int64_t seq = blockIdx.z;
  x += seq * tokens * ldx;
  y += seq * tokens * ldy;
  if (slots != nullptr) {
    const int32_t slot = slots[seq];
    if (slot < 0) {
      if (blockIdx.y == 0) {
        for (int64_t t = 0; t < tokens; ++t) y[t * ldy + c] = 0.0f;
      }
      return;
    }
    state += slot * state_stride;
  }
  const int64_t k = kK > 0 ? kK : kernel, tail = k - 1;
  // Row `row` of xx = [state; x] for this channel.
  auto xx = [&](int64_t row) -> float {
    return row < tail ? state[row * channels + c] : x[(row - tail) * ldx + c];
  };
  const int64_t chunks = (tokens + chunk - 1) / chunk;
  for (int64_t ch = blockIdx.y; ch < chunks; ch += gridDim.y) {
    const int64_t t0 = ch * chunk, t1 = std::min(tokens, t0 + chunk);
    if constexpr (kK > 0) {
      float wr[kK], win[kK];
#pragma unroll
      for (int i = 0; i < kK; ++i) wr[i] = w[c * kK + i];
#pragma unroll
      for (int i = 0; i < kK - 1; ++i) win[i] = xx(t0 + i);
      for (int64_t t = t0; t < t1; ++t) {
        win[kK - 1] = x[t * ldx + c];
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < kK; ++i) acc += wr[i] * win[i];
        y[t * ldy + c] = acc * Sigmoid(acc);
#pragma unroll
        for (int i = 0; i < kK - 1; ++i) win[i] = win[i + 1];
      }
    } else {
      for (int64_t t = t0; t < t1; ++t) {
        float acc = 0.0f;
        for (int64_t i = 0; i < k; ++i) acc += w[c * k + i] * xx(t + i);
        y[t * ldy + c] = acc * Sigmoid(acc);
      }
    }
    // The new state is rows tokens..tokens+tail-1 of xx. Only chunk 0 read the old
    // state (chunk >= tail), and it is this thread's: ascending rows read row
    // tokens + r > r before anything overwrites it.
    if (ch == 0) {
      for (int64_t r = 0; r < tail; ++r) state[r * channels + c] = xx(tokens + r);
    }
  }
}

// ---- Attention residual mix
// ------------------------------------------------------------ Block (t, j): score[t *
// n + j] = sum V*norm_w*proj_w / sqrt(mean V^2 + eps).
__global__ void __launch_bounds__(256)
    MixScoreKernel(const float* const* bank, int64_t bank_size, const float* p,
                   const float* proj_w, const float* norm_w, float eps, int64_t hidden,
                   float* score) {
  TANDEM_SHARED(float, partials, [2 * kWarpSize]);
  const int64_t t = blockIdx.x, j = blockIdx.y, n = bank_size + 1;
  const float* v = (j < bank_size ? bank[j] : p) + t * hidden;
  float ss = 0.0f, dot = 0.0f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float vi = v[i];
    ss += vi * vi;
    dot += vi * (norm_w[i] * proj_w[i]);
  }
  ss = WarpSum(ss);
  dot = WarpSum(dot);
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  if (lane == 0) {
    partials[warp] = ss;
    partials[kWarpSize + warp] = dot;
  }
  __syncthreads();
  if (warp == 0) {
    ss = WarpSum(lane < warps ? partials[lane] : 0.0f);
    dot = WarpSum(lane < warps ? partials[kWarpSize + lane] : 0.0f);
    if (lane == 0) {
      score[t * n + j] = dot / sqrtf(ss / static_cast<float>(hidden) + eps);
    }
  }
}

constexpr int kMixThreads = 256;
constexpr int kMixPerThread = 4;  // elements per thread per token

// Blocks (hidden chunk, token): out[t, chunk] = sum_j softmax(score[t])_j V_j[t,
// chunk].
__global__ void __launch_bounds__(kMixThreads)
    MixKernel(const float* const* bank, int64_t bank_size, const float* p,
              int64_t tokens, int64_t hidden, const float* score, float* out) {
  TANDEM_DYNAMIC_SMEM(float, weight);  // [n]
  const int64_t n = bank_size + 1;
  for (int64_t t = blockIdx.y; t < tokens; t += gridDim.y) {
    const float* s = score + t * n;
    float mx = s[0];
    for (int64_t j = 1; j < n; ++j) mx = fmaxf(mx, s[j]);
    float den = 0.0f;
    for (int64_t j = 0; j < n; ++j) den += expf(s[j] - mx);
    __syncthreads();  // the previous token's weights are no longer read
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
      weight[j] = expf(s[j] - mx) / den;
    __syncthreads();
    const int64_t base =
        static_cast<int64_t>(blockIdx.x) * kMixThreads * kMixPerThread + threadIdx.x;
    float acc[kMixPerThread];
#pragma unroll
    for (int e = 0; e < kMixPerThread; ++e) acc[e] = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      const float* v = (j < bank_size ? bank[j] : p) + t * hidden;
      const float wj = weight[j];
#pragma unroll
      for (int e = 0; e < kMixPerThread; ++e) {
        const int64_t i = base + e * kMixThreads;
        if (i < hidden) acc[e] += wj * v[i];
      }
    }
    float* o = out + t * hidden;
#pragma unroll
    for (int e = 0; e < kMixPerThread; ++e) {
      const int64_t i = base + e * kMixThreads;
      if (i < hidden) o[i] = acc[e];
    }
  }
}

}  // namespace

// ---- Launchers
// -------------------------------------------------------------------------

const char* LaunchRmsNorm(const float* x, int64_t ldx, const float* w, float* y,
                          int64_t ldy, int64_t rows, int64_t n, float eps,
                          void* stream) {
  NormArgs a{};
  a.x = x;
  a.ldx = ldx;
  a.w = w;
  a.y = y;
  a.ldy = ldy;
  a.segments = rows;
  a.heads = 1;
  a.d = n;
  a.eps = eps;
  return LaunchNorm<kRms>(a, stream);
}

const char* LaunchL2NormHeads(const float* x, int64_t ldx, float* y, int64_t ldy,
                              int64_t rows, int64_t heads, int64_t d, float eps,
                              float scale, void* stream) {
  if (heads <= 0) return nullptr;
  NormArgs a{};
  a.x = x;
  a.ldx = ldx;
  a.y = y;
  a.ldy = ldy;
  a.segments = rows * heads;
  a.heads = heads;
  a.d = d;
  a.eps = eps;
  a.scale = scale;
  return LaunchNorm<kL2>(a, stream);
}

const char* LaunchKdaOutputGate(const float* o, int64_t ld_o, const float* norm_w,
                                const float* gate, int64_t ld_gate, float* out,
                                int64_t ld_out, int64_t tokens, int64_t heads,
                                int64_t d, float eps, void* stream) {
  if (heads <= 0) return nullptr;
  NormArgs a{};
  a.x = o;
  a.ldx = ld_o;
  a.w = norm_w;
  a.gate = gate;
  a.ldg = ld_gate;
  a.y = out;
  a.ldy = ld_out;
  a.segments = tokens * heads;
  a.heads = heads;
  a.d = d;
  a.eps = eps;
  return LaunchNorm<kRmsGate>(a, stream);
}

const char* LaunchAddRmsNorm(float* x, int64_t ldx, const float* res, int64_t ldr,
                             const float* w, float* y, int64_t ldy, int64_t rows,
                             int64_t n, float eps, void* stream) {
  NormArgs a{};
  a.x = x;
  a.x_out = x;
  a.ldx = ldx;
  a.res = res;
  a.ldr = ldr;
  a.w = w;
  a.y = y;
  a.ldy = ldy;
  a.segments = rows;
  a.heads = 1;
  a.d = n;
  a.eps = eps;
  return LaunchNorm<kAddRms>(a, stream);
}

const char* LaunchSituGlu(const float* g, int64_t ldg, const float* u, int64_t ldu,
                          float* out, int64_t ldo, int64_t rows, int64_t n, float beta,
                          float lbeta, void* stream) {
  return LaunchBinary(g, ldg, u, ldu, out, ldo, rows, n, SituOp{beta, lbeta}, stream);
}

const char* LaunchMulSigmoid(const float* x, int64_t ldx, const float* gate,
                             int64_t ldg, float* out, int64_t ldo, int64_t rows,
                             int64_t n, void* stream) {
  return LaunchBinary(x, ldx, gate, ldg, out, ldo, rows, n, MulSigmoidOp{}, stream);
}

const char* LaunchAddInPlace(float* y, const float* x, int64_t n, void* stream) {
  if (n <= 0) return nullptr;
  const bool vec = Aligned(y, 16) && Aligned(x, 16) && n >= 4;
  const dim3 block(kElementwiseThreads);
  if (vec) {
    TANDEM_LAUNCH((AddInPlaceKernel<true>), dim3(GridFor(n / 4, kElementwiseThreads)),
                  block, 0, stream, y, x, n);
  } else {
    TANDEM_LAUNCH((AddInPlaceKernel<false>), dim3(GridFor(n, kElementwiseThreads)),
                  block, 0, stream, y, x, n);
  }
  return ::tandem::gpu::LaunchError();
}

const char* LaunchEmbeddingGather(const uint16_t* table, int64_t vocab, int64_t first,
                                  int64_t rows, int64_t hidden, const int32_t* ids,
                                  int64_t tokens, float* out, int32_t* error_word,
                                  void* stream) {
  if (tokens <= 0 || hidden <= 0) return nullptr;
  const bool vec = hidden % 4 == 0 && Aligned(table, 8) && Aligned(out, 16);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(tokens, kMaxGridBlocks)));
  const dim3 block(128);
  if (vec) {
    TANDEM_LAUNCH((EmbeddingKernel<true>), grid, block, 0, stream, table, vocab, first,
                  rows, hidden, ids, tokens, out, error_word);
  } else {
    TANDEM_LAUNCH((EmbeddingKernel<false>), grid, block, 0, stream, table, vocab, first,
                  rows, hidden, ids, tokens, out, error_word);
  }
  return ::tandem::gpu::LaunchError();
}

const char* LaunchPagedCacheWrite(const float* src, int64_t ld_src,
                                  const int32_t* slots, int64_t tokens, int64_t width,
                                  uint16_t* cache, int64_t num_slots,
                                  int32_t* error_word, void* stream) {
  if (tokens <= 0 || width <= 0) return nullptr;
  const bool vec =
      width % 4 == 0 && RowsAligned16(src, ld_src, tokens) && Aligned(cache, 8);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(tokens, kMaxGridBlocks)));
  const dim3 block(128);
  if (vec) {
    TANDEM_LAUNCH((CacheWriteKernel<true>), grid, block, 0, stream, src, ld_src, slots,
                  tokens, width, cache, num_slots, error_word);
  } else {
    TANDEM_LAUNCH((CacheWriteKernel<false>), grid, block, 0, stream, src, ld_src, slots,
                  tokens, width, cache, num_slots, error_word);
  }
  return ::tandem::gpu::LaunchError();
}

namespace {

const char* LaunchConv(const float* x, int64_t ldx, const float* w, int64_t kernel,
                       float* state, float* y, int64_t ldy, int64_t tokens,
                       int64_t channels, int64_t num_seqs, const int32_t* slots,
                       int64_t state_stride, void* stream) {
  if (tokens <= 0 || channels <= 0 || kernel < 1 || num_seqs <= 0) return nullptr;
  if (num_seqs > 65535) return "causal_conv1d: more than 65535 sequences";
  constexpr int kThreads = 128;
  // Chunks of >= kernel - 1 tokens (only the first reads the old state).
  const int64_t chunk = std::max<int64_t>(kernel - 1, 32);
  const int64_t chunks = (tokens + chunk - 1) / chunk;
  const dim3 grid(static_cast<unsigned>((channels + kThreads - 1) / kThreads),
                  static_cast<unsigned>(std::min<int64_t>(chunks, 65535)),
                  static_cast<unsigned>(num_seqs));
  const dim3 block(kThreads);
  switch (kernel) {
    case 2:
      TANDEM_LAUNCH((Conv1dSiluKernel<2>), grid, block, 0, stream, x, ldx, w, kernel,
                    state, y, ldy, tokens, channels, chunk, slots, state_stride);
      break;
    case 3:
      TANDEM_LAUNCH((Conv1dSiluKernel<3>), grid, block, 0, stream, x, ldx, w, kernel,
                    state, y, ldy, tokens, channels, chunk, slots, state_stride);
      break;
    case 4:
      TANDEM_LAUNCH((Conv1dSiluKernel<4>), grid, block, 0, stream, x, ldx, w, kernel,
                    state, y, ldy, tokens, channels, chunk, slots, state_stride);
      break;
    default:
      TANDEM_LAUNCH((Conv1dSiluKernel<0>), grid, block, 0, stream, x, ldx, w, kernel,
                    state, y, ldy, tokens, channels, chunk, slots, state_stride);
      break;
  }
  return ::tandem::gpu::LaunchError();
}

}  // namespace

const char* LaunchCausalConv1dSilu(const float* x, int64_t ldx, const float* w,
                                   int64_t kernel, float* state, float* y, int64_t ldy,
                                   int64_t tokens, int64_t channels, void* stream) {
  return LaunchConv(x, ldx, w, kernel, state, y, ldy, tokens, channels, 1, nullptr, 0,
                    stream);
}

const char* LaunchCausalConv1dSiluSlots(const float* x, int64_t ldx, const float* w,
                                        int64_t kernel, float* state_base,
                                        int64_t state_stride, const int32_t* slots,
                                        int64_t num_seqs, float* y, int64_t ldy,
                                        int64_t tokens_per_seq, int64_t channels,
                                        void* stream) {
  return LaunchConv(x, ldx, w, kernel, state_base, y, ldy, tokens_per_seq, channels,
                    num_seqs, slots, state_stride, stream);
}

const char* LaunchKdaGates(const float* graw, int64_t ld_graw, const float* a_log,
                           const float* dt_bias, const float* braw, int64_t ld_braw,
                           float lower_bound, int64_t tokens, int64_t heads, int64_t d,
                           float* g, float* beta, void* stream) {
  if (tokens <= 0 || heads <= 0 || d <= 0) return nullptr;
  if (heads * d > (int64_t{1} << 30)) return "kda_gates: heads * d too large";
  constexpr int kThreads = 128;
  TANDEM_LAUNCH(KdaGatesKernel, RowGrid(tokens, heads * d, kThreads), dim3(kThreads), 0,
                stream, graw, ld_graw, a_log, dt_bias, braw, ld_braw, lower_bound,
                tokens, heads, d, g, beta);
  return ::tandem::gpu::LaunchError();
}

size_t AttnResMixScratchBytes(int64_t tokens, int64_t bank_size) {
  return static_cast<size_t>(std::max<int64_t>(0, tokens) * (bank_size + 1)) *
         sizeof(float);
}

const char* LaunchAttnResMix(const float* const* bank, int64_t bank_size,
                             const float* p, const float* proj_w, const float* norm_w,
                             float eps, int64_t tokens, int64_t hidden, float* out,
                             float* scratch, void* stream) {
  if (tokens <= 0 || hidden <= 0 || bank_size < 0) return nullptr;
  const int64_t n = bank_size + 1;
  int64_t threads = (hidden + 3) / 4;  // ~4 elements per thread, 32..256 threads
  threads = (threads + kWarpSize - 1) / kWarpSize * kWarpSize;
  threads = std::min<int64_t>(256, std::max<int64_t>(kWarpSize, threads));
  TANDEM_LAUNCH(MixScoreKernel,
                dim3(static_cast<unsigned>(tokens), static_cast<unsigned>(n)),
                dim3(static_cast<unsigned>(threads)), 0, stream, bank, bank_size, p,
                proj_w, norm_w, eps, hidden, scratch);
  if (const char* e = ::tandem::gpu::LaunchError()) return e;
  const int64_t per_block = kMixThreads * kMixPerThread;
  const dim3 grid(static_cast<unsigned>((hidden + per_block - 1) / per_block),
                  static_cast<unsigned>(std::min<int64_t>(tokens, 65535)));
  const size_t smem = static_cast<size_t>(n) * sizeof(float);
  if (smem > 48 * 1024) {
    if (const char* e = ::tandem::gpu::AllowDynamicSmem(MixKernel, smem)) return e;
  }
  TANDEM_LAUNCH(MixKernel, grid, dim3(kMixThreads), smem, stream, bank, bank_size, p,
                tokens, hidden, scratch, out);
  return ::tandem::gpu::LaunchError();
}

}  // namespace tandem::kernels::cuda
