// cuda_sim: CUDA kernels compiled as host C++ and run on the CPU.
//
// Included (through kernels/cuda/vendor.h) by every .cu source when it is built
// with the host compiler and -DTANDEM_CUDA_SIM. The emulation keeps CUDA's
// execution model, not just its syntax, so that the bugs a GPU would show show
// here too:
//   - each CUDA thread of a block is a fiber with its own stack; the threads of a
//     block run on one OS thread, one at a time, and switch only at cooperative
//     points: __syncthreads, every warp collective (__shfl_*_sync, votes,
//     __syncwarp, the PTX warp instructions of kernels/cuda/ptx.h), atomics,
//     __threadfence;
//   - the order in which runnable fibers go, and the order of the blocks of a
//     grid, are drawn from a seed (SetSeed, or $TANDEM_SIM_SEED), so a missing
//     barrier or a race between warps gives a wrong result under some seeds;
//   - static shared memory (TANDEM_SHARED, kernels/cuda/vendor.h) is a
//     function-local `static thread_local` (blocks run one after another on one
//     OS thread), filled with a poison pattern by the first thread of each block
//     that reaches its declaration, so a block never reads what an earlier block
//     left there; a block's static shared bytes over 48 KiB (ptxas refuses
//     them), or static and dynamic together over the opt-in limit, fail the
//     launch; dynamic shared memory is a heap buffer of exactly the launch's
//     size (ASan sees overruns), poisoned at the start of each block;
//   - warp collectives check CUDA's rules: every lane named in the mask must reach
//     the same collective with the same mask; a lane reading from a lane outside
//     the mask, a barrier that can never complete (a deadlock), or a launch over
//     the device limits ends the launch with an error (TakeLaunchError), as a GPU
//     would report cudaErrorLaunchFailure.
// Limits (docs/ARCHITECTURE.md, "The CUDA emulation"): no memory-model effects
// beyond interleaving at cooperative points (plain loads and stores between two
// points are atomic with respect to other threads); no timing; a launch runs to
// completion when it is enqueued (streams are in order and synchronous).
#ifndef TANDEM_KERNELS_CUDA_SIM_SIMT_H_
#define TANDEM_KERNELS_CUDA_SIM_SIMT_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1)
      : x(x_), y(y_), z(z_) {}
};
using uint3 = dim3;

