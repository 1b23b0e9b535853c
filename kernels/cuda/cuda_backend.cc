// GpuBackend: construction, the op table, errors, scratch and the dense GEMMs.
// The op families' methods are in backend_<family>.cc.
#include "kernels/cuda/cuda_backend.h"

#include <array>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda/blas.h"
#include "kernels/cuda/device_errors.h"
#include "kernels/op_checks.h"

#if defined(TANDEM_GPU_BACKEND_CUDA)
#include <cuda_runtime.h>
#else
#include "kernels/cuda/sim/simt.h"
#endif

namespace tandem::kernels::cuda {
namespace {

// The ops whose GpuBackend method is implemented (Supports). An op family flips
// its entries here when its backend_<family>.cc methods land; the conformance
// suite skips the tests of ops that are still false, and a model that needs one
// fails at load with the op's name.
constexpr std::array<std::pair<Op, bool>, kNumOps> kImplemented = {{
    {Op::kGemmBf16, true},
    {Op::kGemmF32, true},
    // elementwise (backend_elementwise.cc)
    {Op::kRmsNorm, true},
    {Op::kL2NormHeads, true},
    {Op::kSituGlu, true},
    {Op::kMulSigmoid, true},
    {Op::kAddInPlace, true},
    {Op::kEmbeddingGather, true},
    {Op::kCausalConv1dSilu, true},
    {Op::kKdaGates, true},
    {Op::kKdaOutputGate, true},
    {Op::kPagedCacheWrite, true},
    {Op::kAttnResMix, true},
    // kda (backend_kda.cc)
    {Op::kKdaRecurrent, true},
    {Op::kKdaChunked, true},
    // mla (backend_mla.cc)
    {Op::kMlaAttentionExpanded, true},
    {Op::kMlaAttentionAbsorbed, true},
    // moe (backend_moe.cc)
    {Op::kRouterTopK, true},
    {Op::kMoeMxfp4, true},
    // checksum (backend_checksum.cc)
    {Op::kChunkHashes, true},
    // vision tower (backend_vision.cc)
    {Op::kRope2d, true},
    {Op::kGelu, true},
    {Op::kVisionAttention, true},
    {Op::kMerge2x2, true},
}};

constexpr std::array<bool, kNumOps> SupportTable() {
  std::array<bool, kNumOps> t{};
  for (const auto& [op, on] : kImplemented) t[static_cast<int>(op)] = on;
  return t;
}
constexpr std::array<bool, kNumOps> kSupported = SupportTable();

// Elements spanned by `rows` rows of `n` with row stride `ld` (0 when empty).
size_t Span(int64_t rows, int64_t n, int64_t ld) {
  if (rows <= 0 || n <= 0) return 0;
  return static_cast<size_t>((rows - 1) * ld + n);
}

constexpr size_t kErrorWordBytes = 256;

}  // namespace

GpuBackend::GpuBackend(std::string name, std::unique_ptr<Device> device,
                       std::unique_ptr<Blas> blas, GpuPrecision precision)
    : name_(std::move(name)),
      device_(std::move(device)),
      blas_(std::move(blas)),
      precision_(precision) {
  // The factories check error_word() != nullptr (a constructor cannot fail).
  auto buffer = DeviceBuffer::Allocate(device_.get(), kErrorWordBytes);
  if (!buffer.ok()) return;
  if (!device_->Memset(buffer->data(), 0, kErrorWordBytes).ok()) return;
  if (!device_->Synchronize().ok()) return;
  error_buffer_ = std::move(buffer).value();
  error_word_ = error_buffer_.as<int32_t>();
}

GpuBackend::~GpuBackend() {
  // Let queued work finish before its buffers go.
  (void)device_->Synchronize();
  scratch_.Reset();
  error_buffer_.Reset();
  blas_.reset();
}

bool GpuBackend::Supports(Op op) const {
  const int i = static_cast<int>(op);
  return i >= 0 && i < kNumOps && kSupported[i];
}

absl::Status GpuBackend::Synchronize() {
  TANDEM_RETURN_IF_ERROR(Annotate(device_->Synchronize(), name_));
  if (error_word_ == nullptr) return Internal(name_, ": no device error word");
  int32_t code = 0;
  TANDEM_RETURN_IF_ERROR(device_->CopyToHost(&code, error_word_, sizeof code));
  if (code == kDeviceOk) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(device_->Memset(error_word_, 0, sizeof code));
  TANDEM_RETURN_IF_ERROR(device_->Synchronize());
  return InvalidArgument(name_, ": a kernel reported: ", DeviceErrorName(code),
                         " (device error ", code,
                         "); the outputs of that op are "
                         "unspecified");
}

absl::StatusOr<void*> GpuBackend::Scratch(size_t bytes) {
  if (bytes <= scratch_.bytes() && scratch_.data() != nullptr) return scratch_.data();
  // Grow in 1 MiB steps. The old buffer's free is ordered after the work queued on
  // the compute stream (cudaFreeAsync on CUDA; the emulator runs work at once).
  constexpr size_t kStep = size_t{1} << 20;
  const size_t want = (std::max<size_t>(bytes, 1) + kStep - 1) / kStep * kStep;
  // Not inside a capture: the old buffer may still be read by work queued before
  // it, and the allocation would be refused anyway.
  if (device_->compute_stream().capturing()) {
    return FailedPrecondition(name_, ": scratch must grow to ", want,
                              " bytes during a stream capture");
  }
  scratch_.Reset();
  ++scratch_moves_;
  TANDEM_ASSIGN_OR_RETURN(scratch_, DeviceBuffer::Allocate(device_.get(), want));
  return scratch_.data();
}

int64_t GpuBackend::workspace_generation() const {
  return scratch_moves_ + blas_->buffer_generation();
}

absl::Status GpuBackend::Launched(const char* what) {
#if defined(TANDEM_GPU_BACKEND_CUDA)
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return absl::OkStatus();
  return Internal(name_, ": launching ", what, " failed: ", cudaGetErrorString(e));
#else
  const char* e = ::cuda_sim::TakeLaunchError();
  if (e == nullptr) return absl::OkStatus();
  return Internal(name_, ": launching ", what, " failed: ", e);
#endif
}

absl::Status GpuBackend::CheckResident(const void* p, size_t bytes,
                                       const char* what) const {
  // Only where the answer is cheap (a range lookup); CUDA would need a driver
  // call per pointer.
  if (bytes == 0 || !device_->host_addressable()) return absl::OkStatus();
  if (device_->Owns(p, bytes)) return absl::OkStatus();
  return FailedPrecondition(
      name_, ": ", what, " [", absl::Hex(reinterpret_cast<uintptr_t>(p)), ", +", bytes,
      " bytes) is not memory of device ", device_->name(),
      " (every op pointer must be device memory: kernels/device.h)");
}

absl::Status GpuBackend::GemmBf16(const float* x, int64_t ldx, const uint16_t* w,
                                  int64_t ldw, float* y, int64_t ldy, int64_t m,
                                  int64_t n, int64_t k, bool accumulate) {
  TANDEM_RETURN_IF_ERROR(CheckGemm(x, ldx, w, ldw, y, ldy, m, n, k));
  if (m == 0 || n == 0) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(CheckResident(x, Span(m, k, ldx) * sizeof(float), "gemm x"));
  TANDEM_RETURN_IF_ERROR(
      CheckResident(w, Span(n, k, ldw) * sizeof(uint16_t), "gemm w"));
  TANDEM_RETURN_IF_ERROR(CheckResident(y, Span(m, n, ldy) * sizeof(float), "gemm y"));
  return blas_->GemmBf16(x, ldx, w, ldw, y, ldy, m, n, k, accumulate,
                         device_->compute_stream());
}

absl::Status GpuBackend::GemmF32(const float* x, int64_t ldx, const float* w,
                                 int64_t ldw, float* y, int64_t ldy, int64_t m,
                                 int64_t n, int64_t k, bool accumulate) {
  TANDEM_RETURN_IF_ERROR(CheckGemm(x, ldx, w, ldw, y, ldy, m, n, k));
  if (m == 0 || n == 0) return absl::OkStatus();
  TANDEM_RETURN_IF_ERROR(CheckResident(x, Span(m, k, ldx) * sizeof(float), "gemm x"));
  TANDEM_RETURN_IF_ERROR(CheckResident(w, Span(n, k, ldw) * sizeof(float), "gemm w"));
  TANDEM_RETURN_IF_ERROR(CheckResident(y, Span(m, n, ldy) * sizeof(float), "gemm y"));
  return blas_->GemmF32(x, ldx, w, ldw, y, ldy, m, n, k, accumulate,
                        device_->compute_stream());
}

}  // namespace tandem::kernels::cuda
