// The device-neutral kernel interface of the K3 forward pass.
//
// → The engine owns tensors and calls one method per op on raw pointers with
//   explicit shapes and row strides ("ld" = elements between consecutive rows).
//   Every pointer in an op's arguments (including pointer tables such as
//   MoeArgs::experts and AttnResMix's bank) is memory of the backend's Device
//   (kernels/device.h): host memory for the CPU backends, GPU memory for "cuda",
//   tracked host memory for "cuda_sim". Scalars are host values. Ops are enqueued
//   on device().compute_stream() in call order and never read device memory from
//   the host: the contents of index arrays (token ids, block ids, slots, expert
//   ids) are checked by host-addressable backends when the op runs and by device
//   backends in the kernel, which then records the error for the next
//   Synchronize() (outputs of that op are unspecified). Every backend passes
//   kernels/conformance_test.cc against the "cpu_reference" backend (plain loops,
//   fp64 accumulation: the oracle).
//
// Conventions (all backends):
// - BF16 values are uint16_t bit patterns (the high half of an fp32).
// - Activations, accumulation and recurrent state are fp32 unless stated.
// - Weights are row-major [out, in] and applied as x @ W^T.
// - Every op returns absl::OkStatus() or InvalidArgument for bad shapes / ids;
//   outputs are unspecified after an error. Ops never allocate per call beyond
//   bounded scratch, and never keep pointers after returning.
// - Outputs never alias inputs unless the op says so.
#ifndef TANDEM_KERNELS_BACKEND_H_
#define TANDEM_KERNELS_BACKEND_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/device.h"
#include "kernels/sampling_args.h"

