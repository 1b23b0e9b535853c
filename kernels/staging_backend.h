// A Backend on host pointers in front of a device backend ("cuda_sim", "cuda"):
// how the conformance suite (kernels/conformance_test.cc), written against host
// std::vectors, runs on backends whose ops take device memory.
//
// Per op it
//   1. runs the host-side content checks the CPU backends run (token ids, cache
//      slots, MLA block tables, MoE expert ids; kernels/op_checks.h) so that bad
//      ids are rejected with the same messages (Options::check_contents = false
//      leaves them to the device kernels, whose errors come back from
//      Synchronize: the device error word path);
//   2. allocates device buffers of exactly the extents the op's shapes and strides
//      imply (e.g. x of a GEMM: (m - 1) * ldx + k elements), uploads the inputs and
//      the current contents of the outputs (in/out state, accumulation, padding
//      columns that must stay untouched); pointers that alias (y == x) or lie
//      inside another argument's range share one buffer; pointer tables (MoeArgs::
//      experts, AttnResMix's bank) become device tables of device pointers;
//   3. surrounds every output buffer with Options::guard_bytes of a pattern before
//      and after, runs the op on the device backend, synchronises it (forwarding
//      its device errors), checks the guards (Internal naming the op and the
//      buffer, also printed to stderr, when a kernel wrote outside its output),
//      and downloads the outputs.
// Not for serving: it round-trips every op through host memory.
#ifndef TANDEM_KERNELS_STAGING_BACKEND_H_
#define TANDEM_KERNELS_STAGING_BACKEND_H_

#include <cstddef>
#include <memory>

#include "kernels/backend.h"

namespace tandem::kernels {

class StagingBackend final : public Backend {
 public:
  struct Options {
    bool check_contents = true;
    size_t guard_bytes = 256;  // a multiple of 256 keeps CUDA's alignment
  };
  explicit StagingBackend(std::unique_ptr<Backend> device_backend)
      : StagingBackend(std::move(device_backend), Options()) {}
  StagingBackend(std::unique_ptr<Backend> device_backend, Options options);
  ~StagingBackend() override;

  // The wrapped backend (its device memory, Synchronize, error word).
  Backend& device_backend() { return *inner_; }

  absl::string_view name() const override { return inner_->name(); }
  // The memory this adapter's op arguments live in: the host.
  Device& device() override { return *host_; }
  bool Supports(Op op) const override { return inner_->Supports(op); }
  absl::Status Synchronize() override { return inner_->Synchronize(); }

  absl::Status GemmBf16(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw,
                        float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                        bool accumulate) override;
  absl::Status GemmF32(const float* x, int64_t ldx, const float* w, int64_t ldw,
                       float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                       bool accumulate) override;
  absl::Status RmsNorm(const float* x, int64_t ldx, const float* w, float* y,
                       int64_t ldy, int64_t rows, int64_t n, float eps) override;
  absl::Status L2NormHeads(const float* x, int64_t ldx, float* y, int64_t ldy,
                           int64_t rows, int64_t heads, int64_t d, float eps,
                           float scale) override;
  absl::Status SituGlu(const float* g, int64_t ldg, const float* u, int64_t ldu,
                       float* out, int64_t ldo, int64_t rows, int64_t n, float beta,
                       float lbeta) override;
  absl::Status MulSigmoid(const float* x, int64_t ldx, const float* gate, int64_t ldg,
                          float* out, int64_t ldo, int64_t rows, int64_t n) override;
  absl::Status AddInPlace(float* y, const float* x, int64_t n) override;
  absl::Status EmbeddingGatherRows(const uint16_t* table, int64_t vocab, int64_t first,
                                   int64_t rows, int64_t hidden, const int32_t* ids,
                                   int64_t tokens, float* out) override;
  absl::Status CausalConv1dSilu(const float* x, int64_t ldx, const float* w,
                                int64_t kernel, float* state, float* y, int64_t ldy,
                                int64_t tokens, int64_t channels) override;
  absl::Status KdaGates(const float* graw, int64_t ld_graw, const float* a_log,
                        const float* dt_bias, const float* braw, int64_t ld_braw,
                        float lower_bound, int64_t tokens, int64_t heads, int64_t d,
                        float* g, float* beta) override;
  absl::Status KdaRecurrent(const KdaArgs& args) override;
  absl::Status KdaChunked(const KdaArgs& args) override;
  absl::Status KdaOutputGate(const float* o, int64_t ld_o, const float* norm_w,
                             const float* gate, int64_t ld_gate, float* out,
                             int64_t ld_out, int64_t tokens, int64_t heads, int64_t d,
                             float eps) override;
  absl::Status PagedCacheWrite(const float* src, int64_t ld_src, const int32_t* slots,
                               int64_t tokens, int64_t width, uint16_t* cache,
                               int64_t num_slots) override;
  absl::Status MlaAttentionExpanded(const MlaArgs& args) override;
  absl::Status MlaAttentionAbsorbed(const MlaArgs& args) override;
  absl::Status RouterTopK(const float* x, int64_t ldx, const uint16_t* gate,
                          const float* bias, int64_t tokens, int64_t hidden,
                          int64_t num_experts, int64_t top_k, bool renormalize,
                          float scaling, int32_t* ids, float* weights) override;
  absl::Status MoeMxfp4(const MoeArgs& args) override;
  absl::Status AttnResMix(const float* const* bank, int64_t bank_size, const float* p,
                          const float* proj_w, const float* norm_w, float eps,
                          int64_t tokens, int64_t hidden, float* out) override;
  absl::Status ChunkHashes(const ChunkHashArgs& args) override;
  absl::Status Rope2d(float* x, int64_t ldx, const int32_t* pos, int64_t tokens,
                      int64_t heads, int64_t head_dim, float theta) override;
  absl::Status Gelu(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t rows,
                    int64_t n, bool tanh_approx) override;
  absl::Status VisionAttention(const VisionAttnArgs& args) override;
  absl::Status Merge2x2(const float* x, int64_t ldx, int64_t grid_h, int64_t grid_w,
                        int64_t d, float* out, int64_t ldo) override;

 private:
  absl::Status Kda(const KdaArgs& args, bool chunked);
  absl::Status Mla(const MlaArgs& args, bool absorbed);

  std::unique_ptr<Backend> inner_;
  Options options_;
  std::unique_ptr<Device> host_;
};

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_STAGING_BACKEND_H_
