// MLA attention kernels over the paged BF16 latent cache (design and measured
// errors: mla.h).
//
// Precision: the contract is 2e-5 * max|want| against the fp64 oracle. FlashMLA
// rounds q and p to BF16: 2^-9 relative per product, outputs off by ~1e-3 of
// max|want|, 50x over the bound. The tensor-core kernels here therefore split the
// fp32 operands into two BF16 (x = hi + lo, hi = bf16(x), lo = bf16(x - hi)) and
// issue two mma per product where the other operand is BF16 already (the cache's
// latents, k_rot) and three (hi.hi + hi.lo + lo.hi) where both are fp32 (the
// expanded form's k_nope / v); fp32 accumulation throughout. The SIMT kernels
// (fp32 FMA) serve shapes the mma tiling does not (odd head dims) and are the
// baseline the tests compare both against.
#include "kernels/cuda/vendor.h"
// (vendor.h first: it maps the CUDA programming model onto this toolchain.)
#include <algorithm>
#include <cmath>

#include "kernels/cuda/device_errors.h"
#include "kernels/cuda/mla.h"
#include "kernels/cuda/ptx.h"

namespace tandem::kernels::cuda {
namespace {

using tandem::gpu::Bf16ToF32;
using tandem::gpu::CpAsync16;
using tandem::gpu::CpAsyncCommit;
using tandem::gpu::CpAsyncWait;
using tandem::gpu::F32ToBf16;
using tandem::gpu::kFullMask;
using tandem::gpu::kWarpSize;
using tandem::gpu::MmaBf16M16N8K16;
using tandem::gpu::MmaStride;
using tandem::gpu::PackBf16x2;
using tandem::gpu::SplitBf16x2;
using tandem::gpu::ToBf16x2;
using tandem::gpu::WarpMax;
using tandem::gpu::WarpSum;

constexpr int kKeys = kWarpSize;  // keys per tile: lane = key in Q.K
static_assert(kKeys == kMlaKeyTile, "one key per lane");
constexpr int kRowsPerWarp = 4;

// Absorbed attention: 4 warps x 4 rows = 16 (query, head) rows per block.
constexpr int kAbsWarps = 4;
constexpr int kAbsRows = kAbsWarps * kRowsPerWarp;
constexpr int kAbsMaxPairs = kMlaMaxLora / (2 * kWarpSize);  // latent pairs per lane
// q absorption and combine: tokens per block.
constexpr int kQTok = 8;
constexpr int kCombTok = 4;
constexpr int kAuxThreads = 128;
constexpr int kQMaxCols = kMlaMaxLora / kAuxThreads;
// Expanded: 8 warps x 4 rows = 32 queries per block; expansion GEMM tiles.
constexpr int kExpWarps = 8;
constexpr int kExpRows = kExpWarps * kRowsPerWarp;
constexpr int kExpMaxV = kMlaMaxVDimExpanded / kWarpSize;
constexpr int kGemmPos = 64, kGemmN = 128, kGemmK = 32, kGemmThreads = 256;

// The opt-in limit of dynamic shared memory a block (sm_90 / sm_100), less room
// for the kernels' few static bytes (FindTileShared's), which count against it.
constexpr size_t kMaxSmem = 227 * 1024 - 256;
// The position of a row past its tile's rows (absorbed split kernels). A padding
// sequence (ctx 0) has positions < 0 but real rows: no keys, and its partials
// (m = -inf, l = 0) are written, so the combine gives zeros.
constexpr int64_t kNoRow = INT64_MIN / 2;

__device__ __forceinline__ void RecordError(int32_t* word, int32_t code) {
  if (word != nullptr) atomicCAS(word, 0, code);
}

__device__ __forceinline__ float Lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float Hi(uint32_t w) {
  return __uint_as_float(w & 0xffff0000u);
}

// Whether sequence s can be read safely (the kernel skips it otherwise; the
// reason is recorded once, by CheckSequences).
__device__ __forceinline__ bool SeqOk(const MlaLaunchArgs& a, int64_t s, int64_t* ctx,
                                      int64_t* q0, int64_t* q_len) {
  *q0 = a.query_start[s];
  *q_len = a.query_start[s + 1] - *q0;
  *ctx = a.seq_lens[s];
  // Absorbed form: ctx == 0 is a padding sequence (CUDA-graph batches), no keys,
  // its rows are zeros.
  return *q0 >= 0 && *q_len >= 0 && *q0 + *q_len <= a.num_tokens &&
         (*q_len <= *ctx || (*ctx == 0 && a.empty_is_padding)) &&
         *ctx <= a.block_table_stride * a.block_size &&
         (a.max_context <= 0 || *ctx <= a.max_context);
}

// One thread checks every sequence's lengths and records the first problem.
__device__ void CheckSequences(const MlaLaunchArgs& a) {
  if (a.query_start[0] != 0 || a.query_start[a.num_seqs] != a.num_tokens) {
    RecordError(a.error_word, kBadSequenceLength);
  }
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t q_len = a.query_start[s + 1] - a.query_start[s];
    const int64_t ctx = a.seq_lens[s];
    if (q_len < 0 || (q_len > ctx && !(ctx == 0 && a.empty_is_padding)) ||
        (a.max_context > 0 && ctx > a.max_context)) {
      RecordError(a.error_word, kBadSequenceLength);
    }
    if (ctx > a.block_table_stride * a.block_size) {
      RecordError(a.error_word, kBlockIdOutOfRange);
    }
  }
}

struct Tile {
  int64_t seq, ctx, q0, q_len, row0;
};

// The tile-th tile of `tile_rows` rows when sequence s has q_len_s *
// rows_per_token rows and every sequence starts a new tile. False when there is
// no such tile or its sequence is malformed. Run by one thread.
__device__ bool FindTile(const MlaLaunchArgs& a, int64_t tile, int64_t rows_per_token,
                         int64_t tile_rows, Tile* t) {
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t q_len = std::max<int64_t>(a.query_start[s + 1] - a.query_start[s], 0);
    const int64_t n = (q_len * rows_per_token + tile_rows - 1) / tile_rows;
    if (tile < n) {
      t->seq = s;
      t->row0 = tile * tile_rows;
      return SeqOk(a, s, &t->ctx, &t->q0, &t->q_len);
    }
    tile -= n;
  }
  return false;
}

// Shared-memory broadcast of a tile found by thread 0.
__device__ bool FindTileShared(const MlaLaunchArgs& a, int64_t tile,
                               int64_t rows_per_token, int64_t tile_rows, Tile* t) {
  TANDEM_SHARED(Tile, found, );
  TANDEM_SHARED(int, ok, );
  if (threadIdx.x == 0)
    ok = FindTile(a, tile, rows_per_token, tile_rows, &found) ? 1 : 0;
  __syncthreads();
  *t = found;
  return ok != 0;
}

// The cache row of position p of sequence s, or nullptr (recording the error)
// when its block id is out of range.
__device__ __forceinline__ const uint16_t* CacheRow(const MlaLaunchArgs& a, int64_t s,
                                                    int64_t p, bool record) {
  const int32_t blk = a.block_tables[s * a.block_table_stride + p / a.block_size];
  if (blk < 0 || blk >= a.num_blocks) {
    if (record) RecordError(a.error_word, kBlockIdOutOfRange);
    return nullptr;
  }
  return a.kv_cache + (static_cast<int64_t>(blk) * a.block_size + p % a.block_size) *
                          (a.lora + a.rope);
}

// One online-softmax step for a warp's row: lane = key with score s (-inf when
// masked). Updates the running max m and sum l; returns this lane's p and sets
// alpha, the factor the row's accumulators are rescaled by.
__device__ __forceinline__ float SoftmaxStep(float s, float* m, float* l,
                                             float* alpha) {
  const float m_new = fmaxf(*m, WarpMax(s));
  float p = 0.0f;
  *alpha = 1.0f;
  if (m_new != -INFINITY) {
    *alpha = expf(*m - m_new);
    p = s == -INFINITY ? 0.0f : expf(s - m_new);
  }
  *l = *l * *alpha + WarpSum(p);
  *m = m_new;
  return p;
}

// Row stride (in 32-bit words) of a shared tile row of `words` words: odd, so
// that 32 lanes reading one word of 32 different rows hit 32 banks.
__host__ __device__ __forceinline__ int64_t OddStride(int64_t words) {
  return words % 2 == 1 ? words : words + 1;
}

