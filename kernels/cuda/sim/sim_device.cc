#include "kernels/cuda/sim/sim_device.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/sim/simt.h"

// Under ASan the bytes between an allocation's requested size and its 256-byte
// rounding are poisoned, so that a kernel reading or writing past the extent it was
// given is caught although the emulated device rounds like cudaMalloc.
#if defined(__SANITIZE_ADDRESS__)
#define TANDEM_SIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TANDEM_SIM_ASAN 1
#endif
#endif
#if defined(TANDEM_SIM_ASAN)
#include <sanitizer/asan_interface.h>
#define TANDEM_SIM_POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define TANDEM_SIM_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define TANDEM_SIM_POISON(p, n) ((void)(p), (void)(n))
#define TANDEM_SIM_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace tandem::kernels::cuda {
namespace {

constexpr size_t kAlignment = 256;

size_t Rounded(size_t bytes) {
  return (std::max<size_t>(bytes, 1) + kAlignment - 1) / kAlignment * kAlignment;
}

// Replays the work one capture recorded (kernels/device.h Graph): each launch
// with the arguments it was captured with.
class SimGraph final : public Graph {
 public:
  explicit SimGraph(std::vector<std::function<void()>> ops) : ops_(std::move(ops)) {}
  absl::Status Launch(Stream& stream) override {
    if (cuda_sim::IsCapturing(stream.native())) {
      // A graph launched into a capture becomes part of it (a child graph).
      for (const auto& op : ops_) cuda_sim::Record(stream.native(), op);
      return absl::OkStatus();
    }
    (void)cuda_sim::TakeLaunchError();  // errors from before belong to their ops
    for (const auto& op : ops_) op();
    if (const char* e = cuda_sim::TakeLaunchError()) {
      return absl::InternalError(absl::StrCat("cuda_sim: graph launch: ", e));
    }
    return absl::OkStatus();
  }
  int64_t num_nodes() const override { return static_cast<int64_t>(ops_.size()); }