namespace tandem::kernels {

// The ops of the interface, for Backend::Supports: a model that needs an op its
// backend lacks fails at load with an error naming it (never a silent fallback
// to another device).
enum class Op {
  kGemmBf16,
  kGemmF32,
  kRmsNorm,
  kL2NormHeads,
  kSituGlu,
  kMulSigmoid,
  kAddInPlace,
  kEmbeddingGather,
  kCausalConv1dSilu,
  kKdaGates,
  kKdaRecurrent,
  kKdaChunked,
  kKdaOutputGate,
  kPagedCacheWrite,
  kMlaAttentionExpanded,
  kMlaAttentionAbsorbed,
  kRouterTopK,
  kMoeMxfp4,
  kAttnResMix,
  kChunkHashes,
  // The vision tower (engine/vision/): optional ops, implemented by the CPU
  // backends; the Backend defaults below are Unimplemented errors naming the op.
  kRope2d,
  kGelu,
  kVisionAttention,
  kMerge2x2,
};
inline constexpr int kNumOps = static_cast<int>(Op::kMerge2x2) + 1;
absl::string_view OpName(Op op);
// True for the vision-tower ops (kRope2d .. kMerge2x2).
bool IsVisionOp(Op op);

// KDA (Kimi Delta Attention) recurrence over T tokens of ONE sequence.
// Per head h and token t (q, k already L2-normalised and q scaled by the caller,
// see Backend::L2NormHeads):
//   S_h = diag(exp(g_t)) S_h;  S_h += beta_t k_t (v_t - S_h^T k_t)^T;  o_t = S_h^T q_t
struct KdaArgs {
  int64_t tokens = 0;        // T >= 0
  int64_t heads = 0;         // h
  int64_t head_dim_k = 0;    // d_k
  int64_t head_dim_v = 0;    // d_v
  const float* q = nullptr;  // [T, h, d_k], row stride ld_qk (per token)
  const float* k = nullptr;  // [T, h, d_k], row stride ld_qk
  int64_t ld_qk = 0;
  const float* v = nullptr;  // [T, h, d_v], row stride ld_v
  int64_t ld_v = 0;
  const float* g = nullptr;     // [T, h, d_k] log-decay (<= 0), contiguous
  const float* beta = nullptr;  // [T, h], contiguous
  float* state = nullptr;       // [h, d_k, d_v] in/out (initial -> final)
  float* out = nullptr;         // [T, h, d_v], row stride ld_out
  int64_t ld_out = 0;
};

// MLA attention over a paged latent cache. Per layer the cache is
// [num_blocks, block_size, kv_lora_rank + rope_dim] BF16: per token the normalised
// c_kv [kv_lora_rank] then k_rot [rope_dim]. Sequence s has seq_lens[s] tokens in the
// cache (its new tokens included, already written with MlaCacheWrite) and
// q_len_s = query_start[s+1] - query_start[s] query tokens: the LAST q_len_s tokens
// of its context. Query i of s sits at position p = seq_lens[s] - q_len_s + i and
// attends to positions 0..p (causal inside the queries; q_len_s > 1 serves prefill
// chunks and speculative verification alike). Position p of s lives in block
// block_tables[s * block_table_stride + p / block_size], row p % block_size.
// kv_b_proj [heads * (nope_dim + v_dim), kv_lora_rank] BF16, per head [W_UK; W_UV].
struct MlaArgs {
  int64_t heads = 0;
  int64_t nope_dim = 0;      // 128
  int64_t rope_dim = 0;      // 64
  int64_t v_dim = 0;         // 128
  int64_t kv_lora_rank = 0;  // 512
  float scale = 0;           // (nope_dim + rope_dim)^-0.5
  int64_t num_seqs = 0;
  // Total query tokens, = query_start[num_seqs] (a host copy: device backends size
  // their grids from it). 0 means "read query_start" (host-addressable only).
  int64_t num_tokens = 0;
  const int32_t* seq_lens = nullptr;      // [num_seqs]
  const int32_t* query_start = nullptr;   // [num_seqs + 1], query_start[0] = 0
  const int32_t* block_tables = nullptr;  // [num_seqs, block_table_stride]
  int64_t block_table_stride = 0;
  const uint16_t* kv_cache = nullptr;  // [num_blocks, block_size, lora + rope] BF16
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  const uint16_t* kv_b_proj = nullptr;  // BF16, see above
  const float* q = nullptr;  // [num_tokens, heads, nope + rope], row stride ld_q
  int64_t ld_q = 0;
  float* out = nullptr;  // [num_tokens, heads, v_dim], row stride ld_out
  int64_t ld_out = 0;
  // Device backends size the absorbed form's split-KV decomposition from the
  // batch (num_seqs, num_tokens) and the largest context the tables allow
  // (block_table_stride * block_size). A caller that needs one decomposition for
  // different batches (a CUDA graph's padded batch and the eager steps it is
  // compared with) sets the batch and context to plan for: split_seqs sequences
  // of num_tokens / num_seqs queries, split_context positions. 0: the call's own.
  // Host backends ignore both.
  int64_t split_seqs = 0;
  int64_t split_context = 0;
  // The longest seq_lens value (a host copy) or 0 (unknown: the tables' reach,
  // block_table_stride * block_size). Device backends walk the expanded form's
  // context up to it, not to the tables' reach (a table sized for a 1M-token
  // prompt, the first chunks of its prefill); a sequence longer than it is
  // refused (kBadSequenceLength). Host backends ignore it.
  int64_t max_context = 0;
};

// One routed expert in MXFP4 (compressed-tensors "mxfp4-pack-quantized"):
// w1 (gate) and w3 (up) [inter, hidden], w2 (down) [hidden, inter];
// *_packed U8 [out, in/2] (byte j: element 2j low nibble, 2j+1 high nibble),
// *_scale U8 [out, in/32] E8M0 (2^(s-127); 0xFF = NaN).
struct Mxfp4Expert {
  const uint8_t* w1_packed = nullptr;
  const uint8_t* w1_scale = nullptr;
  const uint8_t* w3_packed = nullptr;
  const uint8_t* w3_scale = nullptr;
  const uint8_t* w2_packed = nullptr;
  const uint8_t* w2_scale = nullptr;
};

// Routed MoE over MXFP4 experts: out[t] = sum_i weights[t,i] * E_{ids[t,i]}(z[t]),
// E(z) = w2(SiTU(w1 z, w3 z)). An id < 0, or an expert whose w1_packed is null
// (owned by another rank), contributes nothing.
struct MoeArgs {
  int64_t tokens = 0;
  int64_t hidden = 0;  // routed_expert_hidden_size (3584), multiple of 32
  int64_t inter = 0;   // moe_intermediate_size (3072), multiple of 32
  int64_t top_k = 0;
  int64_t num_experts = 0;
  const Mxfp4Expert* experts = nullptr;  // [num_experts]
  const float* z = nullptr;              // [T, hidden], row stride ld_z
  int64_t ld_z = 0;
  const int32_t* ids = nullptr;    // [T, top_k]
  const float* weights = nullptr;  // [T, top_k]
  float situ_beta = 4.0f;
  float situ_linear_beta = 25.0f;
  float* out = nullptr;  // [T, hidden], row stride ld_out (overwritten)
  int64_t ld_out = 0;
};

// One piece of a logical byte stream (ChunkHashes): `bytes` bytes at `data`,
// which sit at [offset, offset + bytes) of the stream.
struct ByteSegment {
  const uint8_t* data = nullptr;
  int64_t offset = 0;
  int64_t bytes = 0;
};

// Chunk hashes of one byte stream (the KV-transfer checksums of
// kvtransfer/checksum.h, computed where the cache lives). The stream is the
// concatenation of segments[0..num_segments) in order (segments[0].offset == 0,
// each next offset == the previous offset + bytes, the last ending at
// total_bytes; zero-byte segments allowed); it is cut into pieces of chunk_bytes
// (the last one shorter) and hashes[c] = XXH64(piece c, seed 0) (the published
// xxHash XXH64, as libxxhash computes it). num_chunks = ceil(total_bytes /
// chunk_bytes) outputs; none for an empty stream. total_bytes is a host copy (device
// backends size their grids from it); a table that does not match it is an
// InvalidArgument (host backends at once, device backends at Synchronize()).
struct ChunkHashArgs {
  const ByteSegment* segments = nullptr;  // [num_segments] (the table is device memory)
  int64_t num_segments = 0;
  int64_t total_bytes = 0;
  int64_t chunk_bytes = 0;     // 1 .. kMaxHashChunkBytes
  uint64_t* hashes = nullptr;  // [num_chunks]
  // Where a device backend enqueues the work: a stream of its device, or null for
  // the compute stream. A checksum taken beside the engine (another thread) uses
  // its own stream, so it never lands in a CUDA graph the engine is capturing.
  Stream* stream = nullptr;
};
inline constexpr int64_t kMaxHashChunkBytes = int64_t{1} << 30;
// Rope2d positions are < this (the tower's 512x512 table).
inline constexpr int32_t kMaxRopePosition = 512;

// Non-causal attention within each image of a packed batch (the vision tower's
// block-diagonal attention): image i owns tokens [cu_seqlens[i], cu_seqlens[i+1]),
// and each of its queries attends to every key of the same image only:
//   out[t, h] = sum_j softmax_j(scale * q[t,h] . k[j,h]) v[j,h],  j in t's image.
// q, k, v, out: [num_tokens, heads * head_dim] with row strides (q/k/v may be
// column slices of one [T, 3Q] qkv row: ld_qkv).
struct VisionAttnArgs {
  int64_t heads = 0;
  int64_t head_dim = 0;
  float scale = 0;  // head_dim^-0.5
  int64_t num_images = 0;
  // Host copies: num_tokens = cu_seqlens[num_images]; max_seqlen >= every image's
  // token count (device backends size grids and scratch from them).
  int64_t num_tokens = 0;
  int64_t max_seqlen = 0;
  const int32_t* cu_seqlens = nullptr;  // [num_images + 1], cu_seqlens[0] = 0
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t ld_qkv = 0;
  float* out = nullptr;  // [num_tokens, heads * head_dim], row stride ld_out
  int64_t ld_out = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual absl::string_view name() const = 0;
  // The memory every op's pointers refer to, and its compute stream.
  virtual Device& device() = 0;
  // Whether this backend implements `op` (all ops but the optional vision ops,
  // unless it says otherwise).
  virtual bool Supports(Op op) const { return !IsVisionOp(op); }
  // Waits for the ops enqueued so far; returns the first error a kernel recorded
  // (e.g. a token id out of range) since the last call.
  virtual absl::Status Synchronize() { return device().Synchronize(); }
  // Changes whenever device memory the backend's ops use internally (workspace,
  // GEMM staging buffers) moves: a CUDA graph captured over its ops before the
  // change would use freed memory, so its owner recaptures. 0: no such memory.
  virtual int64_t workspace_generation() const { return 0; }