// ---- Absorbed: q_abs = scale * [W_UK^T q_nope | q_rope] ------------------------
__global__ void __launch_bounds__(kAuxThreads)
    MlaAbsorbQ(MlaLaunchArgs a, float* q_abs) {
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) CheckSequences(a);
  TANDEM_DYNAMIC_SMEM(float, qn);  // [kQTok][nope]
  const int64_t h = blockIdx.y, t0 = static_cast<int64_t>(blockIdx.x) * kQTok;
  const int64_t nt = std::min<int64_t>(kQTok, a.num_tokens - t0);
  const int64_t dq = a.nope + a.rope, width = a.lora + a.rope;
  for (int64_t i = threadIdx.x; i < kQTok * a.nope; i += blockDim.x) {
    const int64_t tok = i / a.nope, d = i % a.nope;
    qn[i] = tok < nt ? a.q[(t0 + tok) * a.ld_q + h * dq + d] : 0.0f;
  }
  for (int64_t i = threadIdx.x; i < nt * a.rope; i += blockDim.x) {
    const int64_t tok = i / a.rope, d = i % a.rope;
    q_abs[((t0 + tok) * a.heads + h) * width + a.lora + d] =
        a.scale * a.q[(t0 + tok) * a.ld_q + h * dq + a.nope + d];
  }
  __syncthreads();
  const uint16_t* wuk = a.kv_b_proj + h * (a.nope + a.v) * a.lora;
  float acc[kQMaxCols][kQTok] = {};
  for (int64_t i = 0; i < a.nope; ++i) {
    float w[kQMaxCols];
#pragma unroll
    for (int k = 0; k < kQMaxCols; ++k) {
      const int64_t c = threadIdx.x + k * kAuxThreads;
      w[k] = c < a.lora ? Bf16ToF32(wuk[i * a.lora + c]) : 0.0f;
    }
#pragma unroll
    for (int tok = 0; tok < kQTok; ++tok) {
      const float qv = qn[tok * a.nope + i];
#pragma unroll
      for (int k = 0; k < kQMaxCols; ++k) acc[k][tok] += qv * w[k];
    }
  }
  for (int k = 0; k < kQMaxCols; ++k) {
    const int64_t c = threadIdx.x + k * kAuxThreads;
    if (c >= a.lora) continue;
    for (int64_t tok = 0; tok < nt; ++tok) {
      q_abs[((t0 + tok) * a.heads + h) * width + c] = a.scale * acc[k][tok];
    }
  }
}

// ---- Absorbed: split-KV MQA over [c | k_rot] ------------------------------------
__global__ void __launch_bounds__(kAbsWarps* kWarpSize)
    MlaAbsorbedSplitKv(MlaLaunchArgs a, const float* q_abs, int splits, float* part_acc,
                       float* part_ml) {
  Tile t;
  if (!FindTileShared(a, blockIdx.x, a.heads, kAbsRows, &t)) return;
  const int split = blockIdx.y;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t width = a.lora + a.rope, half = width / 2, ks = OddStride(half);
  TANDEM_DYNAMIC_SMEM(float, smem);
  float* qs = smem;                                                   // [16][width]
  uint32_t* kt = reinterpret_cast<uint32_t*>(qs + kAbsRows * width);  // [32][ks]
  float* ps = reinterpret_cast<float*>(kt + kKeys * ks);              // [4][4][32]

  const int64_t rows = t.q_len * a.heads;
  for (int64_t i = threadIdx.x; i < kAbsRows * width; i += blockDim.x) {
    const int64_t r = i / width, d = i % width, g = t.row0 + r;
    qs[i] = g < rows ? q_abs[(t.q0 * a.heads + g) * width + d] : 0.0f;
  }
  // This split's positions, cut at the tile's last query position (causal).
  const int64_t per_split = (t.ctx + splits - 1) / splits;
  const int64_t chunk = (per_split + kKeys - 1) / kKeys * kKeys;
  const int64_t k_begin = split * chunk;
  const int64_t last_row = std::min(rows, t.row0 + kAbsRows) - 1;
  const int64_t k_end = std::min(std::min(t.ctx, k_begin + chunk),
                                 t.ctx - t.q_len + last_row / a.heads + 1);

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kAbsMaxPairs][2];
  int64_t pos[kRowsPerWarp];
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.0f;
    const int64_t g = t.row0 + warp * kRowsPerWarp + j;
    pos[j] = g < rows ? t.ctx - t.q_len + g / a.heads : kNoRow;
#pragma unroll
    for (int k = 0; k < kAbsMaxPairs; ++k) acc[j][k][0] = acc[j][k][1] = 0.0f;
  }
  const int64_t lora_pairs = a.lora / 2;
  for (int64_t n0 = k_begin; n0 < k_end; n0 += kKeys) {
    __syncthreads();  // the previous tile is consumed (and q is staged)
    for (int n = warp; n < kKeys; n += kAbsWarps) {
      const int64_t p = n0 + n;
      const uint32_t* src = nullptr;
      if (p < k_end) {
        src = reinterpret_cast<const uint32_t*>(CacheRow(a, t.seq, p, lane == 0));
      }
      for (int64_t w = lane; w < half; w += kWarpSize)
        kt[n * ks + w] = src ? src[w] : 0u;
    }
    __syncthreads();
    // Scores: lane = key.
    float sc[kRowsPerWarp] = {};
    const uint32_t* krow = kt + lane * ks;
    const float* q0 = qs + warp * kRowsPerWarp * width;
    for (int64_t w = 0; w < half; ++w) {
      const uint32_t kk = krow[w];
      const float k0 = Lo(kk), k1 = Hi(kk);
#pragma unroll
      for (int j = 0; j < kRowsPerWarp; ++j) {
        sc[j] += q0[j * width + 2 * w] * k0 + q0[j * width + 2 * w + 1] * k1;
      }
    }
    const int64_t p = n0 + lane;
    float* pw = ps + warp * kRowsPerWarp * kKeys;
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
      const bool ok = p < k_end && p <= pos[j];
      float alpha;
      pw[j * kKeys + lane] = SoftmaxStep(ok ? sc[j] : -INFINITY, &m[j], &l[j], &alpha);
#pragma unroll
      for (int k = 0; k < kAbsMaxPairs; ++k) {
        acc[j][k][0] *= alpha;
        acc[j][k][1] *= alpha;
      }
    }
    __syncwarp();
    // P.C: lane = latent column pair.
    for (int n = 0; n < kKeys; ++n) {
      float pn[kRowsPerWarp];
#pragma unroll
      for (int j = 0; j < kRowsPerWarp; ++j) pn[j] = pw[j * kKeys + n];
#pragma unroll
      for (int k = 0; k < kAbsMaxPairs; ++k) {
        const int64_t c2 = lane + k * kWarpSize;
        if (c2 >= lora_pairs) break;
        const uint32_t kk = kt[n * ks + c2];
        const float v0 = Lo(kk), v1 = Hi(kk);
#pragma unroll
        for (int j = 0; j < kRowsPerWarp; ++j) {
          acc[j][k][0] += pn[j] * v0;
          acc[j][k][1] += pn[j] * v1;
        }
      }
    }
    __syncwarp();
  }
  // Partials (written for every row, empty ranges included: m = -inf, l = 0).
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    if (pos[j] == kNoRow) continue;
    const int64_t g = t.row0 + warp * kRowsPerWarp + j;
    const int64_t base =
        (split * a.num_tokens + t.q0 + g / a.heads) * a.heads + g % a.heads;
    if (lane == 0) {
      part_ml[base * 2] = m[j];
      part_ml[base * 2 + 1] = l[j];
    }
    float* dst = part_acc + base * a.lora;
#pragma unroll
    for (int k = 0; k < kAbsMaxPairs; ++k) {
      const int64_t c2 = lane + k * kWarpSize;
      if (c2 >= lora_pairs) break;
      dst[2 * c2] = acc[j][k][0];
      dst[2 * c2 + 1] = acc[j][k][1];
    }
  }
}

// ---- Absorbed, tensor cores: the same split-KV MQA on mma.sync m16n8k16 ---------
// One block = 16 (query, head) rows x one split, 4 warps, key tiles of 32.
//   S = Q K^T: warp w computes the 16 x 8 scores of keys 8w..8w+7 over the padded
//     width (k-steps of 16); Q is split-BF16 (hi = bf16(q), lo = bf16(q - hi), two
//     mma per step), K is the cache's BF16 itself (exact): error ~2^-17 relative.
//     !kSplit ("cuda_bf16"): Q and P rounded to BF16 once, one mma per step (a
//     k = 4 verification's 48 rows a key make the split form compute-bound).
//   The 16 x 32 score tile goes through shared memory; every warp reads all of it
//     in the A-fragment layout and runs the (identical) online softmax itself.
//   O += P C: warp w owns latent columns [w lora/4, (w+1) lora/4) as n8 tiles in
//     accumulator registers; P split-BF16 as well (two mma per step; one when
//     !kSplit), C = the tile's BF16 latents packed from shared memory.
// Needs lora % 32 == 0 (whole n8 tiles per warp).
constexpr int kMmaMaxTiles = kMlaMaxLora / (kAbsWarps * 8);
constexpr int kScoreStride = kKeys + 8;  // floats per score row in shared memory