namespace cuda_sim {

// A cp.async copy issued but not yet waited for (kernels/cuda/ptx.h).
struct PendingCopy {
  void* dst = nullptr;
  unsigned char data[16];
  int group = 0;
};

struct ThreadState {
  dim3 thread_idx, block_idx, block_dim, grid_dim;
  int linear =
      0;         // threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)
  int lane = 0;  // linear % 32
  int warp = 0;  // linear / 32
  std::vector<PendingCopy> cp_async;  // issued, not yet waited for
  int cp_async_group = 0;             // the open (uncommitted) group
};

// The running CUDA thread (valid only inside a kernel).
ThreadState& Self();

// Runs `body` once per thread of every block of `grid` (see the header comment).
// On a launch error the error is recorded for TakeLaunchError and the remaining
// blocks are not run.
void Launch(const char* name, const void* kernel, dim3 grid, dim3 block,
            size_t dynamic_smem, void* stream, const std::function<void()>& body);
// nullptr, or the first error since the last call (then cleared).
const char* TakeLaunchError();
// Opt-in beyond 48 KiB of dynamic shared memory (up to 227 KiB, Hopper).
const char* AllowDynamicSmemFor(const void* kernel, size_t bytes);
const char* CheckDynamicSmemLimit(size_t bytes);
void* DynamicShared();
// TANDEM_SHARED's: fills `bytes` at p with 0xFF once per block (the first
// thread of the block to declare it) and counts them against the block's
// shared memory limits.
void PoisonSharedBytes(void* p, size_t bytes);
template <typename T>
inline void PoisonShared(T* p) {
  static_assert(std::is_trivially_copyable_v<std::remove_all_extents_t<T>>,
                "__shared__ storage must be trivially copyable");
  PoisonSharedBytes(static_cast<void*>(p), sizeof(T));
}

// ---- Stream capture (CUDA graphs, kernels/device.h Graph) ---------------------
// While `stream` (a native stream handle) captures, Launch on it checks the launch
// configuration (the errors a GPU reports at launch) and records the launch, its
// arguments by value as the kernel lambda holds them, instead of running it;
// Record adds other work (device copies, memsets, host GEMMs). EndCapture hands
// the recorded work back in order, or the first capture-rule violation.
struct Captured {
  std::vector<std::function<void()>> ops;
  std::string error;  // empty: the capture is valid
};
// False (and nothing changes) when `stream` already captures.
bool BeginCapture(void* stream);
bool IsCapturing(void* stream);
// Appends `op` when `stream` captures (true), else returns false.
bool Record(void* stream, std::function<void()> op);
// Marks the capture on `stream` invalid with `why` (kept: the first one).
void InvalidateCapture(void* stream, const std::string& why);
Captured EndCapture(void* stream);
// Records a launch-class error from work outside a kernel (a replayed host GEMM);
// TakeLaunchError returns it.
void RecordLaunchError(const std::string& message);

// Scheduling seed (0 = in order, no shuffling). Default: $TANDEM_SIM_SEED or 1.
void SetSeed(uint64_t seed);
uint64_t Seed();

struct Stats {
  uint64_t launches = 0, blocks = 0, threads = 0, switches = 0;
};
Stats GetStats();

// ---- Cooperative points (used by the built-ins below) -----------------------
void SyncThreads();
int SyncThreadsReduce(int value, int op);  // op 0: count, 1: and, 2: or
// Every lane of `mask` contributes `bytes` (<= 64) at the same collective; returns
// the 32 lanes' slots of 64 bytes each (lane l's contribution at l * 64). The
// slots stay valid until this lane's next warp collective.
const unsigned char* WarpExchange(unsigned mask, const void* mine, size_t bytes);
void Yield();
// A coin flip from the block's seeded scheduler stream (false when the seed is 0:
// in-order runs are deterministic).
bool RandomBit();
// Records a kernel error (like a device-side fault) for the current launch.
void Fault(const char* what);
unsigned LiveLanes();

template <typename T>
T WarpShuffle(unsigned mask, T v, int src_lane_or_neg) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 64);
  const unsigned char* all = WarpExchange(mask, &v, sizeof v);
  if (src_lane_or_neg < 0) return v;  // own value (out of the segment)
  if (((mask >> src_lane_or_neg) & 1u) == 0) {
    Fault("warp shuffle reads a lane outside the mask");
    return v;
  }
  T out;
  std::memcpy(&out, all + 64 * src_lane_or_neg, sizeof out);
  return out;
}

}  // namespace cuda_sim

// ---- CUDA's vector types -------------------------------------------------------
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) int2 {
  int x, y;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
  return {x, y, z, w};
}

// ---- Qualifiers and built-in variables ----------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Kernels declare static shared memory with TANDEM_SHARED (vendor.h), which
// poisons it per block; a plain __shared__ would not, so it does not compile.
#define __shared__ use_TANDEM_SHARED_for_static_shared_memory
#define __constant__ static
#define __grid_constant__

#define threadIdx (::cuda_sim::Self().thread_idx)
#define blockIdx (::cuda_sim::Self().block_idx)
#define blockDim (::cuda_sim::Self().block_dim)
#define gridDim (::cuda_sim::Self().grid_dim)
#define warpSize 32

// ---- Synchronisation ------------------------------------------------------------
inline void __syncthreads() { ::cuda_sim::SyncThreads(); }
inline int __syncthreads_count(int p) {
  return ::cuda_sim::SyncThreadsReduce(p != 0, 0);
}
inline int __syncthreads_and(int p) { return ::cuda_sim::SyncThreadsReduce(p != 0, 1); }
inline int __syncthreads_or(int p) { return ::cuda_sim::SyncThreadsReduce(p != 0, 2); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::cuda_sim::WarpExchange(mask, nullptr, 0);
}
inline void __threadfence() { ::cuda_sim::Yield(); }
inline void __threadfence_block() { ::cuda_sim::Yield(); }
[[noreturn]] void __trap();
inline unsigned __activemask() { return ::cuda_sim::LiveLanes(); }