  // ---- Dense algebra -------------------------------------------------------
  // Y[m, n] (+)= sum_k X[m, k] * W[n, k]; W BF16. accumulate=false overwrites Y.
  // Optimised backends may round X to BF16 (products are then exact in fp32):
  // bound |err| <= 1e-2 * sum_k |X||W| scale (see conformance test).
  virtual absl::Status GemmBf16(const float* x, int64_t ldx, const uint16_t* w,
                                int64_t ldw, float* y, int64_t ldy, int64_t m,
                                int64_t n, int64_t k, bool accumulate) = 0;
  // The same with fp32 W (fp32 products: |err| <= 1e-5 * sum |X||W|).
  virtual absl::Status GemmF32(const float* x, int64_t ldx, const float* w, int64_t ldw,
                               float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                               bool accumulate) = 0;

  // ---- Element-wise and norms -----------------------------------------------
  // y[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w over n. Per-head norms (KDA o_norm)
  // are rows = tokens * heads, n = head_dim. y may equal x (same ld).
  virtual absl::Status RmsNorm(const float* x, int64_t ldx, const float* w, float* y,
                               int64_t ldy, int64_t rows, int64_t n, float eps) = 0;
  // Per head of width d: y = x * rsqrt(sum(x^2) + eps) * scale (FLA l2norm; KDA
  // q uses scale = d^-0.5, k uses 1). x, y: [rows, heads * d] with strides.
  virtual absl::Status L2NormHeads(const float* x, int64_t ldx, float* y, int64_t ldy,
                                   int64_t rows, int64_t heads, int64_t d, float eps,
                                   float scale) = 0;
  // out = beta*tanh(g/beta)*sigmoid(g) * lbeta*tanh(u/lbeta), [rows, n] with strides.
  virtual absl::Status SituGlu(const float* g, int64_t ldg, const float* u, int64_t ldu,
                               float* out, int64_t ldo, int64_t rows, int64_t n,
                               float beta, float lbeta) = 0;
  // out = x * sigmoid(gate), [rows, n] with strides (MLA output gate). out may be x.
  virtual absl::Status MulSigmoid(const float* x, int64_t ldx, const float* gate,
                                  int64_t ldg, float* out, int64_t ldo, int64_t rows,
                                  int64_t n) = 0;
  // y[i] += x[i], i < n (residual adds).
  virtual absl::Status AddInPlace(float* y, const float* x, int64_t n) = 0;