template <int kGroups, bool kSplit>
__global__ void __launch_bounds__(kGroups* kAbsWarps* kWarpSize)
    MlaAbsorbedSplitKvMma(MlaLaunchArgs a, const float* q_abs, int splits,
                          float* part_acc, float* part_ml) {
  constexpr int kRows = 16 * kGroups, kWarps = kAbsWarps * kGroups;
  Tile t;
  if (!FindTileShared(a, blockIdx.x, a.heads, kRows, &t)) return;
  const int split = blockIdx.y;
  const int lane = threadIdx.x % kWarpSize, wid = threadIdx.x / kWarpSize;
  // Row group rg (16 rows) x this warp's quarter `warp` of the keys and columns.
  const int rg = wid / kAbsWarps, warp = wid % kAbsWarps;
  const int g = lane / 4, tq = lane % 4;
  const int rbase = 16 * rg + g;  // this lane's first row in the tile
  const int64_t width = a.lora + a.rope, half = width / 2;
  const int64_t sw = MmaStride(width), steps = (width + 15) / 16, padded = steps * 8;
  TANDEM_DYNAMIC_SMEM(uint32_t, smem);
  uint32_t* qh = smem;  // [kRows][sw] q hi pairs
  // [kRows][sw] q lo pairs (kSplit only)
  uint32_t* ql = kSplit ? qh + kRows * sw : nullptr;
  uint32_t* kbuf = qh + (kSplit ? 2 : 1) * kRows * sw;          // [2][32][sw] key tiles
  float* st = reinterpret_cast<float*>(kbuf + 2 * kKeys * sw);  // [kRows][kScoreStride]

  const int64_t rows = t.q_len * a.heads;
  for (int64_t i = threadIdx.x; i < kRows * padded; i += blockDim.x) {
    const int64_t r = i / padded, w = i % padded, gr = t.row0 + r;
    float x0 = 0.0f, x1 = 0.0f;
    if (gr < rows && w < half) {
      const float* src = q_abs + (t.q0 * a.heads + gr) * width + 2 * w;
      x0 = src[0];
      x1 = src[1];
    }
    uint32_t lo;
    qh[r * sw + w] = ToBf16x2<kSplit>(x0, x1, &lo);
    if constexpr (kSplit) ql[r * sw + w] = lo;
  }
  const int64_t per_split = (t.ctx + splits - 1) / splits;
  const int64_t chunk = (per_split + kKeys - 1) / kKeys * kKeys;
  const int64_t k_begin = split * chunk;
  const int64_t last_row = std::min(rows, t.row0 + kRows) - 1;
  const int64_t k_end = std::min(std::min(t.ctx, k_begin + chunk),
                                 t.ctx - t.q_len + last_row / a.heads + 1);
  // This lane's two rows (rbase and rbase + 8): positions, kNoRow past the tile
  int64_t pos[2];
  for (int hr = 0; hr < 2; ++hr) {
    const int64_t gr = t.row0 + rbase + 8 * hr;
    pos[hr] = gr < rows ? t.ctx - t.q_len + gr / a.heads : kNoRow;
  }
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float acc[kMmaMaxTiles][4];
#pragma unroll
  for (int j = 0; j < kMmaMaxTiles; ++j)
    acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0;
  const int tiles = static_cast<int>(a.lora / (kAbsWarps * 8));
  const int64_t col0 = warp * (a.lora / kAbsWarps);

  // Key tiles stream through two buffers: tile i + 1's cp.async copies are in
  // flight while tile i is computed. Warp w fetches rows w, w + 4, ..., lanes the
  // 16-byte pieces of a row (one block-table read per row and warp); rows past
  // k_end and bad block ids are zero-filled with plain stores.
  auto fetch = [&](int64_t n0, uint32_t* dst) {
    for (int n = wid; n < kKeys; n += kWarps) {
      const int64_t p = n0 + n;
      const uint16_t* src = p < k_end ? CacheRow(a, t.seq, p, lane == 0) : nullptr;
      for (int64_t c = lane; c < padded / 4; c += kWarpSize) {
        uint32_t* d = dst + n * sw + 4 * c;
        if (src != nullptr && 4 * c + 4 <= half) {
          CpAsync16(d, src + 8 * c);
        } else {
          for (int e = 0; e < 4; ++e) {
            d[e] = src != nullptr && 4 * c + e < half
                       ? reinterpret_cast<const uint32_t*>(src)[4 * c + e]
                       : 0u;
          }
        }
      }
    }
    CpAsyncCommit();
  };
  if (k_begin < k_end) fetch(k_begin, kbuf);
  int buf = 0;
  for (int64_t n0 = k_begin; n0 < k_end; n0 += kKeys, buf ^= 1) {
    const uint32_t* kt = kbuf + buf * kKeys * sw;
    const uint16_t* k16 = reinterpret_cast<const uint16_t*>(kt);
    if (n0 + kKeys < k_end) {
      fetch(n0 + kKeys, kbuf + (buf ^ 1) * kKeys * sw);
      CpAsyncWait<1>();  // all but the newest group: this tile has landed
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();  // every thread's copies (and q, first time) are visible
    {
      // S: keys 8 warp .. 8 warp + 7, in 8 independent accumulators (k-step mod 4
      // x hi/lo; k-step mod 8 when !kSplit): short dependency chains between the
      // mma.
      float dd[8][4] = {};
      const uint32_t* kb = kt + (8 * warp + g) * sw;
      const uint32_t* q0h = qh + rbase * sw;
      const uint32_t* q1h = q0h + 8 * sw;
      constexpr int kUnroll = kSplit ? 4 : 8;
      for (int64_t k4 = 0; k4 < steps; k4 += kUnroll) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (k4 + u >= steps) break;
          const int64_t w0 = (k4 + u) * 8 + tq;
          const uint32_t ah[4] = {q0h[w0], q1h[w0], q0h[w0 + 4], q1h[w0 + 4]};
          const uint32_t b[2] = {kb[w0], kb[w0 + 4]};
          if constexpr (kSplit) {
            const uint32_t* q0l = ql + rbase * sw;
            const uint32_t* q1l = q0l + 8 * sw;
            const uint32_t al[4] = {q0l[w0], q1l[w0], q0l[w0 + 4], q1l[w0 + 4]};
            MmaBf16M16N8K16(dd[2 * u], ah, b);
            MmaBf16M16N8K16(dd[2 * u + 1], al, b);
          } else {
            MmaBf16M16N8K16(dd[u], ah, b);
          }
        }
      }
      float d[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        d[e] = ((dd[0][e] + dd[1][e]) + (dd[2][e] + dd[3][e])) +
               ((dd[4][e] + dd[5][e]) + (dd[6][e] + dd[7][e]));
      }
      float* s0 = st + rbase * kScoreStride + 8 * warp + 2 * tq;
      float* s1 = s0 + 8 * kScoreStride;
      s0[0] = d[0];
      s0[1] = d[1];
      s1[0] = d[2];
      s1[1] = d[3];
    }
    __syncthreads();
    // Online softmax on this lane's 2 rows x 8 keys (16 kk + 2 tq + {0, 1, 8, 9}).
    uint32_t ph[2][4], pl[2][4];
    float alpha[2];
    for (int hr = 0; hr < 2; ++hr) {
      const float* srow = st + (rbase + 8 * hr) * kScoreStride;
      float s[8];
      float mx = -INFINITY;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int key = 16 * (e / 4) + 2 * tq + (e % 2) + 8 * ((e / 2) % 2);
        const int64_t p = n0 + key;
        s[e] = p < k_end && p <= pos[hr] ? srow[key] : -INFINITY;
        mx = fmaxf(mx, s[e]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
      const float m_new = fmaxf(m[hr], mx);
      alpha[hr] = 1.0f;
      float sum = 0.0f;
      if (m_new != -INFINITY) {
        alpha[hr] = expf(m[hr] - m_new);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          s[e] = s[e] == -INFINITY ? 0.0f : expf(s[e] - m_new);
          sum += s[e];
        }
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) s[e] = 0.0f;
      }
      sum += __shfl_xor_sync(kFullMask, sum, 1);
      sum += __shfl_xor_sync(kFullMask, sum, 2);
      l[hr] = l[hr] * alpha[hr] + sum;
      m[hr] = m_new;
      // A fragments of P for the two k-steps: row hr's registers are a[hr] and
      // a[hr + 2] (columns 2 tq.. and 2 tq + 8..).
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        ph[kk][hr] = ToBf16x2<kSplit>(s[4 * kk], s[4 * kk + 1], &pl[kk][hr]);
        ph[kk][hr + 2] =
            ToBf16x2<kSplit>(s[4 * kk + 2], s[4 * kk + 3], &pl[kk][hr + 2]);
      }
    }
#pragma unroll
    for (int j = 0; j < kMmaMaxTiles; ++j) {
      acc[j][0] *= alpha[0];
      acc[j][1] *= alpha[0];
      acc[j][2] *= alpha[1];
      acc[j][3] *= alpha[1];
    }
    // O += P C over this warp's latent columns.
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const uint16_t* r0 = k16 + (16 * kk + 2 * tq) * 2 * sw;
      const uint16_t* r1 = r0 + 2 * sw;
      const uint16_t* r8 = r0 + 16 * sw;
      const uint16_t* r9 = r8 + 2 * sw;
#pragma unroll
      for (int j = 0; j < kMmaMaxTiles; ++j) {
        if (j >= tiles) break;
        const int64_t c = col0 + 8 * j + g;
        const uint32_t b[2] = {PackBf16x2(r0[c], r1[c]), PackBf16x2(r8[c], r9[c])};
        MmaBf16M16N8K16(acc[j], ph[kk], b);
        if constexpr (kSplit) MmaBf16M16N8K16(acc[j], pl[kk], b);
      }
    }
    __syncthreads();  // this buffer and the scores are consumed before refilling
  }
  // Partials for every row of the tile (empty ranges: m = -inf, l = 0, acc = 0).
  for (int hr = 0; hr < 2; ++hr) {
    if (pos[hr] == kNoRow) continue;
    const int64_t gr = t.row0 + rbase + 8 * hr;
    const int64_t base = (split * a.num_tokens + t.q0) * a.heads + gr;
    if (warp == 0 && tq == 0) {
      part_ml[base * 2] = m[hr];
      part_ml[base * 2 + 1] = l[hr];
    }
    float* dst = part_acc + base * a.lora + col0 + 2 * tq;
#pragma unroll
    for (int j = 0; j < kMmaMaxTiles; ++j) {
      if (j >= tiles) break;
      dst[8 * j] = acc[j][2 * hr];
      dst[8 * j + 1] = acc[j][2 * hr + 1];
    }
  }
}

