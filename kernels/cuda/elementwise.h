// Launchers of the elementwise kernels (elementwise.cu). Plain C++ types only
// (nvcc-compiled code includes no project headers beyond kernels/cuda/). Device
// pointers; `stream` is the native stream handle. Each returns nullptr on success or
// the launch error.
//
// The math and layouts are those of the ops of the same name in kernels/backend.h;
// shapes are validated by the caller (GpuBackend, kernels/op_checks.h). A launcher
// given an empty problem (rows, tokens or width 0) launches nothing and returns
// nullptr. Kernels that read device index arrays record bad entries in
// `error_word` (kernels/cuda/device_errors.h: atomicCAS(word, 0, code)).
#ifndef TANDEM_KERNELS_CUDA_ELEMENTWISE_H_
#define TANDEM_KERNELS_CUDA_ELEMENTWISE_H_

#include <cstddef>
#include <cstdint>

namespace tandem::kernels::cuda {

// y[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w over n. y may equal x (same ld).
// A warp per row for n <= 1024, else a block per row; float4 loads where every
// pointer is 16-byte aligned and n and the strides are multiples of 4.
const char* LaunchRmsNorm(const float* x, int64_t ldx, const float* w, float* y,
                          int64_t ldy, int64_t rows, int64_t n, float eps,
                          void* stream);

// Per head of width d: y = x * rsqrt(sum(x^2) + eps) * scale. y may equal x.
const char* LaunchL2NormHeads(const float* x, int64_t ldx, float* y, int64_t ldy,
                              int64_t rows, int64_t heads, int64_t d, float eps,
                              float scale, void* stream);

// out = beta*tanh(g/beta)*sigmoid(g) * lbeta*tanh(u/lbeta). out may equal g or u.
const char* LaunchSituGlu(const float* g, int64_t ldg, const float* u, int64_t ldu,
                          float* out, int64_t ldo, int64_t rows, int64_t n, float beta,
                          float lbeta, void* stream);

// out = x * sigmoid(gate). out may equal x.
const char* LaunchMulSigmoid(const float* x, int64_t ldx, const float* gate,
                             int64_t ldg, float* out, int64_t ldo, int64_t rows,
                             int64_t n, void* stream);

// y[i] += x[i], i < n.
const char* LaunchAddInPlace(float* y, const float* x, int64_t n, void* stream);

// out[t] = fp32(table[ids[t] - first]) for ids in [first, first + rows) (table
// holds those rows of a [vocab, hidden] embedding; first 0, rows vocab: all of
// it), a zero row for the other ids; out [tokens, hidden] contiguous. An id
// outside [0, vocab) also records kTokenIdOutOfRange.
const char* LaunchEmbeddingGather(const uint16_t* table, int64_t vocab, int64_t first,
                                  int64_t rows, int64_t hidden, const int32_t* ids,
                                  int64_t tokens, float* out, int32_t* error_word,
                                  void* stream);

// Causal depthwise conv + SiLU with the carried [kernel-1, channels] state (see
// Backend::CausalConv1dSilu). kernel >= 1; y may not alias x. A thread per channel
// and chunk of tokens; the chunk that reads the old state also writes the new one.
const char* LaunchCausalConv1dSilu(const float* x, int64_t ldx, const float* w,
                                   int64_t kernel, float* state, float* y, int64_t ldy,
                                   int64_t tokens, int64_t channels, void* stream);
// The same over num_seqs sequences of tokens_per_seq rows each (rows s * T ..),
// sequence s's state at state_base + slots[s] * state_stride (slots: device
// memory; < 0: padding, zero y rows, no state). Each sequence's arithmetic is the
// one-sequence launch's.
const char* LaunchCausalConv1dSiluSlots(const float* x, int64_t ldx, const float* w,
                                        int64_t kernel, float* state_base,
                                        int64_t state_stride, const int32_t* slots,
                                        int64_t num_seqs, float* y, int64_t ldy,
                                        int64_t tokens_per_seq, int64_t channels,
                                        void* stream);

// g[t,h,c] = lower_bound * sigmoid(exp(a_log[h]) * (graw[t,h*d+c] + dt_bias[h*d+c]));
// beta[t,h] = sigmoid(braw[t,h]); g and beta contiguous.
const char* LaunchKdaGates(const float* graw, int64_t ld_graw, const float* a_log,
                           const float* dt_bias, const float* braw, int64_t ld_braw,
                           float lower_bound, int64_t tokens, int64_t heads, int64_t d,
                           float* g, float* beta, void* stream);

// out[t,h] = RMSNorm_d(o[t,h]) * norm_w * sigmoid(gate[t, h*d:(h+1)*d]); out may
// equal o (same ld).
const char* LaunchKdaOutputGate(const float* o, int64_t ld_o, const float* norm_w,
                                const float* gate, int64_t ld_gate, float* out,
                                int64_t ld_out, int64_t tokens, int64_t heads,
                                int64_t d, float eps, void* stream);

// cache[slots[t] * width + i] = bf16_rne(src[t * ld_src + i]); slots < 0 skipped,
// slots >= num_slots record kSlotOutOfRange (and are skipped).
const char* LaunchPagedCacheWrite(const float* src, int64_t ld_src,
                                  const int32_t* slots, int64_t tokens, int64_t width,
                                  uint16_t* cache, int64_t num_slots,
                                  int32_t* error_word, void* stream);

// Block attention residual mix (Backend::AttnResMix): bank is a device array of
// bank_size device pointers to [tokens, hidden]; out may equal p. Two kernels: the
// scores of every (token, entry) into `scratch` (AttnResMixScratchBytes), then the
// softmax-weighted sum, split over hidden, so decode (1-3 tokens) fills the GPU.
size_t AttnResMixScratchBytes(int64_t tokens, int64_t bank_size);
const char* LaunchAttnResMix(const float* const* bank, int64_t bank_size,
                             const float* p, const float* proj_w, const float* norm_w,
                             float eps, int64_t tokens, int64_t hidden, float* out,
                             float* scratch, void* stream);

// Fused residual add + RMSNorm (not a Backend op; for the GPU engine):
//   x[r] += res[r];  y[r] = rmsnorm(x[r]) * w
// x and res [rows, n] with strides ldx / ldr, y ldy. y may alias neither x nor res.
const char* LaunchAddRmsNorm(float* x, int64_t ldx, const float* res, int64_t ldr,
                             const float* w, float* y, int64_t ldy, int64_t rows,
                             int64_t n, float eps, void* stream);

}  // namespace tandem::kernels::cuda

#endif  // TANDEM_KERNELS_CUDA_ELEMENTWISE_H_
