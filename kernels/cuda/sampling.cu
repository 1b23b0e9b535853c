// Token sampling kernels (sampling.h has the design and the exactness argument).
#include <cmath>
#include <cstdint>

#include "kernels/cuda/device_errors.h"
#include "kernels/cuda/sampling.h"
#include "kernels/cuda/vendor.h"

namespace tandem::kernels::cuda {
namespace {

using gpu::kFullMask;
using gpu::kWarpSize;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kChunk = 256;       // engine::Sampler's online-softmax chunk
constexpr int kBins = 256;        // radix digit of 8 bits
constexpr float kWindow = 16.0f;  // engine::Sampler's kGatherWindow
constexpr int kSub = 8;           // tokens per chunk per ChunkSweep step
static_assert(kChunk % kSub == 0 && kWarpSize % kSub == 0);
// Worst-case relative disagreement between two double summations of <= 2^19
// non-negative float weights in different orders (about 4 * n * 2^-53), with a
// safety factor: a draw whose target is closer than this to a CDF step is
// replayed exactly.
constexpr double kMarginRel = 1e-9;

// ---- Arithmetic the CPU does without contraction ---------------------------
__device__ __forceinline__ float MulF(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
__device__ __forceinline__ float AddF(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
__device__ __forceinline__ double MulD(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
__device__ __forceinline__ double AddD(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
// std::exp(float) / std::log(float) as the CPU sampler calls them.
__device__ __forceinline__ float ExpF(float x) {
#if defined(__CUDA_ARCH__)
  return static_cast<float>(::exp(static_cast<double>(x)));
#else
  return std::exp(x);
#endif
}
__device__ __forceinline__ float LogF(float x) {
#if defined(__CUDA_ARCH__)
  return static_cast<float>(::log(static_cast<double>(x)));
#else
  return std::log(x);
#endif
}
__device__ __forceinline__ double ExpD(double x) {
#if defined(__CUDA_ARCH__)
  return ::exp(x);
#else
  return std::exp(x);
#endif
}
__device__ __forceinline__ double LogD(double x) {
#if defined(__CUDA_ARCH__)
  return ::log(x);
#else
  return std::log(x);
#endif
}

__device__ __forceinline__ float NegInf() {
  return __int_as_float(static_cast<int>(0xff800000u));
}
__device__ __forceinline__ float PosInf() { return __int_as_float(0x7f800000); }
__device__ __forceinline__ float Lowest() {
  return __int_as_float(static_cast<int>(0xff7fffffu));
}
__device__ __forceinline__ bool IsNan(float x) { return x != x; }

// Total ranking: logit descending, then id ascending. A kept set is every token
// ranked at or above `b` (Sampler::Keeps).
struct Boundary {
  float logit;
  int32_t id;
};
__device__ __forceinline__ bool Keeps(float x, int32_t id, Boundary b) {
  return x > b.logit || (x == b.logit && id <= b.id);
}
__device__ __forceinline__ Boundary KeepAll() { return {Lowest(), 0x7fffffff}; }

// Order-preserving key, ascending key = descending logit; -0 and +0 equal.
__device__ __forceinline__ uint32_t DescKey(float x) {
  if (x == 0.0f) x = 0.0f;
  const uint32_t u = __float_as_uint(x);
  const uint32_t asc = (u >> 31) ? ~u : (u | 0x80000000u);
  return ~asc;
}
__device__ __forceinline__ float FromDescKey(uint32_t d) {
  const uint32_t asc = ~d;
  const uint32_t u = (asc >> 31) ? (asc & 0x7fffffffu) : ~asc;
  return __uint_as_float(u);
}

// The processed logit: temperature on the fly (the row already holds
// suppression and penalties).
struct RowView {
  const float* l;
  int32_t vocab;
  bool scale;
  float t;
  __device__ __forceinline__ float operator()(int32_t i) const {
    const float v = l[i];
    return scale ? v / t : v;
  }
};

// ---- Block collectives (deterministic order) -------------------------------
struct Shared {
  double red_d[kWarps];
  float red_f[kWarps];
  int32_t red_i[kWarps];
  int32_t hist[kBins];
  double mass[kBins];
  int32_t bcast_i[4];
  double bcast_d[4];
  float bcast_f[2];
  // Per-warp transpose tile of ChunkSweep: 32 chunks x kSub tokens.
  float tile[kWarps][kWarpSize][kSub + 1];
  int32_t gather_n;
  int32_t gather_id[kSamplingMaxTopLogprobs];
  float gather_x[kSamplingMaxTopLogprobs];
};

__device__ __forceinline__ int Lane() {
  return static_cast<int>(threadIdx.x) % kWarpSize;
}
__device__ __forceinline__ int Warp() {
  return static_cast<int>(threadIdx.x) / kWarpSize;
}

__device__ double BlockSumD(double v, Shared& s) {
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  __syncthreads();
  if (Lane() == 0) s.red_d[Warp()] = v;
  __syncthreads();
  double r = s.red_d[0];
  for (int w = 1; w < kWarps; ++w) r += s.red_d[w];
  return r;
}
__device__ int32_t BlockSumI(int32_t v, Shared& s) {
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  __syncthreads();
  if (Lane() == 0) s.red_i[Warp()] = v;
  __syncthreads();
  int32_t r = 0;
  for (int w = 0; w < kWarps; ++w) r += s.red_i[w];
  return r;
}
__device__ int32_t BlockMinI(int32_t v, Shared& s) {
  for (int o = kWarpSize / 2; o > 0; o >>= 1)
    v = std::min(v, __shfl_xor_sync(kFullMask, v, o));
  __syncthreads();
  if (Lane() == 0) s.red_i[Warp()] = v;
  __syncthreads();
  int32_t r = s.red_i[0];
  for (int w = 1; w < kWarps; ++w) r = std::min(r, s.red_i[w]);
  return r;
}
__device__ int32_t BlockMaxI(int32_t v, Shared& s) {
  for (int o = kWarpSize / 2; o > 0; o >>= 1)
    v = std::max(v, __shfl_xor_sync(kFullMask, v, o));
  __syncthreads();
  if (Lane() == 0) s.red_i[Warp()] = v;
  __syncthreads();
  int32_t r = s.red_i[0];
  for (int w = 1; w < kWarps; ++w) r = std::max(r, s.red_i[w]);
  return r;
}
// Argmax with the lowest id on ties; (v, id) in, the block's best out.
__device__ void BlockArgMax(float& v, int32_t& id, Shared& s) {
  for (int o = kWarpSize / 2; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFullMask, v, o);
    const int32_t oid = __shfl_xor_sync(kFullMask, id, o);
    if (ov > v || (ov == v && oid < id)) {
      v = ov;
      id = oid;
    }
  }
  __syncthreads();
  if (Lane() == 0) {
    s.red_f[Warp()] = v;
    s.red_i[Warp()] = id;
  }
  __syncthreads();
  v = s.red_f[0];
  id = s.red_i[0];
  for (int w = 1; w < kWarps; ++w) {
    if (s.red_f[w] > v || (s.red_f[w] == v && s.red_i[w] < id)) {
      v = s.red_f[w];
      id = s.red_i[w];
    }
  }
}

// In-place scan of a[0, n) (shared memory): each thread takes a contiguous
// segment, a warp scan and a scan over warps combine them. Inclusive or
// exclusive; returns the total. `op` must have `identity` as an exact identity.
template <typename T, typename Op>
__device__ T BlockScan(T* a, int n, bool exclusive, T identity, Op op, T* red) {
  const int seg = (n + kThreads - 1) / kThreads;
  const int lo = std::min(n, static_cast<int>(threadIdx.x) * seg);
  const int hi = std::min(n, lo + seg);
  T local = identity;
  for (int i = lo; i < hi; ++i) local = op(local, a[i]);
  T inc = local;
  for (int o = 1; o < kWarpSize; o <<= 1) {
    const T y = __shfl_up_sync(kFullMask, inc, o);
    if (Lane() >= o) inc = op(y, inc);
  }
  T ex = __shfl_up_sync(kFullMask, inc, 1);
  if (Lane() == 0) ex = identity;
  __syncthreads();
  if (Lane() == kWarpSize - 1) red[Warp()] = inc;
  __syncthreads();
  T run = identity;
  for (int w = 0; w < Warp(); ++w) run = op(run, red[w]);
  T total = identity;
  for (int w = 0; w < kWarps; ++w) total = op(total, red[w]);
  run = op(run, ex);
  for (int i = lo; i < hi; ++i) {
    const T v = a[i];
    if (exclusive) {
      a[i] = run;
      run = op(run, v);
    } else {
      run = op(run, v);
      a[i] = run;
    }
  }
  __syncthreads();
  return total;
}

// Sequential per-chunk passes with coalesced loads: each lane owns one 256-token
// chunk (warp w takes chunks [32w, 32w + 32), then every kThreads chunks) and
// sees its tokens one at a time in increasing id, as the CPU's loops do; the
// warp loads 32 chunks x kSub tokens at a time (full 32-byte sectors) through a
// padded shared tile (odd stride: conflict-free). begin(c), fn(c, i, v) for
// each token i of chunk c with v = load(i), end(c).
template <typename Load, typename Begin, typename Fn, typename End>
__device__ void ChunkSweep(int32_t vocab, Load load, Begin begin, Fn fn, End end,
                           Shared& s) {
  const int nch = (vocab + kChunk - 1) / kChunk;
  const int lane = Lane();
  float(*tile)[kSub + 1] = s.tile[Warp()];
  for (int c0 = Warp() * kWarpSize; c0 < nch; c0 += kThreads) {
    const int c = c0 + lane;
    const bool mine = c < nch;
    const int32_t stop = std::min(vocab, (c + 1) * kChunk);
    if (mine) begin(c);
    for (int off = 0; off < kChunk; off += kSub) {
      for (int r = lane / kSub; r < kWarpSize; r += kWarpSize / kSub) {
        const int32_t i = (c0 + r) * kChunk + off + lane % kSub;
        tile[r][lane % kSub] = i < vocab ? load(i) : 0.0f;
      }
      __syncwarp();
      if (mine) {
        for (int j = 0; j < kSub; ++j) {
          const int32_t i = c * kChunk + off + j;
          if (i < stop) fn(c, i, tile[lane][j]);
        }
      }
      __syncwarp();
    }
    if (mine) end(c);
  }
}

struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct AddOpD {
  __device__ double operator()(double a, double b) const { return AddD(a, b); }
};

// ---- Selection -----------------------------------------------------------------

// Warp 0: the first non-empty bin b (counts[b] > 0) at which base + the sum of
// vals[0..b] reaches `target`, and that sum before b; -1 when none does. Lanes
// own 8 consecutive bins: a warp scan finds the lane, which scans its bins in
// order. (The CPU's mass prefixes are summed in yet another order: see
// "Exactness" in sampling.h.)
template <typename T>
__device__ void FindBin(const T* vals, const int32_t* counts, T base, T target,
                        int32_t* sel, T* before) {
  constexpr int kPer = kBins / kWarpSize;
  const int lane = Lane();
  T local = 0;
  for (int j = 0; j < kPer; ++j) local += vals[lane * kPer + j];
  T inc = local;
  for (int o = 1; o < kWarpSize; o <<= 1) {
    const T y = __shfl_up_sync(kFullMask, inc, o);
    if (lane >= o) inc += y;
  }
  T ex = __shfl_up_sync(kFullMask, inc, 1);
  if (lane == 0) ex = 0;
  const unsigned hit = __ballot_sync(kFullMask, base + inc >= target);
  const int first = hit == 0 ? -1 : __ffs(hit) - 1;
  int32_t my_sel = -1;
  T my_before = 0;
  if (lane == first) {
    T a = base + ex;
    int32_t last_nonempty = -1;
    T a_last = a;
    for (int j = 0; j < kPer; ++j) {
      const int b = lane * kPer + j;
      if (counts[b] == 0) continue;
      if (a + vals[b] >= target) {
        my_sel = b;
        break;
      }
      last_nonempty = b;
      a_last = a;
      a += vals[b];
    }
    if (my_sel < 0) {  // rounding between the two orders: the lane's last bin
      my_sel = last_nonempty;
      a = a_last;
    }
    my_before = a;
  }
  if (first < 0) {
    *sel = -1;
    *before = 0;
    return;
  }
  *sel = __shfl_sync(kFullMask, my_sel, first);
  *before = __shfl_sync(kFullMask, my_before, first);
}

// The `rank`-th (1-based) token with the given value among those passing `pred`, in
// id order. Every thread returns it.
template <typename Pred, typename X>
__device__ int32_t KthEqualId(float value, int32_t rank, int32_t vocab, Pred pred, X x,
                              Shared& s) {
  int32_t remaining = rank;
  for (int32_t base = 0; base < vocab; base += kThreads) {
    const int32_t i = base + static_cast<int32_t>(threadIdx.x);
    const bool flag = i < vocab && pred(i) && x(i) == value;
    const int cnt = __syncthreads_count(flag);
    if (cnt >= remaining) {
      const unsigned ballot = __ballot_sync(kFullMask, flag);
      if (Lane() == 0) s.red_i[Warp()] = __popc(ballot);
      __syncthreads();
      int pre = __popc(ballot & ((1u << Lane()) - 1u));
      for (int w = 0; w < Warp(); ++w) pre += s.red_i[w];
      if (flag && pre + 1 == remaining) s.bcast_i[3] = i;
      __syncthreads();
      const int32_t id = s.bcast_i[3];
      __syncthreads();
      return id;
    }
    remaining -= cnt;
  }
  return vocab - 1;  // unreachable when `rank` tokens qualify
}

// The k-th ranked token (1-based) among those passing `pred`; at least k must.
template <typename Pred, typename X>
__device__ Boundary RadixKth(int32_t k, int32_t vocab, Pred pred, X x, Shared& s) {
  uint32_t prefix = 0, mask = 0;
  int32_t kk = k;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < kBins; b += kThreads) s.hist[b] = 0;
    __syncthreads();
    for (int32_t i = threadIdx.x; i < vocab; i += kThreads) {
      if (!pred(i)) continue;
      const uint32_t key = DescKey(x(i));
      if ((key & mask) == prefix) atomicAdd(&s.hist[(key >> shift) & 0xff], 1);
    }
    __syncthreads();
    if (Warp() == 0) {
      int32_t sel, before;
      FindBin(s.hist, s.hist, 0, kk, &sel, &before);
      if (Lane() == 0) {
        s.bcast_i[0] = sel < 0 ? kBins - 1 : sel;
        s.bcast_i[1] = kk - before;
      }
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(s.bcast_i[0]) << shift;
    mask |= 0xffu << shift;
    kk = s.bcast_i[1];
    __syncthreads();
  }
  const float value = FromDescKey(prefix);
  return {value, KthEqualId(value, kk, vocab, pred, x, s)};
}

// Top-p: the shortest prefix of the ranking (among `pred` tokens) whose weight
// exp(x - mf) reaches `target`. Returns false (keep everything) when the
// candidates' whole mass falls short.
template <typename Pred, typename X>
__device__ bool RadixMass(double target, float mf, int32_t vocab, Pred pred, X x,
                          Shared& s, Boundary* out) {
  uint32_t prefix = 0, mask = 0;
  double acc = 0.0;  // mass ranked strictly above the current prefix's bin
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < kBins; b += kThreads) {
      s.hist[b] = 0;
      s.mass[b] = 0.0;
    }
    __syncthreads();
    for (int32_t i = threadIdx.x; i < vocab; i += kThreads) {
      if (!pred(i)) continue;
      const float v = x(i);
      const uint32_t key = DescKey(v);
      if ((key & mask) == prefix) {
        const int b = (key >> shift) & 0xff;
        atomicAdd(&s.hist[b], 1);
        atomicAdd(&s.mass[b], static_cast<double>(ExpF(v - mf)));
      }
    }
    __syncthreads();
    if (Warp() == 0) {
      int32_t sel;
      double before;
      FindBin(s.mass, s.hist, acc, target, &sel, &before);
      if (Lane() == 0) {
        s.bcast_i[0] = sel;
        s.bcast_i[1] = sel >= 0 ? s.hist[sel] : 0;
        s.bcast_d[0] = before;
      }
    }
    __syncthreads();
    const int32_t sel = s.bcast_i[0];
    const int32_t count = s.bcast_i[1];
    acc = s.bcast_d[0];
    __syncthreads();
    if (sel < 0) return false;
    prefix |= static_cast<uint32_t>(sel) << shift;
    mask |= 0xffu << shift;
    if (shift == 0) {
      // `count` tokens share this value, each of weight w; the CPU adds them one
      // at a time in id order.
      const float value = FromDescKey(prefix);
      const double w = static_cast<double>(ExpF(value - mf));
      int32_t c = 1;
      double a = AddD(acc, w);
      while (c < count && !(a >= target)) {
        a = AddD(a, w);
        ++c;
      }
      *out = {value, KthEqualId(value, c, vocab, pred, x, s)};
      return true;
    }
  }
  return false;
}

// ---- Inverse-CDF draw ----------------------------------------------------------

// A draw's weight functor gives (w, eligible) for token i. Eligible tokens with w == 0
// only matter as the fallback when the CDF never crosses the target (the CPU returns
// the last eligible token then).
struct DrawResult {
  int32_t token;   // -1: no eligible token with mass
  bool ambiguous;  // too close to call: replay exactly
  double total;    // sum of the weights (this order)
};

// chunk_sum/chunk_pre: shared [nchunks] doubles. `target_total` < 0: use the
// weights' own total.
template <typename W>
__device__ DrawResult BlockDraw(int32_t vocab, W weight, double u, double target_total,
                                double* chunk_sum, double* chunk_pre, Shared& s) {
  const int nch = (vocab + kChunk - 1) / kChunk;
  int32_t last = -1;
  double d = 0.0;
  ChunkSweep(
      vocab,
      [&](int32_t i) {
        float w;
        return weight(i, &w) ? w : -1.0f;  // -1: not eligible
      },
      [&](int) { d = 0.0; },
      [&](int, int32_t i, float w) {
        if (w < 0.0f) return;
        last = i;
        d = AddD(d, static_cast<double>(w));
      },
      [&](int c) {
        chunk_sum[c] = d;
        chunk_pre[c] = d;
      },
      s);
  last = BlockMaxI(last, s);
  __syncthreads();
  const double total =
      BlockScan(chunk_pre, nch, /*exclusive=*/true, 0.0, AddOpD(), s.red_d);
  DrawResult r{-1, false, total};
  if (!(total > 0.0)) return r;  // nothing with mass (uniform across the block)
  const double tt = target_total < 0.0 ? total : target_total;
  const double target = MulD(u, tt);
  const double eps = kMarginRel * (tt > total ? tt : total);
  int32_t first = 0x7fffffff;
  for (int c = threadIdx.x; c < nch; c += kThreads) {
    if (AddD(chunk_pre[c], chunk_sum[c]) > target) {
      first = c;
      break;
    }
  }
  first = BlockMinI(first, s);
  if (threadIdx.x == 0) {
    s.bcast_i[2] = last;
    s.bcast_i[3] = 1;  // ambiguous unless shown otherwise
  }
  __syncthreads();
  if (first != 0x7fffffff && static_cast<int>(threadIdx.x) == first % kThreads) {
    const int32_t end = std::min(vocab, (first + 1) * kChunk);
    double acc = chunk_pre[first];
    for (int32_t i = first * kChunk; i < end; ++i) {
      float w;
      if (!weight(i, &w)) continue;
      const double prev = acc;
      acc = AddD(acc, static_cast<double>(w));
      if (acc > target) {
        s.bcast_i[2] = i;
        s.bcast_i[3] = (target - prev < eps || acc - target <= eps) ? 1 : 0;
        break;
      }
    }
  }
  __syncthreads();
  r.token = s.bcast_i[2];
  r.ambiguous = s.bcast_i[3] != 0;
  __syncthreads();
  return r;
}

// engine::DrawFromWeights, sequentially (one thread): the exact replay.
template <typename W>
__device__ int32_t SequentialDraw(int32_t vocab, W weight, double u, double total) {
  const double target = MulD(u, total);
  double acc = 0.0;
  int32_t last = -1;
  for (int32_t i = 0; i < vocab; ++i) {
    float w;
    if (!weight(i, &w)) continue;
    last = i;
    acc = AddD(acc, static_cast<double>(w));
    if (acc > target) return last;
  }
  return last;
}

// ---- The sampling kernel -------------------------------------------------------
__global__ void __launch_bounds__(kThreads, 1) SampleKernel(SampleArgs a) {
  TANDEM_SHARED(Shared, s, );
  TANDEM_DYNAMIC_SMEM(unsigned char, dyn);
  const int32_t row = static_cast<int32_t>(blockIdx.x);
  const int32_t vocab = a.vocab;
  const int nch = (vocab + kChunk - 1) / kChunk;
  float* cmax = reinterpret_cast<float*>(dyn);
  float* cpre = cmax + nch;
  double* chunk_sum = reinterpret_cast<double*>(dyn + ((8 * nch + 15) / 16) * 16);
  double* chunk_pre = chunk_sum + nch;

  const SamplingRowParams p = a.params[row];
  float* l = a.logits + static_cast<int64_t>(row) * vocab;
  // A scored row (prompt logprobs): its token is given, its logits raw.
  const bool scoring = p.score_token >= 0;
  const bool greedy = p.temperature < kSamplingGreedyTemperature;
  const int n_top = p.logprobs ? std::min(p.top_logprobs, a.top_n_stride) : 0;

  auto fail = [&](int32_t status) {
    if (threadIdx.x == 0) {
      a.token_ids[row] = -1;
      if (a.row_status != nullptr) a.row_status[row] = status;
    }
  };

  // P0: the structured-output mask, the logit bias, penalties, then
  // suppression (the CPU suppresses before the bias and the penalties; -inf
  // stays -inf through all three, so the order does not matter).
  const bool masked = a.allowed_bitmask != nullptr && p.mask_row >= 0;
  if (masked) {
    if (p.mask_row >= a.mask_count) {
      atomicCAS(a.error_word, 0, static_cast<int32_t>(kTokenIdOutOfRange));
      return fail(kSampleNoAllowedToken);
    }
    const uint32_t* m =
        a.allowed_bitmask + static_cast<int64_t>(p.mask_row) * a.mask_words;
    for (int32_t i = threadIdx.x; i < vocab; i += kThreads) {
      if (((m[i >> 5] >> (i & 31)) & 1u) == 0u) l[i] = NegInf();
    }
    __syncthreads();
  }
  if (a.bias_offsets != nullptr) {
    for (int32_t e = a.bias_offsets[row] + threadIdx.x; e < a.bias_offsets[row + 1];
         e += kThreads) {
      const int32_t id = a.bias_tokens[e];
      if (id < 0 || id >= vocab) {
        atomicCAS(a.error_word, 0, static_cast<int32_t>(kTokenIdOutOfRange));
        continue;
      }
      l[id] = AddF(l[id], a.bias_values[e]);
    }
    __syncthreads();
  }
  if (a.penalty_offsets != nullptr) {
    const float rep = p.repetition_penalty;
    for (int32_t e = a.penalty_offsets[row] + threadIdx.x;
         e < a.penalty_offsets[row + 1]; e += kThreads) {
      const int32_t id = a.penalty_tokens[e];
      if (id < 0 || id >= vocab) {
        atomicCAS(a.error_word, 0, static_cast<int32_t>(kTokenIdOutOfRange));
        continue;
      }
      const int32_t count = a.penalty_output_counts[e];
      const bool in_prompt = a.penalty_in_prompt[e] != 0;
      float v = l[id];
      if (rep != 1.0f && (in_prompt || count > 0))
        v = v > 0.0f ? v / rep : MulF(v, rep);
      if (count > 0) {
        v = v - AddF(MulF(p.frequency_penalty, static_cast<float>(count)),
                     p.presence_penalty);
      }
      l[id] = v;
    }
    __syncthreads();
  }
  if (a.suppress_offsets != nullptr) {
    for (int32_t e = a.suppress_offsets[row] + threadIdx.x;
         e < a.suppress_offsets[row + 1]; e += kThreads) {
      const int32_t id = a.suppress_tokens[e];
      if (id < 0 || id >= vocab) {
        atomicCAS(a.error_word, 0, static_cast<int32_t>(kTokenIdOutOfRange));
        continue;
      }
      l[id] = NegInf();
    }
    __syncthreads();
  }
  const RowView x{l, vocab, !greedy && p.temperature != 1.0f, p.temperature};

  // P1: chunk maxima, validity, finite count, argmax.
  int bad = 0;
  int32_t finite = 0;
  float best = NegInf();
  int32_t best_id = 0x7fffffff;
  float cm = NegInf();
  ChunkSweep(
      vocab, x, [&](int) { cm = NegInf(); },
      [&](int, int32_t i, float v) {
        bad |= IsNan(v) || v == PosInf();
        finite += v != NegInf();
        if (v > cm) cm = v;
        if (v > best) {
          best = v;
          best_id = i;
        }
      },
      [&](int c) {
        cmax[c] = cm;
        cpre[c] = cm;
      },
      s);
  bad = __syncthreads_or(bad);
  finite = BlockSumI(finite, s);
  BlockArgMax(best, best_id, s);
  if (bad) return fail(kSampleBadLogits);
  // A mask that leaves no finite token is the CPU's "the constraint allows no
  // next token" (only NaN left is bad logits there too, as here).
  if (finite == 0) return fail(masked ? kSampleNoAllowedToken : kSampleAllMasked);
  if (!greedy && !p.has_seed && !scoring) return fail(kSampleNoSeed);
  if (scoring && p.score_token >= vocab) {  // DeviceSampler::Pack refuses it first
    if (threadIdx.x == 0)
      atomicCAS(a.error_word, 0, static_cast<int32_t>(kTokenIdOutOfRange));
    return fail(kSampleBadLogits);
  }

  // P2: the CPU's chunked online softmax, chunk sums bit for bit.
  const bool need_softmax = !greedy || p.logprobs != 0 || n_top > 0 || scoring;
  double sum = 0.0, lse = 0.0;
  const float mf = best;  // the row max
  // Selection looks first among the tokens within kWindow nats of the max (as
  // the CPU gathers them): a prefix of the ranking, usually a few hundred
  // tokens, so the radix histograms see few atomics. It widens to every finite
  // token when that prefix cannot hold the answer.
  const float window = mf - kWindow;
  double hi_mass = 0.0;  // weight of the tokens >= window
  int32_t hi_count = 0;
  if (need_softmax) {
    BlockScan(cpre, nch, /*exclusive=*/false, NegInf(), MaxOp(), s.red_f);
    double part = 0.0, hi_part = 0.0;
    int32_t hi_part_n = 0;
    // Chunks whose maximum is -inf are skipped (the CPU's `continue`).
    float run = 0.0f, cs = 0.0f;
    bool live = false;
    ChunkSweep(
        vocab, x,
        [&](int c) {
          live = cmax[c] != NegInf();
          run = cpre[c];
          cs = 0.0f;
        },
        [&](int, int32_t, float v) {
          if (!live) return;
          const float e = ExpF(v - run);
          cs = AddF(cs, e);
          if (v >= window) {
            ++hi_part_n;
            hi_part += static_cast<double>(run == mf ? e : ExpF(v - mf));
          }
        },
        [&](int) {
          if (live) {
            part += MulD(static_cast<double>(cs),
                         ExpD(static_cast<double>(run) - static_cast<double>(mf)));
          }
        },
        s);
    sum = BlockSumD(part, s);
    hi_mass = BlockSumD(hi_part, s);
    hi_count = BlockSumI(hi_part_n, s);
    lse = static_cast<double>(mf) + LogD(sum);
  }

  int32_t token = scoring ? p.score_token : best_id;
  if (scoring && a.ranks != nullptr) {
    // The scored token's rank: 1 + the tokens strictly more likely.
    const float own = x(token);
    int32_t above = 0;
    for (int32_t i = threadIdx.x; i < vocab; i += kThreads) above += x(i) > own;
    above = BlockSumI(above, s);
    if (threadIdx.x == 0) a.ranks[row] = above + 1;
  }
  if (!greedy && !scoring) {
    // P3: the kept set.
    const bool use_k = p.top_k > 0 && p.top_k < vocab;
    const bool use_p = p.top_p < 1.0f;
    const bool use_min_p = p.min_p > 0.0f;
    const bool keep_all = !use_k && !use_p && !use_min_p;
    Boundary bnd = KeepAll();
    if (use_k && finite >= p.top_k) {
      const float floor = hi_count >= p.top_k ? window : NegInf();
      auto cand = [&](int32_t i) {
        const float v = x(i);
        return v != NegInf() && v >= floor;
      };
      bnd = RadixKth(p.top_k, vocab, cand, x, s);
    }
    if (use_p) {
      double norm = sum, norm_hi = hi_mass;
      if (use_k) {
        double m = 0.0, mh = 0.0;
        for (int32_t i = threadIdx.x; i < vocab; i += kThreads) {
          const float v = x(i);
          if (v != NegInf() && Keeps(v, i, bnd)) {
            const double w = static_cast<double>(ExpF(v - mf));
            m += w;
            if (v >= window) mh += w;
          }
        }
        norm = BlockSumD(m, s);
        norm_hi = BlockSumD(mh, s);
      }
      const double target = MulD(static_cast<double>(p.top_p), norm);
      const Boundary kb = bnd;
      Boundary pb;
      bool found = false;
      if (norm_hi >= target) {  // the boundary lies within the window
        auto cand = [&](int32_t i) {
          const float v = x(i);
          return v >= window && Keeps(v, i, kb);
        };
        found = RadixMass(target, mf, vocab, cand, x, s, &pb);
      }
      if (!found) {
        auto cand = [&](int32_t i) {
          const float v = x(i);
          return v != NegInf() && Keeps(v, i, kb);
        };
        found = RadixMass(target, mf, vocab, cand, x, s, &pb);
      }
      if (found) bnd = pb;
    }
    if (use_min_p) {
      const float cut = static_cast<float>(static_cast<double>(mf) +
                                           static_cast<double>(LogF(p.min_p)));
      if (bnd.logit < cut) bnd = {cut, 0x7fffffff};
    }
    // P4: the draw.
    const double u = CounterUniform(p.seed, p.position, kRngSample);
    const Boundary kept = bnd;
    auto weight = [&](int32_t i, float* w) {
      const float v = x(i);
      if (keep_all) {
        *w = ExpF(v - mf);
        return *w > 0.0f;
      }
      if (!Keeps(v, i, kept)) return false;
      *w = ExpF(v - mf);
      return true;
    };
    const DrawResult d =
        BlockDraw(vocab, weight, u, keep_all ? sum : -1.0, chunk_sum, chunk_pre, s);
    token = d.token;
    double kept_mass = d.total;
    if (d.ambiguous || a.debug_exact_replay) {
      if (threadIdx.x == 0) {
        double total;
        if (keep_all) {
          // Sampler::Prepare's sum, sequentially.
          double m = -INFINITY, sm = 0.0;
          for (int c = 0; c < nch; ++c) {
            const float cm = cmax[c];
            if (cm == NegInf()) continue;
            if (static_cast<double>(cm) > m) {
              sm = MulD(sm, ExpD(m - static_cast<double>(cm)));
              m = cm;
            }
            const float run = static_cast<float>(m);
            const int32_t end = std::min(vocab, (c + 1) * kChunk);
            float cs = 0.0f;
            for (int32_t i = c * kChunk; i < end; ++i) cs = AddF(cs, ExpF(x(i) - run));
            sm = AddD(sm, static_cast<double>(cs));
          }
          total = sm;
        } else {
          total = 0.0;
          for (int32_t i = 0; i < vocab; ++i) {
            float w;
            if (weight(i, &w)) total = AddD(total, static_cast<double>(w));
          }
          kept_mass = total;
        }
        s.bcast_i[0] = SequentialDraw(vocab, weight, u, total);
        s.bcast_d[1] = kept_mass;
      }
      __syncthreads();
      token = s.bcast_i[0];
      kept_mass = s.bcast_d[1];
      __syncthreads();
    }
    if (a.probs != nullptr) {
      float* out = a.probs + static_cast<int64_t>(row) * vocab;
      for (int32_t i = threadIdx.x; i < vocab; i += kThreads) {
        const float v = x(i);
        const double w = static_cast<double>(ExpF(v - mf));
        out[i] = keep_all
                     ? static_cast<float>(w / sum)
                     : (Keeps(v, i, kept) ? static_cast<float>(w / kept_mass) : 0.0f);
      }
    }
  } else if (a.probs != nullptr && !scoring) {
    float* out = a.probs + static_cast<int64_t>(row) * vocab;
    for (int32_t i = threadIdx.x; i < vocab; i += kThreads)
      out[i] = i == token ? 1.0f : 0.0f;
  }

  if (threadIdx.x == 0) {
    a.token_ids[row] = token;
    if (a.row_status != nullptr) a.row_status[row] = kSampleOk;
    if (p.logprobs && a.logprobs != nullptr) {
      a.logprobs[row] = static_cast<float>(static_cast<double>(x(token)) - lse);
    }
  }

  // P5: top-n alternatives.
  if (n_top > 0 && a.top_ids != nullptr) {
    const float floor = hi_count >= n_top ? window : NegInf();
    auto cand = [&](int32_t i) {
      const float v = x(i);
      return v != NegInf() && v >= floor;
    };
    const Boundary tb = finite > n_top ? RadixKth(n_top, vocab, cand, x, s) : KeepAll();
    if (threadIdx.x == 0) s.gather_n = 0;
    __syncthreads();
    for (int32_t i = threadIdx.x; i < vocab; i += kThreads) {
      const float v = x(i);
      if (v != NegInf() && Keeps(v, i, tb)) {
        const int slot = atomicAdd(&s.gather_n, 1);
        if (slot < kSamplingMaxTopLogprobs) {
          s.gather_id[slot] = i;
          s.gather_x[slot] = v;
        }
      }
    }
    __syncthreads();
    const int got = std::min(s.gather_n, n_top);
    int32_t* ids = a.top_ids + static_cast<int64_t>(row) * a.top_n_stride;
    float* lps = a.top_logprobs + static_cast<int64_t>(row) * a.top_n_stride;
    for (int j = threadIdx.x; j < a.top_n_stride; j += kThreads) {
      if (j >= got) {
        ids[j] = -1;
        lps[j] = NegInf();
        continue;
      }
      // This entry's rank among the gathered ones.
      const float v = s.gather_x[j];
      const int32_t id = s.gather_id[j];
      int rank = 0;
      for (int q = 0; q < got; ++q) {
        rank += s.gather_x[q] > v || (s.gather_x[q] == v && s.gather_id[q] < id);
      }
      ids[rank] = id;
      lps[rank] = static_cast<float>(static_cast<double>(v) - lse);
    }
  }
}

// ---- Rejection sampling --------------------------------------------------------
__global__ void __launch_bounds__(kThreads, 1) RejectionKernel(RejectionArgs a) {
  TANDEM_SHARED(Shared, s, );
  TANDEM_DYNAMIC_SMEM(double, dyn);
  const int32_t req = static_cast<int32_t>(blockIdx.x);
  const int32_t vocab = a.vocab;
  const int32_t K = a.max_drafts;
  const int nch = (vocab + kChunk - 1) / kChunk;
  double* chunk_sum = dyn;
  double* chunk_pre = dyn + nch;
  const int32_t nd = a.num_drafts != nullptr ? std::min(a.num_drafts[req], K) : K;
  const uint64_t seed = a.seeds[req];
  const int64_t pos0 = a.first_positions[req];
  const float* target = a.target_probs + static_cast<int64_t>(req) * (K + 1) * vocab;
  const float* draft = a.draft_probs + static_cast<int64_t>(req) * K * vocab;

  // A block-wide draw from non-negative weights, replayed exactly when close.
  auto draw = [&](auto weight, double u) -> int32_t {
    const DrawResult d = BlockDraw(vocab, weight, u, -1.0, chunk_sum, chunk_pre, s);
    if (d.token < 0 || !(d.ambiguous || a.debug_exact_replay)) return d.token;
    if (threadIdx.x == 0) {
      double total = 0.0;
      for (int32_t i = 0; i < vocab; ++i) {
        float w;
        weight(i, &w);
        total = AddD(total, static_cast<double>(w > 0.0f ? w : 0.0f));
      }
      s.bcast_i[0] = SequentialDraw(vocab, weight, u, total);
    }
    __syncthreads();
    const int32_t t = s.bcast_i[0];
    __syncthreads();
    return t;
  };

  int32_t accepted = 0;
  for (int32_t j = 0; j < nd; ++j) {
    const int32_t d = a.draft_tokens[static_cast<int64_t>(req) * K + j];
    if (d < 0 || d >= vocab) {
      if (threadIdx.x == 0) {
        atomicCAS(a.error_word, 0, static_cast<int32_t>(kTokenIdOutOfRange));
        a.num_accepted[req] = -1;
        a.next_token[req] = -1;
      }
      return;
    }
    const float* pj = target + static_cast<int64_t>(j) * vocab;
    const float* qj = draft + static_cast<int64_t>(j) * vocab;
    const double u = CounterUniform(seed, pos0 + j, kRngSpecAccept);
    if (MulD(u, static_cast<double>(qj[d])) < static_cast<double>(pj[d])) {
      ++accepted;
      continue;
    }
    const double r = CounterUniform(seed, pos0 + j, kRngSpecResidual);
    auto residual = [&](int32_t i, float* w) {
      const float diff = pj[i] - qj[i];
      *w = diff > 0.0f ? diff : 0.0f;
      return *w > 0.0f;
    };
    int32_t token = draw(residual, r);
    if (token < 0) {
      auto plain = [&](int32_t i, float* w) {
        *w = pj[i];
        return *w > 0.0f;
      };
      token = draw(plain, r);
    }
    if (threadIdx.x == 0) {
      a.num_accepted[req] = token < 0 ? -1 : accepted;
      a.next_token[req] = token;
    }
    return;
  }
  const float* pk = target + static_cast<int64_t>(nd) * vocab;
  auto bonus = [&](int32_t i, float* w) {
    *w = pk[i];
    return *w > 0.0f;
  };
  const int32_t token = draw(bonus, CounterUniform(seed, pos0 + nd, kRngSample));
  if (threadIdx.x == 0) {
    a.num_accepted[req] = token < 0 ? -1 : accepted;
    a.next_token[req] = token;
  }
}

__global__ void GreedyVerifyKernel(int32_t requests, int32_t K,
                                   const int32_t* target_argmax, const int32_t* drafts,
                                   const int32_t* num_drafts, int32_t* num_accepted,
                                   int32_t* next_token) {
  const int32_t r = static_cast<int32_t>(blockIdx.x * blockDim.x + threadIdx.x);
  if (r >= requests) return;
  const int32_t nd = num_drafts != nullptr ? std::min(num_drafts[r], K) : K;
  const int32_t* t = target_argmax + static_cast<int64_t>(r) * (K + 1);
  const int32_t* d = drafts + static_cast<int64_t>(r) * K;
  int32_t j = 0;
  while (j < nd && d[j] == t[j]) ++j;
  num_accepted[r] = j;
  next_token[r] = t[j];
}

size_t SampleSmemBytes(int32_t vocab) {
  const size_t nch = (static_cast<size_t>(vocab) + kChunk - 1) / kChunk;
  return ((8 * nch + 15) / 16) * 16 + 16 * nch;
}

}  // namespace

const char* LaunchSample(const SampleArgs& args, void* stream) {
  if (args.rows <= 0) return nullptr;
  if (args.vocab <= 0 || args.vocab > kSamplingMaxVocab)
    return "sampling: vocab out of range";
  if (args.logits == nullptr || args.params == nullptr || args.token_ids == nullptr ||
      args.error_word == nullptr) {
    return "sampling: logits, params, token_ids and error_word are required";
  }
  if (args.top_ids != nullptr &&
      (args.top_logprobs == nullptr || args.top_n_stride <= 0 ||
       args.top_n_stride > kSamplingMaxTopLogprobs)) {
    return "sampling: top_ids needs top_logprobs and 0 < top_n_stride <= 20";
  }
  if ((args.penalty_offsets != nullptr) &&
      (args.penalty_tokens == nullptr || args.penalty_output_counts == nullptr ||
       args.penalty_in_prompt == nullptr)) {
    return "sampling: penalty_offsets needs tokens, output counts and prompt flags";
  }
  if (args.suppress_offsets != nullptr && args.suppress_tokens == nullptr) {
    return "sampling: suppress_offsets needs suppress_tokens";
  }
  if (args.bias_offsets != nullptr &&
      (args.bias_tokens == nullptr || args.bias_values == nullptr)) {
    return "sampling: bias_offsets needs bias_tokens and bias_values";
  }
  if (args.allowed_bitmask != nullptr &&
      (args.mask_count <= 0 ||
       static_cast<int64_t>(args.mask_words) * 32 < static_cast<int64_t>(args.vocab))) {
    return "sampling: allowed_bitmask needs mask_count > 0 and mask_words * 32 >= "
           "vocab";
  }
  const size_t smem = SampleSmemBytes(args.vocab);
  if (smem > 48 * 1024) {
    if (const char* e = gpu::AllowDynamicSmem(SampleKernel, smem)) return e;
  }
  TANDEM_LAUNCH(SampleKernel, dim3(args.rows), dim3(kThreads), smem, stream, args);
  return gpu::LaunchError();
}

const char* LaunchRejectionSample(const RejectionArgs& args, void* stream) {
  if (args.requests <= 0) return nullptr;
  if (args.vocab <= 0 || args.vocab > kSamplingMaxVocab || args.max_drafts < 0) {
    return "rejection sampling: vocab or max_drafts out of range";
  }
  if (args.target_probs == nullptr || args.seeds == nullptr ||
      args.first_positions == nullptr || args.num_accepted == nullptr ||
      args.next_token == nullptr || args.error_word == nullptr ||
      (args.max_drafts > 0 &&
       (args.draft_probs == nullptr || args.draft_tokens == nullptr))) {
    return "rejection sampling: a required pointer is null";
  }
  const size_t nch = (static_cast<size_t>(args.vocab) + kChunk - 1) / kChunk;
  const size_t smem = 16 * nch;
  if (smem > 48 * 1024) {
    if (const char* e = gpu::AllowDynamicSmem(RejectionKernel, smem)) return e;
  }
  TANDEM_LAUNCH(RejectionKernel, dim3(args.requests), dim3(kThreads), smem, stream,
                args);
  return gpu::LaunchError();
}

const char* LaunchGreedyVerify(int32_t requests, int32_t max_drafts,
                               const int32_t* target_argmax,
                               const int32_t* draft_tokens, const int32_t* num_drafts,
                               int32_t* num_accepted, int32_t* next_token,
                               void* stream) {
  if (requests <= 0) return nullptr;
  if (max_drafts < 0) return "greedy verify: max_drafts < 0";
  constexpr int kVerifyThreads = 128;
  TANDEM_LAUNCH(GreedyVerifyKernel,
                dim3((requests + kVerifyThreads - 1) / kVerifyThreads),
                dim3(kVerifyThreads), 0, stream, requests, max_drafts, target_argmax,
                draft_tokens, num_drafts, num_accepted, next_token);
  return gpu::LaunchError();
}

}  // namespace tandem::kernels::cuda
