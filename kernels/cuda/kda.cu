// KDA kernels: the token recurrence (decode) and the chunk-16 two-kernel prefill.
// Design and numerics: kda.h.
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/kda.h"
#include "kernels/cuda/ptx.h"
#include "kernels/cuda/vendor.h"

namespace tandem::kernels::cuda {
namespace {

using ::tandem::gpu::Bf16ToF32;
using ::tandem::gpu::F32ToBf16;
using ::tandem::gpu::kWarpSize;
using ::tandem::gpu::MmaBf16M16N8K16;
using ::tandem::gpu::PackBf16x2;
using ::tandem::gpu::WarpSum;

constexpr int kTile = 32;  // d_v columns per block (both forms)
constexpr int kC = static_cast<int>(kKdaChunk);
constexpr size_t kDefaultSmem = 48 * 1024;

// 8- and 16-byte vectors (the emulator has no float2 / float4).
struct alignas(8) F2 {
  float x, y;
};
struct alignas(16) F4 {
  float x, y, z, w;
};

__host__ __device__ __forceinline__ int RoundUp(int x, int m) {
  return (x + m - 1) / m * m;
}

// ---- Recurrent ------------------------------------------------------------------

// grid (ceil(d_v / 8), heads), block 32 * warps. A warp covers 4 rows x 8 columns
// (lane = 8 * row group + column): its loads and stores of S are 4 full 32-byte
// sectors; 8-column tiles give K3's 12 heads x 128 columns 192 blocks. Thread
// (warp w, lane) owns S[i][tile + lane % 8] for i = 4w + lane / 8 + 4 * warps * r,
// r < kRows, in registers for all T tokens.
constexpr int kRecCols = 8;
constexpr int kRecGroups = kWarpSize / kRecCols;
template <int kRows>
__global__ void KdaRecurrentKernel(KdaLaunchArgs a, int warps) {
  const int dk = static_cast<int>(a.head_dim_k), dv = static_cast<int>(a.head_dim_v);
  const int heads = static_cast<int>(a.heads);
  const int h = blockIdx.y;
  const int lane = threadIdx.x % kWarpSize, w = threadIdx.x / kWarpSize;
  const int col = lane % kRecCols;
  const int row0 = w * kRecGroups + lane / kRecCols;
  const int row_step = warps * kRecGroups;
  const int j = blockIdx.x * kRecCols + col;
  const bool col_ok = j < dv;
  TANDEM_DYNAMIC_SMEM(float, smem);
  float* sk = smem;
  float* sq = sk + dk;
  float* sdecay = sq + dk;
  float* red_k = sdecay + dk;               // [warps][8]
  float* red_o = red_k + warps * kRecCols;  // [warps][8]

  float* st = a.state + static_cast<int64_t>(h) * dk * dv;
  float s[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = row0 + row_step * r;
    s[r] = (i < dk && col_ok) ? st[static_cast<int64_t>(i) * dv + j] : 0.0f;
  }
  for (int64_t t = 0; t < a.tokens; ++t) {
    const float* kt = a.k + t * a.ld_qk + static_cast<int64_t>(h) * dk;
    const float* qt = a.q + t * a.ld_qk + static_cast<int64_t>(h) * dk;
    const float* gt = a.g + (t * heads + h) * dk;
    for (int c = threadIdx.x; c < dk; c += blockDim.x) {
      sk[c] = kt[c];
      sq[c] = qt[c];
      sdecay[c] = expf(gt[c]);
    }
    const float beta = a.beta[t * heads + h];
    const float vj = col_ok ? a.v[t * a.ld_v + static_cast<int64_t>(h) * dv + j] : 0.0f;
    __syncthreads();
    // S = diag(e^g) S; (S^T k)_j over this thread's rows, the warp's row groups,
    // then the warps.
    float part = 0.0f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int i = row0 + row_step * r;
      if (i < dk) {
        s[r] *= sdecay[i];
        part = fmaf(s[r], sk[i], part);
      }
    }
#pragma unroll
    for (int o = kRecCols; o < kWarpSize; o *= 2) {
      part += __shfl_xor_sync(::tandem::gpu::kFullMask, part, o);
    }
    if (lane < kRecCols) red_k[w * kRecCols + lane] = part;
    __syncthreads();
    float ks = 0.0f;
    for (int ww = 0; ww < warps; ++ww) ks += red_k[ww * kRecCols + col];
    // S += beta k (v - S^T k)^T; o = S^T q.
    const float delta = beta * (vj - ks);
    float po = 0.0f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int i = row0 + row_step * r;
      if (i < dk) {
        s[r] = fmaf(sk[i], delta, s[r]);
        po = fmaf(s[r], sq[i], po);
      }
    }
#pragma unroll
    for (int o = kRecCols; o < kWarpSize; o *= 2) {
      po += __shfl_xor_sync(::tandem::gpu::kFullMask, po, o);
    }
    if (lane < kRecCols) red_o[w * kRecCols + lane] = po;
    __syncthreads();
    if (threadIdx.x < kRecCols && col_ok) {
      float o = 0.0f;
      for (int ww = 0; ww < warps; ++ww) o += red_o[ww * kRecCols + col];
      a.out[t * a.ld_out + static_cast<int64_t>(h) * dv + j] = o;
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = row0 + row_step * r;
    if (i < dk && col_ok) st[static_cast<int64_t>(i) * dv + j] = s[r];
  }
}

// ---- Chunked: per-(chunk, head) scratch layout ----------------------------------

struct ChunkLayout {
  int dkp, dvp;  // d_k rounded up to 16, d_v to 32
  int w, qg, kdt, egl, qk, up, floats;
  __host__ __device__ explicit ChunkLayout(int dk, int dv) {
    dkp = RoundUp(dk, 16);
    dvp = RoundUp(dv, kTile);
    w = 0;                 // W  [16][dkp]  T diag(beta) e^G k
    qg = w + kC * dkp;     // Qg [16][dkp]  e^G q
    kdt = qg + kC * dkp;   // KdT [dkp][16] e^{G_L - G_j} k_j
    egl = kdt + dkp * kC;  // [dkp] e^{G_L}
    qk = egl + dkp;        // [16][16] decayed q.k, zero above the diagonal
    up = qk + kC * kC;     // U' [16][dvp]  T diag(beta) v
    floats = RoundUp(up + kC * dvp, 4);
  }
};

// grid (chunks, heads), block 256. Dynamic smem: k, q, G [16][dk], M [16][16], beta.
constexpr int kPrepThreads = 256;
__global__ void KdaChunkPrepKernel(KdaLaunchArgs a, float* scratch) {
  const int dk = static_cast<int>(a.head_dim_k), dv = static_cast<int>(a.head_dim_v);
  const int heads = static_cast<int>(a.heads);
  const int64_t chunk = blockIdx.x;
  const int h = blockIdx.y;
  const int64_t t0 = chunk * kC;
  const int len = static_cast<int>(std::min<int64_t>(kC, a.tokens - t0));
  const ChunkLayout L(dk, dv);
  float* base = scratch + (chunk * heads + h) * L.floats;
  TANDEM_DYNAMIC_SMEM(float, smem);
  float* sk = smem;             // [16][dk]
  float* sq = sk + kC * dk;     // [16][dk]
  float* sg = sq + kC * dk;     // [16][dk] g, then the cumulative G
  float* sm = sg + kC * dk;     // [16][16] beta_t A_tj (j < t)
  float* sbeta = sm + kC * kC;  // [16]
  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int nwarps = blockDim.x / kWarpSize;

  for (int idx = tid; idx < kC * dk; idx += blockDim.x) {
    const int t = idx / dk, c = idx % dk;
    float kv = 0.0f, qv = 0.0f, gv = 0.0f;
    if (t < len) {
      const int64_t row = (t0 + t) * a.ld_qk + static_cast<int64_t>(h) * dk + c;
      kv = a.k[row];
      qv = a.q[row];
      gv = a.g[((t0 + t) * heads + h) * dk + c];
    }
    sk[idx] = kv;
    sq[idx] = qv;
    sg[idx] = gv;
  }
  if (tid < kC) sbeta[tid] = tid < len ? a.beta[(t0 + tid) * heads + h] : 0.0f;
  __syncthreads();
  // Cumulative gates (padding tokens have g = 0, so G stays at G_{len-1}).
  for (int c = tid; c < dk; c += blockDim.x) {
    float acc = 0.0f;
#pragma unroll
    for (int t = 0; t < kC; ++t) {
      acc += sg[t * dk + c];
      sg[t * dk + c] = acc;
    }
  }
  float* qk_out = base + L.qk;
  for (int idx = tid; idx < kC * kC; idx += blockDim.x) {
    if (idx % kC > idx / kC) qk_out[idx] = 0.0f;
  }
  __syncthreads();
  // Decayed products for the 136 pairs j <= t: a warp per pair, lanes over d_k.
  // e^{G_t - G_j} <= 1 (j <= t).
  for (int p = warp; p < kC * (kC + 1) / 2; p += nwarps) {
    int t = 0;
    while ((t + 1) * (t + 2) / 2 <= p) ++t;
    const int jj = p - t * (t + 1) / 2;
    float qk = 0.0f, kk = 0.0f;
    for (int c = lane; c < dk; c += kWarpSize) {
      const float kj = sk[jj * dk + c] * expf(sg[t * dk + c] - sg[jj * dk + c]);
      qk = fmaf(sq[t * dk + c], kj, qk);
      kk = fmaf(sk[t * dk + c], kj, kk);
    }
    qk = WarpSum(qk);
    kk = WarpSum(kk);
    if (lane == 0) {
      qk_out[t * kC + jj] = qk;
      sm[t * kC + jj] = jj < t ? sbeta[t] * kk : 0.0f;
    }
  }
  __syncthreads();
  // Forward substitution (I + diag(beta) A) X = diag(beta) R, a thread per column
  // of R = [e^G k | v]; and the chunk's Qg, KdT, e^{G_L} columns.
  const float* glast = sg + (kC - 1) * dk;
  for (int col = tid; col < L.dkp + L.dvp; col += blockDim.x) {
    float x[kC];
    const bool is_k = col < L.dkp;
    const int c = is_k ? col : col - L.dkp;
    if (is_k) {
      const bool ok = c < dk;
      const float gl = ok ? glast[c] : 0.0f;
      float kdt[kC];
#pragma unroll
      for (int t = 0; t < kC; ++t) {
        const float gt = ok ? sg[t * dk + c] : 0.0f;
        const float eg = ok ? expf(gt) : 0.0f;
        const float kv = ok ? sk[t * dk + c] : 0.0f;
        x[t] = sbeta[t] * eg * kv;
        base[L.qg + t * L.dkp + c] = ok ? eg * sq[t * dk + c] : 0.0f;
        kdt[t] = ok ? expf(gl - gt) * kv : 0.0f;
      }
      F4* kd4 = reinterpret_cast<F4*>(base + L.kdt + c * kC);
#pragma unroll
      for (int q4 = 0; q4 < kC / 4; ++q4) {
        kd4[q4] = F4{kdt[4 * q4], kdt[4 * q4 + 1], kdt[4 * q4 + 2], kdt[4 * q4 + 3]};
      }
      base[L.egl + c] = ok ? expf(gl) : 0.0f;
    } else {
      const bool ok = c < dv;
#pragma unroll
      for (int t = 0; t < kC; ++t) {
        x[t] =
            (ok && t < len)
                ? sbeta[t] * a.v[(t0 + t) * a.ld_v + static_cast<int64_t>(h) * dv + c]
                : 0.0f;
      }
    }
#pragma unroll
    for (int t = 1; t < kC; ++t) {
#pragma unroll
      for (int jj = 0; jj < t; ++jj) x[t] = fmaf(-sm[t * kC + jj], x[jj], x[t]);
    }
    float* dst = is_k ? base + L.w + c : base + L.up + c;
    const int ld = is_k ? L.dkp : L.dvp;
#pragma unroll
    for (int t = 0; t < kC; ++t) dst[t * ld] = x[t];
  }
}

// ---- Chunked: the sequential state pass on tensor cores ---------------------------

// x = hi + lo, both BF16.
__device__ __forceinline__ void Split(float x, uint16_t& hi, uint16_t& lo) {
  hi = F32ToBf16(x);
  lo = F32ToBf16(x - Bf16ToF32(hi));
}
__device__ __forceinline__ void SplitPair(float x0, float x1, uint32_t& hi,
                                          uint32_t& lo) {
  uint16_t h0, l0, h1, l1;
  Split(x0, h0, l0);
  Split(x1, h1, l1);
  hi = PackBf16x2(h0, h1);
  lo = PackBf16x2(l0, l1);
}
// A fragment (16 x 16 row-major fp32 at `src`, row stride ld) split into hi / lo.
__device__ __forceinline__ void LoadSplitA(const float* src, int ld, int g, int tq,
                                           uint32_t hi[4], uint32_t lo[4]) {
  const F2 r0 = *reinterpret_cast<const F2*>(src + g * ld + 2 * tq);
  const F2 r1 = *reinterpret_cast<const F2*>(src + (g + 8) * ld + 2 * tq);
  const F2 r2 = *reinterpret_cast<const F2*>(src + g * ld + 2 * tq + 8);
  const F2 r3 = *reinterpret_cast<const F2*>(src + (g + 8) * ld + 2 * tq + 8);
  SplitPair(r0.x, r0.y, hi[0], lo[0]);
  SplitPair(r1.x, r1.y, hi[1], lo[1]);
  SplitPair(r2.x, r2.y, hi[2], lo[2]);
  SplitPair(r3.x, r3.y, hi[3], lo[3]);
}
// d += a * b in split BF16 (three products; lo * lo dropped).
__device__ __forceinline__ void Mma3(float d[4], const uint32_t ahi[4],
                                     const uint32_t alo[4], const uint32_t bhi[2],
                                     const uint32_t blo[2]) {
  MmaBf16M16N8K16(d, alo, bhi);
  MmaBf16M16N8K16(d, ahi, blo);
  MmaBf16M16N8K16(d, ahi, bhi);
}

constexpr int kStateWarps = 4;
constexpr int kUPitch = kTile + 4;  // sU row pitch (floats): conflict-free B reads

// grid (ceil(d_v / 32), heads), block 128 (4 warps). Warp w owns the state rows of
// m-tiles w + 4r (r < kMT), all 32 columns of the tile (4 n-tiles of 8), as mma
// accumulators, and computes columns 8w..8w+7 of X, Y, U, O.
template <int kMT>
__global__ void __launch_bounds__(kStateWarps * 32)
    KdaChunkStateKernel(KdaLaunchArgs a, const float* scratch) {
  const int dk = static_cast<int>(a.head_dim_k), dv = static_cast<int>(a.head_dim_v);
  const int heads = static_cast<int>(a.heads);
  const int h = blockIdx.y;
  const int col0 = blockIdx.x * kTile;
  const ChunkLayout L(dk, dv);
  const int mtiles = L.dkp / 16;
  const int pitch = L.dkp + 8;  // bf16 elements per row of sHi / sLo
  const int lane = threadIdx.x % kWarpSize, w = threadIdx.x / kWarpSize;
  const int g = lane / 4, tq = lane % 4;
  TANDEM_DYNAMIC_SMEM(uint16_t, smem16);
  uint16_t* s_hi = smem16;                // [32][pitch]  S^T, high BF16 part
  uint16_t* s_lo = s_hi + kTile * pitch;  // [32][pitch]  low part
  float* s_u = reinterpret_cast<float*>(s_lo + kTile * pitch);  // [16][kUPitch]

  float* st = a.state + static_cast<int64_t>(h) * dk * dv;
  float s[kMT][4][4];
#pragma unroll
  for (int r = 0; r < kMT; ++r) {
    const int mt = w + kStateWarps * r;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = 16 * mt + g + 8 * (e / 2);
        const int col = col0 + 8 * nt + 2 * tq + (e % 2);
        s[r][nt][e] = (mt < mtiles && row < dk && col < dv)
                          ? st[static_cast<int64_t>(row) * dv + col]
                          : 0.0f;
      }
    }
  }
  const int64_t chunks = (a.tokens + kC - 1) / kC;
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const float* base = scratch + (chunk * heads + h) * L.floats;
    const int len = static_cast<int>(std::min<int64_t>(kC, a.tokens - chunk * kC));
    // (a) S0 -> shared, transposed, split BF16: the B operand of X = W S0.