// ---- Warp shuffles and votes (width: a power of two <= 32) -----------------------
template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const int lane = ::cuda_sim::Self().lane;
  return ::cuda_sim::WarpShuffle(mask, v, (lane & ~(width - 1)) + (src & (width - 1)));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const int lane = ::cuda_sim::Self().lane;
  const int src = lane ^ lane_mask;
  return ::cuda_sim::WarpShuffle(mask, v, (src / width > lane / width) ? -1 : src);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = ::cuda_sim::Self().lane;
  return ::cuda_sim::WarpShuffle(
      mask, v, (lane & (width - 1)) < static_cast<int>(delta) ? -1 : lane - int(delta));
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = ::cuda_sim::Self().lane;
  return ::cuda_sim::WarpShuffle(
      mask, v, (lane & (width - 1)) + int(delta) >= width ? -1 : lane + int(delta));
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  const int mine = pred != 0;
  const unsigned char* all = ::cuda_sim::WarpExchange(mask, &mine, sizeof mine);
  unsigned out = 0;
  for (int l = 0; l < 32; ++l) {
    int p;
    std::memcpy(&p, all + 64 * l, sizeof p);
    if (((mask >> l) & 1u) && p) out |= 1u << l;
  }
  return out;
}
inline int __any_sync(unsigned mask, int pred) {
  return __ballot_sync(mask, pred) != 0;
}
inline int __all_sync(unsigned mask, int pred) {
  return __ballot_sync(mask, pred) == mask;
}

// ---- Atomics (blocks of one launch run on one OS thread; the builtins keep them
// correct should that change) ------------------------------------------------------
template <typename T>
inline T __sim_atomic_add(T* p, T v) {
  T old;
  if constexpr (std::is_floating_point_v<T>) {
    old = *p;
    *p = old + v;
  } else {
    old = __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
  }
  ::cuda_sim::Yield();
  return old;
}
inline float atomicAdd(float* p, float v) { return __sim_atomic_add(p, v); }
inline double atomicAdd(double* p, double v) { return __sim_atomic_add(p, v); }
inline int atomicAdd(int* p, int v) { return __sim_atomic_add(p, v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __sim_atomic_add(p, v); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return __sim_atomic_add(p, v);
}
template <typename T>
inline T __sim_atomic_update(T* p, T v, int op) {
  const T old = *p;
  *p = op == 0 ? std::max(old, v) : op == 1 ? std::min(old, v) : v;
  ::cuda_sim::Yield();
  return old;
}
inline int atomicMax(int* p, int v) { return __sim_atomic_update(p, v, 0); }
inline unsigned atomicMax(unsigned* p, unsigned v) {
  return __sim_atomic_update(p, v, 0);
}
inline int atomicMin(int* p, int v) { return __sim_atomic_update(p, v, 1); }
inline unsigned atomicMin(unsigned* p, unsigned v) {
  return __sim_atomic_update(p, v, 1);
}
inline int atomicExch(int* p, int v) { return __sim_atomic_update(p, v, 2); }
inline unsigned atomicExch(unsigned* p, unsigned v) {
  return __sim_atomic_update(p, v, 2);
}
inline float atomicExch(float* p, float v) { return __sim_atomic_update(p, v, 2); }
template <typename T>
inline T __sim_atomic_cas(T* p, T compare, T v) {
  const T old = *p;
  if (old == compare) *p = v;
  ::cuda_sim::Yield();
  return old;
}
inline int atomicCAS(int* p, int c, int v) { return __sim_atomic_cas(p, c, v); }
inline unsigned atomicCAS(unsigned* p, unsigned c, unsigned v) {
  return __sim_atomic_cas(p, c, v);
}
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long c,
                                    unsigned long long v) {
  return __sim_atomic_cas(p, c, v);
}

// ---- Device math and bit built-ins --------------------------------------------------
using std::isfinite;  // CUDA's are global
using std::isinf;
using std::isnan;
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
// Round-to-nearest arithmetic the compiler may not contract (host: the default
// rounding, and these are separate operations).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __saturatef(float x) { return std::min(1.0f, std::max(0.0f, x)); }
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline int __float_as_int(float f) {
  int i;
  std::memcpy(&i, &f, 4);
  return i;
}
inline float __uint_as_float(unsigned i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned i;
  std::memcpy(&i, &f, 4);
  return i;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(unsigned x) { return x == 0 ? 32 : __builtin_clz(x); }
inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

#endif  // TANDEM_KERNELS_CUDA_SIM_SIMT_H_
