// Launchers of the moe kernels (moe.cu). Plain C++ types only (nvcc-compiled code
// includes no project headers beyond kernels/cuda/). Device pointers; `stream` is
// the native stream handle. Each returns nullptr on success or the launch error.
//
// RouterTopK (noaux_tc sigmoid router): a logits GEMM, then a top-k kernel. Not
// one block per token: decode (1-few tokens) needs the BF16 gate (12.8 MiB for K3)
// streamed by many SMs at once, prefill needs each gate row reused across tokens.
//   1. logits[t, e] = x[t] . fp32(gate[e]) in fp32; x is NOT rounded to BF16, so
//      the ids match the fp64 oracle except at near-ties closer than the fp32
//      rounding of a hidden-long dot product. Every logit is summed in one fixed
//      order (32 contiguous k ranges, each an fmaf chain in increasing k, the
//      ranges added in order), whichever kernel runs, so a token's ids and weights
//      do not depend on its batch:
//      - < 65 tokens: one warp per expert (lane l = range l), 8 experts x 8 tokens
//        per block: the gate streamed once per 8 tokens by E/8 blocks (112 for K3);
//        x staged transposed in shared memory, 32 k of every range per step;
//      - >= 65 tokens: 64 tokens x 64 experts per block, x and the widened gate in
//        shared-memory k tiles of 32, 4 x 4 outputs per thread.
//   2. one block per token: s = sigmoid(logit), key = s + bias, top_k rounds of a
//      block arg-max (ties: lower expert id; NaN keys last), weights from the
//      chosen s (renormalised in fp64 by sum + 1e-20 when asked, times scaling).
//
// MoeMxfp4 (routed experts, MXFP4 weights), five launches on one stream:
//   1. sort (one block of 1024, counters in shared memory): histogram of valid
//      expert ids -> exclusive scan -> offsets, the active experts (ascending id)
//      and a scatter of the (token, slot) pair ids grouped by expert. An id < 0 or
//      an expert with a null w1_packed (another rank's) is skipped; an id >=
//      num_experts records kExpertIdOutOfRange in the error word and is skipped.
//      The order inside an expert's group depends on the scheduling, the numbers
//      do not (every output column of a tile depends only on its own pair).
//   2. z -> BF16 once (zb [tokens, hidden]): the B operand of the gate/up GEMM.
//   3. gate/up grouped GEMM, block = (n-split, 64 rows of inter, active expert),
//      4 warps of 16 rows. The w1 and w3 E2M1 nibbles and E8M0 scales come
//      straight from global memory (16 bytes per lane = one 32-element scale
//      group), are decoded to BF16 in registers (byte permute + masks + two
//      BF16x2 multiplies: exact for every scale) and feed mma.m16n8k16 as the A
//      operand: weights on M, tokens on N, so a decode token costs one 8-column
//      n-group. SiTU-GLU in the epilogue; the activation stored BF16 [pairs,
//      inter] in sorted order. Two paths, chosen per expert in the block:
//      - GEMV (<= 8 pairs: decode): lane (g, t) reads column g of B straight from
//        global memory (L1/L2-resident), the weights stream through a 4-chunk
//        register ring refilled as each 128-k chunk is consumed; no shared
//        memory, no barriers: every weight byte read once, warps run free;
//      - tiled (more pairs): the expert's pairs in tiles of kN, tile i on n-split
//        i mod 4 (the splits of one weight slab are adjacent blocks: they share
//        its reads in L2), B staged in shared memory (k-permuted, bank-conflict-
//        free), a whole stage of weights in flight before the staging barrier;
//        kN = 32 with stages of 512 k, or 64 from 128 tokens on with stages of
//        256 k (each decoded register feeds 8 n-groups: prefill, where the decode
//        ALU work would otherwise bound the tensor cores).
//      All paths and tile sizes give the same bits (same k order, same mma
//      sequence per column).
//   4. down grouped GEMM, the same kernel over w2 with K = inter, B = the
//      activations: y[pair, hidden] fp32, indexed by pair id t * top_k + slot.
//   5. reduce: out[t] = sum over the valid slots, in slot order, of
//      weights[t, slot] * y[t * top_k + slot] (no float atomics: results do not
//      depend on scheduling, nor on the batch); 0 for tokens with no valid slot.
// Batches over kMoeChunkTokens tokens are processed in chunks (the backend method
// loops), bounding the scratch (pairs * (2 * inter + 4 * hidden) + tokens * 2 *
// hidden bytes + small).
//
// Numerics: z and the SiTU activations are rounded to BF16 for the tensor cores;
// the MXFP4 weights are exact in BF16; products accumulate in fp32. Bound vs the
// fp32 dequantise-then-GEMM oracle: the BF16 one, |err| <= 1e-2 * max|out| (the
// CPU backends' 1e-4 does not apply to GPU backends). moe_test measures ~3e-3 vs
// the oracle and ~1e-7 vs an fp64 model of the BF16 rounding.
#ifndef TANDEM_KERNELS_CUDA_MOE_H_
#define TANDEM_KERNELS_CUDA_MOE_H_