#pragma unroll
    for (int r = 0; r < kMT; ++r) {
      const int mt = w + kStateWarps * r;
      if (mt >= mtiles) continue;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = 16 * mt + g + 8 * (e / 2);
          const int col = 8 * nt + 2 * tq + (e % 2);
          uint16_t hi, lo;
          Split(s[r][nt][e], hi, lo);
          s_hi[col * pitch + row] = hi;
          s_lo[col * pitch + row] = lo;
        }
      }
    }
    __syncthreads();
    // (b) X = W S0, Y = Qg S0 for columns 8w..8w+7 (contraction over d_k).
    float xacc[4] = {0, 0, 0, 0}, yacc[4] = {0, 0, 0, 0};
    for (int kt = 0; kt < mtiles; ++kt) {
      const int k0 = 16 * kt;
      uint32_t bhi[2], blo[2];
      const int n = 8 * w + g;
      bhi[0] = *reinterpret_cast<const uint32_t*>(s_hi + n * pitch + k0 + 2 * tq);
      bhi[1] = *reinterpret_cast<const uint32_t*>(s_hi + n * pitch + k0 + 2 * tq + 8);
      blo[0] = *reinterpret_cast<const uint32_t*>(s_lo + n * pitch + k0 + 2 * tq);
      blo[1] = *reinterpret_cast<const uint32_t*>(s_lo + n * pitch + k0 + 2 * tq + 8);
      uint32_t ahi[4], alo[4];
      LoadSplitA(base + L.w + k0, L.dkp, g, tq, ahi, alo);
      Mma3(xacc, ahi, alo, bhi, blo);
      LoadSplitA(base + L.qg + k0, L.dkp, g, tq, ahi, alo);
      Mma3(yacc, ahi, alo, bhi, blo);
    }
    // (c) U = U' - X -> shared.
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = g + 8 * (e / 2);
      const int col = 8 * w + 2 * tq + (e % 2);
      s_u[row * kUPitch + col] = base[L.up + row * L.dvp + col0 + col] - xacc[e];
    }
    __syncthreads();
    // B fragments of U (16 tokens x 8 columns) for the 4 n-tiles.
    uint32_t uhi[4][2], ulo[4][2];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int n = 8 * nt + g;
      SplitPair(s_u[(2 * tq) * kUPitch + n], s_u[(2 * tq + 1) * kUPitch + n],
                uhi[nt][0], ulo[nt][0]);
      SplitPair(s_u[(2 * tq + 8) * kUPitch + n], s_u[(2 * tq + 9) * kUPitch + n],
                uhi[nt][1], ulo[nt][1]);
    }
    // (d) O = Y + Qk U for columns 8w..8w+7.
    {
      uint32_t ahi[4], alo[4];
      LoadSplitA(base + L.qk, kC, g, tq, ahi, alo);
      uint32_t bhi[2] = {uhi[0][0], uhi[0][1]}, blo[2] = {ulo[0][0], ulo[0][1]};
#pragma unroll
      for (int nt = 1; nt < 4; ++nt) {  // select n-tile w without local memory
        if (nt == w) {
          bhi[0] = uhi[nt][0];
          bhi[1] = uhi[nt][1];
          blo[0] = ulo[nt][0];
          blo[1] = ulo[nt][1];
        }
      }
      Mma3(yacc, ahi, alo, bhi, blo);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e / 2);
        const int col = col0 + 8 * w + 2 * tq + (e % 2);
        if (row < len && col < dv) {
          a.out[(chunk * kC + row) * a.ld_out + static_cast<int64_t>(h) * dv + col] =
              yacc[e];
        }
      }
    }
    // (e) S = diag(e^{G_L}) S0 + KdT U on the warp's rows.