  // ---- Embedding --------------------------------------------------------------
  // out[t] = fp32(table[ids[t]]), table [vocab, hidden] BF16. Ids out of range:
  // InvalidArgument.
  absl::Status EmbeddingGather(const uint16_t* table, int64_t vocab, int64_t hidden,
                               const int32_t* ids, int64_t tokens, float* out) {
    return EmbeddingGatherRows(table, vocab, 0, vocab, hidden, ids, tokens, out);
  }
  // The vocabulary-parallel form (tensor parallelism): `table` holds rows
  // [first, first + rows) of a [vocab, hidden] BF16 embedding; out[t] =
  // fp32(table[ids[t] - first]) where ids[t] lies in that range, zeros where it
  // is another rank's row. Ids outside [0, vocab): InvalidArgument (on a device
  // at the next Synchronize, as every kernel-detected error); a range outside
  // [0, vocab): InvalidArgument. One launch however the ids fall.
  virtual absl::Status EmbeddingGatherRows(const uint16_t* table, int64_t vocab,
                                           int64_t first, int64_t rows, int64_t hidden,
                                           const int32_t* ids, int64_t tokens,
                                           float* out) = 0;

  // ---- KDA ------------------------------------------------------------------
  // Causal depthwise conv over T new tokens of one sequence, then SiLU:
  //   y[t,c] = silu(sum_{i<K} w[c,i] * xx[t+i, c]),  xx = [state (K-1 rows); x]
  // w [channels, K] (the [C,1,K] checkpoint tensor), no bias. state
  // [K-1, channels] (oldest first) in/out: on return it holds the last K-1 inputs
  // of xx (correct for T < K-1 too). x [T, channels] ld_x, y ld_y; y may not alias x.
  virtual absl::Status CausalConv1dSilu(const float* x, int64_t ldx, const float* w,
                                        int64_t kernel, float* state, float* y,
                                        int64_t ldy, int64_t tokens,
                                        int64_t channels) = 0;
  // CausalConv1dSilu over num_seqs sequences of tokens_per_seq new tokens each
  // (x / y rows s * tokens_per_seq ..), sequence s's state at
  // state_base + slots[s] * state_stride. slots is device memory (so one CUDA
  // graph serves any slot assignment); a slot < 0 is padding: its y rows are
  // zeros and no state is touched. Equals num_seqs CausalConv1dSilu calls. The
  // default reads the slots on the host (host-addressable devices only).
  virtual absl::Status CausalConv1dSiluSlots(const float* x, int64_t ldx,
                                             const float* w, int64_t kernel,
                                             float* state_base, int64_t state_stride,
                                             const int32_t* slots, int64_t num_seqs,
                                             float* y, int64_t ldy,
                                             int64_t tokens_per_seq, int64_t channels);
  // g[t,h,c] = lower_bound * sigmoid(exp(a_log[h]) * (graw[t,h*d+c] + dt_bias[h*d+c]))
  // beta[t,h] = sigmoid(braw[t,h]). graw ld_graw, braw ld_braw; g [T,h,d] and
  // beta [T,h] contiguous.
  virtual absl::Status KdaGates(const float* graw, int64_t ld_graw, const float* a_log,
                                const float* dt_bias, const float* braw,
                                int64_t ld_braw, float lower_bound, int64_t tokens,
                                int64_t heads, int64_t d, float* g, float* beta) = 0;
  // Token-by-token recurrence (decode and the oracle).
  virtual absl::Status KdaRecurrent(const KdaArgs& args) = 0;
  // KdaRecurrent over num_seqs sequences of args.tokens tokens each (rows
  // s * tokens .. of q, k, v, g, beta, out), sequence s's state at
  // args.state + slots[s] * state_stride; slots as in CausalConv1dSiluSlots (< 0:
  // padding, zero out rows, no state). Equals num_seqs KdaRecurrent calls.
  virtual absl::Status KdaRecurrentSlots(const KdaArgs& args, int64_t num_seqs,
                                         const int32_t* slots, int64_t state_stride);
  // Chunked (chunk 64, WY/UT form) prefill; equals KdaRecurrent.
  virtual absl::Status KdaChunked(const KdaArgs& args) = 0;
  // out[t,h] = RMSNorm_d(o[t,h]) * norm_w * sigmoid(gate[t, h*d:(h+1)*d]).
  // o [T, h*d] ld_o, gate ld_gate, out ld_out (may equal o).
  virtual absl::Status KdaOutputGate(const float* o, int64_t ld_o, const float* norm_w,
                                     const float* gate, int64_t ld_gate, float* out,
                                     int64_t ld_out, int64_t tokens, int64_t heads,
                                     int64_t d, float eps) = 0;

