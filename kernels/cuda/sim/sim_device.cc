#include "kernels/cuda/sim/sim_device.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/capture_gate.h"
#include "kernels/cuda/shareable_handle.h"
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

size_t PageRounded(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (std::max<size_t>(bytes, 1) + page - 1) / page * page;
}

// What a cuda_sim handle carries beyond the common header (shareable_handle.h):
// the exporter's memfd, by number (opened through /proc/<pid>/fd/<fd>) and by
// identity (device and inode: a number reused by another file after a Free is
// not the allocation).
struct SimShareablePayload {
  int32_t fd;
  int32_t reserved;
  uint64_t st_dev;
  uint64_t st_ino;
};
static_assert(sizeof(SimShareablePayload) == 24);
static_assert(kShareableHandleHeaderBytes + sizeof(SimShareablePayload) <=
              kMaxShareableHandleBytes);

std::string ErrnoText(int e) {
  return absl::StrCat(std::strerror(e), " (errno ", e, ")");
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
  // gate: the device's, for its compute stream (CaptureGate); null otherwise.
  explicit SimStream(CaptureGate* gate = nullptr) : gate_(gate) {}
  // The emulator only needs a distinct, stable handle per stream.
  void* native() override { return this; }
  // Launches and copies run when they are enqueued; another thread's
  // synchronisation waits out a capture of the compute stream.
  absl::Status Synchronize() override {
    if (gate_ != nullptr && !gate_->HeldByMe()) {
      CaptureGate::Pass pass(*gate_);
      return absl::OkStatus();
    }
    if (capturing()) return CaptureViolation(this, "Synchronize");
    return absl::OkStatus();
  }
  absl::Status BeginCapture() override {
    if (gate_ != nullptr && !gate_->Begin()) {
      return absl::FailedPreconditionError("cuda_sim: stream is already capturing");
    }
    if (!cuda_sim::BeginCapture(this)) {
      if (gate_ != nullptr) gate_->End();
      return absl::FailedPreconditionError("cuda_sim: stream is already capturing");
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<Graph>> EndCapture() override {
    cuda_sim::Captured c = cuda_sim::EndCapture(this);
    if (gate_ != nullptr) gate_->End();
    if (!c.error.empty()) return absl::FailedPreconditionError(c.error);
    return std::unique_ptr<Graph>(new SimGraph(std::move(c.ops)));
  }
  bool capturing() const override {
    return cuda_sim::IsCapturing(const_cast<SimStream*>(this));
  }
  absl::Status EnqueueHostFunction(std::function<void()> fn) override {
    if (cuda_sim::Record(this, fn)) return absl::OkStatus();  // a host node
    fn();
    return absl::OkStatus();
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

 private:
  CaptureGate* const gate_;
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
      auto sh = shareable_.find(start);
      if (sh != shareable_.end()) {
        munmap(reinterpret_cast<void*>(start), sh->second.mapped_bytes);
        close(sh->second.fd);
        continue;
      }
      TANDEM_SIM_UNPOISON(reinterpret_cast<void*>(start), Rounded(bytes));
      std::free(reinterpret_cast<void*>(start));
    }
    for (auto& [start, m] : opened_) munmap(m.base, m.mapped_bytes);
  }

  absl::string_view name() const override { return "cuda_sim"; }
  bool host_addressable() const override { return true; }

  bool supports_graphs() const override { return true; }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    const size_t rounded = Rounded(bytes);
    if (gate_.HeldByMe()) {
      return SimStream::CaptureViolation(&stream_, "Allocate on the device");
    }
    CaptureGate::Pass pass(gate_);  // another thread's capture ends first
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
    if (gate_.HeldByMe()) (void)SimStream::CaptureViolation(&stream_, "Free");
    std::optional<CaptureGate::Pass> pass;
    if (!gate_.HeldByMe()) pass.emplace(gate_);  // another thread's capture ends first
    Shareable shareable;
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
      reserved_ -= static_cast<int64_t>(rounded);
      allocated_ -= static_cast<int64_t>(it->second);
      live_.erase(it);
      auto sh = shareable_.find(reinterpret_cast<uintptr_t>(p));
      if (sh != shareable_.end()) {
        shareable = sh->second;
        shareable_.erase(sh);
      } else {
        TANDEM_SIM_UNPOISON(p, rounded);
      }
    }
    if (shareable.fd >= 0) {
      // Another process's mapping of it stays valid (the memfd lives while mapped).
      munmap(p, shareable.mapped_bytes);
      close(shareable.fd);
      return;
    }
    std::free(p);
  }

  // Live allocations (shareable ones included) and the ranges OpenShared mapped.
  bool Owns(const void* p, size_t bytes) const override {
    if (p == nullptr) return false;
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    absl::MutexLock lock(&mu_);
    if (InRange(live_, a, bytes, [](size_t size) { return size; })) return true;
    return InRange(opened_, a, bytes, [](const Opened& m) { return m.length; });
  }

  DeviceMemoryInfo MemoryInfo() const override {
    absl::MutexLock lock(&mu_);
    DeviceMemoryInfo info;
    info.total_bytes = capacity_;
    info.free_bytes = capacity_ - reserved_;
    info.allocated_bytes = allocated_;
    return info;
  }

  // A memfd mapped MAP_SHARED (zero-filled, committed). The fd stays open for
  // the allocation's life: an opener maps it through /proc/<pid>/fd/<fd>.
  absl::StatusOr<void*> AllocateShareable(size_t bytes) override {
    const size_t rounded = Rounded(bytes);
    if (gate_.HeldByMe()) {
      return SimStream::CaptureViolation(&stream_, "AllocateShareable on the device");
    }
    CaptureGate::Pass pass(gate_);  // another thread's capture ends first
    {
      absl::MutexLock lock(&mu_);
      if (static_cast<int64_t>(rounded) > capacity_ - reserved_) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "cuda_sim: out of device memory allocating ", bytes, " shareable bytes (",
            capacity_ - reserved_, " of ", capacity_, " bytes free)"));
      }
      reserved_ += static_cast<int64_t>(rounded);
    }
    absl::StatusOr<Shareable> sh = MapNewMemfd(bytes);
    absl::MutexLock lock(&mu_);
    if (!sh.ok()) {
      reserved_ -= static_cast<int64_t>(rounded);
      return sh.status();
    }
    const uintptr_t start = reinterpret_cast<uintptr_t>(sh->base);
    live_[start] = bytes;
    shareable_[start] = *sh;
    allocated_ += static_cast<int64_t>(bytes);
    return sh->base;
  }

  absl::StatusOr<std::string> ExportShareable(const void* p, size_t bytes) override {
    ShareableHandle h;
    h.kind = ShareableKind::kCudaSim;
    SimShareablePayload payload = {};
    {
      absl::MutexLock lock(&mu_);
      const uintptr_t a = reinterpret_cast<uintptr_t>(p);
      if (p == nullptr || bytes == 0 ||
          !InRange(shareable_, a, bytes,
                   [](const Shareable& sh) { return sh.bytes; })) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cuda_sim: ExportShareable [", absl::Hex(a), ", +", bytes,
            ") is not a non-empty range inside one live shareable allocation"));
      }
      auto it = std::prev(shareable_.upper_bound(a));
      const Shareable& sh = it->second;
      h.allocation_bytes = sh.bytes;
      h.offset = a - it->first;
      h.length = bytes;
      payload.fd = sh.fd;
      payload.st_dev = sh.st_dev;
      payload.st_ino = sh.st_ino;
    }
    return SealShareableHandle(
        h, absl::string_view(reinterpret_cast<const char*>(&payload), sizeof payload),
        "cuda_sim");
  }

  absl::StatusOr<void*> OpenShared(absl::string_view handle) override {
    absl::StatusOr<ShareableHandle> h = DecodeShareableHandle(
        handle, ShareableKind::kCudaSim, sizeof(SimShareablePayload), name());
    if (!h.ok()) return h.status();
    if (absl::Status st = CheckShareableOpenableHere(*h, name()); !st.ok()) return st;
    SimShareablePayload payload;
    std::memcpy(&payload, h->payload.data(), sizeof payload);
    const std::string path = absl::StrCat("/proc/", h->pid, "/fd/", payload.fd);
    auto gone = [&](absl::string_view why) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cuda_sim: cannot open the shareable memory of process ", h->pid, " (", path,
          "): ", why, "; the exporter has exited or freed it"));
    };
    const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return gone(ErrnoText(errno));
    struct stat st = {};
    if (fstat(fd, &st) != 0) {
      const int e = errno;
      close(fd);
      return gone(ErrnoText(e));
    }
    const size_t mapped_bytes = PageRounded(h->allocation_bytes);
    if (static_cast<uint64_t>(st.st_dev) != payload.st_dev ||
        static_cast<uint64_t>(st.st_ino) != payload.st_ino ||
        static_cast<uint64_t>(st.st_size) != mapped_bytes) {
      close(fd);
      return gone(absl::StrCat("the fd is another file now (inode ", st.st_ino, ", ",
                               st.st_size, " bytes; the handle's: inode ",
                               payload.st_ino, ", ", mapped_bytes, " bytes)"));
    }
    void* base = mmap(nullptr, mapped_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int map_errno = errno;
    close(fd);  // the mapping keeps the memory
    if (base == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cuda_sim: cannot map ", mapped_bytes,
                       " shared bytes: ", ErrnoText(map_errno)));
    }
    char* start = static_cast<char*>(base) + h->offset;
    absl::MutexLock lock(&mu_);
    opened_[reinterpret_cast<uintptr_t>(start)] = {base, mapped_bytes, h->length};
    return start;
  }

  void CloseShared(void* mapped) override {
    if (mapped == nullptr) return;
    Opened m;
    {
      absl::MutexLock lock(&mu_);
      auto it = opened_.find(reinterpret_cast<uintptr_t>(mapped));
      if (it == opened_.end()) {
        std::fprintf(stderr,
                     "cuda_sim: CloseShared(%p): not a mapping OpenShared returned "
                     "(closed twice, or another pointer)\n",
                     mapped);
        std::abort();
      }
      m = it->second;
      opened_.erase(it);
    }
    munmap(m.base, m.mapped_bytes);
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
    const auto pass = WaitOutCapture(s);
    if (s->capturing()) return SimStream::CaptureViolation(s, "CopyToDevice");
    if (bytes == 0) return absl::OkStatus();
    if (!Owns(dst, bytes)) return NotOwned("CopyToDevice destination", dst, bytes);
    std::memmove(dst, host_src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes,
                          Stream* stream) override {
    Stream* s = StreamOf(stream);
    const auto pass = WaitOutCapture(s);
    if (s->capturing()) return SimStream::CaptureViolation(s, "CopyToHost");
    if (bytes == 0) return absl::OkStatus();
    if (!Owns(src, bytes)) return NotOwned("CopyToHost source", src, bytes);
    std::memmove(host_dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes,
                            Stream* stream) override {
    const auto pass = WaitOutCapture(StreamOf(stream));
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
    const auto pass = WaitOutCapture(StreamOf(stream));
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
  // Work another thread enqueues on the compute stream waits out a capture of it
  // (CaptureGate); the capturing thread's own is captured or refused.
  std::unique_ptr<CaptureGate::Pass> WaitOutCapture(Stream* s) {
    if (s != &stream_ || gate_.HeldByMe()) return nullptr;
    return std::make_unique<CaptureGate::Pass>(gate_);
  }
  static absl::Status NotOwned(const char* what, const void* p, size_t bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_sim: ", what, " [", absl::Hex(reinterpret_cast<uintptr_t>(p)), ", +",
        bytes, ") is not inside one live device allocation"));
  }

  // A shareable allocation: its memfd and mapping.
  struct Shareable {
    int fd = -1;
    size_t bytes = 0;         // requested
    size_t mapped_bytes = 0;  // the memfd's size (page-rounded)
    void* base = nullptr;
    uint64_t st_dev = 0;
    uint64_t st_ino = 0;
  };
  // Another process's range, mapped by OpenShared.
  struct Opened {
    void* base = nullptr;  // the whole allocation's mapping
    size_t mapped_bytes = 0;
    size_t length = 0;  // of the range, from the pointer OpenShared returned
  };

  // True when [a, a + bytes) lies inside one entry of `m` (start -> entry),
  // `size` giving an entry's extent (at least one byte).
  template <typename Map, typename Size>
  static bool InRange(const Map& m, uintptr_t a, size_t bytes, Size size) {
    auto it = m.upper_bound(a);
    if (it == m.begin()) return false;
    it = std::prev(it);
    const size_t extent = size(it->second);
    const size_t off = a - it->first;
    if (off >= std::max<size_t>(extent, 1)) return false;
    return bytes <= extent - off;
  }

  static absl::StatusOr<Shareable> MapNewMemfd(size_t bytes) {
    Shareable sh;
    sh.bytes = bytes;
    sh.mapped_bytes = PageRounded(bytes);
    auto fail = [&](absl::string_view what, int e) {
      if (sh.fd >= 0) close(sh.fd);
      return absl::ResourceExhaustedError(
          absl::StrCat("cuda_sim: shareable allocation of ", bytes, " bytes: ", what,
                       ": ", ErrnoText(e)));
    };
    sh.fd = memfd_create("tandem-cuda-sim-shareable", MFD_CLOEXEC);
    if (sh.fd < 0) return fail("memfd_create", errno);
    if (ftruncate(sh.fd, static_cast<off_t>(sh.mapped_bytes)) != 0) {
      return fail("ftruncate", errno);
    }
    // Commit the pages now (as Allocate does), so that a host short of memory
    // fails here rather than with SIGBUS on first touch.
    if (const int e = posix_fallocate(sh.fd, 0, static_cast<off_t>(sh.mapped_bytes));
        e != 0 && e != EOPNOTSUPP && e != EINVAL) {
      return fail("fallocate", e);
    }
    struct stat st = {};
    if (fstat(sh.fd, &st) != 0) return fail("fstat", errno);
    sh.st_dev = static_cast<uint64_t>(st.st_dev);
    sh.st_ino = static_cast<uint64_t>(st.st_ino);
    sh.base =
        mmap(nullptr, sh.mapped_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, sh.fd, 0);
    if (sh.base == MAP_FAILED) return fail("mmap", errno);
    return sh;
  }

  const int64_t capacity_;
  CaptureGate gate_;  // the compute stream's captures (before stream_)
  SimStream stream_{&gate_};
  mutable absl::Mutex mu_;
  // start -> bytes; shareable allocations are here too (Owns, Free).
  std::map<uintptr_t, size_t> live_ ABSL_GUARDED_BY(mu_);
  std::map<uintptr_t, Shareable> shareable_ ABSL_GUARDED_BY(mu_);  // by start
  // The pointer OpenShared returned -> its mapping.
  std::map<uintptr_t, Opened> opened_ ABSL_GUARDED_BY(mu_);
  int64_t reserved_ ABSL_GUARDED_BY(mu_) = 0;   // rounded sizes
  int64_t allocated_ ABSL_GUARDED_BY(mu_) = 0;  // requested sizes
};

}  // namespace

std::unique_ptr<Device> CreateSimDevice(int64_t capacity_bytes) {
  return std::make_unique<SimDevice>(capacity_bytes < 0 ? CapacityFromEnv()
                                                        : capacity_bytes);
}

}  // namespace tandem::kernels::cuda