 private:
  const std::vector<std::function<void()>> ops_;
};

class SimStream final : public Stream {
 public:
  // The emulator only needs a distinct, stable handle per stream.
  void* native() override { return this; }
  // Launches and copies run when they are enqueued.
  absl::Status Synchronize() override {
    if (capturing()) return CaptureViolation(this, "Synchronize");
    return absl::OkStatus();
  }
  absl::Status BeginCapture() override {
    if (!cuda_sim::BeginCapture(this)) {
      return absl::FailedPreconditionError("cuda_sim: stream is already capturing");
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<Graph>> EndCapture() override {
    cuda_sim::Captured c = cuda_sim::EndCapture(this);
    if (!c.error.empty()) return absl::FailedPreconditionError(c.error);
    return std::unique_ptr<Graph>(new SimGraph(std::move(c.ops)));
  }
  bool capturing() const override {
    return cuda_sim::IsCapturing(const_cast<SimStream*>(this));
  }

  // Fails `what` on a capturing stream and invalidates the capture, as CUDA
  // does (cudaErrorStreamCaptureUnsupported / ...Invalidated).
  static absl::Status CaptureViolation(Stream* s, absl::string_view what) {
    const std::string why =
        absl::StrCat("cuda_sim: ", what,
                     " is not allowed while the stream is capturing (CUDA graph "
                     "capture rules: capture device work only)");
    cuda_sim::InvalidateCapture(s->native(), why);
    return absl::FailedPreconditionError(why);
  }
};

class SimEvent final : public Event {
 public:
  absl::Status Record(Stream&) override { return absl::OkStatus(); }
  absl::Status MakeWait(Stream&) override { return absl::OkStatus(); }
  absl::StatusOr<bool> Done() override { return true; }
  absl::Status Synchronize() override { return absl::OkStatus(); }
};

int64_t CapacityFromEnv() {
  const char* env = std::getenv("TANDEM_SIM_DEVICE_BYTES");
  int64_t v = 0;
  if (env != nullptr && absl::SimpleAtoi(env, &v) && v > 0) return v;
  if (env != nullptr && *env != '\0') {
    std::fprintf(stderr,
                 "cuda_sim: ignoring TANDEM_SIM_DEVICE_BYTES=\"%s\" (want a positive "
                 "byte count)\n",
                 env);
  }
  return kDefaultSimDeviceBytes;
}

class SimDevice final : public Device {
 public:
  explicit SimDevice(int64_t capacity) : capacity_(capacity) {}
  ~SimDevice() override {
    absl::MutexLock lock(&mu_);
    for (auto& [start, bytes] : live_) {
      TANDEM_SIM_UNPOISON(reinterpret_cast<void*>(start), Rounded(bytes));
      std::free(reinterpret_cast<void*>(start));
    }
  }

  absl::string_view name() const override { return "cuda_sim"; }
  bool host_addressable() const override { return true; }

  bool supports_graphs() const override { return true; }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    const size_t rounded = Rounded(bytes);
    if (stream_.capturing()) {
      return SimStream::CaptureViolation(&stream_, "Allocate on the device");
    }
    {
      absl::MutexLock lock(&mu_);
      if (static_cast<int64_t>(rounded) > capacity_ - reserved_) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "cuda_sim: out of device memory allocating ", bytes, " bytes (",
            capacity_ - reserved_, " of ", capacity_, " bytes free)"));
      }
      reserved_ += static_cast<int64_t>(rounded);
    }
    void* p = std::aligned_alloc(kAlignment, rounded);
    absl::MutexLock lock(&mu_);
    if (p == nullptr) {
      reserved_ -= static_cast<int64_t>(rounded);
      return absl::ResourceExhaustedError(
          absl::StrCat("cuda_sim: host allocation of ", bytes, " bytes failed"));
    }
    std::memset(p, 0xff, rounded);
    TANDEM_SIM_POISON(static_cast<char*>(p) + bytes, rounded - bytes);
    live_[reinterpret_cast<uintptr_t>(p)] = bytes;
    allocated_ += static_cast<int64_t>(bytes);
    return p;
  }

  void Free(void* p) override {
    if (p == nullptr) return;
    // The memory goes (a graph captured now could not use it); the capture fails.
    if (stream_.capturing()) (void)SimStream::CaptureViolation(&stream_, "Free");
    {
      absl::MutexLock lock(&mu_);
      auto it = live_.find(reinterpret_cast<uintptr_t>(p));
      if (it == live_.end()) {
        std::fprintf(stderr,
                     "cuda_sim: Free(%p): not the start of a live allocation of this "
                     "device (double free, or a host pointer)\n",
                     p);
        std::abort();
      }
      const size_t rounded = Rounded(it->second);
      TANDEM_SIM_UNPOISON(p, rounded);
      reserved_ -= static_cast<int64_t>(rounded);
      allocated_ -= static_cast<int64_t>(it->second);
      live_.erase(it);
    }
    std::free(p);
  }

  bool Owns(const void* p, size_t bytes) const override {
    if (p == nullptr) return false;
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    absl::MutexLock lock(&mu_);
    auto it = live_.upper_bound(a);
    if (it == live_.begin()) return false;
    it = std::prev(it);
    // p inside [start, start + size) and p + bytes <= start + size (the requested
    // size, not the rounded one).
    const size_t off = a - it->first;
    if (off >= std::max<size_t>(it->second, 1)) return false;
    return bytes <= it->second - off;
  }

  DeviceMemoryInfo MemoryInfo() const override {
    absl::MutexLock lock(&mu_);
    DeviceMemoryInfo info;
    info.total_bytes = capacity_;
    info.free_bytes = capacity_ - reserved_;
    info.allocated_bytes = allocated_;
    return info;
  }

  Stream& compute_stream() override { return stream_; }
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    return std::unique_ptr<Stream>(new SimStream());
  }
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    return std::unique_ptr<Event>(new SimEvent());
  }

  // Host <-> device copies are not captured: a graph's inputs are written into its
  // fixed buffers before the launch, its outputs read after it.
  absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes,
                            Stream* stream) override {
    Stream* s = StreamOf(stream);
    if (s->capturing()) return SimStream::CaptureViolation(s, "CopyToDevice");
    if (bytes == 0) return absl::OkStatus();
    if (!Owns(dst, bytes)) return NotOwned("CopyToDevice destination", dst, bytes);
    std::memmove(dst, host_src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes,
                          Stream* stream) override {
    Stream* s = StreamOf(stream);
    if (s->capturing()) return SimStream::CaptureViolation(s, "CopyToHost");
    if (bytes == 0) return absl::OkStatus();
    if (!Owns(src, bytes)) return NotOwned("CopyToHost source", src, bytes);
    std::memmove(host_dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes,
                            Stream* stream) override {
    if (bytes == 0) return absl::OkStatus();
    if (!Owns(dst, bytes)) return NotOwned("CopyOnDevice destination", dst, bytes);
    if (!Owns(src, bytes)) return NotOwned("CopyOnDevice source", src, bytes);
    if (cuda_sim::Record(StreamOf(stream)->native(),
                         [dst, src, bytes] { std::memmove(dst, src, bytes); })) {
      return absl::OkStatus();
    }
    std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Memset(void* dst, uint8_t byte, size_t bytes, Stream* stream) override {
    if (bytes == 0) return absl::OkStatus();
    if (!Owns(dst, bytes)) return NotOwned("Memset destination", dst, bytes);
    if (cuda_sim::Record(StreamOf(stream)->native(),
                         [dst, byte, bytes] { std::memset(dst, byte, bytes); })) {
      return absl::OkStatus();
    }
    std::memset(dst, byte, bytes);
    return absl::OkStatus();
  }

 private:
  Stream* StreamOf(Stream* s) { return s == nullptr ? &stream_ : s; }
  static absl::Status NotOwned(const char* what, const void* p, size_t bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_sim: ", what, " [", absl::Hex(reinterpret_cast<uintptr_t>(p)), ", +",
        bytes, ") is not inside one live device allocation"));
  }

  const int64_t capacity_;
  SimStream stream_;
  mutable absl::Mutex mu_;
  std::map<uintptr_t, size_t> live_ ABSL_GUARDED_BY(mu_);  // start -> bytes
  int64_t reserved_ ABSL_GUARDED_BY(mu_) = 0;              // rounded sizes
  int64_t allocated_ ABSL_GUARDED_BY(mu_) = 0;             // requested sizes
};

}  // namespace

std::unique_ptr<Device> CreateSimDevice(int64_t capacity_bytes) {
  return std::make_unique<SimDevice>(capacity_bytes < 0 ? CapacityFromEnv()
                                                        : capacity_bytes);
}

}  // namespace tandem::kernels::cuda
