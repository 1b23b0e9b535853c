// Dense GEMMs on cuBLASLt (blas.h). --config=cuda only.
//
// GemmBf16 (BF16 weights x FP32 activations): cuBLASLt has no FP32 x BF16 matmul.
// Two modes:
//   exact (the "cuda" backend, default): X is split into BF16 hi and lo parts
//     (blas_kernels.cu) stacked as one [2m, k] operand, ONE BF16 x BF16 -> FP32
//     matmul (CUBLAS_COMPUTE_32F) computes both products, reading W once, and a
//     small kernel adds the row pairs into Y. Products of BF16 values are exact in
//     FP32, hi + lo carries 16 bits of X: fp32-class accuracy (~2^-17 relative per
//     product), at 2x the tensor-core work but the same weight traffic, so decode
//     (bandwidth-bound) costs the same and prefill GEMMs twice the FLOPs;
//   bf16 ("cuda_bf16"): X rounded to BF16 once: the 1e-2 bound of
//     Backend::GemmBf16, as BF16 serving engines run.
// (TF32 would need W in FP32: twice the weight bytes.)
// GemmF32: FP32 x FP32 with CUBLAS_COMPUTE_32F (no TF32: the 1e-5 contract).
//
// Row-major Y[m,n] = X[m,k] W[n,k]^T is, column-major, Y^T = W^T' X^T: cuBLASLt's
// A = W (k x n, ld ldw, transposed), B = X (k x m, ld ldx), C = D = Y (n x m, ld
// ldy): the "TN" layout. accumulate=true is beta = 1 with C = D.
//
// The matmul descriptor, layouts and the heuristic's algorithm are cached per
// (type, m, n, k, ld*, pointer alignments) key: cublasLtMatmulAlgoGetHeuristic
// runs once per key, with a 32 MiB workspace allocated once. One caller at a time
// (as a Backend).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda/blas.h"
#include "kernels/cuda/blas_kernels.h"

namespace tandem::kernels::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;

absl::Status LtError(cublasStatus_t s, absl::string_view what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  // A failed launch inside cuBLASLt also set the runtime's last error: taken
  // here, or the next kernel's launch check would report it as its own.
  const cudaError_t last = cudaGetLastError();
  return Internal(
      "cuBLASLt ", what, ": ", cublasLtGetStatusName(s), " (",
      cublasLtGetStatusString(s), ")",
      last == cudaSuccess ? "" : absl::StrCat("; CUDA: ", cudaGetErrorString(last)));
}

#define TANDEM_LT(expr, what) TANDEM_RETURN_IF_ERROR(LtError((expr), (what)))

// The largest power of two <= 256 that divides the address.
int AlignmentOf(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  int al = 256;
  while (al > 1 && a % al != 0) al /= 2;
  return al;
}

// (BF16?, m, n, k, ldx, ldw, ldy, align x, align w, align y)
using PlanKey = std::tuple<bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int, int, int>;

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo;
  ~Plan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

class CublasLtBlas final : public Blas {
 public:
  CublasLtBlas(Device* device, cublasLtHandle_t handle, DeviceBuffer workspace,
               bool exact)
      : device_(device),
        handle_(handle),
        workspace_(std::move(workspace)),
        exact_(exact) {}
  ~CublasLtBlas() override {
    (void)device_->Synchronize();
    plans_.clear();
    cublasLtDestroy(handle_);
  }
  absl::string_view name() const override {
    return exact_ ? "cublaslt_split_bf16" : "cublaslt_bf16";
  }
  int64_t buffer_generation() const override { return moves_; }

