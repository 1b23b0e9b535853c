#include "kernels/cuda/cuda_device.h"

#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "kernels/capture_gate.h"
#include "kernels/cuda/shareable_handle.h"

namespace tandem::kernels::cuda {
namespace {

constexpr size_t kAlignment = 256;
// Shareable allocations are rounded to the driver's granularity for IPC memory.
constexpr size_t kShareableGranularity = size_t{2} << 20;  // 2 MiB

// What a "cuda" handle carries beyond the common header (shareable_handle.h):
// the driver's IPC handle of the allocation and the exporting GPU's identity
// (its UUID and PCI location; ordinals differ between processes).
struct CudaShareablePayload {
  cudaIpcMemHandle_t ipc;
  unsigned char uuid[16];
  int32_t pci_domain;
  int32_t pci_bus;
  int32_t pci_device;
};
static_assert(sizeof(cudaIpcMemHandle_t) == 64);
static_assert(sizeof(CudaShareablePayload) == 64 + 16 + 12);
static_assert(kShareableHandleHeaderBytes + sizeof(CudaShareablePayload) <=
              kMaxShareableHandleBytes);

// "GPU-<uuid> (PCI 0000:3b:00)".
std::string GpuIdentity(const CudaShareablePayload& p) {
  std::string uuid;
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) uuid += '-';
    absl::StrAppendFormat(&uuid, "%02x", p.uuid[i]);
  }
  return absl::StrFormat("GPU-%s (PCI %04x:%02x:%02x)", uuid, p.pci_domain, p.pci_bus,
                         p.pci_device);
}

