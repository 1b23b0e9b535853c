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
using ::tandem::gpu::CpAsync16;
using ::tandem::gpu::CpAsyncCommit;
using ::tandem::gpu::CpAsyncWait;
using ::tandem::gpu::F32ToBf16;
using ::tandem::gpu::kWarpSize;
using ::tandem::gpu::LdMatrixX4;
using ::tandem::gpu::MmaBf16M16N8K16;
using ::tandem::gpu::PackBf16x2;
using ::tandem::gpu::WarpSum;

constexpr int kTile = 32;  // d_v padding of the chunk records: the widest state tile
constexpr int kC = static_cast<int>(kKdaChunk);
constexpr size_t kDefaultSmem = 48 * 1024;

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
// kMaxThreads (launch bounds): the block the launch uses, 256 or 1024. A
// 1024-thread block fits the register file only at <= 64 registers a thread,
// which the compiler must know, or the launch fails for lack of resources.
template <int kRows, int kMaxThreads>
__global__ void __launch_bounds__(kMaxThreads)
    KdaRecurrentKernel(KdaLaunchArgs a, int warps) {
  const int dk = static_cast<int>(a.head_dim_k), dv = static_cast<int>(a.head_dim_v);
  const int heads = static_cast<int>(a.heads);
  const int h = blockIdx.y;
  const int lane = threadIdx.x % kWarpSize, w = threadIdx.x / kWarpSize;
  const int col = lane % kRecCols;
  const int row0 = w * kRecGroups + lane / kRecCols;
  const int row_step = warps * kRecGroups;
  const int j = blockIdx.x * kRecCols + col;
  const bool col_ok = j < dv;
  // Sequence blockIdx.z of a batched launch: its rows, and its state slot.
  const int64_t seq = blockIdx.z, r0 = seq * a.tokens;
  a.q += r0 * a.ld_qk;
  a.k += r0 * a.ld_qk;
  a.v += r0 * a.ld_v;
  a.g += r0 * heads * dk;
  a.beta += r0 * heads;
  a.out += r0 * a.ld_out;
  if (a.state_slots != nullptr) {
    const int32_t slot = a.state_slots[seq];
    if (slot < 0) {  // padding: zero output rows, no state
      if (threadIdx.x < kRecCols && col_ok) {
        for (int64_t t = 0; t < a.tokens; ++t)
          a.out[t * a.ld_out + static_cast<int64_t>(h) * dv + j] = 0.0f;
      }
      return;
    }
    a.state += slot * a.state_stride;
  }
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

// x = hi + lo, both BF16.
__device__ __forceinline__ void Split(float x, uint16_t& hi, uint16_t& lo) {
  hi = F32ToBf16(x);
  lo = F32ToBf16(x - Bf16ToF32(hi));
}

// Byte offsets inside one (chunk, head) record. The mma operands are stored split
// (hi, lo BF16 planes), ready for the state pass; U' and e^{G_L} stay fp32.
struct ChunkLayout {
  int dkp, dvp;                  // d_k rounded up to 16, d_v to 32
  int w_hi, w_lo, qg_hi, qg_lo;  // [16][dkp] bf16: W = T diag(beta) e^G k, Qg = e^G q
  int kdt_hi, kdt_lo;            // [dkp][16] bf16: KdT[c][j] = e^{G_L - G_j} k_j
  int qk_hi, qk_lo;              // [16][16] bf16: decayed q.k, zero above the diagonal
  int egl;                       // [dkp] f32: e^{G_L}
  int up;                        // [16][dvp] f32: U' = T diag(beta) v
  int bytes;
  __host__ __device__ explicit ChunkLayout(int dk, int dv) {
    dkp = RoundUp(dk, 16);
    dvp = RoundUp(dv, kTile);
    const int plane = kC * dkp * 2;
    w_hi = 0;
    w_lo = w_hi + plane;
    qg_hi = w_lo + plane;
    qg_lo = qg_hi + plane;
    kdt_hi = qg_lo + plane;
    kdt_lo = kdt_hi + plane;
    qk_hi = kdt_lo + plane;
    qk_lo = qk_hi + kC * kC * 2;
    egl = qk_lo + kC * kC * 2;
    up = egl + dkp * 4;
    bytes = up + kC * dvp * 4;  // a multiple of 16
  }
};

struct alignas(16) U4 {
  uint32_t x, y, z, w;
};

// grid (chunks, heads), block 256. Dynamic smem: k, q, G [16][dk], M [16][16], beta.
constexpr int kPrepThreads = 256;
__global__ void KdaChunkPrepKernel(KdaLaunchArgs a, unsigned char* scratch) {
  const int dk = static_cast<int>(a.head_dim_k), dv = static_cast<int>(a.head_dim_v);
  const int heads = static_cast<int>(a.heads);
  const int64_t chunk = blockIdx.x;
  const int h = blockIdx.y;
  const int64_t t0 = chunk * kC;
  const int len = static_cast<int>(std::min<int64_t>(kC, a.tokens - t0));
  const ChunkLayout L(dk, dv);
  unsigned char* base = scratch + (chunk * heads + h) * L.bytes;
  uint16_t* w_hi = reinterpret_cast<uint16_t*>(base + L.w_hi);
  uint16_t* w_lo = reinterpret_cast<uint16_t*>(base + L.w_lo);
  uint16_t* qg_hi = reinterpret_cast<uint16_t*>(base + L.qg_hi);
  uint16_t* qg_lo = reinterpret_cast<uint16_t*>(base + L.qg_lo);
  uint16_t* qk_hi = reinterpret_cast<uint16_t*>(base + L.qk_hi);
  uint16_t* qk_lo = reinterpret_cast<uint16_t*>(base + L.qk_lo);
  float* egl = reinterpret_cast<float*>(base + L.egl);
  float* up = reinterpret_cast<float*>(base + L.up);
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
  for (int idx = tid; idx < kC * kC; idx += blockDim.x) {
    if (idx % kC > idx / kC) qk_hi[idx] = qk_lo[idx] = 0;
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
      Split(qk, qk_hi[t * kC + jj], qk_lo[t * kC + jj]);
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
      uint16_t kd_hi[kC], kd_lo[kC];
#pragma unroll
      for (int t = 0; t < kC; ++t) {
        const float gt = ok ? sg[t * dk + c] : 0.0f;
        const float eg = ok ? expf(gt) : 0.0f;
        const float kv = ok ? sk[t * dk + c] : 0.0f;
        x[t] = sbeta[t] * eg * kv;
        Split(ok ? eg * sq[t * dk + c] : 0.0f, qg_hi[t * L.dkp + c],
              qg_lo[t * L.dkp + c]);
        Split(ok ? expf(gl - gt) * kv : 0.0f, kd_hi[t], kd_lo[t]);
      }
      U4* kh = reinterpret_cast<U4*>(base + L.kdt_hi + c * kC * 2);
      U4* kl = reinterpret_cast<U4*>(base + L.kdt_lo + c * kC * 2);
#pragma unroll
      for (int q = 0; q < kC / 8; ++q) {
        const uint16_t* h8 = kd_hi + 8 * q;
        const uint16_t* l8 = kd_lo + 8 * q;
        kh[q] = U4{PackBf16x2(h8[0], h8[1]), PackBf16x2(h8[2], h8[3]),
                   PackBf16x2(h8[4], h8[5]), PackBf16x2(h8[6], h8[7])};
        kl[q] = U4{PackBf16x2(l8[0], l8[1]), PackBf16x2(l8[2], l8[3]),
                   PackBf16x2(l8[4], l8[5]), PackBf16x2(l8[6], l8[7])};
      }
      egl[c] = ok ? expf(gl) : 0.0f;
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
    if (is_k) {
#pragma unroll
      for (int t = 0; t < kC; ++t)
        Split(x[t], w_hi[t * L.dkp + c], w_lo[t * L.dkp + c]);
    } else {
#pragma unroll
      for (int t = 0; t < kC; ++t) up[t * L.dvp + c] = x[t];
    }
  }
}

// ---- Chunked: the sequential state pass on tensor cores ---------------------------

// d += a * b in split BF16: the big product into `big`, the two cross terms into
// `small` (independent accumulation chains; lo * lo dropped).
__device__ __forceinline__ void Mma3(float big[4], float small[4],
                                     const uint32_t ahi[4], const uint32_t alo[4],
                                     const uint32_t bhi[2], const uint32_t blo[2]) {
  MmaBf16M16N8K16(big, ahi, bhi);
  MmaBf16M16N8K16(small, alo, bhi);
  MmaBf16M16N8K16(small, ahi, blo);
}

constexpr int kSmallPitch = 24;  // bf16 pitch of 16-wide planes (48 B: odd 16-B units)
constexpr int kUpPitch = kTile + 8;  // f32 pitch of the staged U' tile

// One chunk's operands in shared memory (byte offsets), rows padded so that the
// ldmatrix row addresses of a matrix fall in distinct 16-byte bank groups.
struct StageLayout {
  int pa;  // bf16 pitch of the [16][dkp] planes: dkp + 8
  int w_hi, kdt_hi, kdt_lo, qk_hi, qk_lo, egl, up, bytes;
  __host__ __device__ explicit StageLayout(int dkp) {
    pa = dkp + 8;
    w_hi = 0;  // W hi, W lo, Qg hi, Qg lo: 64 rows of pitch pa
    kdt_hi = w_hi + 4 * kC * pa * 2;
    kdt_lo = kdt_hi + dkp * kSmallPitch * 2;
    qk_hi = kdt_lo + dkp * kSmallPitch * 2;
    qk_lo = qk_hi + kC * kSmallPitch * 2;
    egl = qk_lo + kC * kSmallPitch * 2;
    up = egl + dkp * 4;
    bytes = up + kC * kUpPitch * 4;
  }
  __host__ __device__ int w_lo() const { return w_hi + kC * pa * 2; }
  __host__ __device__ int qg_hi() const { return w_hi + 2 * kC * pa * 2; }
  __host__ __device__ int qg_lo() const { return w_hi + 3 * kC * pa * 2; }
};
// After the stages: S^T hi / lo [32][pa] and U^T hi / lo [32][kSmallPitch], bf16.
__host__ __device__ inline int FixedSmemBytes(int dkp, int tile) {
  return 2 * tile * (dkp + 8) * 2 + 2 * tile * kSmallPitch * 2;
}

// `rows` rows of `units` 16-byte units, cp.async by the whole block.
__device__ __forceinline__ void CopyRows(unsigned char* dst, int dst_pitch,
                                         const unsigned char* src, int src_pitch,
                                         int rows, int units) {
  for (int idx = threadIdx.x; idx < rows * units; idx += blockDim.x) {
    const int r = idx / units, u = idx % units;
    CpAsync16(dst + r * dst_pitch + 16 * u, src + r * src_pitch + 16 * u);
  }
}

// ldmatrix x4 of a 16 x 16 bf16 tile at `tile` (row pitch in elements): the mma A
// fragment a[0..3] when the rows are M and the columns K; for a tile stored with
// rows N and columns K it gives two B fragments (n 0-7: r[0], r[2]... see callers).
__device__ __forceinline__ void LdTileA(uint32_t r[4], const uint16_t* tile, int pitch,
                                        int lane) {
  const int row = ((lane / 8) % 2) * 8 + lane % 8, col = (lane / 16) * 8;
  LdMatrixX4(r, tile + row * pitch + col);
}
// B fragments (K = 16, N = 8) of hi and lo planes stored N-major ([n][k], pitch):
// r = {hi k0-7, hi k8-15, lo k0-7, lo k8-15}.
__device__ __forceinline__ void LdSplitB(uint32_t bhi[2], uint32_t blo[2],
                                         const uint16_t* hi, const uint16_t* lo,
                                         int pitch, int k0, int lane) {
  const int i = lane / 8;
  const uint16_t* plane = i < 2 ? hi : lo;
  uint32_t r[4];
  LdMatrixX4(r, plane + (lane % 8) * pitch + k0 + (i % 2) * 8);
  bhi[0] = r[0];
  bhi[1] = r[1];
  blo[0] = r[2];
  blo[1] = r[3];
}

// grid (ceil(d_v / 8kW), heads), block 32 kW (kW warps, 8 kW columns). Warp w owns
// the state rows of m-tiles w + kW r (r < kMT), all columns of the tile (kW n-tiles
// of 8), as mma accumulators, and computes columns 8w..8w+7 of X, Y, U, O. The next
// chunk's operands stream in (cp.async) while this one computes when `stages` is 2.
template <int kMT, int kW>
__global__ void __launch_bounds__(kW * 32)
    KdaChunkStateKernel(KdaLaunchArgs a, const unsigned char* scratch, int stages) {
  const int dk = static_cast<int>(a.head_dim_k), dv = static_cast<int>(a.head_dim_v);
  const int heads = static_cast<int>(a.heads);
  const int h = blockIdx.y;
  constexpr int kTV = 8 * kW;  // d_v columns of the block: an n-tile per warp
  const int col0 = blockIdx.x * kTV;
  const ChunkLayout L(dk, dv);
  const StageLayout SL(L.dkp);
  const int mtiles = L.dkp / 16;
  const int pa = SL.pa;
  const int lane = threadIdx.x % kWarpSize, w = threadIdx.x / kWarpSize;
  const int g = lane / 4, tq = lane % 4;
  TANDEM_DYNAMIC_SMEM(unsigned char, smem);
  uint16_t* s_hi = reinterpret_cast<uint16_t*>(smem + stages * SL.bytes);  // [32][pa]
  uint16_t* s_lo = s_hi + kTV * pa;
  uint16_t* u_hi = s_lo + kTV * pa;  // U^T [kTV][kSmallPitch]
  uint16_t* u_lo = u_hi + kTV * kSmallPitch;

  float* st = a.state + static_cast<int64_t>(h) * dk * dv;
  float s[kMT][kW][4];
#pragma unroll
  for (int r = 0; r < kMT; ++r) {
    const int mt = w + kW * r;
#pragma unroll
    for (int nt = 0; nt < kW; ++nt) {
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
  auto issue = [&](int64_t chunk, int buf) {
    const unsigned char* src = scratch + (chunk * heads + h) * L.bytes;
    unsigned char* dst = smem + buf * SL.bytes;
    CopyRows(dst + SL.w_hi, 2 * pa, src + L.w_hi, 2 * L.dkp, 4 * kC, L.dkp / 8);
    CopyRows(dst + SL.kdt_hi, 2 * kSmallPitch, src + L.kdt_hi, 2 * kC, 2 * L.dkp, 2);
    CopyRows(dst + SL.qk_hi, 2 * kSmallPitch, src + L.qk_hi, 2 * kC, 2 * kC, 2);
    CopyRows(dst + SL.egl, 0, src + L.egl, 0, 1, L.dkp / 4);
    CopyRows(dst + SL.up, 4 * kUpPitch, src + L.up + 4 * col0, 4 * L.dvp, kC, kTV / 4);
  };
  const int64_t chunks = (a.tokens + kC - 1) / kC;
  issue(0, 0);
  CpAsyncCommit();
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int buf = stages == 2 ? static_cast<int>(chunk & 1) : 0;
    const int len = static_cast<int>(std::min<int64_t>(kC, a.tokens - chunk * kC));
    if (stages == 1 && chunk > 0) {
      __syncthreads();  // everyone is done with the previous chunk's operands
      issue(chunk, 0);
      CpAsyncCommit();
    }
    CpAsyncWait<0>();
    // (a) S0 -> shared, transposed, split BF16: the B operand of X = W S0.
#pragma unroll
    for (int r = 0; r < kMT; ++r) {
      const int mt = w + kW * r;
      if (mt >= mtiles) continue;
#pragma unroll
      for (int nt = 0; nt < kW; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = 16 * mt + g + 8 * (e / 2);
          const int col = 8 * nt + 2 * tq + (e % 2);
          Split(s[r][nt][e], s_hi[col * pa + row], s_lo[col * pa + row]);
        }
      }
    }
    __syncthreads();  // S^T and this chunk's operands visible; U^T free
    if (stages == 2 && chunk + 1 < chunks) issue(chunk + 1, buf ^ 1);
    CpAsyncCommit();
    const unsigned char* stage = smem + buf * SL.bytes;
    const uint16_t* w_hi = reinterpret_cast<const uint16_t*>(stage + SL.w_hi);
    const uint16_t* w_lo = reinterpret_cast<const uint16_t*>(stage + SL.w_lo());
    const uint16_t* qg_hi = reinterpret_cast<const uint16_t*>(stage + SL.qg_hi());
    const uint16_t* qg_lo = reinterpret_cast<const uint16_t*>(stage + SL.qg_lo());
    const uint16_t* kdt_hi = reinterpret_cast<const uint16_t*>(stage + SL.kdt_hi);
    const uint16_t* kdt_lo = reinterpret_cast<const uint16_t*>(stage + SL.kdt_lo);
    const uint16_t* qk_hi = reinterpret_cast<const uint16_t*>(stage + SL.qk_hi);
    const uint16_t* qk_lo = reinterpret_cast<const uint16_t*>(stage + SL.qk_lo);
    const float* egl = reinterpret_cast<const float*>(stage + SL.egl);
    const float* up = reinterpret_cast<const float*>(stage + SL.up);
    // (b) X = W S0, Y = Qg S0 for columns 8w..8w+7 (contraction over d_k).
    float xb[4] = {0, 0, 0, 0}, xs[4] = {0, 0, 0, 0};
    float yb[4] = {0, 0, 0, 0}, ys[4] = {0, 0, 0, 0};
    for (int kt = 0; kt < mtiles; ++kt) {
      const int k0 = 16 * kt;
      uint32_t bhi[2], blo[2], ahi[4], alo[4];
      LdSplitB(bhi, blo, s_hi + 8 * w * pa, s_lo + 8 * w * pa, pa, k0, lane);
      LdTileA(ahi, w_hi + k0, pa, lane);
      LdTileA(alo, w_lo + k0, pa, lane);
      Mma3(xb, xs, ahi, alo, bhi, blo);
      LdTileA(ahi, qg_hi + k0, pa, lane);
      LdTileA(alo, qg_lo + k0, pa, lane);
      Mma3(yb, ys, ahi, alo, bhi, blo);
    }
    // (c) U = U' - X -> shared, transposed, split BF16.
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = g + 8 * (e / 2);
      const int col = 8 * w + 2 * tq + (e % 2);
      const float u = up[row * kUpPitch + col] - (xb[e] + xs[e]);
      Split(u, u_hi[col * kSmallPitch + row], u_lo[col * kSmallPitch + row]);
    }
    __syncthreads();
    // B fragments of U (16 tokens x 8 columns) for the 4 n-tiles.
    uint32_t uhi[kW][2], ulo[kW][2];
#pragma unroll
    for (int nt = 0; nt < kW; ++nt) {
      LdSplitB(uhi[nt], ulo[nt], u_hi + 8 * nt * kSmallPitch,
               u_lo + 8 * nt * kSmallPitch, kSmallPitch, 0, lane);
    }
    // (d) O = Y + Qk U for columns 8w..8w+7.
    {
      uint32_t ahi[4], alo[4], bhi[2], blo[2];
      LdTileA(ahi, qk_hi, kSmallPitch, lane);
      LdTileA(alo, qk_lo, kSmallPitch, lane);
      LdSplitB(bhi, blo, u_hi + 8 * w * kSmallPitch, u_lo + 8 * w * kSmallPitch,
               kSmallPitch, 0, lane);
      Mma3(yb, ys, ahi, alo, bhi, blo);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e / 2);
        const int col = col0 + 8 * w + 2 * tq + (e % 2);
        if (row < len && col < dv) {
          a.out[(chunk * kC + row) * a.ld_out + static_cast<int64_t>(h) * dv + col] =
              yb[e] + ys[e];
        }
      }
    }
    // (e) S = diag(e^{G_L}) S0 + KdT U on the warp's rows.