#pragma unroll
    for (int r = 0; r < kMT; ++r) {
      const int mt = w + kStateWarps * r;
      if (mt >= mtiles) continue;
      const float e0 = base[L.egl + 16 * mt + g], e1 = base[L.egl + 16 * mt + g + 8];
      uint32_t ahi[4], alo[4];
      LoadSplitA(base + L.kdt + 16 * mt * kC, kC, g, tq, ahi, alo);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        s[r][nt][0] *= e0;
        s[r][nt][1] *= e0;
        s[r][nt][2] *= e1;
        s[r][nt][3] *= e1;
        Mma3(s[r][nt], ahi, alo, uhi[nt], ulo[nt]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kMT; ++r) {
    const int mt = w + kStateWarps * r;
    if (mt >= mtiles) continue;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = 16 * mt + g + 8 * (e / 2);
        const int col = col0 + 8 * nt + 2 * tq + (e % 2);
        if (row < dk && col < dv)
          st[static_cast<int64_t>(row) * dv + col] = s[r][nt][e];
      }
    }
  }
}

int PowerOfTwoAtLeast(int x) {
  int p = 1;
  while (p < x) p *= 2;
  return p;
}

template <typename Kernel>
const char* PrepareSmem(Kernel kernel, size_t bytes) {
  if (bytes <= kDefaultSmem) return nullptr;
  return ::tandem::gpu::AllowDynamicSmem(kernel, bytes);
}

}  // namespace

