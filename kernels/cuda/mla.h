// Launchers of the mla kernels (mla.cu). Plain C++ types only (nvcc-compiled code
// includes no project headers beyond kernels/cuda/). Device pointers; `stream` is
// the native stream handle. Each returns nullptr on success or the launch error.
//
// MLA attention over the paged BF16 latent cache (kernels/backend.h, MlaArgs):
// cache [num_blocks, block_size, lora + rope] BF16 (c_kv then k_rot per token);
// sequence s has seq_lens[s] cached tokens and q_len_s = query_start[s+1] -
// query_start[s] queries, its LAST q_len_s positions, causal among themselves.
// kv_b_proj [heads * (nope + v), lora] BF16, per head [W_UK; W_UV].
// Block tables, seq_lens and query_start are device memory: the kernels check
// them and record kBlockIdOutOfRange / kBadSequenceLength in `error_word`
// (device_errors.h), skipping what they cannot read. Grids are sized from host
// values only (num_tokens, num_seqs, block_table_stride * block_size).
//
// Numerics (mla_test, vs the fp64 oracle, fraction of max|want|; contract 2e-5):
//   SIMT kernels: fp32 throughout (BF16 inputs widened exactly, fp32 FMA, expf),
//     ~1e-7 (small dims) to ~9e-7 (K3 dims).
//   Absorbed on tensor cores: q and p split-BF16 (x = hi + lo, two mma per
//     product; the cache's BF16 latents are exact operands), fp32 accumulate:
//     ~3e-6 (small dims) to ~4e-6 (K3 dims). FlashMLA's plain BF16 q and p
//     (2^-9 relative per product) would be ~1e-3: 50x over the contract.
//   Expanded on tensor cores: q, k_nope, v, p split-BF16 (hi.hi + hi.lo + lo.hi),
//     ~2e-6 (small dims) to ~7e-6 (K3 dims).
//
// ---- Absorbed (decode, speculative verification): MlaAbsorbedLaunch -----------
//   1. MlaAbsorbQ: q_abs[t,h] = scale * [W_UK_h^T q_nope | q_rope] (576 wide for
//      K3), fp32 into scratch; one block per (8 tokens, head), W_UK streamed
//      coalesced once per block.
//   2. MlaAbsorbedSplitKvMma / MlaAbsorbedSplitKv (tensor cores where lora % 32
//      == 0, else SIMT; the FlashMLA split-KV design): rows are the (query,
//      head) pairs of one sequence (K3 at TP8: 12 heads x q_len), 16 per block on
//      SIMT, 16, 32 or 48 on mma (1-3 groups of 4 warps sharing the key tiles,
//      picked from the average rows per sequence: a k = 4 verification's 48 rows
//      read the sequence's keys once);
//      blockIdx.y picks one of `splits` ranges of the sequence's positions. MQA
//      over [c | k_rot]: key tiles of 32 positions in shared memory (BF16, padded
//      rows: conflict-free), lane = key for Q.K, online softmax per row, lane =
//      latent column pair for P.C (C = the tile's own c: values are the keys'
//      first lora columns). Writes unnormalised partial (max, sum, acc[lora]).
//      The mma version: key tiles double-buffered through cp.async (tile i + 1
//      in flight while tile i is computed; 112 / 151 / 190 KiB of shared memory
//      at K3 for 1 / 2 / 3 row groups: one block per SM; the cuda_bf16 form keeps
//      no q lo rows, ~94 KiB for one group, and the split count still assumes one), S =
//      Q K^T with warp w on keys 8w..8w+7 (m16n8k16 over the 576 width, 8 independent
//      accumulators), the score tile through shared memory, the softmax in the
//      A-fragment layout, O += P C with warp w owning lora/4 latent columns as n8
//      accumulator tiles (64 fp32 registers per lane at K3).
//   3. MlaAbsorbedCombine: merges the splits' partials per (token, head) and
//      applies W_UV (warp per output column, lanes over lora: coalesced rows).
//   Splits: MlaAbsorbedSplits, from host values only.
//
// ---- Expanded (prefill): MlaExpandedLaunch ----------------------------------
// The context is walked in chunks of `chunk` positions (host loop, so scratch is
// bounded for any context), up to max_context where the caller gave it (else
// the tables' reach, block_table_stride * block_size): per chunk
//   1. MlaExpandKvMma / MlaExpandKv: [k_nope | v] = W_h c for every position of
//      the chunk, head h, into scratch: a 64 x 128 block tile, K-steps of 32
//      staged in shared memory; on tensor cores where lora % 32 == 0 (c and W are
//      BF16: exact products, one mma each, warp w on 16 positions x 128 outputs),
//      else a register-blocked SIMT GEMM (4 x 8 outputs per thread). Written as
//      its reader takes it: split once into BF16 hi and lo parts for the
//      tensor-core flash kernel (not once per query tile), fp32 for the SIMT one;
//   2. MlaFlashChunkMma / MlaFlashChunk (FlashAttention-2; tensor cores where
//      (nope + rope) % 16 == 0, nope, rope, lora and v % 8 == 0 and the cache is
//      16-byte aligned, else SIMT): one block per (query tile of one sequence,
//      head): 64 queries, 4 warps of 16 rows on mma (32 and 8 x 4 on SIMT); key
//      tiles of 32 with an online softmax in registers, causal (a warp skips
//      tiles after its last query); on mma the key tiles are double-buffered
//      through cp.async (tile i + 1 in flight while tile i is computed; 134 KiB
//      of shared memory at K3, 67 KiB on "cuda_bf16"); q, k_nope, v and p
//      split-BF16 (three mma per product), k_rot exact; on "cuda_bf16" rounded
//      to BF16 once (one mma per product, half the shared memory). The running (max,
//      sum) lives in scratch and the running output, normalised, in `out` itself, so
//      chunk k+1 resumes where chunk k stopped.
//
// Limits of these kernels: lora <= 512, v <= 128 (absorbed: any v), lora and
// rope even; other shapes return an error string.
#ifndef TANDEM_KERNELS_CUDA_MLA_H_
#define TANDEM_KERNELS_CUDA_MLA_H_

