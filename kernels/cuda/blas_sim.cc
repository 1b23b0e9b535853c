// The emulator's GEMM (blas.h): the CPU backend's exact kernels on the emulated
// device's memory, which is host memory.
#include <algorithm>
#include <memory>
#include <string>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cuda/blas.h"
#include "kernels/cuda/sim/simt.h"

namespace tandem::kernels::cuda {
namespace {

void Replayed(const absl::Status& s) {
  if (!s.ok()) cuda_sim::RecordLaunchError("host gemm: " + std::string(s.message()));
}

class SimBlas final : public Blas {
 public:
  explicit SimBlas(std::unique_ptr<Backend> cpu) : cpu_(std::move(cpu)) {}
  absl::string_view name() const override { return "host gemm"; }

  // On a capturing stream the call is recorded (arguments by value) and runs when
  // the graph is launched; a failure then is a launch error of the replay.
  absl::Status GemmBf16(const float* x, int64_t ldx, const uint16_t* w, int64_t ldw,
                        float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                        bool accumulate, Stream& stream) override {
    Backend* cpu = cpu_.get();
    if (cuda_sim::Record(stream.native(), [=] {
          Replayed(cpu->GemmBf16(x, ldx, w, ldw, y, ldy, m, n, k, accumulate));
        })) {
      return absl::OkStatus();
    }
    return cpu_->GemmBf16(x, ldx, w, ldw, y, ldy, m, n, k, accumulate);
  }
  absl::Status GemmF32(const float* x, int64_t ldx, const float* w, int64_t ldw,
                       float* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                       bool accumulate, Stream& stream) override {
    Backend* cpu = cpu_.get();
    if (cuda_sim::Record(stream.native(), [=] {
          Replayed(cpu->GemmF32(x, ldx, w, ldw, y, ldy, m, n, k, accumulate));
        })) {
      return absl::OkStatus();
    }
    return cpu_->GemmF32(x, ldx, w, ldw, y, ldy, m, n, k, accumulate);
  }

 private:
  std::unique_ptr<Backend> cpu_;
};

}  // namespace

std::unique_ptr<Blas> CreateSimBlas() {
  // Exact mode (fp32 activations, batch invariant), as the "cpu" backend: the best
  // ISA of this machine up to AVX-512. Two threads: the emulator itself is the
  // slow part, and tests run several at once.
  const CpuIsa isa = static_cast<CpuIsa>(
      std::min(static_cast<int>(ActiveIsa()), static_cast<int>(CpuIsa::kAvx512)));
  auto cpu = CreateCpuBackend(isa, /*threads=*/2, /*use_onednn=*/false);
  if (!cpu.ok()) {  // only if ActiveIsa() is not supported, which cannot happen
    cpu = CreateCpuBackend(CpuIsa::kGeneric, /*threads=*/2, /*use_onednn=*/false);
  }
  return std::make_unique<SimBlas>(std::move(cpu).value());
}

}  // namespace tandem::kernels::cuda