// ---- Absorbed: merge the splits, o = W_UV ctx ---------------------------------------
__global__ void __launch_bounds__(kAuxThreads)
    MlaAbsorbedCombine(MlaLaunchArgs a, int splits, const float* part_acc,
                       const float* part_ml) {
  TANDEM_DYNAMIC_SMEM(float, smem);
  float* ctx = smem;                      // [kCombTok][lora]
  float* wts = smem + kCombTok * a.lora;  // [kCombTok][splits]
  const int64_t h = blockIdx.y, t0 = static_cast<int64_t>(blockIdx.x) * kCombTok;
  const int64_t nt = std::min<int64_t>(kCombTok, a.num_tokens - t0);
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  for (int64_t tok = warp; tok < nt; tok += warps) {
    float mx = -INFINITY;
    for (int s = lane; s < splits; s += kWarpSize) {
      mx = fmaxf(mx, part_ml[((s * a.num_tokens + t0 + tok) * a.heads + h) * 2]);
    }
    mx = WarpMax(mx);
    float den = 0.0f;
    for (int s = lane; s < splits; s += kWarpSize) {
      const float* ml = part_ml + ((s * a.num_tokens + t0 + tok) * a.heads + h) * 2;
      const float w = mx == -INFINITY ? 0.0f : expf(ml[0] - mx);
      wts[tok * splits + s] = w;
      den += w * ml[1];
    }
    den = WarpSum(den);
    const float inv = den > 0.0f ? 1.0f / den : 0.0f;
    __syncwarp();
    for (int s = lane; s < splits; s += kWarpSize) wts[tok * splits + s] *= inv;
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < nt * a.lora; i += blockDim.x) {
    const int64_t tok = i / a.lora, c = i % a.lora;
    float v = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const float w = wts[tok * splits + s];
      if (w != 0.0f)
        v += w * part_acc[((s * a.num_tokens + t0 + tok) * a.heads + h) * a.lora + c];
    }
    ctx[i] = v;
  }
  __syncthreads();
  const uint16_t* wuv = a.kv_b_proj + (h * (a.nope + a.v) + a.nope) * a.lora;
  for (int64_t j = warp; j < a.v; j += warps) {
    float o[kCombTok] = {};
    for (int64_t c = lane; c < a.lora; c += kWarpSize) {
      const float w = Bf16ToF32(wuv[j * a.lora + c]);
#pragma unroll
      for (int tok = 0; tok < kCombTok; ++tok) o[tok] += w * ctx[tok * a.lora + c];
    }
#pragma unroll
    for (int tok = 0; tok < kCombTok; ++tok) o[tok] = WarpSum(o[tok]);
    if (lane == 0) {
      for (int64_t tok = 0; tok < nt; ++tok)
        a.out[(t0 + tok) * a.ld_out + h * a.v + j] = o[tok];
    }
  }
}

// ---- Expanded: [k_nope | v] = W_h c for one chunk of positions ----------------
// One record of nope + v words per (sequence, position, head):
// kv + ((s * chunk + p - c0) * heads + h) * (nope + v). Its layout is the reader's:
//   fp32 [k_nope | v] for the SIMT flash kernel (kPacked false);
//   16-bit [k hi | k lo | v hi | v lo] (nope, nope, v, v values; x = hi + lo,
//   hi = bf16(x), lo = bf16(x - hi)) for the tensor-core one (kPacked): split
//   once here, not once per query tile, and copied to shared memory as 16-byte
//   pieces (cp.async). Its BF16 form reads only the hi parts (= bf16(x)).
template <bool kPacked>
__device__ __forceinline__ void StoreKv(float* rec, int64_t nope, int64_t v, int64_t n,
                                        float x) {
  if constexpr (kPacked) {
    uint16_t* r16 = reinterpret_cast<uint16_t*>(rec);
    const uint16_t hi = F32ToBf16(x);
    // k column n: hi at n, lo at nope + n; v column n - nope: hi at 2 nope +
    // (n - nope) = nope + n, lo v further.
    const int64_t at = n < nope ? n : nope + n;
    r16[at] = hi;
    r16[at + (n < nope ? nope : v)] = F32ToBf16(x - Bf16ToF32(hi));
  } else {
    rec[n] = x;
  }
}

// Columns n and n + 1 (n even: one part, as nope is) as 32-bit stores.
template <bool kPacked>
__device__ __forceinline__ void StoreKv2(float* rec, int64_t nope, int64_t v, int64_t n,
                                         float x0, float x1) {
  if constexpr (kPacked) {
    uint32_t* r32 = reinterpret_cast<uint32_t*>(rec);
    uint32_t lo;
    const uint32_t hi = SplitBf16x2(x0, x1, &lo);
    const int64_t at = (n < nope ? n : nope + n) / 2;  // in words
    r32[at] = hi;
    r32[at + (n < nope ? nope : v) / 2] = lo;
  } else {
    rec[n] = x0;
    rec[n + 1] = x1;
  }
}

template <bool kPacked>
__global__ void __launch_bounds__(kGemmThreads)
    MlaExpandKv(MlaLaunchArgs a, int64_t c0, int64_t chunk, float* kv) {
  const int64_t s = blockIdx.z / a.heads, h = blockIdx.z % a.heads;
  const int64_t ctx = a.seq_lens[s];
  if (ctx < 0 || ctx > a.block_table_stride * a.block_size) return;
  // A sequence without queries in this call needs no keys.
  if (a.query_start[s + 1] - a.query_start[s] <= 0) return;
  const int64_t p0 = c0 + static_cast<int64_t>(blockIdx.x) * kGemmPos;
  const int64_t pend = std::min(ctx, c0 + chunk);
  if (p0 >= pend) return;
  const int64_t nn = a.nope + a.v, n0 = static_cast<int64_t>(blockIdx.y) * kGemmN;
  if (n0 >= nn) return;
  TANDEM_SHARED(float, as, [kGemmK][kGemmPos + 1]);  // [k][position]
  TANDEM_SHARED(float, bs, [kGemmK][kGemmN + 1]);    // [k][output]
  TANDEM_SHARED(const uint16_t*, rows, [kGemmPos]);
  const int tid = threadIdx.x;
  if (tid < kGemmPos) {
    const int64_t p = p0 + tid;
    rows[tid] = p < pend ? CacheRow(a, s, p, true) : nullptr;
  }
  const uint16_t* w = a.kv_b_proj + h * nn * a.lora;
  const int ty = tid / 16, tx = tid % 16;  // positions 4 ty + i, outputs tx + 16 j
  float acc[4][8] = {};
  for (int64_t k0 = 0; k0 < a.lora; k0 += kGemmK) {
    __syncthreads();
    for (int i = tid; i < kGemmPos * kGemmK; i += kGemmThreads) {
      const int pp = i / kGemmK, k = i % kGemmK;
      const uint16_t* row = rows[pp];
      as[k][pp] = row != nullptr && k0 + k < a.lora ? Bf16ToF32(row[k0 + k]) : 0.0f;
    }
    for (int i = tid; i < kGemmN * kGemmK; i += kGemmThreads) {
      const int n = i / kGemmK, k = i % kGemmK;
      bs[k][n] = n0 + n < nn && k0 + k < a.lora
                     ? Bf16ToF32(w[(n0 + n) * a.lora + k0 + k])
                     : 0.0f;
    }
    __syncthreads();
#pragma unroll 4
    for (int k = 0; k < kGemmK; ++k) {
      float av[4], bv[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = as[k][ty * 4 + i];
#pragma unroll
      for (int j = 0; j < 8; ++j) bv[j] = bs[k][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] += av[i] * bv[j];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t p = p0 + ty * 4 + i;
    if (p >= pend) continue;
    float* rec = kv + ((s * chunk + p - c0) * a.heads + h) * nn;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t n = n0 + tx + 16 * j;
      if (n < nn) StoreKv<kPacked>(rec, a.nope, a.v, n, acc[i][j]);
    }
  }
}

// ---- Expanded, tensor cores: [k_nope | v] = W_h c on mma.sync -------------------
// c and W are BF16 already: exact products, fp32 accumulation, one mma each.
// Block tile 64 positions x 128 outputs, K-steps of 32 staged in shared memory;
// warp w computes positions 16w..16w+15 x all 128 outputs (16 n8 tiles). Needs
// lora % 32 == 0.
constexpr int kEgWarps = 4;
constexpr int kEgStride = 20;  // words per staged row of 32 BF16 (16 + 4: banks)

template <bool kPacked>
__global__ void __launch_bounds__(kEgWarps* kWarpSize)
    MlaExpandKvMma(MlaLaunchArgs a, int64_t c0, int64_t chunk, float* kv) {
  const int64_t s = blockIdx.z / a.heads, h = blockIdx.z % a.heads;
  const int64_t ctx = a.seq_lens[s];
  if (ctx < 0 || ctx > a.block_table_stride * a.block_size) return;
  // A sequence without queries in this call needs no keys.
  if (a.query_start[s + 1] - a.query_start[s] <= 0) return;
  const int64_t p0 = c0 + static_cast<int64_t>(blockIdx.x) * kGemmPos;
  const int64_t pend = std::min(ctx, c0 + chunk);
  if (p0 >= pend) return;
  const int64_t nn = a.nope + a.v, n0 = static_cast<int64_t>(blockIdx.y) * kGemmN;
  if (n0 >= nn) return;
  TANDEM_SHARED(uint32_t, as, [kGemmPos * kEgStride]);
  TANDEM_SHARED(uint32_t, bs, [kGemmN * kEgStride]);
  TANDEM_SHARED(const uint32_t*, rows, [kGemmPos]);
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int g = lane / 4, tq = lane % 4;
  if (tid < kGemmPos) {
    const int64_t p = p0 + tid;
    rows[tid] =
        p < pend ? reinterpret_cast<const uint32_t*>(CacheRow(a, s, p, true)) : nullptr;
  }
  const uint32_t* w32 =
      reinterpret_cast<const uint32_t*>(a.kv_b_proj + h * nn * a.lora);
  const int64_t lw = a.lora / 2;
  float acc[kGemmN / 8][4];
#pragma unroll
  for (int j = 0; j < kGemmN / 8; ++j)
    acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0;
  for (int64_t k0 = 0; k0 < lw; k0 += kGemmK / 2) {
    __syncthreads();
    for (int i = tid; i < kGemmPos * 16; i += blockDim.x) {
      const int r = i / 16, w = i % 16;
      as[r * kEgStride + w] = rows[r] != nullptr ? rows[r][k0 + w] : 0u;
    }
    for (int i = tid; i < kGemmN * 16; i += blockDim.x) {
      const int n = i / 16, w = i % 16;
      bs[n * kEgStride + w] = n0 + n < nn ? w32[(n0 + n) * lw + k0 + w] : 0u;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const int wo = kk * 8 + tq;
      const uint32_t* ar0 = as + (16 * warp + g) * kEgStride + wo;
      const uint32_t* ar1 = ar0 + 8 * kEgStride;
      const uint32_t af[4] = {ar0[0], ar1[0], ar0[4], ar1[4]};
#pragma unroll
      for (int j = 0; j < kGemmN / 8; ++j) {
        const uint32_t* br = bs + (8 * j + g) * kEgStride + wo;
        const uint32_t b[2] = {br[0], br[4]};
        MmaBf16M16N8K16(acc[j], af, b);
      }
    }
  }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int64_t p = p0 + 16 * warp + g + 8 * hr;
    if (p >= pend) continue;
    float* rec = kv + ((s * chunk + p - c0) * a.heads + h) * nn;
#pragma unroll
    for (int j = 0; j < kGemmN / 8; ++j) {
      const int64_t n = n0 + 8 * j + 2 * tq;
      // n is even (n0 % 128 == 0); packed records have nope % 8 == 0.
      if (n + 1 < nn) {
        StoreKv2<kPacked>(rec, a.nope, a.v, n, acc[j][2 * hr], acc[j][2 * hr + 1]);
      } else if (n < nn) {
        StoreKv<kPacked>(rec, a.nope, a.v, n, acc[j][2 * hr]);
      }
    }
  }
}