absl::Status CudaError(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  // A failed call also sets the thread's last error; reported here, it is
  // cleared (where it is not sticky) so that a later launch's cudaGetLastError
  // check does not report it again as that launch's failure.
  (void)cudaGetLastError();
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
  // gate: the device's, for its compute stream (CaptureGate); null otherwise.
  CudaStream(int ordinal, cudaStream_t s, bool owned, CaptureGate* gate = nullptr)
      : ordinal_(ordinal), stream_(s), owned_(owned), gate_(gate) {}
  ~CudaStream() override {
    if (owned_ && stream_ != nullptr) {
      cudaSetDevice(ordinal_);
      cudaStreamDestroy(stream_);
    }
  }
  void* native() override { return stream_; }
  cudaStream_t get() const { return stream_; }
  absl::Status Synchronize() override {
    // Another thread's synchronisation waits out a capture (it would invalidate it).
    std::optional<CaptureGate::Pass> pass;
    if (gate_ != nullptr && !gate_->HeldByMe()) pass.emplace(*gate_);
    // Errors of kernels that faulted surface here (they are sticky on CUDA).
    return CudaError(cudaStreamSynchronize(stream_), "stream synchronize");
  }
  // cudaStreamCaptureModeThreadLocal: this thread may not make unsafe calls
  // (cudaMalloc, synchronous copies) during the capture; other threads may.
  absl::Status BeginCapture() override {
    cudaSetDevice(ordinal_);
    if (gate_ != nullptr && !gate_->Begin()) {
      return absl::FailedPreconditionError("cuda: the stream is already capturing");
    }
    absl::Status st =
        CudaError(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal),
                  "begin stream capture");
    if (!st.ok() && gate_ != nullptr) gate_->End();
    return st;
  }
  absl::StatusOr<std::unique_ptr<Graph>> EndCapture() override {
    cudaSetDevice(ordinal_);
    cudaGraph_t graph = nullptr;
    absl::Status st =
        CudaError(cudaStreamEndCapture(stream_, &graph), "end stream capture");
    if (gate_ != nullptr) gate_->End();  // other threads' device calls go on
    // Memory freed during the capture goes now, after the work queued before
    // it (the capture itself queued none), and the capture fails.
    std::vector<std::pair<void*, bool>> frees;
    {
      absl::MutexLock lock(&mu_);
      frees.swap(deferred_frees_);
    }
    if (!frees.empty()) {
      for (const auto& [p, pool] : frees) {
        if (pool) {
          cudaFreeAsync(p, stream_);
        } else {
          cudaStreamSynchronize(stream_);
          if (cudaFree(p) != cudaSuccess) (void)cudaGetLastError();
        }
      }
      if (st.ok()) {
        st = NotDuringCapture(absl::StrCat("Free (", frees.size(),
                                           " buffer(s) freed during the capture)"));
      }
    }
    if (!st.ok()) {
      // Not sticky (an invalidated capture): cleared, or the next launch's
      // cudaGetLastError would report it and fail an eager step.
      (void)cudaGetLastError();
      if (graph != nullptr) cudaGraphDestroy(graph);
      return st;
    }
    size_t nodes = 0;
    cudaGraphGetNodes(graph, nullptr, &nodes);
    cudaGraphExec_t exec = nullptr;
    st = CudaError(cudaGraphInstantiate(&exec, graph, 0), "graph instantiate");
    if (!st.ok()) {
      (void)cudaGetLastError();  // as above
      cudaGraphDestroy(graph);
      return st;
    }
    return std::unique_ptr<Graph>(
        new CudaGraph(ordinal_, graph, exec, static_cast<int64_t>(nodes)));
  }
  bool capturing() const override { return IsCapturing(stream_); }
  // A free asked for while this stream captures: neither cudaFreeAsync (it would
  // become a node of the graph, a free at every replay) nor cudaFree (not
  // ordered after the work queued before the capture, which may still read the
  // buffer). Done at EndCapture, which then fails. pool: cudaMallocAsync memory
  // (else cudaMalloc's).
  void DeferFree(void* p, bool pool) {
    absl::MutexLock lock(&mu_);
    deferred_frees_.emplace_back(p, pool);
  }

 private:
  int ordinal_;
  cudaStream_t stream_;
  bool owned_;
  CaptureGate* const gate_;
  absl::Mutex mu_;
  std::vector<std::pair<void*, bool>> deferred_frees_ ABSL_GUARDED_BY(mu_);
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
    if (e == cudaErrorNotReady) {
      // Recorded as the thread's last error: cleared, or the next kernel launch
      // checked with cudaGetLastError would fail with "not ready".
      (void)cudaGetLastError();
      return false;
    }
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
        compute_(ordinal, compute, /*owned=*/true, &gate_) {}
  ~CudaDevice() override {
    cudaSetDevice(ordinal_);
    cudaStreamSynchronize(compute_.get());
    {
      absl::MutexLock lock(&mu_);
      for (auto& [p, bytes] : sizes_) cudaFreeAsync(p, compute_.get());
      sizes_.clear();
      for (auto& [base, m] : mappings_) cudaIpcCloseMemHandle(m.base);
      mappings_.clear();
      opened_.clear();
    }
    cudaStreamSynchronize(compute_.get());
    {
      absl::MutexLock lock(&mu_);
      for (auto& [start, sh] : shareable_) cudaFree(reinterpret_cast<void*>(start));
      shareable_.clear();
    }
    cudaMemPoolDestroy(pool_);
  }

  absl::string_view name() const override { return name_; }
  bool host_addressable() const override { return false; }
  absl::Status MakeCurrent() override {
    return CudaError(cudaSetDevice(ordinal_), "set device");
  }

  bool supports_graphs() const override { return true; }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (bytes > (size_t{1} << 62)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name_, ": cannot allocate ", bytes, " bytes (beyond any GPU)"));
    }
    const size_t rounded =
        (std::max<size_t>(bytes, 1) + kAlignment - 1) / kAlignment * kAlignment;
    void* p = nullptr;
    cudaSetDevice(ordinal_);
    // An allocation on the compute stream would become a node of the graph:
    // refused on the capturing thread; another thread's waits out the capture.
    if (gate_.HeldByMe()) return NotDuringCapture("Allocate");
    CaptureGate::Pass pass(gate_);
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
    if (FreeShareable(p)) return;
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
    std::optional<CaptureGate::Pass> pass;
    if (!gate_.HeldByMe()) pass.emplace(gate_);  // another thread's capture ends first
    if (IsCapturing(compute_.get())) {
      std::fprintf(stderr, "%s: Free(%p) during stream capture: the capture fails\n",
                   name_.c_str(), p);
      compute_.DeferFree(p, /*pool=*/true);
      return;
    }
    cudaFreeAsync(p, compute_.get());
  }

  bool Owns(const void* p, size_t) const override {
    if (p == nullptr) return false;
    {
      // Another process's memory mapped here (OpenShared): its attributes may
      // name the GPU it lives on, a peer of this one.
      absl::MutexLock lock(&mu_);
      const uintptr_t a = reinterpret_cast<uintptr_t>(p);
      auto it = mappings_.upper_bound(a);
      if (it != mappings_.begin() &&
          a - std::prev(it)->first < std::prev(it)->second.bytes) {
        return true;
      }
    }
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

  // cudaMalloc (legacy IPC maps only cudaMalloc'd memory, not pool memory),
  // rounded to 2 MiB.
  absl::StatusOr<void*> AllocateShareable(size_t bytes) override {
    if (bytes > (size_t{1} << 62)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name_, ": cannot allocate ", bytes, " bytes (beyond any GPU)"));
    }
    const size_t rounded = (std::max<size_t>(bytes, 1) + kShareableGranularity - 1) /
                           kShareableGranularity * kShareableGranularity;
    cudaSetDevice(ordinal_);
    // cudaMalloc is not allowed in a capture (this thread's; it would invalidate
    // it); another thread's waits out the capture (its retry synchronises).
    if (gate_.HeldByMe()) return NotDuringCapture("AllocateShareable");
    CaptureGate::Pass pass(gate_);
    if (IsCapturing(compute_.get())) return NotDuringCapture("AllocateShareable");
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, rounded);
    if (e == cudaErrorMemoryAllocation) {
      // The pool keeps what it once held (the profiling forward's activations
      // and cache, counted as free by MemoryInfo): give its unused part back
      // to the driver, then try again.
      cudaGetLastError();
      cudaStreamSynchronize(compute_.get());
      cudaMemPoolTrimTo(pool_, 0);
      e = cudaMalloc(&p, rounded);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it
      const DeviceMemoryInfo info = MemoryInfo();
      return absl::ResourceExhaustedError(absl::StrCat(
          name_, ": cannot allocate ", bytes, " shareable bytes (", info.free_bytes,
          " of ", info.total_bytes, " bytes free): ", cudaGetErrorString(e)));
    }
    absl::MutexLock lock(&mu_);
    shareable_[reinterpret_cast<uintptr_t>(p)] = Shareable{bytes, rounded};
    allocated_ += static_cast<int64_t>(rounded);
    return p;
  }

  absl::StatusOr<std::string> ExportShareable(const void* p, size_t bytes) override {
    ShareableHandle h;
    h.kind = ShareableKind::kCuda;
    void* base = nullptr;
    {
      absl::MutexLock lock(&mu_);
      const uintptr_t a = reinterpret_cast<uintptr_t>(p);
      auto it = shareable_.upper_bound(a);
      if (p == nullptr || bytes == 0 || it == shareable_.begin() ||
          a - std::prev(it)->first >= std::prev(it)->second.bytes ||
          bytes > std::prev(it)->second.bytes - (a - std::prev(it)->first)) {
        return absl::InvalidArgumentError(absl::StrCat(
            name_, ": ExportShareable [", absl::Hex(a), ", +", bytes,
            ") is not a non-empty range inside one live shareable allocation"));
      }
      it = std::prev(it);
      base = reinterpret_cast<void*>(it->first);
      h.allocation_bytes = it->second.rounded;
      h.offset = a - it->first;
      h.length = bytes;
    }
    CudaShareablePayload payload = {};
    cudaSetDevice(ordinal_);
    const cudaError_t e = cudaIpcGetMemHandle(&payload.ipc, base);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError(
          absl::StrCat(name_, ": cudaIpcGetMemHandle: ", cudaGetErrorString(e)));
    }
    absl::Status st = Identity(&payload);
    if (!st.ok()) return st;
    return SealShareableHandle(
        h, absl::string_view(reinterpret_cast<const char*>(&payload), sizeof payload),
        name_);
  }

  // cudaIpcOpenMemHandle maps the whole allocation, once per process: ranges of
  // one allocation opened here share one mapping, closed with the last of them.
  absl::StatusOr<void*> OpenShared(absl::string_view handle) override {
    absl::StatusOr<ShareableHandle> h = DecodeShareableHandle(
        handle, ShareableKind::kCuda, sizeof(CudaShareablePayload), name_);
    if (!h.ok()) return h.status();
    if (absl::Status st = CheckShareableOpenableHere(*h, name_); !st.ok()) return st;
    CudaShareablePayload payload;
    std::memcpy(&payload, h->payload.data(), sizeof payload);
    const std::string key(reinterpret_cast<const char*>(&payload.ipc),
                          sizeof payload.ipc);
    absl::MutexLock lock(&mu_);
    auto known = by_ipc_handle_.find(key);
    uintptr_t base = 0;
    if (known != by_ipc_handle_.end()) {
      base = known->second;
    } else {
      void* mapped = nullptr;
      cudaSetDevice(ordinal_);
      const cudaError_t e =
          cudaIpcOpenMemHandle(&mapped, payload.ipc, cudaIpcMemLazyEnablePeerAccess);
      if (e != cudaSuccess) {
        cudaGetLastError();  // not sticky: clear it
        return absl::FailedPreconditionError(absl::StrCat(
            name_, ": cannot open the shareable memory of process ", h->pid, " on ",
            GpuIdentity(payload), ": ", cudaGetErrorName(e), " (",
            cudaGetErrorString(e),
            "); the exporter may have exited or freed it, or that GPU is not "
            "reachable from this one (no peer access)"));
      }
      base = reinterpret_cast<uintptr_t>(mapped);
      mappings_[base] =
          Mapping{mapped, key, static_cast<size_t>(h->allocation_bytes), 0};
      by_ipc_handle_[key] = base;
    }
    ++mappings_[base].refs;
    void* start = reinterpret_cast<char*>(base) + h->offset;
    ++opened_[start].refs;
    opened_[start].base = base;
    return start;
  }

  void CloseShared(void* mapped) override {
    if (mapped == nullptr) return;
    absl::MutexLock lock(&mu_);
    auto it = opened_.find(mapped);
    if (it == opened_.end()) {
      std::fprintf(stderr,
                   "%s: CloseShared(%p): not a mapping OpenShared returned (closed "
                   "twice, or another pointer)\n",
                   name_.c_str(), mapped);
      std::abort();
    }
    const uintptr_t base = it->second.base;
    if (--it->second.refs == 0) opened_.erase(it);
    auto m = mappings_.find(base);
    if (m == mappings_.end() || --m->second.refs > 0) return;
    cudaSetDevice(ordinal_);
    const cudaError_t e = cudaIpcCloseMemHandle(m->second.base);
    if (e != cudaSuccess) {
      cudaGetLastError();
      std::fprintf(stderr, "%s: cudaIpcCloseMemHandle(%p): %s\n", name_.c_str(),
                   m->second.base, cudaGetErrorString(e));
    }
    by_ipc_handle_.erase(m->second.key);
    mappings_.erase(m);
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
    std::optional<CaptureGate::Pass> pass;
    WaitOutCapture(stream, &pass);
    if (IsCapturing(StreamOf(stream))) return NotDuringCapture("CopyToDevice");
    if (bytes == 0) return absl::OkStatus();
    return CudaError(
        cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, StreamOf(stream)),
        "copy to device");
  }
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes,
                          Stream* stream) override {
    std::optional<CaptureGate::Pass> pass;
    WaitOutCapture(stream, &pass);
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
    std::optional<CaptureGate::Pass> pass;
    WaitOutCapture(stream, &pass);
    cudaStream_t s = StreamOf(stream);
    if (IsCapturing(s)) return NotDuringCapture("CopyToHostAsync");
    if (bytes == 0) return absl::OkStatus();
    return CudaError(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, s),
                     "copy to host");
  }
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes,
                            Stream* stream) override {
    std::optional<CaptureGate::Pass> pass;
    WaitOutCapture(stream, &pass);
    if (bytes == 0) return absl::OkStatus();
    return CudaError(
        cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, StreamOf(stream)),
        "copy on device");
  }
  absl::Status CopyOnDevice2D(void* dst, size_t dst_pitch, const void* src,
                              size_t src_pitch, size_t width, size_t height,
                              Stream* stream) override {
    std::optional<CaptureGate::Pass> pass;
    WaitOutCapture(stream, &pass);
    if (width == 0 || height == 0) return absl::OkStatus();
    if (dst_pitch < width || src_pitch < width) {
      return Device::CopyOnDevice2D(dst, dst_pitch, src, src_pitch, width, height,
                                    stream);  // its error
    }
    return CudaError(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height,
                                       cudaMemcpyDeviceToDevice, StreamOf(stream)),
                     "2D copy on device");
  }
  // One cudaMemcpyBatchAsync (CUDA 12.8+) for the whole batch; where the
  // driver refuses it, one cudaMemcpyAsync per piece from then on.
  absl::Status CopyBatchAsync(CopyKind kind, absl::Span<const CopyPiece> pieces,
                              Stream* stream) override {
    std::optional<CaptureGate::Pass> pass;
    WaitOutCapture(stream, &pass);
    cudaStream_t s = StreamOf(stream);
    if (IsCapturing(s)) return NotDuringCapture("CopyBatchAsync");
    if (pieces.size() <= 1 || !batch_copies_.load()) {
      return Device::CopyBatchAsync(kind, pieces, stream);
    }
    std::vector<void*> dsts;
    std::vector<const void*> srcs;
    std::vector<size_t> sizes;
    dsts.reserve(pieces.size());
    srcs.reserve(pieces.size());
    sizes.reserve(pieces.size());
    for (const CopyPiece& p : pieces) {
      if (p.bytes == 0) continue;
      dsts.push_back(p.dst);
      srcs.push_back(p.src);
      sizes.push_back(p.bytes);
    }
    if (dsts.empty()) return absl::OkStatus();
#if CUDART_VERSION >= 12080
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t first = 0;
#if CUDART_VERSION >= 13000
    const cudaError_t e = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(),
                                               dsts.size(), &attr, &first, 1, s);
