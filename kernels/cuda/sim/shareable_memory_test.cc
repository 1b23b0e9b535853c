// Device memory shared between processes (Device::AllocateShareable /
// ExportShareable / OpenShared) on the cuda_sim device, across two real
// processes: the test binary re-executes itself (/proc/self/exe) with
// $TANDEM_SHAREABLE_TEST_CHILD set, and that process opens the parent's handle.
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kernels/cuda/shareable_handle.h"
#include "kernels/cuda/sim/sim_device.h"
#include "kernels/device.h"

extern char** environ;

namespace tandem::kernels::cuda {
namespace {

// "<mode>:<handle in hex>": the process that opens the handle (RunChild).
constexpr char kChildEnv[] = "TANDEM_SHAREABLE_TEST_CHILD";

// The shareable allocation, and the range of it the parent exports.
constexpr size_t kAllocBytes = 3 * 4096 + 100;
constexpr size_t kRangeOffset = 4096 + 8;
constexpr size_t kRangeBytes = 6000;
// What the child writes, relative to the range: by CopyToDevice and by
// CopyOnDevice from a buffer of its own device.
constexpr size_t kHostWriteAt = 100, kHostWriteBytes = 500;
constexpr size_t kDeviceWriteAt = 2000, kDeviceWriteBytes = 1000;

// The parent's bytes and the child's, by offset in the allocation.
uint8_t PatternA(size_t i) { return static_cast<uint8_t>(i * 131 + 7 + (i >> 8)); }
uint8_t PatternB(size_t i) { return PatternA(i) ^ 0xa5; }

std::vector<uint8_t> Pattern(uint8_t (*f)(size_t), size_t from, size_t bytes) {
  std::vector<uint8_t> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = f(from + i);
  return v;
}

// ---- The child process -------------------------------------------------------

int Fail(const std::string& why) {
  std::fprintf(stderr, "shareable_memory_test child: %s\n", why.c_str());
  return 1;
}

// "rw": checks the parent's pattern through the mapping, writes PatternB into
// two sub-ranges. "gone": OpenShared must be FAILED_PRECONDITION (the exporter
// freed the allocation).
int RunChild(absl::string_view spec) {
  const size_t colon = spec.find(':');
  if (colon == absl::string_view::npos)
    return Fail("malformed $" + std::string(kChildEnv));
  const absl::string_view mode = spec.substr(0, colon);
  const std::string handle = absl::HexStringToBytes(spec.substr(colon + 1));
  auto dev = CreateSimDevice(1 << 20);

  absl::StatusOr<void*> opened = dev->OpenShared(handle);
  if (mode == "gone") {
    if (opened.ok()) return Fail("OpenShared of a freed allocation succeeded");
    if (opened.status().code() != absl::StatusCode::kFailedPrecondition ||
        !absl::StrContains(opened.status().message(), "exporter")) {
      return Fail(absl::StrCat("want FAILED_PRECONDITION naming the exporter, got ",
                               opened.status().ToString()));
    }
    std::fprintf(stderr, "child: as expected: %s\n",
                 opened.status().ToString().c_str());
    return 0;
  }
  if (mode != "rw") return Fail(absl::StrCat("unknown mode ", mode));
  if (!opened.ok()) return Fail("OpenShared: " + opened.status().ToString());
  char* mapped = static_cast<char*>(*opened);

  // The range, and only the range, is this device's memory now.
  if (!dev->Owns(mapped, kRangeBytes)) return Fail("Owns(mapping) is false");
  if (dev->Owns(mapped, kRangeBytes + 1)) return Fail("Owns past the range");
  if (dev->Owns(mapped - 1, 1)) return Fail("Owns before the range");
  if (dev->MemoryInfo().allocated_bytes != 0) return Fail("a mapping counted");

  std::vector<uint8_t> got(kRangeBytes);
  if (absl::Status st = dev->CopyToHost(got.data(), mapped, kRangeBytes); !st.ok()) {
    return Fail("CopyToHost: " + st.ToString());
  }
  if (got != Pattern(PatternA, kRangeOffset, kRangeBytes)) {
    return Fail("the mapping does not hold the parent's pattern");
  }

  // Host -> mapping.
  const std::vector<uint8_t> b1 =
      Pattern(PatternB, kRangeOffset + kHostWriteAt, kHostWriteBytes);
  if (absl::Status st = dev->CopyToDevice(mapped + kHostWriteAt, b1.data(), b1.size());
      !st.ok()) {
    return Fail("CopyToDevice: " + st.ToString());
  }
  // Own device memory -> mapping, and back (the mapping as dst and as src).
  const std::vector<uint8_t> b2 =
      Pattern(PatternB, kRangeOffset + kDeviceWriteAt, kDeviceWriteBytes);
  auto own = DeviceBuffer::Allocate(dev.get(), b2.size());
  if (!own.ok()) return Fail("Allocate: " + own.status().ToString());
  if (absl::Status st = dev->CopyToDevice(own->data(), b2.data(), b2.size());
      !st.ok()) {
    return Fail("CopyToDevice: " + st.ToString());
  }
  if (absl::Status st =
          dev->CopyOnDevice(mapped + kDeviceWriteAt, own->data(), b2.size());
      !st.ok()) {
    return Fail("CopyOnDevice into the mapping: " + st.ToString());
  }
  if (absl::Status st = dev->Memset(own->data(), 0, b2.size()); !st.ok()) {
    return Fail("Memset: " + st.ToString());
  }
  if (absl::Status st =
          dev->CopyOnDevice(own->data(), mapped + kDeviceWriteAt, b2.size());
      !st.ok()) {
    return Fail("CopyOnDevice from the mapping: " + st.ToString());
  }
  std::vector<uint8_t> back(b2.size());
  if (absl::Status st = dev->CopyToHost(back.data(), own->data(), back.size());
      !st.ok()) {
    return Fail("CopyToHost: " + st.ToString());
  }
  if (back != b2) return Fail("the copy out of the mapping differs");
  // A copy running past the exported range is refused.
  if (dev->CopyToDevice(mapped + kRangeBytes - 10, b1.data(), 20).ok()) {
    return Fail("CopyToDevice past the range succeeded");
  }

  dev->CloseShared(mapped);
  if (dev->Owns(mapped, 1)) return Fail("Owns after CloseShared");
  return 0;
}

// ---- The parent's side ---------------------------------------------------------

// Starts this binary as a child opening `handle` in `mode` and returns its exit
// status (-1: no child; -2: it ran past `limit` and was killed).
int RunChildProcess(absl::string_view mode, absl::string_view handle,
                    absl::Duration limit = absl::Seconds(60)) {
  const std::string env =
      absl::StrCat(kChildEnv, "=", mode, ":", absl::BytesToHexString(handle));
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) {
    if (!absl::StartsWith(*e, absl::StrCat(kChildEnv, "="))) envp.push_back(*e);
  }
  envp.push_back(const_cast<char*>(env.c_str()));
  envp.push_back(nullptr);
  char exe[] = "/proc/self/exe";
  char* argv[] = {exe, nullptr};
  pid_t pid = 0;
  if (const int e = posix_spawn(&pid, exe, nullptr, nullptr, argv, envp.data());
      e != 0) {
    ADD_FAILURE() << "posix_spawn: " << std::strerror(e);
    return -1;
  }
  const absl::Time deadline = absl::Now() + limit;
  for (;;) {
    int status = 0;
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      ADD_FAILURE() << "child killed by signal " << WTERMSIG(status);
      return 128 + WTERMSIG(status);
    }
    if (r < 0 && errno != EINTR) {
      ADD_FAILURE() << "waitpid: " << std::strerror(errno);
      return -1;
    }
    if (absl::Now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      ADD_FAILURE() << "child still running after " << limit << ": killed";
      return -2;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
}

TEST(ShareableMemory, AnotherProcessReadsAndWritesTheExportedRange) {
  auto dev = CreateSimDevice(1 << 20);
  absl::StatusOr<void*> p = dev->AllocateShareable(kAllocBytes);
  ASSERT_TRUE(p.ok()) << p.status();
  char* base = static_cast<char*>(*p);
  const std::vector<uint8_t> a = Pattern(PatternA, 0, kAllocBytes);
  ASSERT_TRUE(dev->CopyToDevice(base, a.data(), a.size()).ok());
  absl::StatusOr<std::string> handle =
      dev->ExportShareable(base + kRangeOffset, kRangeBytes);
  ASSERT_TRUE(handle.ok()) << handle.status();
  EXPECT_LE(handle->size(), kMaxShareableHandleBytes);

  ASSERT_EQ(RunChildProcess("rw", *handle), 0) << "see the child's stderr above";

  std::vector<uint8_t> got(kAllocBytes);
  ASSERT_TRUE(dev->CopyToHost(got.data(), base, got.size()).ok());
  size_t wrong = 0;
  for (size_t i = 0; i < kAllocBytes; ++i) {
    const size_t r = i - kRangeOffset;  // wraps below the range: matches neither
    const bool b = (r >= kHostWriteAt && r < kHostWriteAt + kHostWriteBytes) ||
                   (r >= kDeviceWriteAt && r < kDeviceWriteAt + kDeviceWriteBytes);
    if (got[i] != (b ? PatternB(i) : PatternA(i)) && wrong++ < 5) {
      ADD_FAILURE() << "byte " << i << ": " << int{got[i]};
    }
  }
  EXPECT_EQ(wrong, 0u);
  dev->Free(base);
}

TEST(ShareableMemory, AFreedAllocationCannotBeOpened) {
  auto dev = CreateSimDevice(1 << 20);
  absl::StatusOr<void*> p = dev->AllocateShareable(kAllocBytes);
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<std::string> handle = dev->ExportShareable(*p, kAllocBytes);
  ASSERT_TRUE(handle.ok()) << handle.status();
  dev->Free(*p);
  // Its fd is closed ...
  EXPECT_EQ(RunChildProcess("gone", *handle), 0) << "see the child's stderr above";
  // ... or, likely, the number of another allocation's fd now (same size too).
  absl::StatusOr<void*> q = dev->AllocateShareable(kAllocBytes);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(RunChildProcess("gone", *handle), 0) << "see the child's stderr above";
  dev->Free(*q);
}

TEST(ShareableMemory, OwnHandlesAndOtherHostsAreFailedPrecondition) {
  auto dev = CreateSimDevice(1 << 20);
  absl::StatusOr<void*> p = dev->AllocateShareable(4096);
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<std::string> handle = dev->ExportShareable(*p, 4096);
  ASSERT_TRUE(handle.ok()) << handle.status();

  absl::StatusOr<void*> same = dev->OpenShared(*handle);
  EXPECT_EQ(same.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(same.status().message(), "this process"))
      << same.status();
  // A second device of this process is this process too.
  EXPECT_EQ(CreateSimDevice(1 << 20)->OpenShared(*handle).status().code(),
            absl::StatusCode::kFailedPrecondition);

  auto h = DecodeShareableHandle(*handle, ShareableKind::kCudaSim,
                                 handle->size() - kShareableHandleHeaderBytes, "test");
  ASSERT_TRUE(h.ok()) << h.status();
  h->boot_id[0] = h->boot_id[0] == '0' ? '1' : '0';
  h->pid = h->pid == 1 ? 2 : 1;  // another process, too: the host check comes first
  absl::StatusOr<void*> other = dev->OpenShared(EncodeShareableHandle(*h));
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(other.status().message(), "another host"))
      << other.status();
  dev->Free(*p);
}

TEST(ShareableMemory, MalformedHandlesAreInvalidArgument) {
  auto dev = CreateSimDevice(1 << 20);
  absl::StatusOr<void*> p = dev->AllocateShareable(4096);
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<std::string> handle = dev->ExportShareable(*p, 4096);
  ASSERT_TRUE(handle.ok()) << handle.status();
  for (size_t n = 0; n < handle->size(); ++n) {
    EXPECT_EQ(dev->OpenShared(handle->substr(0, n)).status().code(),
              absl::StatusCode::kInvalidArgument)
        << "truncated to " << n;
  }
  EXPECT_EQ(dev->OpenShared(*handle + "x").status().code(),
            absl::StatusCode::kInvalidArgument);
  for (char c : {'\0', '\xff', 'T'}) {
    EXPECT_EQ(dev->OpenShared(std::string(handle->size(), c)).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(dev->OpenShared(std::string(300, c)).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  // Any one byte changed: refused one way or another, never mapped (the memfd's
  // inode is in the handle, so another process's fd of that number is not it).
  for (size_t i = 0; i < handle->size(); ++i) {
    for (uint8_t x : {0x01, 0x80, 0xff}) {
      std::string bad = *handle;
      bad[i] = static_cast<char>(bad[i] ^ x);
      absl::StatusOr<void*> m = dev->OpenShared(bad);
      EXPECT_FALSE(m.ok()) << "byte " << i << " ^ " << int{x};
      if (m.ok()) dev->CloseShared(*m);
    }
  }
  dev->Free(*p);
}

TEST(ShareableMemory, ExportedRangesLieInsideOneShareableAllocation) {
  auto dev = CreateSimDevice(1 << 20);
  absl::StatusOr<void*> p = dev->AllocateShareable(1000);
  ASSERT_TRUE(p.ok()) << p.status();
  char* s = static_cast<char*>(*p);
  auto plain = DeviceBuffer::Allocate(dev.get(), 1000);
  ASSERT_TRUE(plain.ok());
  std::vector<char> host(1000);
  EXPECT_TRUE(dev->ExportShareable(s, 1000).ok());
  EXPECT_TRUE(dev->ExportShareable(s + 999, 1).ok());
  struct Case {
    const char* name;
    const void* p;
    size_t bytes;
  };
  for (const Case& c : std::vector<Case>{
           {"past the end", s + 990, 20},
           {"one byte long", s, 1001},
           {"at the end", s + 1000, 1},
           {"before the start", s - 1, 2},
           {"empty", s, 0},
           {"nullptr", nullptr, 1},
           {"plain device memory", plain->data(), 16},
           {"host memory", host.data(), 16},
       }) {
    EXPECT_EQ(dev->ExportShareable(c.p, c.bytes).status().code(),
              absl::StatusCode::kInvalidArgument)
        << c.name;
  }
  dev->Free(s);
  EXPECT_EQ(dev->ExportShareable(s, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ShareableMemory, CountsAgainstCapacityUntilFreed) {
  auto dev = CreateSimDevice(1 << 20);
  const DeviceMemoryInfo before = dev->MemoryInfo();
  absl::StatusOr<void*> p = dev->AllocateShareable(1000);
  ASSERT_TRUE(p.ok()) << p.status();
  const DeviceMemoryInfo during = dev->MemoryInfo();
  EXPECT_EQ(during.allocated_bytes, before.allocated_bytes + 1000);
  EXPECT_EQ(during.free_bytes, before.free_bytes - 1024);
  EXPECT_TRUE(dev->Owns(*p, 1000));
  EXPECT_FALSE(dev->Owns(*p, 1001));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(*p) % 256, 0u);
  // Zero-filled, and ordinary device memory for copies.
  std::vector<uint8_t> got(1000, 1);
  ASSERT_TRUE(dev->CopyToHost(got.data(), *p, got.size()).ok());
  EXPECT_EQ(got, std::vector<uint8_t>(1000, 0));
  auto plain = DeviceBuffer::Allocate(dev.get(), 1000);
  ASSERT_TRUE(plain.ok());
  ASSERT_TRUE(dev->Memset(*p, 7, 1000).ok());
  ASSERT_TRUE(dev->CopyOnDevice(plain->data(), *p, 1000).ok());
  ASSERT_TRUE(dev->CopyToHost(got.data(), plain->data(), got.size()).ok());
  EXPECT_EQ(got, std::vector<uint8_t>(1000, 7));
  plain->Reset();

  dev->Free(*p);
  EXPECT_FALSE(dev->Owns(*p, 1));
  const DeviceMemoryInfo after = dev->MemoryInfo();
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);
  EXPECT_EQ(after.free_bytes, before.free_bytes);

  // Beyond the capacity: RESOURCE_EXHAUSTED, and nothing stays reserved.
  absl::StatusOr<void*> big = dev->AllocateShareable((1 << 20) + 1);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(dev->MemoryInfo().free_bytes, before.free_bytes);
  // Not while the compute stream captures (as Allocate).
  ASSERT_TRUE(dev->compute_stream().BeginCapture().ok());
  EXPECT_EQ(dev->AllocateShareable(16).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(dev->compute_stream().EndCapture().ok());
  dev->CloseShared(nullptr);  // a no-op
}

TEST(ShareableMemory, TheHostDeviceHasNone) {
  auto host = CreateHostDevice();
  std::vector<char> mem(64);
  for (const absl::Status& st : {host->AllocateShareable(64).status(),
                                 host->ExportShareable(mem.data(), 64).status(),
                                 host->OpenShared("anything").status()}) {
    EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented) << st;
    EXPECT_EQ(st.message(), "host has no device memory shareable between processes");
  }
  host->CloseShared(nullptr);
}

}  // namespace
}  // namespace tandem::kernels::cuda

int main(int argc, char** argv) {
  if (const char* child = std::getenv(tandem::kernels::cuda::kChildEnv)) {
    return tandem::kernels::cuda::RunChild(child);
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