// ---- Expanded: FlashAttention-2 over one chunk of keys --------------------------
// Running state: normalised output in a.out, (max, sum) in ml[(token*heads+h)*2].
__global__ void __launch_bounds__(kExpWarps* kWarpSize)
    MlaFlashChunk(MlaLaunchArgs a, int64_t c0, int64_t chunk, const float* kv,
                  float* ml) {
  if (c0 == 0 && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    CheckSequences(a);
  }
  Tile t;
  if (!FindTileShared(a, blockIdx.x, 1, kExpRows, &t)) return;
  const int64_t h = blockIdx.y;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t dq = a.nope + a.rope, nn = a.nope + a.v;
  const int64_t ks = OddStride(dq);
  const int64_t last_q = std::min(t.q_len, t.row0 + kExpRows) - 1;
  const int64_t k_end =
      std::min(std::min(t.ctx, c0 + chunk), t.ctx - t.q_len + last_q + 1);
  if (c0 >= k_end) return;  // nothing of this chunk is visible to the tile
  TANDEM_DYNAMIC_SMEM(float, smem);
  float* qs = smem;                // [32][dq]
  float* kt = qs + kExpRows * dq;  // [32][ks]
  float* vt = kt + kKeys * ks;     // [32][v]
  float* ps = vt + kKeys * a.v;    // [8][4][32]
  for (int64_t i = threadIdx.x; i < kExpRows * dq; i += blockDim.x) {
    const int64_t r = i / dq, d = i % dq, qi = t.row0 + r;
    qs[i] = qi < t.q_len ? a.scale * a.q[(t.q0 + qi) * a.ld_q + h * dq + d] : 0.0f;
  }
  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kExpMaxV];
  int64_t pos[kRowsPerWarp];
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int64_t qi = t.row0 + warp * kRowsPerWarp + j;
    pos[j] = qi < t.q_len ? t.ctx - t.q_len + qi : -1;
    m[j] = -INFINITY;
    l[j] = 0.0f;
#pragma unroll
    for (int k = 0; k < kExpMaxV; ++k) acc[j][k] = 0.0f;
    if (c0 > 0 && pos[j] >= 0) {
      const int64_t tok = t.q0 + qi;
      m[j] = ml[(tok * a.heads + h) * 2];
      l[j] = ml[(tok * a.heads + h) * 2 + 1];
      const float* o = a.out + tok * a.ld_out + h * a.v;
#pragma unroll
      for (int k = 0; k < kExpMaxV; ++k) {
        if (lane + k * kWarpSize < a.v) acc[j][k] = o[lane + k * kWarpSize] * l[j];
      }
    }
  }
  for (int64_t n0 = c0; n0 < k_end; n0 += kKeys) {
    __syncthreads();
    for (int n = warp; n < kKeys; n += kExpWarps) {
      const int64_t p = n0 + n;
      const float* src =
          p < k_end ? kv + ((t.seq * chunk + p - c0) * a.heads + h) * nn : nullptr;
      const uint16_t* row = p < k_end ? CacheRow(a, t.seq, p, lane == 0) : nullptr;
      for (int64_t d = lane; d < a.nope; d += kWarpSize)
        kt[n * ks + d] = src ? src[d] : 0.0f;
      for (int64_t d = lane; d < a.rope; d += kWarpSize) {
        kt[n * ks + a.nope + d] = row ? Bf16ToF32(row[a.lora + d]) : 0.0f;
      }
      for (int64_t d = lane; d < a.v; d += kWarpSize) {
        vt[n * a.v + d] = src ? src[a.nope + d] : 0.0f;
      }
    }
    __syncthreads();
    float sc[kRowsPerWarp] = {};
    const float* krow = kt + lane * ks;
    const float* q0 = qs + warp * kRowsPerWarp * dq;
    for (int64_t d = 0; d < dq; ++d) {
      const float kd = krow[d];
#pragma unroll
      for (int j = 0; j < kRowsPerWarp; ++j) sc[j] += q0[j * dq + d] * kd;
    }
    const int64_t p = n0 + lane;
    float* pw = ps + warp * kRowsPerWarp * kKeys;
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
      const bool ok = p < k_end && p <= pos[j];
      float alpha;
      pw[j * kKeys + lane] = SoftmaxStep(ok ? sc[j] : -INFINITY, &m[j], &l[j], &alpha);
#pragma unroll
      for (int k = 0; k < kExpMaxV; ++k) acc[j][k] *= alpha;
    }
    __syncwarp();
    for (int n = 0; n < kKeys; ++n) {
      float pn[kRowsPerWarp];
#pragma unroll
      for (int j = 0; j < kRowsPerWarp; ++j) pn[j] = pw[j * kKeys + n];
#pragma unroll
      for (int k = 0; k < kExpMaxV; ++k) {
        const int64_t d = lane + k * kWarpSize;
        if (d >= a.v) break;
        const float vd = vt[n * a.v + d];
#pragma unroll
        for (int j = 0; j < kRowsPerWarp; ++j) acc[j][k] += pn[j] * vd;
      }
    }
    __syncwarp();
  }
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    if (pos[j] < 0) continue;
    const int64_t tok = t.q0 + t.row0 + warp * kRowsPerWarp + j;
    if (lane == 0) {
      ml[(tok * a.heads + h) * 2] = m[j];
      ml[(tok * a.heads + h) * 2 + 1] = l[j];
    }
    const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
    float* o = a.out + tok * a.ld_out + h * a.v;
#pragma unroll
    for (int k = 0; k < kExpMaxV; ++k) {
      if (lane + k * kWarpSize < a.v) o[lane + k * kWarpSize] = acc[j][k] * inv;
    }
  }
}