#pragma unroll
    for (int r = 0; r < kMT; ++r) {
      const int mt = w + kW * r;
      if (mt >= mtiles) continue;
      const float e0 = egl[16 * mt + g], e1 = egl[16 * mt + g + 8];
      uint32_t ahi[4], alo[4];
      LdTileA(ahi, kdt_hi + 16 * mt * kSmallPitch, kSmallPitch, lane);
      LdTileA(alo, kdt_lo + 16 * mt * kSmallPitch, kSmallPitch, lane);
#pragma unroll
      for (int nt = 0; nt < kW; ++nt) {
        float small[4] = {0, 0, 0, 0};
        s[r][nt][0] *= e0;
        s[r][nt][1] *= e0;
        s[r][nt][2] *= e1;
        s[r][nt][3] *= e1;
        Mma3(s[r][nt], small, ahi, alo, uhi[nt], ulo[nt]);
#pragma unroll
        for (int e = 0; e < 4; ++e) s[r][nt][e] += small[e];
      }
    }
  }
  CpAsyncWait<0>();
#pragma unroll
  for (int r = 0; r < kMT; ++r) {
    const int mt = w + kW * r;
    if (mt >= mtiles) continue;
#pragma unroll
    for (int nt = 0; nt < kW; ++nt) {
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

constexpr size_t kMaxSmem = 227 * 1024;  // opt-in limit, sm_90 / sm_100
constexpr int kAssumedSms = 132;         // H100 / H200 (B300: 148)

template <typename Kernel>
const char* PrepareSmem(Kernel kernel, size_t bytes) {
  if (bytes <= kDefaultSmem) return nullptr;
  return ::tandem::gpu::AllowDynamicSmem(kernel, bytes);
}

template <int kMT, int kW>
const char* LaunchState(const KdaLaunchArgs& a, const unsigned char* scratch, dim3 grid,
                        int stages, size_t smem, void* stream) {
  if (const char* e = PrepareSmem(KdaChunkStateKernel<kMT, kW>, smem)) return e;
  // Parenthesised: the template-id's comma would split the macro argument.
  TANDEM_LAUNCH((KdaChunkStateKernel<kMT, kW>), grid, dim3(kW * kWarpSize), smem,
                stream, a, scratch, stages);
  return ::tandem::gpu::LaunchError();
}

// KdaRecurrentKernel's instance for `rows` (1, 2 or 4) state rows per thread
// and a kMaxThreads-thread block.
template <int kMaxThreads>
void LaunchKdaRecurrent(int rows, dim3 grid, dim3 block, size_t smem, void* stream,
                        const KdaLaunchArgs& a, int warps) {
  switch (rows) {
    case 1:
      TANDEM_LAUNCH((KdaRecurrentKernel<1, kMaxThreads>), grid, block, smem, stream, a,
                    warps);
      break;
    case 2:
      TANDEM_LAUNCH((KdaRecurrentKernel<2, kMaxThreads>), grid, block, smem, stream, a,
                    warps);
      break;
    default:
      TANDEM_LAUNCH((KdaRecurrentKernel<4, kMaxThreads>), grid, block, smem, stream, a,
                    warps);
      break;
  }
}

}  // namespace

const char* KdaRecurrentLaunch(const KdaLaunchArgs& a, void* stream) {
  if (a.tokens <= 0) return nullptr;
  if (a.head_dim_k > kKdaMaxHeadDimK) return "kda: head_dim_k above 512";
  const int dk = static_cast<int>(a.head_dim_k);
  const int warps = dk <= 128 ? 8 : 32;
  const int rows =
      PowerOfTwoAtLeast((dk + warps * kRecGroups - 1) / (warps * kRecGroups));
  if (a.num_seqs < 1 || a.num_seqs > 65535 ||
      (a.state_slots == nullptr && a.num_seqs != 1)) {
    return "kda: num_seqs must be 1..65535 (1 without state_slots)";
  }
  const dim3 grid(static_cast<unsigned>((a.head_dim_v + kRecCols - 1) / kRecCols),
                  static_cast<unsigned>(a.heads), static_cast<unsigned>(a.num_seqs));
  const dim3 block(warps * kWarpSize);
  const size_t smem = (3 * dk + 2 * warps * kRecCols) * sizeof(float);
  if (warps == 8) {
    LaunchKdaRecurrent<256>(rows, grid, block, smem, stream, a, warps);
  } else {
    LaunchKdaRecurrent<1024>(rows, grid, block, smem, stream, a, warps);
  }
  return ::tandem::gpu::LaunchError();
}

size_t KdaChunkedScratchBytes(int64_t tokens, int64_t heads, int64_t head_dim_k,
                              int64_t head_dim_v) {
  if (tokens <= 0) return 0;
  const ChunkLayout L(static_cast<int>(head_dim_k), static_cast<int>(head_dim_v));
  const int64_t chunks = (tokens + kC - 1) / kC;
  return static_cast<size_t>(chunks * heads * L.bytes);
}

int64_t KdaChunkedTokensFor(size_t budget, int64_t heads, int64_t head_dim_k,
                            int64_t head_dim_v) {
  const ChunkLayout L(static_cast<int>(head_dim_k), static_cast<int>(head_dim_v));
  const int64_t per_chunk = std::max<int64_t>(1, heads) * L.bytes;
  return std::max<int64_t>(1, static_cast<int64_t>(budget) / per_chunk) * kC;
}

const char* KdaChunkedLaunch(const KdaLaunchArgs& a, void* scratch, void* stream,
                             int state_tile) {
  if (a.tokens <= 0) return nullptr;
  if (a.head_dim_k > kKdaMaxHeadDimK) return "kda: head_dim_k above 512";
  const int dk = static_cast<int>(a.head_dim_k), dv = static_cast<int>(a.head_dim_v);
  const ChunkLayout L(dk, dv);
  unsigned char* sc = static_cast<unsigned char*>(scratch);
  const int64_t chunks = (a.tokens + kC - 1) / kC;
  {
    const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(a.heads));
    const size_t smem = (3 * kC * dk + kC * kC + kC) * sizeof(float);
    if (const char* e = PrepareSmem(KdaChunkPrepKernel, smem)) return e;
    TANDEM_LAUNCH(KdaChunkPrepKernel, grid, dim3(kPrepThreads), smem, stream, a, sc);
    if (const char* e = ::tandem::gpu::LaunchError()) return e;
  }
  // The state pass: 32-column tiles (4 warps), or 16-column tiles (2 warps, the
  // same work a warp, twice the blocks) where 32-column tiles would leave most of
  // the SMs idle (K3 at TP8: 48 blocks of 32 columns, 96 of 16).
  const int tiles32 = static_cast<int>(a.heads) * ((dv + 31) / 32);
  if (state_tile == 0) {
    state_tile = (L.dkp <= 256 && (2 * tiles32 <= kAssumedSms || dv <= 16)) ? 16 : 32;
  }
  if (state_tile != 16 && state_tile != 32) return "kda: state tile must be 16 or 32";
  if (state_tile == 16 && L.dkp > 256)
    return "kda: 16-column state tiles need d_k <= 256";
  const int warps = state_tile / 8;
  const dim3 grid(static_cast<unsigned>((dv + state_tile - 1) / state_tile),
                  static_cast<unsigned>(a.heads));
  const StageLayout SL(L.dkp);
  const size_t fixed = FixedSmemBytes(L.dkp, state_tile);
  const int stages = 2 * SL.bytes + fixed <= kMaxSmem ? 2 : 1;
  const size_t smem = stages * SL.bytes + fixed;
  const int mt_per_warp = PowerOfTwoAtLeast((L.dkp / 16 + warps - 1) / warps);
  const unsigned char* csc = sc;
  if (warps == 2) {
    switch (mt_per_warp) {
      case 1:
        return LaunchState<1, 2>(a, csc, grid, stages, smem, stream);
      case 2:
        return LaunchState<2, 2>(a, csc, grid, stages, smem, stream);
      case 4:
        return LaunchState<4, 2>(a, csc, grid, stages, smem, stream);
      default:
        return LaunchState<8, 2>(a, csc, grid, stages, smem, stream);
    }
  }
  switch (mt_per_warp) {
    case 1:
      return LaunchState<1, 4>(a, csc, grid, stages, smem, stream);
    case 2:
      return LaunchState<2, 4>(a, csc, grid, stages, smem, stream);
    case 4:
      return LaunchState<4, 4>(a, csc, grid, stages, smem, stream);
    default:
      return LaunchState<8, 4>(a, csc, grid, stages, smem, stream);
  }
}

}  // namespace tandem::kernels::cuda