const char* KdaRecurrentLaunch(const KdaLaunchArgs& a, void* stream) {
  if (a.tokens <= 0) return nullptr;
  if (a.head_dim_k > kKdaMaxHeadDimK) return "kda: head_dim_k above 512";
  const int dk = static_cast<int>(a.head_dim_k);
  const int warps = dk <= 128 ? 8 : 32;
  const int rows =
      PowerOfTwoAtLeast((dk + warps * kRecGroups - 1) / (warps * kRecGroups));
  const dim3 grid(static_cast<unsigned>((a.head_dim_v + kRecCols - 1) / kRecCols),
                  static_cast<unsigned>(a.heads));
  const dim3 block(warps * kWarpSize);
  const size_t smem = (3 * dk + 2 * warps * kRecCols) * sizeof(float);
  switch (rows) {
    case 1:
      TANDEM_LAUNCH(KdaRecurrentKernel<1>, grid, block, smem, stream, a, warps);
      break;
    case 2:
      TANDEM_LAUNCH(KdaRecurrentKernel<2>, grid, block, smem, stream, a, warps);
      break;
    default:
      TANDEM_LAUNCH(KdaRecurrentKernel<4>, grid, block, smem, stream, a, warps);
      break;
  }
  return ::tandem::gpu::LaunchError();
}