// ---- Expanded, tensor cores: FlashAttention-2 over one chunk on mma.sync -------
// One block = 64 queries of one sequence x one head, 4 warps of 16 query rows
// each (the FA-2 split: a warp owns its rows, the softmax stays in registers),
// key tiles of 32.
//   kSplit (the exact backends): every operand is split-BF16 (x = hi + lo): q
//   (scaled), the expanded k_nope / v (split by the expansion: StoreKv) and p;
//   k_rot is the cache's BF16 (lo = 0). a.b ~ hi.hi + hi.lo + lo.hi: three mma
//   per product, error ~2^-16 relative per term (the dropped lo.lo and the
//   residuals).
//   !kSplit ("cuda_bf16"): each operand rounded to BF16 once, one mma per
//   product, no lo parts in shared memory (half of it).
//   Key tiles stream through two buffers: tile i + 1's cp.async copies (16-byte
//   pieces of the packed records and of the cache rows' k_rot) are in flight
//   while tile i is computed.
//   S = Q K^T: 4 n8 tiles of keys, k-steps of 16 over nope + rope;
//   P from the S accumulators directly (the m16n8 C layout of two adjacent n8
//   tiles is the A layout of one k16 step); O += P V: v/8 n8 tiles per warp.
// Needs (nope + rope) % 16 == 0, nope, rope, lora and v % 8 == 0 (whole 16-byte
// pieces), v <= 128, a 16-byte aligned cache and scratch.
constexpr int kFaWarps = 4;
constexpr int kFaRows = kFaWarps * 16;
constexpr int kFaMaxTiles = kMlaMaxVDimExpanded / 8;

template <bool kSplit>
__global__ void __launch_bounds__(kFaWarps* kWarpSize)
    MlaFlashChunkMma(MlaLaunchArgs a, int64_t c0, int64_t chunk, const float* kv,
                     float* ml) {
  if (c0 == 0 && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    CheckSequences(a);
  }
  Tile t;
  if (!FindTileShared(a, blockIdx.x, 1, kFaRows, &t)) return;
  const int64_t h = blockIdx.y;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int g = lane / 4, tq = lane % 4;
  const int64_t dq = a.nope + a.rope, nn = a.nope + a.v;
  const int64_t last_q = std::min(t.q_len, t.row0 + kFaRows) - 1;
  const int64_t k_end =
      std::min(std::min(t.ctx, c0 + chunk), t.ctx - t.q_len + last_q + 1);
  if (c0 >= k_end) return;  // nothing of this chunk is visible to the tile
  const int64_t sq = MmaStride(dq), sv = MmaStride(a.v), steps = dq / 16;
  const int vt = static_cast<int>(a.v / 8);
  TANDEM_DYNAMIC_SMEM(uint32_t, smem);
  // q [64][sq] (hi, then lo when kSplit), then two key buffers, each k [32][sq],
  // v [32][sv] (hi, then lo when kSplit).
  constexpr int kParts = kSplit ? 2 : 1;
  uint32_t* qh = smem;
  uint32_t* ql = kSplit ? qh + kFaRows * sq : nullptr;
  uint32_t* kbuf = qh + kParts * kFaRows * sq;
  const int64_t buf_words = kParts * kKeys * (sq + sv);
  // Buffer b's parts: k hi, v hi, k lo, v lo.
  auto kh_of = [&](int b) { return kbuf + b * buf_words; };
  auto vh_of = [&](int b) { return kh_of(b) + kKeys * sq; };
  auto kl_of = [&](int b) { return vh_of(b) + kKeys * sv; };
  auto vl_of = [&](int b) { return kl_of(b) + kKeys * sq; };
  // k_rot's lo parts are 0 (the cache's BF16 is exact) and no copy writes them.
  if constexpr (kSplit) {
    const int64_t rw = a.rope / 2;
    for (int64_t i = threadIdx.x; i < 2 * kKeys * rw; i += blockDim.x) {
      const int64_t b = i / (kKeys * rw), n = (i / rw) % kKeys, w = i % rw;
      kl_of(static_cast<int>(b))[n * sq + a.nope / 2 + w] = 0u;
    }
  }
  const uint16_t* kv16 = reinterpret_cast<const uint16_t*>(kv);
  // Pieces of 8 16-bit values per key row: k hi (nope / 8), k_rot (rope / 8), v
  // hi (v / 8), then k lo, v lo when kSplit.
  const int64_t pk = a.nope / 8, pr = a.rope / 8, pv = a.v / 8;
  const int64_t pieces = pk + pr + pv + (kSplit ? pk + pv : 0);
  // Warp w fetches rows w, w + 4, ...; lanes the pieces of a row. Rows past
  // k_end and k_rot of a bad block id are zero-filled with plain stores.
  auto fetch = [&](int64_t n0, int b) {
    uint32_t *kh = kh_of(b), *vh = vh_of(b), *kl = kl_of(b), *vl = vl_of(b);
    for (int n = warp; n < kKeys; n += kFaWarps) {
      const int64_t p = n0 + n;
      const bool in = p < k_end;
      const uint16_t* rec =
          in ? kv16 + ((t.seq * chunk + p - c0) * a.heads + h) * 2 * nn : nullptr;
      const uint16_t* row = in ? CacheRow(a, t.seq, p, lane == 0) : nullptr;
      for (int64_t c = lane; c < pieces; c += kWarpSize) {
        uint32_t* dst;
        const uint16_t* src;
        if (c < pk) {
          dst = kh + n * sq + 4 * c;
          src = rec != nullptr ? rec + 8 * c : nullptr;
        } else if (c < pk + pr) {
          dst = kh + n * sq + a.nope / 2 + 4 * (c - pk);
          src = row != nullptr ? row + a.lora + 8 * (c - pk) : nullptr;
        } else if (c < pk + pr + pv) {
          dst = vh + n * sv + 4 * (c - pk - pr);
          src = rec != nullptr ? rec + 2 * a.nope + 8 * (c - pk - pr) : nullptr;
        } else if (c < 2 * pk + pr + pv) {
          dst = kl + n * sq + 4 * (c - pk - pr - pv);
          src = rec != nullptr ? rec + a.nope + 8 * (c - pk - pr - pv) : nullptr;
        } else {
          dst = vl + n * sv + 4 * (c - 2 * pk - pr - pv);
          src = rec != nullptr ? rec + 2 * a.nope + a.v + 8 * (c - 2 * pk - pr - pv)
                               : nullptr;
        }
        if (src != nullptr) {
          CpAsync16(dst, src);
        } else {
          dst[0] = dst[1] = dst[2] = dst[3] = 0u;
        }
      }
    }
    CpAsyncCommit();
  };

  for (int64_t i = threadIdx.x; i < kFaRows * (dq / 2); i += blockDim.x) {
    const int64_t r = i / (dq / 2), w = i % (dq / 2), qi = t.row0 + r;
    float x0 = 0.0f, x1 = 0.0f;
    if (qi < t.q_len) {
      const float* src = a.q + (t.q0 + qi) * a.ld_q + h * dq + 2 * w;
      x0 = a.scale * src[0];
      x1 = a.scale * src[1];
    }
    uint32_t lo;
    qh[r * sq + w] = ToBf16x2<kSplit>(x0, x1, &lo);
    if constexpr (kSplit) ql[r * sq + w] = lo;
  }
  // This lane's rows: 16 warp + g and + 8.
  int64_t pos[2];
  float m[2], l[2];
  float acc[kFaMaxTiles][4];
#pragma unroll
  for (int j = 0; j < kFaMaxTiles; ++j)
    acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0;
  for (int hr = 0; hr < 2; ++hr) {
    const int64_t qi = t.row0 + 16 * warp + g + 8 * hr;
    pos[hr] = qi < t.q_len ? t.ctx - t.q_len + qi : -1;
    m[hr] = -INFINITY;
    l[hr] = 0.0f;
    if (c0 > 0 && pos[hr] >= 0) {
      const int64_t tok = t.q0 + qi;
      m[hr] = ml[(tok * a.heads + h) * 2];
      l[hr] = ml[(tok * a.heads + h) * 2 + 1];
      const float* o = a.out + tok * a.ld_out + h * a.v + 2 * tq;
#pragma unroll
      for (int j = 0; j < kFaMaxTiles; ++j) {
        if (j >= vt) break;
        acc[j][2 * hr] = o[8 * j] * l[hr];
        acc[j][2 * hr + 1] = o[8 * j + 1] * l[hr];
      }
    }
  }
  // The last position any row of this warp attends to (warp-uniform; -1: none).
  const int64_t warp_row_last = std::min(t.q_len, t.row0 + 16 * warp + 16) - 1;
  const int64_t warp_last =
      warp_row_last >= t.row0 + 16 * warp ? t.ctx - t.q_len + warp_row_last : -1;
  fetch(c0, 0);
  int buf = 0;
  for (int64_t n0 = c0; n0 < k_end; n0 += kKeys, buf ^= 1) {
    if (n0 + kKeys < k_end) {
      fetch(n0 + kKeys, buf ^ 1);
      CpAsyncWait<1>();  // all but the newest group: this tile has landed
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();  // every thread's copies (and q, first time) are visible
    const uint32_t* kh = kh_of(buf);
    const uint32_t* vh = vh_of(buf);
    const uint32_t* kl = kSplit ? kl_of(buf) : nullptr;
    const uint32_t* vl = kSplit ? vl_of(buf) : nullptr;
    const uint16_t* vh16 = reinterpret_cast<const uint16_t*>(vh);
    const uint16_t* vl16 = reinterpret_cast<const uint16_t*>(vl);
    // Both of this warp's row groups lie before the tile: nothing to add (causal).
    // (Not a `continue`: every warp reaches the one barrier below.)
    if (warp_last >= n0) {
      float s[4][4];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
        const uint32_t* kbh = kh + (8 * nt + g) * sq;
        const uint32_t* q0h = qh + (16 * warp + g) * sq;
        const uint32_t* q1h = q0h + 8 * sq;
        for (int64_t ks = 0; ks < steps; ++ks) {
          const int64_t w0 = ks * 8 + tq;
          const uint32_t ah[4] = {q0h[w0], q1h[w0], q0h[w0 + 4], q1h[w0 + 4]};
          const uint32_t bh[2] = {kbh[w0], kbh[w0 + 4]};
          MmaBf16M16N8K16(s[nt], ah, bh);
          if constexpr (kSplit) {
            const uint32_t* kbl = kl + (8 * nt + g) * sq;
            const uint32_t* q0l = ql + (16 * warp + g) * sq;
            const uint32_t* q1l = q0l + 8 * sq;
            const uint32_t al[4] = {q0l[w0], q1l[w0], q0l[w0 + 4], q1l[w0 + 4]};
            const uint32_t bl[2] = {kbl[w0], kbl[w0 + 4]};
            MmaBf16M16N8K16(s[nt], ah, bl);
            MmaBf16M16N8K16(s[nt], al, bh);
          }
        }
      }
      // Causal mask: row hr's scores are s[nt][2 hr + e], key n0 + 8 nt + 2 tq + e.
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int64_t p = n0 + 8 * nt + 2 * tq + e;
            if (!(p < k_end && p <= pos[hr])) s[nt][2 * hr + e] = -INFINITY;
          }
        }
      }
      tandem::gpu::FlashSoftmaxTile<kFaMaxTiles>(s, m, l, acc);
      tandem::gpu::FlashPvTile<kSplit, kFaMaxTiles>(s, vh16, vl16, 2 * sv, vt, g, tq,
                                                    acc);
    }
    __syncthreads();  // this buffer is consumed before it is refilled
  }
  for (int hr = 0; hr < 2; ++hr) {
    if (pos[hr] < 0) continue;
    const int64_t tok = t.q0 + t.row0 + 16 * warp + g + 8 * hr;
    if (tq == 0) {
      ml[(tok * a.heads + h) * 2] = m[hr];
      ml[(tok * a.heads + h) * 2 + 1] = l[hr];
    }
    const float inv = l[hr] > 0.0f ? 1.0f / l[hr] : 0.0f;
    float* o = a.out + tok * a.ld_out + h * a.v + 2 * tq;
#pragma unroll
    for (int j = 0; j < kFaMaxTiles; ++j) {
      if (j >= vt) break;
      o[8 * j] = acc[j][2 * hr] * inv;
      o[8 * j + 1] = acc[j][2 * hr + 1] * inv;
    }
  }
}

