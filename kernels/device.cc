// The host "device" of the CPU backends (kernels/device.h).
#include "kernels/device.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace tandem::kernels {
namespace {

constexpr size_t kAlignment = 256;

absl::Status NoShareableMemory(const Device& device) {
  return absl::UnimplementedError(
      absl::StrCat(device.name(), " has no device memory shareable between processes"));
}

// Host memory has no queue: work runs when it is called.
class HostStream final : public Stream {
 public:
  void* native() override { return nullptr; }
  absl::Status Synchronize() override { return absl::OkStatus(); }
  absl::Status EnqueueHostFunction(std::function<void()> fn) override {
    fn();
    return absl::OkStatus();
  }
};

class HostEvent final : public Event {
 public:
  absl::Status Record(Stream&) override { return absl::OkStatus(); }
  absl::Status MakeWait(Stream&) override { return absl::OkStatus(); }
  absl::StatusOr<bool> Done() override { return true; }
  absl::Status Synchronize() override { return absl::OkStatus(); }
};

// MemTotal and MemAvailable of /proc/meminfo in bytes (0 where unreadable).
void ReadMeminfo(int64_t* total, int64_t* available) {
  *total = 0;
  *available = 0;
  FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return;
  char line[256];
  while (std::fgets(line, sizeof line, f) != nullptr) {
    long long kib = 0;
    if (std::sscanf(line, "MemTotal: %lld kB", &kib) == 1) *total = kib * 1024;
    if (std::sscanf(line, "MemAvailable: %lld kB", &kib) == 1) *available = kib * 1024;
  }
  std::fclose(f);
}

class HostDevice final : public Device {
 public:
  absl::string_view name() const override { return "host"; }
  bool host_addressable() const override { return true; }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    const size_t rounded =
        (std::max<size_t>(bytes, 1) + kAlignment - 1) / kAlignment * kAlignment;
    void* p = std::aligned_alloc(kAlignment, rounded);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("host: cannot allocate ", bytes, " bytes"));
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
        std::fprintf(stderr, "host device: Free(%p) of memory it did not allocate\n",
                     p);
        std::abort();
      }
      allocated_ -= static_cast<int64_t>(it->second);
      sizes_.erase(it);
    }
    std::free(p);
  }

  // Every host address is memory of the host device.
  bool Owns(const void*, size_t) const override { return true; }

  DeviceMemoryInfo MemoryInfo() const override {
    DeviceMemoryInfo info;
    ReadMeminfo(&info.total_bytes, &info.free_bytes);
    absl::MutexLock lock(&mu_);
    info.allocated_bytes = allocated_;
    return info;
  }

  Stream& compute_stream() override { return stream_; }
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    return std::unique_ptr<Stream>(new HostStream());
  }
  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    return std::unique_ptr<Event>(new HostEvent());
  }

  absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes,
                            Stream*) override {
    if (bytes > 0) std::memmove(dst, host_src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes,
                          Stream*) override {
    if (bytes > 0) std::memmove(host_dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes,
                            Stream*) override {
    if (bytes > 0) std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Memset(void* dst, uint8_t byte, size_t bytes, Stream*) override {
    if (bytes > 0) std::memset(dst, byte, bytes);
    return absl::OkStatus();
  }

 private:
  HostStream stream_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<void*, size_t> sizes_ ABSL_GUARDED_BY(mu_);
  int64_t allocated_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

// No shareable memory unless a device has it (the host device has none).
absl::StatusOr<void*> Device::AllocateShareable(size_t) {
  return NoShareableMemory(*this);
}
absl::StatusOr<std::string> Device::ExportShareable(const void*, size_t) {
  return NoShareableMemory(*this);
}
absl::StatusOr<void*> Device::OpenShared(absl::string_view) {
  return NoShareableMemory(*this);
}
void Device::CloseShared(void*) {}

absl::Status Device::CopyBatchAsync(CopyKind kind, absl::Span<const CopyPiece> pieces,
                                    Stream* stream) {
  for (const CopyPiece& p : pieces) {
    absl::Status s;
    switch (kind) {
      case CopyKind::kHostToDevice:
        s = CopyToDevice(p.dst, p.src, p.bytes, stream);
        break;
      case CopyKind::kDeviceToHost:
        s = CopyToHostAsync(p.dst, p.src, p.bytes, stream);
        break;
      case CopyKind::kDeviceToDevice:
        s = CopyOnDevice(p.dst, p.src, p.bytes, stream);
        break;
    }
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status Device::CopyOnDevice2D(void* dst, size_t dst_pitch, const void* src,
                                    size_t src_pitch, size_t width, size_t height,
                                    Stream* stream) {
  if (width == 0 || height == 0) return absl::OkStatus();
  if (dst_pitch < width || src_pitch < width) {
    return absl::InvalidArgumentError(
        absl::StrCat(name(), ": 2D copy with a pitch (dst ", dst_pitch, ", src ",
                     src_pitch, ") below the row width ", width));
  }
  for (size_t r = 0; r < height; ++r) {
    absl::Status s =
        CopyOnDevice(static_cast<char*>(dst) + r * dst_pitch,
                     static_cast<const char*>(src) + r * src_pitch, width, stream);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

std::unique_ptr<Device> CreateHostDevice() { return std::make_unique<HostDevice>(); }

}  // namespace tandem::kernels