#else
    // CUDA 12.8 / 12.9: non-const pointer arrays and the index of a failed copy.
    size_t fail_index = 0;
    const cudaError_t e =
        cudaMemcpyBatchAsync(dsts.data(), const_cast<void**>(srcs.data()), sizes.data(),
                             dsts.size(), &attr, &first, 1, &fail_index, s);
#endif
    if (e == cudaErrorNotSupported || e == cudaErrorInvalidValue ||
        e == cudaErrorCallRequiresNewerDriver) {
      (void)cudaGetLastError();  // not sticky: clear it
      batch_copies_.store(false);
      return Device::CopyBatchAsync(kind, pieces, stream);
    }
    return CudaError(e, "batched copy");
#else
    // No cudaMemcpyBatchAsync before CUDA 12.8: a copy per piece.
    batch_copies_.store(false);
    return Device::CopyBatchAsync(kind, pieces, stream);
#endif
  }
  absl::Status Memset(void* dst, uint8_t byte, size_t bytes, Stream* stream) override {
    std::optional<CaptureGate::Pass> pass;
    WaitOutCapture(stream, &pass);
    if (bytes == 0) return absl::OkStatus();
    return CudaError(cudaMemsetAsync(dst, byte, bytes, StreamOf(stream)), "memset");
  }

 private:
  // Work another thread enqueues on the compute stream waits out a capture of it
  // (CaptureGate); the capturing thread's own is captured or refused.
  void WaitOutCapture(Stream* stream, std::optional<CaptureGate::Pass>* pass) {
    if ((stream == nullptr || stream == &compute_) && !gate_.HeldByMe()) {
      pass->emplace(gate_);
    }
  }
  // cudaMemcpyBatchAsync works here (false once the driver refused it).
  std::atomic<bool> batch_copies_{true};
  cudaStream_t StreamOf(Stream* s) {
    return static_cast<cudaStream_t>(s == nullptr ? compute_.native() : s->native());
  }

  // True when `p` was a shareable allocation (now freed): cudaFree once the
  // compute stream's work has run (as Free's cudaFreeAsync is ordered after it).
  bool FreeShareable(void* p) {
    {
      absl::MutexLock lock(&mu_);
      auto it = shareable_.find(reinterpret_cast<uintptr_t>(p));
      if (it == shareable_.end()) return false;
      allocated_ -= static_cast<int64_t>(it->second.rounded);
      shareable_.erase(it);
    }
    cudaSetDevice(ordinal_);
    std::optional<CaptureGate::Pass> pass;
    if (!gate_.HeldByMe()) pass.emplace(gate_);  // another thread's capture ends first
    if (IsCapturing(compute_.get())) {
      std::fprintf(stderr, "%s: Free(%p) during stream capture: the capture fails\n",
                   name_.c_str(), p);
      compute_.DeferFree(p, /*pool=*/false);
      return true;
    }
    cudaStreamSynchronize(compute_.get());
    if (const cudaError_t e = cudaFree(p); e != cudaSuccess) {
      cudaGetLastError();
      std::fprintf(stderr, "%s: cudaFree(%p) of shareable memory: %s\n", name_.c_str(),
                   p, cudaGetErrorString(e));
    }
    return true;
  }

  // This GPU's UUID and PCI location (what a handle says it was exported from).
  absl::Status Identity(CudaShareablePayload* p) const {
    cudaDeviceProp prop;
    absl::Status st =
        CudaError(cudaGetDeviceProperties(&prop, ordinal_), "get device properties");
    if (!st.ok()) return st;
    static_assert(sizeof prop.uuid == sizeof p->uuid);
    std::memcpy(p->uuid, &prop.uuid, sizeof p->uuid);
    p->pci_domain = prop.pciDomainID;
    p->pci_bus = prop.pciBusID;
    p->pci_device = prop.pciDeviceID;
    return absl::OkStatus();
  }

  struct Shareable {
    size_t bytes = 0;    // requested
    size_t rounded = 0;  // cudaMalloc'd
  };
  // One cudaIpcOpenMemHandle of another process's allocation.
  struct Mapping {
    void* base = nullptr;
    std::string key;   // the cudaIpcMemHandle_t's bytes
    size_t bytes = 0;  // the allocation's size
    int refs = 0;      // open ranges of it
  };
  struct Opened {
    uintptr_t base = 0;  // its Mapping
    int refs = 0;        // OpenShared calls that returned this pointer
  };

  const int ordinal_;
  const std::string name_;
  cudaMemPool_t pool_;
  CaptureGate gate_;  // the compute stream's captures (before compute_)
  CudaStream compute_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<void*, size_t> sizes_ ABSL_GUARDED_BY(mu_);
  int64_t allocated_ ABSL_GUARDED_BY(mu_) = 0;
  // Shareable allocations by start (cudaMalloc'd; not in sizes_).
  std::map<uintptr_t, Shareable> shareable_ ABSL_GUARDED_BY(mu_);
  // Other processes' allocations mapped here, by mapped base and by IPC handle,
  // and the pointers OpenShared returned.
  std::map<uintptr_t, Mapping> mappings_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, uintptr_t> by_ipc_handle_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<void*, Opened> opened_ ABSL_GUARDED_BY(mu_);
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
