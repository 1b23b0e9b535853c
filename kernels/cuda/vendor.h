// The one header every kernel source (.cu) includes first: it maps the GPU
// programming model onto the toolchain that compiles the file.
//
//   nvcc (__CUDACC__)        the CUDA runtime and built-ins, as they are
//   host C++ (TANDEM_CUDA_SIM) kernels/cuda/sim/simt.h: every CUDA thread a fiber,
//                            blocks run on the CPU (see that header)
//   hipcc (later)            the AMD build; warp size and intrinsics differ only here
//
// Kernel code uses, besides the ordinary CUDA built-ins (threadIdx, blockIdx,
// blockDim, gridDim, __syncthreads, __shfl_*_sync, __ballot_sync, atomicAdd, ...):
//   TANDEM_LAUNCH(kernel, grid, block, smem_bytes, stream, args...)   instead of <<<>>>
//   TANDEM_SHARED(T, name, dims)   instead of `__shared__ T name dims` (dims
//                                  may be empty; the emulator poisons it per block)
//   TANDEM_DYNAMIC_SMEM(T, name)   instead of `extern __shared__ T name[]`
//   tandem::gpu::LaunchError()     instead of cudaGetLastError(): nullptr or a message
//   tandem::gpu::kWarpSize, Bf16ToF32 / F32ToBf16 (uint16_t bit patterns, RNE)
// and, for PTX instructions, the wrappers of kernels/cuda/ptx.h.
#ifndef TANDEM_KERNELS_CUDA_VENDOR_H_
#define TANDEM_KERNELS_CUDA_VENDOR_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_runtime.h>

#define TANDEM_GPU_NVCC 1
#define TANDEM_LAUNCH(kernel, grid, block, smem, stream, ...) \
  kernel<<<(grid), (block), (smem), static_cast<cudaStream_t>(stream)>>>(__VA_ARGS__)
#define TANDEM_SHARED(T, name, dims) __shared__ T name dims
#define TANDEM_DYNAMIC_SMEM(T, name)                           \
  extern __shared__ __align__(16) unsigned char name##_raw_[]; \
  T* name = reinterpret_cast<T*>(name##_raw_)

namespace tandem::gpu {
inline const char* LaunchError() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}
// Opt a kernel into more than 48 KiB of dynamic shared memory.
template <typename Kernel>
inline const char* AllowDynamicSmem(Kernel kernel, size_t bytes) {
  const cudaError_t e = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}
}  // namespace tandem::gpu

#elif defined(TANDEM_CUDA_SIM)
#include "kernels/cuda/sim/simt.h"

#define TANDEM_LAUNCH(kernel, grid, block, smem, stream, ...)                          \
  ::cuda_sim::Launch(#kernel, reinterpret_cast<const void*>(&kernel), (grid), (block), \
                     (smem), (stream), [=]() { kernel(__VA_ARGS__); })
#define TANDEM_SHARED(T, name, dims) \
  static thread_local T name dims;   \
  ::cuda_sim::PoisonShared(&name)
#define TANDEM_DYNAMIC_SMEM(T, name) \
  T* name = reinterpret_cast<T*>(::cuda_sim::DynamicShared())

namespace tandem::gpu {
inline const char* LaunchError() { return ::cuda_sim::TakeLaunchError(); }
template <typename Kernel>
inline const char* AllowDynamicSmem(Kernel kernel, size_t bytes) {
  return ::cuda_sim::AllowDynamicSmemFor(reinterpret_cast<const void*>(kernel), bytes);
}
}  // namespace tandem::gpu

#else
#error "kernels/cuda/vendor.h: compile with nvcc, or as host C++ with -DTANDEM_CUDA_SIM"
#endif

namespace tandem::gpu {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

__host__ __device__ __forceinline__ float Bf16ToF32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even; NaN stays a (quiet) NaN.
__host__ __device__ __forceinline__ uint16_t F32ToBf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Two BF16 in one 32-bit register (the lower index in the low half), as mma wants.
__host__ __device__ __forceinline__ uint32_t PackBf16x2(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int o = kWarpSize / 2; o > 0; o >>= 1)
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

}  // namespace tandem::gpu

#endif  // TANDEM_KERNELS_CUDA_VENDOR_H_
