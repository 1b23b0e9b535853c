// The emulated device of the "cuda_sim" backend: host memory that the device
// tracks, so that a host pointer handed to a device op is caught (Owns), with
// CUDA's allocation alignment (256 bytes) and a capacity of its own so that
// out-of-memory paths are testable. Streams are distinct objects whose native()
// handle cuda_sim::Launch accepts; the emulator runs a launch when it is enqueued,
// so copies are synchronous and events are always complete. Thread-safe.
//
// Stream capture (Graph): a capturing stream records each kernel launch (the
// launch lambda's arguments by value), device copy, memset and host GEMM as a
// closure; Graph::Launch replays them in order. CUDA's capture rules are enforced,
// so code that would fail under real capture fails here: Allocate / Free while
// the compute stream captures, CopyToDevice / CopyToHost / Synchronize on a
// capturing stream are errors and invalidate the capture (EndCapture fails). A
// host dereference of device memory during capture cannot be caught (the memory
// is host memory); the GpuBackend's ops make none.
//
// Shareable memory (Device::AllocateShareable) is a memfd mapped MAP_SHARED,
// zero-filled, its fd open while it lives; another process's OpenShared maps it
// through /proc/<pid>/fd/<fd> (the handle names the memfd's inode, so a freed
// allocation's reused fd number is refused) and Owns only the exported range.
#ifndef TANDEM_KERNELS_CUDA_SIM_SIM_DEVICE_H_
#define TANDEM_KERNELS_CUDA_SIM_SIM_DEVICE_H_

#include <cstdint>
#include <memory>

#include "kernels/device.h"

namespace tandem::kernels::cuda {

// The emulated device's memory is host memory, committed when allocated (0xFF
// filled), and a worker on cuda_sim sizes its KV cache to 0.9 of it
// (--gpu_memory_utilization): 2 GiB keeps a prefill and a decode worker (and
// the tests that start them) within what a CI host has, and is still far more
// than the tiny model needs (42 MiB of weights, ~170 MiB for a 256-token step
// with its logits). $TANDEM_SIM_DEVICE_BYTES emulates another size (a real
// GPU's, say, to check a sizing).
inline constexpr int64_t kDefaultSimDeviceBytes = int64_t{2} << 30;  // 2 GiB

// capacity_bytes < 0: $TANDEM_SIM_DEVICE_BYTES (a byte count) if set, else
// kDefaultSimDeviceBytes. New allocations are filled with 0xFF bytes (fp32 NaN),
// as uninitialised GPU memory holds garbage.
std::unique_ptr<Device> CreateSimDevice(int64_t capacity_bytes = -1);

}  // namespace tandem::kernels::cuda

#endif  // TANDEM_KERNELS_CUDA_SIM_SIM_DEVICE_H_