size_t KdaChunkedScratchBytes(int64_t tokens, int64_t heads, int64_t head_dim_k,
                              int64_t head_dim_v) {
  if (tokens <= 0) return 0;
  const ChunkLayout L(static_cast<int>(head_dim_k), static_cast<int>(head_dim_v));
  const int64_t chunks = (tokens + kC - 1) / kC;
  return static_cast<size_t>(chunks * heads * L.floats) * sizeof(float);
}

const char* KdaChunkedLaunch(const KdaLaunchArgs& a, void* scratch, void* stream) {
  if (a.tokens <= 0) return nullptr;
  if (a.head_dim_k > kKdaMaxHeadDimK) return "kda: head_dim_k above 512";
  const int dk = static_cast<int>(a.head_dim_k), dv = static_cast<int>(a.head_dim_v);
  const ChunkLayout L(dk, dv);
  float* sc = static_cast<float*>(scratch);
  const int64_t chunks = (a.tokens + kC - 1) / kC;
  {
    const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(a.heads));
    const size_t smem = (3 * kC * dk + kC * kC + kC) * sizeof(float);
    if (const char* e = PrepareSmem(KdaChunkPrepKernel, smem)) return e;
    TANDEM_LAUNCH(KdaChunkPrepKernel, grid, dim3(kPrepThreads), smem, stream, a, sc);
    if (const char* e = ::tandem::gpu::LaunchError()) return e;
  }
  const dim3 grid(static_cast<unsigned>((dv + kTile - 1) / kTile),
                  static_cast<unsigned>(a.heads));
  const dim3 block(kStateWarps * kWarpSize);
  const size_t smem =
      2 * kTile * (L.dkp + 8) * sizeof(uint16_t) + kC * kUPitch * sizeof(float);
  const int mt_per_warp =
      PowerOfTwoAtLeast((L.dkp / 16 + kStateWarps - 1) / kStateWarps);
  const float* csc = sc;
  switch (mt_per_warp) {
    case 1:
      TANDEM_LAUNCH(KdaChunkStateKernel<1>, grid, block, smem, stream, a, csc);
      break;
    case 2:
      TANDEM_LAUNCH(KdaChunkStateKernel<2>, grid, block, smem, stream, a, csc);
      break;
    case 4:
      if (const char* e = PrepareSmem(KdaChunkStateKernel<4>, smem)) return e;
      TANDEM_LAUNCH(KdaChunkStateKernel<4>, grid, block, smem, stream, a, csc);
      break;
    default:
      if (const char* e = PrepareSmem(KdaChunkStateKernel<8>, smem)) return e;
      TANDEM_LAUNCH(KdaChunkStateKernel<8>, grid, block, smem, stream, a, csc);
      break;
  }
  return ::tandem::gpu::LaunchError();
}

}  // namespace tandem::kernels::cuda
