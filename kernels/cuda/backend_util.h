// Helpers the GpuBackend op families share (backend_elementwise.cc,
// backend_moe.cc, backend_vision.cc): argument extents, the residency check of
// a call's ranges, and a launcher's result as a status.
#ifndef TANDEM_KERNELS_CUDA_BACKEND_UTIL_H_
#define TANDEM_KERNELS_CUDA_BACKEND_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "absl/status/status.h"
#include "common/status.h"
#include "kernels/cuda/cuda_backend.h"

namespace tandem::kernels::cuda::backend_util {

// Elements spanned by `rows` rows of `width` with row stride ld (0 when empty).
inline size_t Span(int64_t rows, int64_t width, int64_t ld) {
  return rows <= 0 || width <= 0 ? 0 : static_cast<size_t>((rows - 1) * ld + width);
}

struct Range {
  const void* p;
  size_t bytes;
  const char* what;
};

// FailedPrecondition unless every range is memory of the backend's device (checked
// where that is cheap: cuda_sim).
inline absl::Status Resident(const GpuBackend& be,
                             std::initializer_list<Range> ranges) {
  for (const Range& r : ranges) {
    TANDEM_RETURN_IF_ERROR(be.CheckResident(r.p, r.bytes, r.what));
  }
  return absl::OkStatus();
}

// The launchers return the launch error themselves (they already took it from
// the runtime, so Launched alone would miss it); Launched then reports any other.
inline absl::Status Done(GpuBackend* be, const char* launch_error, const char* what) {
  if (launch_error != nullptr) {
    return Internal(be->name(), ": launching ", what, " failed: ", launch_error);
  }
  return be->Launched(what);
}

inline constexpr size_t kF = sizeof(float);

}  // namespace tandem::kernels::cuda::backend_util

#endif  // TANDEM_KERNELS_CUDA_BACKEND_UTIL_H_
