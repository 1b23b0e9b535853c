// A CUDA GPU as a kernels::Device (kernels/device.h). --config=cuda only.
//
// Memory: cudaMallocFromPoolAsync from a pool of this device's own (release
// threshold: keep everything, so steady-state allocations never reach the driver),
// ordered on the compute stream; never managed memory. Streams are non-blocking
// (cudaStreamNonBlocking: no implicit sync with the legacy default stream).
// Copies are cudaMemcpyAsync on the given stream; CopyToHost then waits for it.
// Graphs: stream capture in cudaStreamCaptureModeThreadLocal, EndCapture
// instantiates (cudaGraphInstantiate), Graph::Launch is cudaGraphLaunch. Allocate
// and Free while the compute stream captures, and host copies on a capturing
// stream, are errors (Free's invalidates the capture).
// Shareable memory (Device::AllocateShareable): cudaMalloc'd, in 2 MiB units,
// exported with cudaIpcGetMemHandle and opened with cudaIpcOpenMemHandle
// (cudaIpcMemLazyEnablePeerAccess: another GPU of the host if peer access works);
// ranges of one allocation opened in a process share one mapping.
#ifndef TANDEM_KERNELS_CUDA_CUDA_DEVICE_H_
#define TANDEM_KERNELS_CUDA_CUDA_DEVICE_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/device.h"

namespace tandem::kernels::cuda {

// GPU `ordinal`. FailedPrecondition when no such GPU is visible (or no driver).
absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(int ordinal);

}  // namespace tandem::kernels::cuda

#endif  // TANDEM_KERNELS_CUDA_CUDA_DEVICE_H_
