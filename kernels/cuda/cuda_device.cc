#include "kernels/cuda/cuda_device.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace tandem::kernels::cuda {
namespace {

constexpr size_t kAlignment = 256;

absl::Status CudaError(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  const std::string msg = absl::StrCat("cuda: ", what, ": ", cudaGetErrorName(e), " (",
                                       cudaGetErrorString(e), ")");
  if (e == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

// An instantiated CUDA graph (cudaGraphExec_t) and the graph it came from.
class CudaGraph final : public Graph {
 public:
  CudaGraph(int ordinal, cudaGraph_t graph, cudaGraphExec_t exec, int64_t nodes)
      : ordinal_(ordinal), graph_(graph), exec_(exec), nodes_(nodes) {}
  ~CudaGraph() override {
    cudaSetDevice(ordinal_);
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
  }
  absl::Status Launch(Stream& stream) override {
    cudaSetDevice(ordinal_);
    return CudaError(cudaGraphLaunch(exec_, static_cast<cudaStream_t>(stream.native())),
                     "graph launch");
  }
  int64_t num_nodes() const override { return nodes_; }

 private:
  int ordinal_;
  cudaGraph_t graph_;
  cudaGraphExec_t exec_;
  int64_t nodes_;
};

// True while `s` captures (a query error counts as not capturing).
bool IsCapturing(cudaStream_t s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &status) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

absl::Status NotDuringCapture(absl::string_view what) {
  return absl::FailedPreconditionError(absl::StrCat(
      "cuda: ", what,
      " is not allowed while the stream is capturing (CUDA graph capture rules)"));
}

class CudaStream final : public Stream {
 public:
  CudaStream(int ordinal, cudaStream_t s, bool owned)
      : ordinal_(ordinal), stream_(s), owned_(owned) {}
  ~CudaStream() override {
    if (owned_ && stream_ != nullptr) {
      cudaSetDevice(ordinal_);
      cudaStreamDestroy(stream_);
    }
  }
  void* native() override { return stream_; }
  cudaStream_t get() const { return stream_; }
  absl::Status Synchronize() override {
    // Errors of kernels that faulted surface here (they are sticky on CUDA).
    return CudaError(cudaStreamSynchronize(stream_), "stream synchronize");
  }
  // cudaStreamCaptureModeThreadLocal: this thread may not make unsafe calls
  // (cudaMalloc, synchronous copies) during the capture; other threads may.
  absl::Status BeginCapture() override {
    cudaSetDevice(ordinal_);
    return CudaError(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal),
                     "begin stream capture");
  }
  absl::StatusOr<std::unique_ptr<Graph>> EndCapture() override {
    cudaSetDevice(ordinal_);
    cudaGraph_t graph = nullptr;
    absl::Status st =
        CudaError(cudaStreamEndCapture(stream_, &graph), "end stream capture");
    if (!st.ok()) {
      if (graph != nullptr) cudaGraphDestroy(graph);
      return st;
    }
    size_t nodes = 0;
    cudaGraphGetNodes(graph, nullptr, &nodes);
    cudaGraphExec_t exec = nullptr;
    st = CudaError(cudaGraphInstantiate(&exec, graph, 0), "graph instantiate");
    if (!st.ok()) {
      cudaGraphDestroy(graph);
      return st;
    }
    return std::unique_ptr<Graph>(
        new CudaGraph(ordinal_, graph, exec, static_cast<int64_t>(nodes)));
  }
  bool capturing() const override { return IsCapturing(stream_); }

 private:
  int ordinal_;
  cudaStream_t stream_;
  bool owned_;
};

class CudaEvent final : public Event {
 public:
  CudaEvent(int ordinal, cudaEvent_t e) : ordinal_(ordinal), event_(e) {}
  ~CudaEvent() override {
    cudaSetDevice(ordinal_);
    cudaEventDestroy(event_);
  }
  absl::Status Record(Stream& stream) override {
    return CudaError(
        cudaEventRecord(event_, static_cast<cudaStream_t>(stream.native())),
        "event record");
  }
  absl::Status MakeWait(Stream& stream) override {
    return CudaError(
        cudaStreamWaitEvent(static_cast<cudaStream_t>(stream.native()), event_, 0),
        "stream wait event");
  }
  absl::StatusOr<bool> Done() override {
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaSuccess) return true;
    if (e == cudaErrorNotReady) return false;
    return CudaError(e, "event query");
  }
  absl::Status Synchronize() override {
    return CudaError(cudaEventSynchronize(event_), "event synchronize");
  }

 private:
  int ordinal_;
  cudaEvent_t event_;
};

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, cudaMemPool_t pool, cudaStream_t compute)
      : ordinal_(ordinal),
        name_(absl::StrCat("cuda:", ordinal)),
        pool_(pool),
        compute_(ordinal, compute, /*owned=*/true) {}
  ~CudaDevice() override {
    cudaSetDevice(ordinal_);
    cudaStreamSynchronize(compute_.get());
    {
      absl::MutexLock lock(&mu_);
      for (auto& [p, bytes] : sizes_) cudaFreeAsync(p, compute_.get());
      sizes_.clear();
    }
    cudaStreamSynchronize(compute_.get());
    cudaMemPoolDestroy(pool_);
  }

  absl::string_view name() const override { return name_; }
  bool host_addressable() const override { return false; }
  absl::Status MakeCurrent() override {
    return CudaError(cudaSetDevice(ordinal_), "set device");
  }

  bool supports_graphs() const override { return true; }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    const size_t rounded =
        (std::max<size_t>(bytes, 1) + kAlignment - 1) / kAlignment * kAlignment;
    void* p = nullptr;
    cudaSetDevice(ordinal_);
    // An allocation on the compute stream would become a node of the graph.
    if (IsCapturing(compute_.get())) return NotDuringCapture("Allocate");
    const cudaError_t e = cudaMallocFromPoolAsync(&p, rounded, pool_, compute_.get());
    if (e != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it
      const DeviceMemoryInfo info = MemoryInfo();
      return absl::ResourceExhaustedError(absl::StrCat(
          name_, ": cannot allocate ", bytes, " bytes (", info.free_bytes, " of ",
          info.total_bytes, " bytes free): ", cudaGetErrorString(e)));
    }
    absl::MutexLock lock(&mu_);
    sizes_[p] = bytes;
    allocated_ += static_cast<int64_t>(bytes);
    return p;
  }

  void Free(void* p) override {
    if (p == nullptr) return;
    {
      absl::MutexLock lock(&mu_);
      auto it = sizes_.find(p);
      if (it == sizes_.end()) {
        std::fprintf(stderr, "%s: Free(%p) of memory it did not allocate\n",
                     name_.c_str(), p);
        std::abort();
      }
      allocated_ -= static_cast<int64_t>(it->second);
      sizes_.erase(it);
    }
    // Ordered after the work already queued on the compute stream.
    cudaSetDevice(ordinal_);
    if (IsCapturing(compute_.get())) {
      // cudaFreeAsync would become a graph node (a free at every replay). A
      // synchronous cudaFree is refused in capture and invalidates it, so the
      // capture fails as it must; the block stays allocated.
      std::fprintf(stderr, "%s: Free(%p) during stream capture: capture invalidated\n",
                   name_.c_str(), p);
      if (cudaFree(p) != cudaSuccess) cudaGetLastError();
      return;
    }
    cudaFreeAsync(p, compute_.get());
  }

  bool Owns(const void* p, size_t) const override {
    if (p == nullptr) return false;
    cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return attr.type == cudaMemoryTypeDevice && attr.device == ordinal_;
  }

  DeviceMemoryInfo MemoryInfo() const override {
    DeviceMemoryInfo info;
    cudaSetDevice(ordinal_);
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) cudaGetLastError();
    // The pool keeps freed memory reserved (release threshold): that is free to us.
    uint64_t reserved = 0, used = 0;
    cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemCurrent, &reserved);
    cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrUsedMemCurrent, &used);
    info.total_bytes = static_cast<int64_t>(total_b);
    info.free_bytes = static_cast<int64_t>(free_b) +
                      static_cast<int64_t>(reserved - std::min(used, reserved));
    absl::MutexLock lock(&mu_);
    info.allocated_bytes = allocated_;
    return info;
  }

  Stream& compute_stream() override { return compute_; }

  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    cudaSetDevice(ordinal_);
    cudaStream_t s = nullptr;
    absl::Status st = CudaError(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                                "stream create");
    if (!st.ok()) return st;
    return std::unique_ptr<Stream>(new CudaStream(ordinal_, s, /*owned=*/true));
  }

  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    cudaSetDevice(ordinal_);
    cudaEvent_t e = nullptr;
    absl::Status st =
        CudaError(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "event create");
    if (!st.ok()) return st;
    return std::unique_ptr<Event>(new CudaEvent(ordinal_, e));
  }

  absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes,
                            Stream* stream) override {
    if (IsCapturing(StreamOf(stream))) return NotDuringCapture("CopyToDevice");
    if (bytes == 0) return absl::OkStatus();
    return CudaError(
        cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, StreamOf(stream)),
        "copy to device");
  }
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes,
                          Stream* stream) override {
    cudaStream_t s = StreamOf(stream);
    if (IsCapturing(s)) return NotDuringCapture("CopyToHost");
    if (bytes == 0) return absl::OkStatus();
    absl::Status st =
        CudaError(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, s),
                  "copy to host");
    if (!st.ok()) return st;
    return CudaError(cudaStreamSynchronize(s), "copy to host (synchronize)");
  }
  absl::Status CopyToHostAsync(void* host_dst, const void* src, size_t bytes,
                               Stream* stream) override {
    cudaStream_t s = StreamOf(stream);
    if (IsCapturing(s)) return NotDuringCapture("CopyToHostAsync");
    if (bytes == 0) return absl::OkStatus();
    return CudaError(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, s),
                     "copy to host");
  }
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes,
                            Stream* stream) override {
    if (bytes == 0) return absl::OkStatus();
    return CudaError(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, StreamOf(stream)),
        "copy on device");
  }
  absl::Status Memset(void* dst, uint8_t byte, size_t bytes, Stream* stream) override {
    if (bytes == 0) return absl::OkStatus();
    return CudaError(cudaMemsetAsync(dst, byte, bytes, StreamOf(stream)), "memset");
  }

 private:
  cudaStream_t StreamOf(Stream* s) {
    return static_cast<cudaStream_t>(s == nullptr ? compute_.native() : s->native());
  }

  const int ordinal_;
  const std::string name_;
  cudaMemPool_t pool_;
  CudaStream compute_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<void*, size_t> sizes_ ABSL_GUARDED_BY(mu_);
  int64_t allocated_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(int ordinal) {
  int count = 0;
  const cudaError_t ce = cudaGetDeviceCount(&count);
  if (ce != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("cuda: no usable GPU (", cudaGetErrorString(ce), ")"));
  }
  if (ordinal < 0 || ordinal >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda: GPU ", ordinal, " not visible (", count, " visible)"));
  }
  absl::Status st = CudaError(cudaSetDevice(ordinal), "set device");
  if (!st.ok()) return st;
  cudaMemPoolProps props = {};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = ordinal;
  cudaMemPool_t pool = nullptr;
  st = CudaError(cudaMemPoolCreate(&pool, &props), "memory pool create");
  if (!st.ok()) return st;
  // Keep freed memory in the pool (no release at synchronisation points).
  uint64_t threshold = std::numeric_limits<uint64_t>::max();
  st = CudaError(
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold),
      "memory pool release threshold");
  if (!st.ok()) {
    cudaMemPoolDestroy(pool);
    return st;
  }
  cudaStream_t compute = nullptr;
  st = CudaError(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking),
                 "compute stream create");
  if (!st.ok()) {
    cudaMemPoolDestroy(pool);
    return st;
  }
  return std::unique_ptr<Device>(new CudaDevice(ordinal, pool, compute));
}

}  // namespace tandem::kernels::cuda