size_t AlignUp(size_t x) { return (x + 255) / 256 * 256; }

int64_t MaxContext(const MlaLaunchArgs& a) {
  return a.block_table_stride * a.block_size;
}

// How far the expanded form walks the context: the caller's longest sequence
// where it gave one, else the tables' reach.
int64_t ExpandedContext(const MlaLaunchArgs& a) {
  return a.max_context > 0 ? std::min(a.max_context, MaxContext(a)) : MaxContext(a);
}

size_t AbsorbedSmem(const MlaLaunchArgs& a) {
  const int64_t width = a.lora + a.rope;
  return sizeof(float) * (kAbsRows * width + kKeys * OddStride(width / 2) +
                          kAbsWarps * kRowsPerWarp * kKeys);
}

// q (hi, and lo when split) [16 groups][sw], two key tiles [32][sw], the scores.
size_t AbsorbedMmaSmem(const MlaLaunchArgs& a, int groups, bool split = true) {
  const int64_t sw = MmaStride(a.lora + a.rope);
  return sizeof(uint32_t) * ((split ? 2 : 1) * 16 * groups * sw + 2 * kKeys * sw) +
         sizeof(float) * 16 * groups * kScoreStride;
}

// 16-row groups per block of the absorbed mma kernel: enough for the average
// sequence's (query, head) rows (K3 TP8: 12 per query token, so q_len 1 -> 1,
// 2 -> 2, 4 drafts -> 3), so that a sequence's keys are read by one block.
int AbsorbedRowGroups(const MlaLaunchArgs& a) {
  if (a.row_groups >= 1 && a.row_groups <= 3) return a.row_groups;
  const int64_t rows = (a.num_tokens * a.heads + std::max<int64_t>(a.num_seqs, 1) - 1) /
                       std::max<int64_t>(a.num_seqs, 1);
  return static_cast<int>(std::clamp<int64_t>((rows + 15) / 16, 1, 3));
}

bool AbsorbedMmaFits(const MlaLaunchArgs& a) {
  // lora + rope a multiple of 8 and a 16-byte aligned cache: rows of whole
  // 16-byte pieces (cp.async faults on a misaligned address; the SIMT kernel
  // takes any). Sized for the split form, so both forms decide alike.
  return a.lora % (kAbsWarps * 8) == 0 && (a.lora + a.rope) % 8 == 0 &&
         reinterpret_cast<uintptr_t>(a.kv_cache) % 16 == 0 &&
         AbsorbedMmaSmem(a, AbsorbedRowGroups(a)) <= kMaxSmem;
}

// Shared memory of MlaFlashChunkMma: q [64][sq] and two key buffers of k [32][sq],
// v [32][sv] words of BF16 pairs, twice (hi and lo) when split: 134 KiB at K3
// (67 KiB not split).
size_t FlashMmaSmem(const MlaLaunchArgs& a, bool split) {
  const int64_t sq = MmaStride(a.nope + a.rope), sv = MmaStride(a.v);
  return sizeof(uint32_t) * (split ? 2 : 1) * (kFaRows * sq + 2 * kKeys * (sq + sv));
}

// The tensor-core flash kernel's shapes: whole k-steps of 16, whole 16-byte
// pieces of every part of a key row (k_nope, k_rot at lora in the cache row, v),
// a 16-byte aligned cache; else the SIMT kernel.
bool FlashMmaFits(const MlaLaunchArgs& a, bool split) {
  return (a.nope + a.rope) % 16 == 0 && a.nope % 8 == 0 && a.rope % 8 == 0 &&
         a.lora % 8 == 0 && a.v % 8 == 0 && a.v <= kMlaMaxVDimExpanded &&
         reinterpret_cast<uintptr_t>(a.kv_cache) % 16 == 0 &&
         FlashMmaSmem(a, split) <= kMaxSmem;
}

size_t FlashSmem(const MlaLaunchArgs& a) {
  const int64_t dq = a.nope + a.rope;
  return sizeof(float) * (kExpRows * dq + kKeys * OddStride(dq) + kKeys * a.v +
                          kExpWarps * kRowsPerWarp * kKeys);
}

}  // namespace

const char* MlaUnsupported(const MlaLaunchArgs& a, bool absorbed) {
  if (a.lora > kMlaMaxLora)
    return "mla: kv_lora_rank > 512 is not supported on the GPU";
  if (a.lora % 2 != 0 || a.rope % 2 != 0) {
    return "mla: odd kv_lora_rank or rope_dim is not supported on the GPU";
  }
  // Every kernel reads cache rows (and the expansion W) as 32-bit words.
  if (reinterpret_cast<uintptr_t>(a.kv_cache) % 4 != 0 ||
      reinterpret_cast<uintptr_t>(a.kv_b_proj) % 4 != 0) {
    return "mla: kv_cache and kv_b_proj must be 4-byte aligned on the GPU";
  }
  if (absorbed) {
    if (AbsorbedSmem(a) > kMaxSmem) return "mla: rope_dim too large for the GPU kernel";
  } else {
    if (a.v > kMlaMaxVDimExpanded)
      return "mla: v_dim > 128 is not supported (expanded)";
    if (FlashSmem(a) > kMaxSmem) return "mla: head dims too large for the GPU kernel";
  }
  return nullptr;
}

namespace {

template <int kGroups, bool kSplit>
const char* LaunchAbsorbedMma(const MlaLaunchArgs& a, const float* q_abs, int splits,
                              float* part_acc, float* part_ml, void* stream) {
  const size_t smem = AbsorbedMmaSmem(a, kGroups, kSplit);
  if (const char* e =
          tandem::gpu::AllowDynamicSmem(MlaAbsorbedSplitKvMma<kGroups, kSplit>, smem)) {
    return e;
  }
  constexpr int64_t kRows = 16 * kGroups;
  const dim3 grid((a.num_tokens * a.heads + kRows - 1) / kRows + a.num_seqs, splits);
  TANDEM_LAUNCH((MlaAbsorbedSplitKvMma<kGroups, kSplit>), grid,
                kGroups * kAbsWarps * kWarpSize, smem, stream, a, q_abs, splits,
                part_acc, part_ml);
  return tandem::gpu::LaunchError();
}

template <bool kSplit>
const char* LaunchAbsorbedMmaGroups(const MlaLaunchArgs& a, const float* q_abs,
                                    int splits, float* part_acc, float* part_ml,
                                    void* stream) {
  switch (AbsorbedRowGroups(a)) {
    case 1:
      return LaunchAbsorbedMma<1, kSplit>(a, q_abs, splits, part_acc, part_ml, stream);
    case 2:
      return LaunchAbsorbedMma<2, kSplit>(a, q_abs, splits, part_acc, part_ml, stream);
    default:
      return LaunchAbsorbedMma<3, kSplit>(a, q_abs, splits, part_acc, part_ml, stream);
  }
}

}  // namespace

