// Where a backend's tensors live: device memory, streams, events and copies.
//
// Every pointer handed to a kernels::Backend op is memory of that backend's
// Device (the CPU backends: host memory; "cuda": GPU memory from cudaMallocAsync
// pools, or cudaMalloc for shareable memory, never managed memory; "cuda_sim":
// host memory that the emulated device tracks, so that a host pointer passed by
// mistake is caught). Only scalars in op arguments are host values. Ops are
// enqueued on the device's compute stream in call order; results are visible to
// the host after Synchronize() (or a CopyToHost, which synchronises).
#ifndef TANDEM_KERNELS_DEVICE_H_
#define TANDEM_KERNELS_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace tandem::kernels {

class Device;
class Stream;

// Device work captured from a stream (a CUDA graph): the launches, device copies
// and memsets enqueued between Stream::BeginCapture and EndCapture, with their
// arguments as they were (pointers included: a replay reads and writes the same
// device memory, so inputs that vary are written into fixed buffers before it).
class Graph {
 public:
  virtual ~Graph() = default;
  // Enqueues the captured work on `stream`, in capture order.
  virtual absl::Status Launch(Stream& stream) = 0;
  // Captured operations (kernel launches, copies, memsets, GEMM calls).
  virtual int64_t num_nodes() const = 0;
};

// An in-order queue of device work.
class Stream {
 public:
  virtual ~Stream() = default;
  // cudaStream_t on CUDA, the emulator's stream under cuda_sim, nullptr on host.
  virtual void* native() = 0;
  // Blocks until the work enqueued so far has run; returns the first device
  // error (a faulted kernel, a failed copy) since the last call.
  virtual absl::Status Synchronize() = 0;

  // Stream capture (Device::supports_graphs()). Between BeginCapture and
  // EndCapture the stream records work instead of running it; CUDA's capture
  // rules apply (cudaStreamCaptureModeThreadLocal): no Synchronize of the stream,
  // no CopyToDevice / CopyToHost on it, no Allocate / Free on the device while
  // its compute stream captures. Breaking one fails that call and EndCapture.
  // Those rules bind the capturing thread only: while the compute stream
  // captures, the other threads' Allocate / Free, synchronisations of it and
  // work they enqueue on it wait for the capture to end (kernels/capture_gate.h),
  // so they neither fail nor join the graph. Free on the capturing thread is
  // done after the capture, which fails.
  virtual absl::Status BeginCapture() {
    return absl::UnimplementedError("this device has no stream capture (graphs)");
  }
  virtual absl::StatusOr<std::unique_ptr<Graph>> EndCapture() {
    return absl::UnimplementedError("this device has no stream capture (graphs)");
  }
  virtual bool capturing() const { return false; }

  // Runs `fn` on the host in stream order: after the work enqueued before it,
  // before the work enqueued after it; while the stream captures, `fn` becomes
  // part of the graph and runs at each of its launches. The host and cuda_sim
  // streams run work as it is enqueued, so `fn` runs now (or at each replay). A
  // CUDA stream answers UNIMPLEMENTED: a host node would stall the GPU between
  // kernels, and the one user, a host communicator's collective in a captured
  // step (engine/runtime/model_runner.h), joins ranks of host-addressable
  // devices only (cuda ranks use NCCL, which enqueues on the stream itself).
  virtual absl::Status EnqueueHostFunction(std::function<void()> fn) {
    (void)fn;
    return absl::UnimplementedError("this stream does not run host functions");
  }
};

// A point in a stream's work, for ordering streams and for waiting.
class Event {
 public:
  virtual ~Event() = default;
  virtual absl::Status Record(Stream& stream) = 0;    // at the current end of `stream`
  virtual absl::Status MakeWait(Stream& stream) = 0;  // `stream` waits for the event
  virtual absl::StatusOr<bool> Done() = 0;            // non-blocking
  virtual absl::Status Synchronize() = 0;             // host waits
};

// One piece of a batched copy (Device::CopyBatchAsync).
struct CopyPiece {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
};
enum class CopyKind { kHostToDevice, kDeviceToHost, kDeviceToDevice };

struct DeviceMemoryInfo {
  int64_t total_bytes = 0;      // device capacity
  int64_t free_bytes = 0;       // what the device can still allocate now
  int64_t allocated_bytes = 0;  // live allocations of this Device object
};

class Device {
 public:
  virtual ~Device() = default;
  virtual absl::string_view name() const = 0;  // "host", "cuda:0", "cuda_sim"
  // True when host code may dereference device pointers (host and cuda_sim).
  virtual bool host_addressable() const = 0;
  // Makes this the calling thread's current device (cudaSetDevice on CUDA, where
  // kernel launches go to the thread's current device; a no-op elsewhere). A
  // thread that runs ops of several devices calls it before each one's work
  // (the TP executor's caller thread, engine/runtime/tp_executor.h).
  virtual absl::Status MakeCurrent() { return absl::OkStatus(); }

  // 256-byte aligned. ResourceExhausted names the size and what is free.
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  virtual void Free(void* p) = 0;  // nullptr is a no-op
  // True when [p, p + bytes) lies inside one live allocation of this device (the
  // check that catches host pointers handed to device ops; CUDA answers from
  // cudaPointerGetAttributes for the device, not the range).
  virtual bool Owns(const void* p, size_t bytes) const = 0;
  virtual DeviceMemoryInfo MemoryInfo() const = 0;