#include <cstddef>
#include <cstdint>

namespace tandem::kernels::cuda {

inline constexpr int64_t kMlaMaxLora = 512;
inline constexpr int64_t kMlaMaxVDimExpanded = 128;
// Key positions per split granule, and the most splits one call uses.
inline constexpr int64_t kMlaKeyTile = 32;
inline constexpr int kMlaMaxSplits = 128;

struct MlaLaunchArgs {
  int64_t heads = 0, nope = 0, rope = 0, v = 0, lora = 0;
  float scale = 0;
  int64_t num_seqs = 0;
  int64_t num_tokens = 0;                 // = query_start[num_seqs] (host copy)
  const int32_t* seq_lens = nullptr;      // [num_seqs]
  const int32_t* query_start = nullptr;   // [num_seqs + 1]
  const int32_t* block_tables = nullptr;  // [num_seqs, block_table_stride]
  int64_t block_table_stride = 0;
  const uint16_t* kv_cache = nullptr;  // [num_blocks, block_size, lora + rope]
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  const uint16_t* kv_b_proj = nullptr;  // [heads * (nope + v), lora]
  const float* q = nullptr;             // [num_tokens, heads, nope + rope], ld_q
  int64_t ld_q = 0;
  float* out = nullptr;  // [num_tokens, heads, v], ld_out
  int64_t ld_out = 0;
  int32_t* error_word = nullptr;
  // MlaArgs::max_context: the longest seq_lens value, 0 unknown.
  int64_t max_context = 0;
  // Absorbed on tensor cores: 16-row groups per block (1..3); 0 = from the
  // average rows per sequence, num_tokens * heads / num_seqs (tests force each).
  int row_groups = 0;
  // Set by MlaAbsorbedLaunch: a sequence with seq_lens 0 is padding (a CUDA
  // graph's batch padded to its bucket), its rows zeros; elsewhere (and in the
  // expanded form) a query without context is kBadSequenceLength.
  bool empty_is_padding = false;
};

// nullptr if the kernels support these dimensions, else why not.
const char* MlaUnsupported(const MlaLaunchArgs& a, bool absorbed);

// ---- Absorbed ----------------------------------------------------------------
// Number of KV splits for a call, from host values only: as many as keep the
// (row tiles x splits) blocks within one wave of `sm_count` SMs (one block per
// SM), no split shorter than 4 key tiles of the largest possible context
// (block_table_stride * block_size), 1..kMlaMaxSplits. E.g. K3 TP8 decode
// (12 heads: one row tile per sequence) at 132 SMs: batch 1 -> 128 splits,
// batch 16 -> 8, batch 64 -> 2, batch >= 67 -> 1.
int MlaAbsorbedSplits(const MlaLaunchArgs& a, int sm_count);
size_t MlaAbsorbedScratchBytes(const MlaLaunchArgs& a, int splits);
// Which attention kernel the absorbed form runs: kAuto = tensor cores where the
// shape allows (lora % 32 == 0: K3), else SIMT; tests force each.
enum class MlaCore { kAuto, kSimt, kTensorCore };
// bf16_operands ("cuda_bf16"): the tensor-core kernel rounds q and p to BF16 once
// (one mma a product instead of two); the SIMT kernel is fp32 either way.
const char* MlaAbsorbedLaunch(const MlaLaunchArgs& a, int splits, void* scratch,
                              void* stream, MlaCore core = MlaCore::kAuto,
                              bool bf16_operands = false);

// ---- Expanded ----------------------------------------------------------------
// Context chunk (a multiple of 64) such that the scratch fits `budget_bytes`
// (at least one 64-position chunk), no longer than the context walked.
int64_t MlaExpandedChunk(const MlaLaunchArgs& a, size_t budget_bytes);
size_t MlaExpandedScratchBytes(const MlaLaunchArgs& a, int64_t chunk);
// kAuto: tensor cores where (nope + rope) % 16 == 0 and v % 8 == 0 (K3), else SIMT.
// bf16_operands ("cuda_bf16", GpuPrecision::kBf16): the tensor-core kernel rounds
// q, k_nope, v and p to BF16 once (one mma a product) instead of splitting them
// (three); the SIMT kernel is fp32 either way.
const char* MlaExpandedLaunch(const MlaLaunchArgs& a, int64_t chunk, void* scratch,
                              void* stream, MlaCore core = MlaCore::kAuto,
                              bool bf16_operands = false);

}  // namespace tandem::kernels::cuda

#endif  // TANDEM_KERNELS_CUDA_MLA_H_