  // ---- MLA ------------------------------------------------------------------
  // cache[slots[t]] = bf16(src[t, 0:width]) where slot = block * block_size + row;
  // slots < 0 are skipped (padding), slots >= num_slots are InvalidArgument.
  virtual absl::Status PagedCacheWrite(const float* src, int64_t ld_src,
                                       const int32_t* slots, int64_t tokens,
                                       int64_t width, uint16_t* cache,
                                       int64_t num_slots) = 0;
  // Expanded form: k_nope/v = W_UK c / W_UV c per cached position (prefill).
  virtual absl::Status MlaAttentionExpanded(const MlaArgs& args) = 0;
  // Weight-absorbed form: q_lat = W_UK^T q_nope; MQA over [c | k_rot]; o = W_UV ctx
  // (decode). Equals the expanded form within fp32 rounding.
  virtual absl::Status MlaAttentionAbsorbed(const MlaArgs& args) = 0;

  // ---- MoE ----------------------------------------------------------------
  // noaux_tc sigmoid router: s = sigmoid(x @ gate^T) in fp32 (gate BF16 [E, hidden]);
  // choose top_k by s + bias (ties: lower expert id first), ordered by that key
  // descending; weights = chosen s (pre-bias), divided by (sum + 1e-20) when
  // renormalize, times scaling. ids [T, top_k] int32, weights [T, top_k].
  virtual absl::Status RouterTopK(const float* x, int64_t ldx, const uint16_t* gate,
                                  const float* bias, int64_t tokens, int64_t hidden,
                                  int64_t num_experts, int64_t top_k, bool renormalize,
                                  float scaling, int32_t* ids, float* weights) = 0;
  // Grouped routed-expert GEMMs on MXFP4 weights (dequantised in the kernel).
  virtual absl::Status MoeMxfp4(const MoeArgs& args) = 0;