  absl::Status GemmBf16(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw,
                        float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                        bool accumulate, Stream& stream) override {
    if (m == 0 || n == 0) return absl::OkStatus();
    if (k == 0) return ZeroK(y, ldy, m, n, accumulate, stream);
    const int64_t rows = exact_ ? 2 * m : m;
    TANDEM_RETURN_IF_ERROR(
        Grow(&x_bf16_, static_cast<size_t>(rows * k) * sizeof(uint16_t)));
    uint16_t* xb = x_bf16_.as<uint16_t>();
    if (!exact_) {
      if (const char* e = LaunchF32ToBf16Rows(x, ldx, xb, m, k, stream.native())) {
        return Internal("cuBLASLt gemm: converting X to BF16: ", e);
      }
      return Run(/*bf16=*/true, xb, k, w, ldw, y, ldy, m, n, k, accumulate, stream);
    }
    if (const char* e = LaunchF32ToBf16SplitRows(x, ldx, xb, m, k, stream.native())) {
      return Internal("cuBLASLt gemm: splitting X into BF16 hi/lo: ", e);
    }
    TANDEM_RETURN_IF_ERROR(
        Grow(&pair_, static_cast<size_t>(2 * m * n) * sizeof(float)));
    float* pair = pair_.as<float>();
    TANDEM_RETURN_IF_ERROR(Run(/*bf16=*/true, xb, k, w, ldw, pair, n, 2 * m, n, k,
                               /*accumulate=*/false, stream));
    if (const char* e =
            LaunchAddRowPairs(pair, m, n, y, ldy, accumulate, stream.native())) {
      return Internal("cuBLASLt gemm: adding the hi/lo products: ", e);
    }
    return absl::OkStatus();
  }

  absl::Status GemmF32(const float* x, int64_t ldx, const float* w, int64_t ldw,
                       float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                       bool accumulate, Stream& stream) override {
    if (m == 0 || n == 0) return absl::OkStatus();
    if (k == 0) return ZeroK(y, ldy, m, n, accumulate, stream);
    return Run(/*bf16=*/false, x, ldx, w, ldw, y, ldy, m, n, k, accumulate, stream);
  }

 private:
  absl::Status Grow(DeviceBuffer* b, size_t bytes) {
    if (b->bytes() >= bytes) return absl::OkStatus();
    // Not inside a capture: the old buffer may still be read by work queued
    // before it, and the allocation would be refused anyway.
    if (device_->compute_stream().capturing()) {
      return FailedPrecondition("cuBLASLt staging must grow to ", bytes,
                                " bytes during a stream capture");
    }
    b->Reset();  // freed in stream order after its last use
    ++moves_;
    TANDEM_ASSIGN_OR_RETURN(*b, DeviceBuffer::Allocate(device_, bytes));
    return absl::OkStatus();
  }

  // An empty sum: Y = 0, or Y unchanged when accumulating.
  absl::Status ZeroK(float* y, int64_t ldy, int64_t m, int64_t n, bool accumulate,
                     Stream& stream) {
    if (accumulate) return absl::OkStatus();
    const cudaError_t e =
        cudaMemset2DAsync(y, ldy * sizeof(float), 0, n * sizeof(float), m,
                          static_cast<cudaStream_t>(stream.native()));
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // reported here: not again at the next launch
      return Internal("gemm k=0 memset: ", cudaGetErrorString(e));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<const Plan*> PlanFor(bool bf16, const void* x, int64_t ldx,
                                      const void* w, int64_t ldw, const float* y,
                                      int64_t ldy, int64_t m, int64_t n, int64_t k) {
    const PlanKey key(bf16, m, n, k, ldx, ldw, ldy, AlignmentOf(x), AlignmentOf(w),
                      AlignmentOf(y));
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second.get();

    auto plan = std::make_unique<Plan>();
    const cudaDataType_t in_type = bf16 ? CUDA_R_16BF : CUDA_R_32F;
    TANDEM_LT(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
              "matmul desc");
    const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
    TANDEM_LT(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA,
                                             &trans_a, sizeof trans_a),
              "transa");
    TANDEM_LT(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB,
                                             &trans_b, sizeof trans_b),
              "transb");
    // Column-major: A = W as k x n (ld ldw), B = X as k x m (ld ldx), C = Y n x m.
    TANDEM_LT(cublasLtMatrixLayoutCreate(&plan->a, in_type, k, n, ldw), "layout A");
    TANDEM_LT(cublasLtMatrixLayoutCreate(&plan->b, in_type, k, m, ldx), "layout B");
    TANDEM_LT(cublasLtMatrixLayoutCreate(&plan->c, CUDA_R_32F, n, m, ldy), "layout C");