int MlaAbsorbedSplits(const MlaLaunchArgs& a, int sm_count) {
  const int64_t tile_rows = AbsorbedMmaFits(a) ? 16 * AbsorbedRowGroups(a) : kAbsRows;
  const int64_t tiles =
      std::max<int64_t>(std::max<int64_t>(a.num_seqs, 1),
                        (a.num_tokens * a.heads + tile_rows - 1) / tile_rows);
  // One wave: the mma kernel holds >= 112 KiB of shared memory (one block per SM),
  // so tiles x splits <= sm_count keeps every block's share equal.
  int64_t splits = static_cast<int64_t>(sm_count) / tiles;
  splits = std::min<int64_t>(splits, MaxContext(a) / (4 * kKeys));
  return static_cast<int>(std::clamp<int64_t>(splits, 1, kMlaMaxSplits));
}

size_t MlaAbsorbedScratchBytes(const MlaLaunchArgs& a, int splits) {
  const size_t rows = static_cast<size_t>(a.num_tokens * a.heads);
  return AlignUp(sizeof(float) * rows * (a.lora + a.rope)) +
         AlignUp(sizeof(float) * rows * a.lora * splits) +
         AlignUp(sizeof(float) * rows * 2 * splits);
}

const char* MlaAbsorbedLaunch(const MlaLaunchArgs& args, int splits, void* scratch,
                              void* stream, MlaCore core, bool bf16_operands) {
  MlaLaunchArgs a = args;
  a.empty_is_padding = true;
  if (const char* why = MlaUnsupported(a, true)) return why;
  const bool mma =
      core == MlaCore::kTensorCore || (core == MlaCore::kAuto && AbsorbedMmaFits(a));
  if (mma && !AbsorbedMmaFits(a)) return "mla: tensor-core path needs lora % 32 == 0";
  if (a.num_seqs == 0 || a.num_tokens == 0) return nullptr;
  if (splits < 1 || splits > kMlaMaxSplits) return "mla: bad split count";
  const size_t rows = static_cast<size_t>(a.num_tokens * a.heads);
  char* base = static_cast<char*>(scratch);
  float* q_abs = reinterpret_cast<float*>(base);
  base += AlignUp(sizeof(float) * rows * (a.lora + a.rope));
  float* part_acc = reinterpret_cast<float*>(base);
  base += AlignUp(sizeof(float) * rows * a.lora * splits);
  float* part_ml = reinterpret_cast<float*>(base);

  const dim3 qgrid((a.num_tokens + kQTok - 1) / kQTok, a.heads);
  TANDEM_LAUNCH(MlaAbsorbQ, qgrid, kAuxThreads, sizeof(float) * kQTok * a.nope, stream,
                a, q_abs);
  if (const char* e = tandem::gpu::LaunchError()) return e;

  if (mma) {
    const char* e = bf16_operands ? LaunchAbsorbedMmaGroups<false>(
                                        a, q_abs, splits, part_acc, part_ml, stream)
                                  : LaunchAbsorbedMmaGroups<true>(
                                        a, q_abs, splits, part_acc, part_ml, stream);
    if (e != nullptr) return e;
  } else {
    const dim3 grid((a.num_tokens * a.heads + kAbsRows - 1) / kAbsRows + a.num_seqs,
                    splits);
    const size_t smem = AbsorbedSmem(a);
    if (const char* e = tandem::gpu::AllowDynamicSmem(MlaAbsorbedSplitKv, smem))
      return e;
    TANDEM_LAUNCH(MlaAbsorbedSplitKv, grid, kAbsWarps * kWarpSize, smem, stream, a,
                  static_cast<const float*>(q_abs), splits, part_acc, part_ml);
  }
  if (const char* e = tandem::gpu::LaunchError()) return e;

  const dim3 cgrid((a.num_tokens + kCombTok - 1) / kCombTok, a.heads);
  TANDEM_LAUNCH(MlaAbsorbedCombine, cgrid, kAuxThreads,
                sizeof(float) * kCombTok * (a.lora + splits), stream, a, splits,
                static_cast<const float*>(part_acc),
                static_cast<const float*>(part_ml));
  return tandem::gpu::LaunchError();
}

int64_t MlaExpandedChunk(const MlaLaunchArgs& a, size_t budget_bytes) {
  const size_t fixed = AlignUp(sizeof(float) * a.num_tokens * a.heads * 2);
  const size_t per_pos =
      sizeof(float) * std::max<int64_t>(a.num_seqs, 1) * a.heads * (a.nope + a.v);
  int64_t chunk =
      budget_bytes > fixed
          ? static_cast<int64_t>((budget_bytes - fixed) / per_pos) / kGemmPos * kGemmPos
          : 0;
  const int64_t max_ctx = (ExpandedContext(a) + kGemmPos - 1) / kGemmPos * kGemmPos;
  return std::max<int64_t>(kGemmPos, std::min(chunk, max_ctx));
}

size_t MlaExpandedScratchBytes(const MlaLaunchArgs& a, int64_t chunk) {
  return 256 /* to align the start */ +
         AlignUp(sizeof(float) * a.num_seqs * chunk * a.heads * (a.nope + a.v)) +
         AlignUp(sizeof(float) * a.num_tokens * a.heads * 2);
}

const char* MlaExpandedLaunch(const MlaLaunchArgs& a, int64_t chunk, void* scratch,
                              void* stream, MlaCore core, bool bf16_operands) {
  if (const char* why = MlaUnsupported(a, false)) return why;
  const bool split = !bf16_operands;
  const bool mma = core == MlaCore::kTensorCore ||
                   (core == MlaCore::kAuto && FlashMmaFits(a, split));
  if (mma && !FlashMmaFits(a, split)) {
    return "mla: tensor-core path needs (nope + rope) % 16 == 0, nope, rope, lora and "
           "v % 8 == 0 and a 16-byte aligned cache";
  }
  if (a.num_seqs == 0 || a.num_tokens == 0) return nullptr;
  if (chunk <= 0 || chunk % kGemmPos != 0) return "mla: chunk must be a multiple of 64";
  // 256-byte aligned (the tensor-core kernel copies 16-byte pieces of it).
  char* base = reinterpret_cast<char*>(AlignUp(reinterpret_cast<uintptr_t>(scratch)));
  float* kv = reinterpret_cast<float*>(base);
  base += AlignUp(sizeof(float) * a.num_seqs * chunk * a.heads * (a.nope + a.v));
  float* ml = reinterpret_cast<float*>(base);
  const size_t smem = mma ? FlashMmaSmem(a, split) : FlashSmem(a);
  if (const char* e =
          !mma    ? tandem::gpu::AllowDynamicSmem(MlaFlashChunk, smem)
          : split ? tandem::gpu::AllowDynamicSmem(MlaFlashChunkMma<true>, smem)
                  : tandem::gpu::AllowDynamicSmem(MlaFlashChunkMma<false>, smem)) {
    return e;
  }
  const int64_t nn = a.nope + a.v;
  const dim3 egrid(chunk / kGemmPos, (nn + kGemmN - 1) / kGemmN, a.num_seqs * a.heads);
  const int64_t rows = mma ? kFaRows : kExpRows;
  // The expansion's operands are BF16: tensor cores unless SIMT is asked for.
  const bool mma_expand = core != MlaCore::kSimt && a.lora % kGemmK == 0;
  const dim3 fgrid((a.num_tokens + rows - 1) / rows + a.num_seqs, a.heads);
  for (int64_t c0 = 0; c0 < std::max<int64_t>(ExpandedContext(a), 1); c0 += chunk) {
    // Packed (split once) for the tensor-core flash kernel, fp32 for the SIMT one.
    if (mma_expand && mma) {
      TANDEM_LAUNCH(MlaExpandKvMma<true>, egrid, kEgWarps * kWarpSize, 0, stream, a, c0,
                    chunk, kv);
    } else if (mma_expand) {
      TANDEM_LAUNCH(MlaExpandKvMma<false>, egrid, kEgWarps * kWarpSize, 0, stream, a,
                    c0, chunk, kv);
    } else if (mma) {
      TANDEM_LAUNCH(MlaExpandKv<true>, egrid, kGemmThreads, 0, stream, a, c0, chunk,
                    kv);
    } else {
      TANDEM_LAUNCH(MlaExpandKv<false>, egrid, kGemmThreads, 0, stream, a, c0, chunk,
                    kv);
    }
    if (const char* e = tandem::gpu::LaunchError()) return e;
    if (mma && split) {
      TANDEM_LAUNCH(MlaFlashChunkMma<true>, fgrid, kFaWarps * kWarpSize, smem, stream,
                    a, c0, chunk, static_cast<const float*>(kv), ml);
    } else if (mma) {
      TANDEM_LAUNCH(MlaFlashChunkMma<false>, fgrid, kFaWarps * kWarpSize, smem, stream,
                    a, c0, chunk, static_cast<const float*>(kv), ml);
    } else {
      TANDEM_LAUNCH(MlaFlashChunk, fgrid, kExpWarps * kWarpSize, smem, stream, a, c0,
                    chunk, static_cast<const float*>(kv), ml);
    }
    if (const char* e = tandem::gpu::LaunchError()) return e;
  }
  return nullptr;
}

}  // namespace tandem::kernels::cuda