  // ---- Block attention residuals ----------------------------------------------
  // Mix(P, B): V = [B_0..B_{n-1}, P]; s_j = sum_d V_j * rsqrt(mean(V_j^2)+eps) *
  // norm_w * proj_w; out = sum_j softmax_j(s) V_j, per token. bank: n pointers to
  // [T, hidden] (contiguous); p, out [T, hidden] (out may equal p).
  virtual absl::Status AttnResMix(const float* const* bank, int64_t bank_size,
                                  const float* p, const float* proj_w,
                                  const float* norm_w, float eps, int64_t tokens,
                                  int64_t hidden, float* out) = 0;

  // ---- Integrity ----------------------------------------------------------------
  // XXH64 per chunk of a byte stream in device memory (ChunkHashArgs above).
  virtual absl::Status ChunkHashes(const ChunkHashArgs& args) = 0;

  // ---- Token sampling (optional: device backends) ---------------------------
  // Samples every row of args.logits where the logits are (kernels/sampling_args.h;
  // the contract is engine::Sampler's: the same tokens for the same logits,
  // parameters, history and seed). Every pointer is device memory; the row
  // statuses and outputs are valid after Synchronize(). Host backends do not
  // implement it (SupportsSampling() false, SampleTokens Unimplemented): the
  // engine samples their logits in place with engine::Sampler, no copy needed.
  // Not an Op: the model's forward never needs it, so no model fails to load
  // for its absence.
  virtual bool SupportsSampling() const { return false; }
  virtual absl::Status SampleTokens(const SampleArgs& args);

  // ---- Vision tower (optional: the defaults return Unimplemented naming the op
  // and the backend, and such a backend answers Supports(op) = false) ----------
  // 2-D rotary embedding in place: for token t at (row, col) = (pos[2t], pos[2t+1])
  // and each of `heads` heads of width head_dim (a multiple of 4), with
  // f_i = theta^(-4i/head_dim), i < head_dim/4, the pairs (4i, 4i+1) rotate by
  // col * f_i and (4i+2, 4i+3) by row * f_i: (a, b) -> (a cos - b sin, a sin + b cos).
  // x [tokens, heads * head_dim] row stride ldx; pos [tokens, 2] int32 (device
  // memory; values in [0, kMaxRopePosition)).
  virtual absl::Status Rope2d(float* x, int64_t ldx, const int32_t* pos, int64_t tokens,
                              int64_t heads, int64_t head_dim, float theta);
  // y = gelu(x) over [rows, n] with strides; tanh_approx: 0.5x(1 + tanh(sqrt(2/pi)
  // (x + 0.044715x^3))) (PyTorch "gelu_pytorch_tanh"), else 0.5x(1 + erf(x/sqrt2)).
  // y may equal x (same ld).
  virtual absl::Status Gelu(const float* x, int64_t ldx, float* y, int64_t ldy,
                            int64_t rows, int64_t n, bool tanh_approx);
  // Block-diagonal attention within each image (VisionAttnArgs above).
  virtual absl::Status VisionAttention(const VisionAttnArgs& args);
  // 2x2 patch merge of one image's [grid_h * grid_w, d] row-major patch grid
  // (grid_h, grid_w even): out row m = (r/2) * (grid_w/2) + c/2 is the concatenation
  // of patches (2R,2C), (2R,2C+1), (2R+1,2C), (2R+1,2C+1) -> [grid_h*grid_w/4, 4d].
  virtual absl::Status Merge2x2(const float* x, int64_t ldx, int64_t grid_h,
                                int64_t grid_w, int64_t d, float* out, int64_t ldo);
};

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_BACKEND_H_
