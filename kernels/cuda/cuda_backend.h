// The GPU backend: every op of kernels/backend.h as CUDA kernels on device memory.
//
// One source, two builds:
//   "cuda"      the kernels compiled by nvcc (sm_90a, sm_100f), a real GPU, CUDA
//               runtime memory pools, cuBLASLt for dense GEMMs (--config=cuda);
//   "cuda_sim"  the same kernel sources compiled as host C++ on the SIMT emulator
//               (kernels/cuda/sim/simt.h), tracked host memory, host GEMM. Runs on
//               any machine: the conformance suite and engine tests use it in CI.
// Method definitions are split by op family: cuda_backend.cc (device, GEMM,
// errors, scratch), backend_elementwise.cc, backend_kda.cc, backend_mla.cc,
// backend_moe.cc, backend_checksum.cc, backend_sampling.cc, backend_vision.cc;
// each family's kernels live in <family>.cu with launchers declared in <family>.h
// (plain C++ types only, so nvcc needs no project headers).
#ifndef TANDEM_KERNELS_CUDA_CUDA_BACKEND_H_
#define TANDEM_KERNELS_CUDA_CUDA_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/device.h"

namespace tandem::kernels::cuda {

class Blas;  // kernels/cuda/blas.h

// How the tensor-core paths treat fp32 activations.
//   kExact: split into BF16 hi + lo parts (two or three mma per product): results
//           within fp32-class bounds of the CPU backend, so tokens match it
//           ("cuda", "cuda_sim"); bandwidth-bound decode costs the same, prefill
//           GEMMs about twice the tensor-core work;
//   kBf16:  rounded to BF16 once, as BF16 serving engines run ("cuda_bf16",
//           "cuda_sim_bf16"): faster prefill, results within BF16 bounds.
enum class GpuPrecision { kExact, kBf16 };

class GpuBackend final : public Backend {
 public:
  // `device` is the emulated device for cuda_sim or a CUDA device; `blas` the
  // matching GEMM library wrapper.
  GpuBackend(std::string name, std::unique_ptr<Device> device,
             std::unique_ptr<Blas> blas, GpuPrecision precision = GpuPrecision::kExact);
  GpuPrecision precision() const { return precision_; }
  ~GpuBackend() override;

  absl::string_view name() const override { return name_; }
  Device& device() override { return *device_; }
  bool Supports(Op op) const override;
  absl::Status Synchronize() override;
  int64_t workspace_generation() const override;

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
  absl::Status CausalConv1dSiluSlots(const float* x, int64_t ldx, const float* w,
                                     int64_t kernel, float* state_base,
                                     int64_t state_stride, const int32_t* slots,
                                     int64_t num_seqs, float* y, int64_t ldy,
                                     int64_t tokens_per_seq, int64_t channels) override;
  absl::Status KdaRecurrentSlots(const KdaArgs& args, int64_t num_seqs,
                                 const int32_t* slots, int64_t state_stride) override;
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
  bool SupportsSampling() const override { return true; }
  absl::Status SampleTokens(const SampleArgs& args) override;
  // The vision tower (backend_vision.cc).
  absl::Status Rope2d(float* x, int64_t ldx, const int32_t* pos, int64_t tokens,
                      int64_t heads, int64_t head_dim, float theta) override;
  absl::Status Gelu(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t rows,
                    int64_t n, bool tanh_approx) override;
  absl::Status VisionAttention(const VisionAttnArgs& args) override;
  absl::Status Merge2x2(const float* x, int64_t ldx, int64_t grid_h, int64_t grid_w,
                        int64_t d, float* out, int64_t ldo) override;

  // ---- For the op families' definitions ---------------------------------------
  // The compute stream's native handle (cudaStream_t / the emulator's stream).
  void* stream() { return device_->compute_stream().native(); }
  // Device workspace of at least `bytes` for one op (grown on demand, never
  // shrunk; valid until the next Scratch call). 256-byte aligned.
  absl::StatusOr<void*> Scratch(size_t bytes);
  // The device word kernels record index errors in (kernels/cuda/device_errors.h);
  // Synchronize() reads and clears it.
  int32_t* error_word() { return error_word_; }
  // Internal error naming `what` if the last launch failed, else OK.
  absl::Status Launched(const char* what);
  // FailedPrecondition unless every pointer range lies in this device's memory
  // (checked where the device can answer cheaply: cuda_sim and host).
  absl::Status CheckResident(const void* p, size_t bytes, const char* what) const;

 private:
  std::string name_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Blas> blas_;
  DeviceBuffer scratch_;
  int64_t scratch_moves_ = 0;  // reallocations of scratch_
  DeviceBuffer error_buffer_;
  int32_t* error_word_ = nullptr;
  GpuPrecision precision_;
};

// "cuda_sim": the emulator (default build; FailedPrecondition in --config=cuda
// builds, whose kernels are the nvcc ones).
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaSimBackend(
    GpuPrecision precision = GpuPrecision::kExact);
// "cuda": GPU `ordinal`; FailedPrecondition where this binary was built without
// CUDA (--config=cuda) or no GPU is visible.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(
    int ordinal = 0, GpuPrecision precision = GpuPrecision::kExact);

}  // namespace tandem::kernels::cuda

#endif  // TANDEM_KERNELS_CUDA_CUDA_BACKEND_H_