    cublasLtMatmulPreference_t pref = nullptr;
    TANDEM_LT(cublasLtMatmulPreferenceCreate(&pref), "preference");
    auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attr, auto value) {
      return cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof value);
    };
    cublasStatus_t s = set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                static_cast<uint64_t>(workspace_.bytes()));
    // The heuristic assumes 256-byte aligned pointers unless told otherwise.
    if (s == CUBLAS_STATUS_SUCCESS) {
      s = set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                   static_cast<uint32_t>(AlignmentOf(w)));
    }
    if (s == CUBLAS_STATUS_SUCCESS) {
      s = set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                   static_cast<uint32_t>(AlignmentOf(x)));
    }
    if (s == CUBLAS_STATUS_SUCCESS) {
      s = set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                   static_cast<uint32_t>(AlignmentOf(y)));
    }
    if (s == CUBLAS_STATUS_SUCCESS) {
      s = set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                   static_cast<uint32_t>(AlignmentOf(y)));
    }
    cublasLtMatmulHeuristicResult_t result = {};
    int found = 0;
    if (s == CUBLAS_STATUS_SUCCESS) {
      s = cublasLtMatmulAlgoGetHeuristic(handle_, plan->op, plan->a, plan->b, plan->c,
                                         plan->c, pref, 1, &result, &found);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    TANDEM_LT(s, "heuristic");
    if (found == 0) {
      return Internal("cuBLASLt: no algorithm for ", bf16 ? "bf16" : "f32", " gemm m ",
                      m, " n ", n, " k ", k, " (ldx ", ldx, ", ldw ", ldw, ", ldy ",
                      ldy, ")");
    }
    plan->algo = result.algo;
    const Plan* raw = plan.get();
    plans_.emplace(key, std::move(plan));
    return raw;
  }

  absl::Status Run(bool bf16, const void* x, int64_t ldx, const void* w, int64_t ldw,
                   float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                   bool accumulate, Stream& stream) {
    TANDEM_ASSIGN_OR_RETURN(const Plan* plan,
                            PlanFor(bf16, x, ldx, w, ldw, y, ldy, m, n, k));
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    TANDEM_LT(
        cublasLtMatmul(handle_, plan->op, &alpha, w, plan->a, x, plan->b, &beta, y,
                       plan->c, y, plan->c, &plan->algo, workspace_.data(),
                       workspace_.bytes(), static_cast<cudaStream_t>(stream.native())),
        "matmul");
    return absl::OkStatus();
  }

  Device* device_;
  cublasLtHandle_t handle_;
  DeviceBuffer workspace_;  // fixed: allocated once, so graphs may capture matmuls
  int64_t moves_ = 0;       // reallocations of the staging buffers (Grow)
  DeviceBuffer x_bf16_;
  DeviceBuffer pair_;  // exact mode: the [2m, n] hi and lo products
  bool exact_;
  absl::flat_hash_map<PlanKey, std::unique_ptr<Plan>> plans_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Blas>> CreateCublasLtBlas(Device* device, bool exact) {
  cublasLtHandle_t handle = nullptr;
  TANDEM_LT(cublasLtCreate(&handle), "create");
  auto workspace = DeviceBuffer::Allocate(device, kWorkspaceBytes);
  if (!workspace.ok()) {
    cublasLtDestroy(handle);
    return workspace.status();
  }
  return std::unique_ptr<Blas>(
      new CublasLtBlas(device, handle, std::move(workspace).value(), exact));
}

}  // namespace tandem::kernels::cuda