  // Shareable memory moves data device to device between two processes of one
  // host (a prefill and a decode worker's KV cache): the owner allocates it and
  // exports a range; the other process opens the handle and copies into or out
  // of the mapping with ordinary device copies. Ordering between the two
  // processes' work is the callers' (the memory carries no events).
  //
  // Device memory another process of this host can map (OpenShared): CUDA IPC
  // (cudaMalloc'd; the emulator: a memfd). Freed by Free(); a process that still
  // has it open must not use it after. Counted in MemoryInfo like Allocate.
  // UNIMPLEMENTED on devices without it (the host device).
  virtual absl::StatusOr<void*> AllocateShareable(size_t bytes);
  // A handle for [p, p + bytes) inside one live shareable allocation of this
  // device: opaque bytes (at most 256) that a process of the same host passes
  // to OpenShared. INVALID_ARGUMENT when the range is not inside one.
  virtual absl::StatusOr<std::string> ExportShareable(const void* p, size_t bytes);
  // Maps a range another process exported into this device's address space and
  // returns its start: this device's memory for copies (CopyOnDevice's dst and
  // src; Owns() true) until CloseShared. FAILED_PRECONDITION saying why when it
  // cannot: another host (the handle carries /proc/sys/kernel/random/boot_id),
  // this same process (CUDA refuses its own handles), the exporter gone, the GPU
  // not reachable from this one; INVALID_ARGUMENT for malformed bytes. Mappings
  // do not count in MemoryInfo.
  virtual absl::StatusOr<void*> OpenShared(absl::string_view handle);
  // Unmaps what OpenShared returned, once the copies using it have run (their
  // streams synchronised).
  virtual void CloseShared(void* mapped);  // nullptr: no-op

  // The stream every backend op runs on.
  virtual Stream& compute_stream() = 0;
  virtual absl::StatusOr<std::unique_ptr<Stream>> CreateStream() = 0;
  virtual absl::StatusOr<std::unique_ptr<Event>> CreateEvent() = 0;

  // Copies enqueued on `stream` (nullptr: the compute stream). Host memory must
  // stay valid until the stream has run the copy; CopyToHost returns after the
  // data is on the host.
  virtual absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes,
                                    Stream* stream = nullptr) = 0;
  virtual absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes,
                                  Stream* stream = nullptr) = 0;
  // As CopyToHost, but may return before the data is on the host: it is there
  // once `stream` (nullptr: the compute stream) is synchronised. Many small
  // copies then cost one wait (the KV's host staging copies a request's blocks
  // this way) where the host memory is pinned; into pageable memory, which the
  // host staging's shadows are, CUDA returns only once each copy is done (correct,
  // slower: pinning the shadows is not done yet, docs/kvtransfer.md). The
  // default is CopyToHost.
  virtual absl::Status CopyToHostAsync(void* host_dst, const void* src, size_t bytes,
                                       Stream* stream = nullptr) {
    return CopyToHost(host_dst, src, bytes, stream);
  }
  virtual absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes,
                                    Stream* stream = nullptr) = 0;
  // Many copies of one kind enqueued on `stream` (nullptr: the compute stream)
  // as one batch, in no order among themselves (pieces must not overlap);
  // done once the stream is synchronised, as CopyToHostAsync. CUDA: one
  // cudaMemcpyBatchAsync per batch, where a copy per piece would cost a call
  // each (the KV's block pieces number tens of thousands for a long prompt).
  // Device memory includes OpenShared mappings. The default: one
  // CopyToDevice / CopyToHostAsync / CopyOnDevice per piece.
  virtual absl::Status CopyBatchAsync(CopyKind kind, absl::Span<const CopyPiece> pieces,
                                      Stream* stream = nullptr);
  // A strided copy on the device, enqueued on `stream` (nullptr: the compute
  // stream) and captured into graphs like CopyOnDevice: `height` rows of `width`
  // bytes from src (rows `src_pitch` bytes apart) to dst (rows `dst_pitch` apart),
  // pitches >= width. CUDA: one cudaMemcpy2DAsync (the TP logits' re-order is a
  // copy per rank, not per (rank, row)). The default: a CopyOnDevice per row.
  virtual absl::Status CopyOnDevice2D(void* dst, size_t dst_pitch, const void* src,
                                      size_t src_pitch, size_t width, size_t height,
                                      Stream* stream = nullptr);
  virtual absl::Status Memset(void* dst, uint8_t byte, size_t bytes,
                              Stream* stream = nullptr) = 0;
  absl::Status Synchronize() { return compute_stream().Synchronize(); }
  // True when streams can be captured into Graphs ("cuda", "cuda_sim"; the host
  // device runs work when it is called and has nothing to capture).
  virtual bool supports_graphs() const { return false; }
};

// Owns one allocation of a Device (move-only).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Device* device, void* data, size_t bytes)
      : device_(device), data_(data), bytes_(bytes) {}
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      device_ = std::exchange(o.device_, nullptr);
      data_ = std::exchange(o.data_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Reset(); }

  static absl::StatusOr<DeviceBuffer> Allocate(Device* device, size_t bytes) {
    if (bytes == 0) return DeviceBuffer(device, nullptr, 0);
    absl::StatusOr<void*> p = device->Allocate(bytes);
    if (!p.ok()) return p.status();
    return DeviceBuffer(device, *p, bytes);
  }
  void Reset() {
    if (device_ != nullptr && data_ != nullptr) device_->Free(data_);
    data_ = nullptr;
    bytes_ = 0;
  }
  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }
  Device* device() const { return device_; }

 private:
  Device* device_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// The host "device" of the CPU backends: malloc'd memory, synchronous copies,
// no streams to speak of. Thread-safe.
std::unique_ptr<Device> CreateHostDevice();

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_DEVICE_H_
