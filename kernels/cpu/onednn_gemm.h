// Prefill-shaped BF16 GEMMs through oneDNN's matmul (libdnnl 2.6), which beats the
// hand-written vdpbf16ps kernel by 1.6-4.7x at M >= 256 on this machine (numbers in
// kernels/README.md). Primitives are cached per shape. Used by the cpu backend for
// the avx512_bf16 level when M >= kOneDnnMinM; all other shapes and levels use the
// kernels in gemm_kernels.h.
#ifndef TANDEM_KERNELS_CPU_ONEDNN_GEMM_H_
#define TANDEM_KERNELS_CPU_ONEDNN_GEMM_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"

namespace tandem::kernels {

inline constexpr int64_t kOneDnnMinM = 64;

class OneDnnGemm {
 public:
  OneDnnGemm();
  ~OneDnnGemm();
  // Y[m, n] (+)= Xb[m, k] @ W[n, k]^T with Xb, W BF16 (Xb contiguous, ld = k).
  absl::Status GemmBf16(const uint16_t* xb, const uint16_t* w, int64_t ldw, float* y,
                        int64_t ldy, int64_t m, int64_t n, int64_t k, bool accumulate);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_CPU_ONEDNN_GEMM_H_