#include <cstddef>
#include <cstdint>

namespace tandem::kernels::cuda {

// Layout-identical to kernels/backend.h's Mxfp4Expert (backend_moe.cc asserts it).
struct MoeExpertPtrs {
  const uint8_t* w1_packed;
  const uint8_t* w1_scale;
  const uint8_t* w3_packed;
  const uint8_t* w3_scale;
  const uint8_t* w2_packed;
  const uint8_t* w2_scale;
};

// ---- RouterTopK ---------------------------------------------------------------
// Scratch (device, 256-byte aligned) RouterTopK needs.
size_t RouterScratchBytes(int64_t tokens, int64_t num_experts);
// ids [tokens, top_k], weights [tokens, top_k]; 0 < top_k <= num_experts.
const char* LaunchRouterTopK(const float* x, int64_t ldx, const uint16_t* gate,
                             const float* bias, int64_t tokens, int64_t hidden,
                             int64_t num_experts, int64_t top_k, bool renormalize,
                             float scaling, int32_t* ids, float* weights, void* scratch,
                             void* stream);

// ---- MoeMxfp4 -------------------------------------------------------------------
inline constexpr int64_t kMoeChunkTokens = 2048;

struct MoeLaunchArgs {
  int64_t tokens = 0;  // <= kMoeChunkTokens per launch
  int64_t hidden = 0;  // multiple of 32
  int64_t inter = 0;   // multiple of 32
  int64_t top_k = 0;
  int64_t num_experts = 0;
  const MoeExpertPtrs* experts = nullptr;  // device array [num_experts]
  const float* z = nullptr;
  int64_t ld_z = 0;
  const int32_t* ids = nullptr;  // [tokens, top_k]
  const float* weights = nullptr;
  float situ_beta = 4.0f;
  float situ_linear_beta = 25.0f;
  float* out = nullptr;
  int64_t ld_out = 0;
  // Pairs per GEMM tile: 0 = by batch (32, 64 from 128 tokens on); tests force 32
  // or 64.
  int tile_n = 0;
  // Experts with <= 8 pairs take the GEMV path (tests turn it off to compare).
  bool allow_gemv = true;
  // Exact mode (the "cuda" backends' default): z and the SiTU activations enter
  // the tensor cores as BF16 hi + lo parts, two mma per product into the same
  // fp32 accumulator (the MXFP4 weights are exact in BF16), so the result is
  // within fp32-class bounds of dequantise-then-GEMM (~1e-5 of max|out|) instead
  // of BF16's (~3e-3). The weight bytes are read once either way: decode costs
  // the same; prefill does twice the tensor-core work.
  bool split_bf16 = false;
};

// Scratch (device, 256-byte aligned) one launch of `tokens` tokens needs.
size_t MoeScratchBytes(int64_t tokens, int64_t hidden, int64_t inter, int64_t top_k,
                       int64_t num_experts, bool split = false);
// The routed MoE for args.tokens tokens; bad ids recorded in *error_word.
const char* LaunchMoeMxfp4(const MoeLaunchArgs& args, void* scratch,
                           int32_t* error_word, void* stream);

}  // namespace tandem::kernels::cuda

#endif  // TANDEM_KERNELS_CUDA_MOE_H_
