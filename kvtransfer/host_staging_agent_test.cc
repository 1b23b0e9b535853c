// HostStagingAgent over two LoopbackAgents: device memory (a buffer only the
// copier touches) goes out through the sender's shadow and lands in the
// receiver's shadow, then on the receiver's device with StageIn; the shadows'
// pages come back once their bytes moved; bad ranges, reads and copier
// failures are refused without copying or leaking.
#include "kvtransfer/host_staging_agent.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "gtest/gtest.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/loopback_agent.h"

namespace tandem::kvtransfer {
namespace {

// "Device" memory: a buffer of its own, reached by the agent only through
// this copier (which counts and can be told to fail).
class FakeDevice : public StagingCopier {
 public:
  explicit FakeDevice(size_t bytes, uint8_t fill) : mem_(bytes, fill) {}
  absl::Status ToHost(absl::Span<const StagingCopy> copies) override {
    if (fail_) return absl::InternalError("device lost");
    for (const StagingCopy& c : copies) {
      if (!Inside(c.src, c.bytes)) return absl::OutOfRangeError("not device memory");
    }
    for (const StagingCopy& c : copies) {
      std::memcpy(c.dst, c.src, c.bytes);
      to_host_ += c.bytes;
    }
    ++batches_;
    return absl::OkStatus();
  }
  absl::Status ToDevice(absl::Span<const StagingCopy> copies) override {
    if (fail_) return absl::InternalError("device lost");
    for (const StagingCopy& c : copies) {
      if (!Inside(c.dst, c.bytes)) return absl::OutOfRangeError("not device memory");
    }
    for (const StagingCopy& c : copies) {
      std::memcpy(c.dst, c.src, c.bytes);
      to_device_ += c.bytes;
    }
    ++batches_;
    return absl::OkStatus();
  }
  std::string DeviceName() const override { return "fake:0"; }

  uint8_t* data() { return mem_.data(); }
  size_t size() const { return mem_.size(); }
  std::atomic<uint64_t> to_host_{0}, to_device_{0};
  std::atomic<int> batches_{0};  // copier calls
  std::atomic<bool> fail_{false};

 private:
  bool Inside(const void* p, size_t n) const {
    const auto* b = static_cast<const uint8_t*>(p);
    return b >= mem_.data() && b + n <= mem_.data() + mem_.size();
  }
  std::vector<uint8_t> mem_;
};

// A device that shares its memory between "processes" (IPC): here both agents
// live in one process, so a handle is the address and opening it returns the
// same memory (a real device maps it at another address). Opens and closes are
// counted; opening can be told to fail (another host, no peer access).
class FakeIpcDevice : public FakeDevice {
 public:
  using FakeDevice::FakeDevice;
  absl::StatusOr<std::string> ExportIpc(const void* base, size_t len) override {
    if (!export_) return absl::InvalidArgumentError("not a shareable allocation");
    return absl::StrCat("fake-ipc:", reinterpret_cast<uintptr_t>(base), ":", len);
  }
  absl::StatusOr<void*> OpenIpc(absl::string_view handle) override {
    if (!open_) return absl::FailedPreconditionError("exported on another host");
    uintptr_t p = 0;
    size_t len = 0;
    if (std::sscanf(std::string(handle).c_str(), "fake-ipc:%zu:%zu", &p, &len) != 2) {
      return absl::InvalidArgumentError("bad handle");
    }
    ++opened_;
    absl::MutexLock l(&mu_);
    mapped_.push_back({reinterpret_cast<uint8_t*>(p), len});
    return reinterpret_cast<void*>(p);
  }
  // Host -> a mapping of the peer's memory, or -> this device's.
  absl::Status ToDevice(absl::Span<const StagingCopy> copies) override {
    bool all_mapped = true;
    {
      absl::MutexLock l(&mu_);
      for (const StagingCopy& c : copies) {
        bool in = false;
        for (const auto& [base, len] : mapped_) {
          const auto* d = static_cast<const uint8_t*>(c.dst);
          in = in || (d >= base && d + c.bytes <= base + len);
        }
        all_mapped = all_mapped && in;
      }
    }
    if (!all_mapped) return FakeDevice::ToDevice(copies);
    for (const StagingCopy& c : copies) std::memcpy(c.dst, c.src, c.bytes);
    to_peer_host_ += copies.size();
    return absl::OkStatus();
  }
  void CloseIpc(void* mapped) override { ++closed_; }
  absl::Status ToPeer(absl::Span<const StagingCopy> copies) override {
    if (fail_) return absl::InternalError("device lost");
    for (const StagingCopy& c : copies) {
      std::memcpy(c.dst, c.src, c.bytes);
      to_peer_ += c.bytes;
    }
    ++peer_batches_;
    return absl::OkStatus();
  }
  bool export_ = true, open_ = true;
  std::atomic<int> opened_{0}, closed_{0}, peer_batches_{0}, to_peer_host_{0};
  absl::Mutex mu_;
  std::vector<std::pair<uint8_t*, size_t>> mapped_;
  std::atomic<uint64_t> to_peer_{0};
};

// Resident pages of [p, p + n) (page-aligned p).
size_t Resident(const void* p, size_t n) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> v((n + page - 1) / page);
  if (mincore(const_cast<void*>(p), n, v.data()) != 0) return SIZE_MAX;
  size_t r = 0;
  for (unsigned char c : v) r += c & 1;
  return r;
}

// Resident pages of [p, p + n) once they settle at `want` (a batch's pages go
// back from its completion callback, on the agent's progress thread, which may
// run just after Wait returned); the last count after 5 s otherwise.
size_t ResidentSettled(const void* p, size_t n, size_t want) {
  const absl::Time end = absl::Now() + absl::Seconds(5);
  size_t r = Resident(p, n);
  while (r != want && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(1));
    r = Resident(p, n);
  }
  return r;
}

// The shadow's host address, as the agent publishes it.
uint8_t* ShadowOf(TransferAgent& agent, RegionId region) {
  auto d = ParseDescriptor(*agent.LocalDescriptor(""));
  if (!d.ok()) return nullptr;
  const RegionDescriptor* r = d->FindRegion(region);
  return r == nullptr ? nullptr : reinterpret_cast<uint8_t*>(r->base);
}

constexpr size_t kBytes = 4 << 20;

class HostStagingTest : public ::testing::Test {
 protected:
  void Start(HostStagingOptions options = {}) {
    sender_ =
        std::make_unique<HostStagingAgent>(std::make_unique<LoopbackAgent>(), options);
    receiver_ =
        std::make_unique<HostStagingAgent>(std::make_unique<LoopbackAgent>(), options);
    src_ = std::make_shared<FakeDevice>(kBytes, 0);
    std::mt19937 rng(7);
    for (size_t i = 0; i < kBytes; ++i) src_->data()[i] = static_cast<uint8_t>(rng());
    dst_ = std::make_shared<FakeDevice>(kBytes, 0xEE);
    src_region_ = *sender_->RegisterStaged(src_->data(), kBytes, src_);
    dst_region_ = *receiver_->RegisterStaged(dst_->data(), kBytes, dst_);
    peer_ = *sender_->Connect(*receiver_->LocalDescriptor("meta"));
  }
  Segment Seg(uint64_t src_off, uint64_t dst_off, uint64_t len) {
    return Segment{src_region_, src_off, dst_region_, dst_off, len};
  }
  absl::Status Send(const std::vector<Segment>& segs) {
    absl::StatusOr<BatchId> b = sender_->PostWrite(peer_, segs, nullptr);
    if (!b.ok()) return b.status();
    return sender_->Wait(*b, absl::Now() + absl::Seconds(10));
  }

  std::unique_ptr<HostStagingAgent> sender_, receiver_;
  std::shared_ptr<FakeDevice> src_, dst_;
  RegionId src_region_ = 0, dst_region_ = 0;
  PeerId peer_ = 0;
};

TEST(KvBufferTest, ParsesTheThreeModes) {
  EXPECT_EQ(*ParseKvBuffer("auto"), KvBuffer::kAuto);
  EXPECT_EQ(*ParseKvBuffer("device"), KvBuffer::kDevice);
  EXPECT_EQ(*ParseKvBuffer("host"), KvBuffer::kHost);
  for (const char* bad : {"", "cpu", "HOST", "cuda"}) {
    EXPECT_EQ(ParseKvBuffer(bad).status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_STREQ(KvBufferName(KvBuffer::kHost), "host");
}

TEST_F(HostStagingTest, DeviceBytesLandOnTheReceiversDeviceAfterStageIn) {
  Start();
  // Unaligned pieces, one crossing granules, landing elsewhere than they start.
  const std::vector<Segment> segs = {Seg(13, 100, 777), Seg(70000, 200000, 300001),
                                     Seg(kBytes - 5, 0, 5)};
  const absl::Status sent = Send(segs);
  ASSERT_TRUE(sent.ok()) << sent.ToString();
  uint64_t total = 0;
  for (const Segment& s : segs) total += s.length;
  EXPECT_EQ(src_->to_host_.load(), total);
  EXPECT_EQ(src_->batches_.load(), 1);  // the batch's pieces in one copier call
  // Landed in the shadow only: the device is untouched until StageIn.
  EXPECT_EQ(dst_->to_device_.load(), 0u);
  for (size_t i = 0; i < kBytes; ++i) ASSERT_EQ(dst_->data()[i], 0xEE) << i;

  std::vector<ByteRange> ranges;
  for (const Segment& s : segs)
    ranges.push_back({dst_region_, s.remote_offset, s.length});
  ASSERT_TRUE(receiver_->StageIn(ranges).ok());
  EXPECT_EQ(dst_->to_device_.load(), total);
  std::vector<uint8_t> want(kBytes, 0xEE);
  for (const Segment& s : segs) {
    std::memcpy(want.data() + s.remote_offset, src_->data() + s.local_offset, s.length);
  }
  EXPECT_EQ(std::memcmp(want.data(), dst_->data(), kBytes), 0);
  EXPECT_EQ(sender_->stats().bytes_to_host, total);
  EXPECT_EQ(receiver_->stats().bytes_to_device, total);
  EXPECT_EQ(receiver_->stats().staged_regions, 1u);
  EXPECT_EQ(receiver_->stats().shadow_bytes, kBytes);
}

TEST_F(HostStagingTest, ShadowPagesAreGivenBackOnceTheBytesMoved) {
  Start();
  uint8_t* send_shadow = ShadowOf(*sender_, src_region_);
  uint8_t* recv_shadow = ShadowOf(*receiver_, dst_region_);
  ASSERT_NE(send_shadow, nullptr);
  ASSERT_NE(recv_shadow, nullptr);
  EXPECT_EQ(Resident(send_shadow, kBytes), 0u);  // reserved, not committed
  // 1 MiB from offset 64 KiB; lands at 100 bytes past 1 MiB (not page-aligned).
  const uint64_t len = 1 << 20;
  ASSERT_TRUE(Send({Seg(64 << 10, (1 << 20) + 100, len)}).ok());
  // The sender's copy is given back when its batch ended.
  EXPECT_EQ(ResidentSettled(send_shadow, kBytes, 0), 0u);
  EXPECT_GE(sender_->stats().pages_released, len / sysconf(_SC_PAGESIZE));
  // The receiver's stays until StageIn: then only the pages wholly inside the
  // range go (the first and last hold bytes outside it). Counted in pages
  // whether or not the kernel backed the shadow with huge pages.
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const uint64_t at = (1 << 20) + 100;
  EXPECT_GE(Resident(recv_shadow, kBytes), len / page + 1);
  ASSERT_TRUE(receiver_->StageIn({{dst_region_, at, len}}).ok());
  const uint64_t first = at / page, last = (at + len - 1) / page;
  EXPECT_EQ(Resident(recv_shadow + (first + 1) * page, (last - first - 1) * page), 0u);
  EXPECT_EQ(Resident(recv_shadow + first * page, page), 1u);
  EXPECT_EQ(Resident(recv_shadow + last * page, page), 1u);
  EXPECT_EQ(receiver_->stats().pages_released, last - first - 1);
  EXPECT_EQ(std::memcmp(dst_->data() + at, src_->data() + (64 << 10), len), 0);
}

// A receiver's reservation freed without its state staged in (a failed
// transfer): Discard gives its shadow pages back without copying anything.
TEST_F(HostStagingTest, DiscardGivesLandedPagesBackWithoutCopying) {
  Start();
  ASSERT_TRUE(Send({Seg(0, 0, 1 << 20)}).ok());
  uint8_t* shadow = ShadowOf(*receiver_, dst_region_);
  ASSERT_NE(shadow, nullptr);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  EXPECT_EQ(Resident(shadow, 1 << 20), (size_t{1} << 20) / page);
  const uint64_t copied = dst_->to_device_;
  ASSERT_TRUE(receiver_->Discard({{dst_region_, 0, 1 << 20}}).ok());
  EXPECT_EQ(Resident(shadow, 1 << 20), 0u);
  EXPECT_EQ(dst_->to_device_, copied);
  EXPECT_EQ(dst_->data()[0], 0xEE);  // the device never saw the bytes
  EXPECT_EQ(receiver_->Discard({{dst_region_, kBytes - 1, 2}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(receiver_->Discard({{dst_region_ + 9, 0, 1}}).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(HostStagingTest, WithoutPageReleaseTheShadowsKeepTheirPages) {
  Start(HostStagingOptions{.release_pages = false});
  const uint64_t len = 256 << 10;
  ASSERT_TRUE(Send({Seg(0, 0, len)}).ok());
  ASSERT_TRUE(receiver_->StageIn({{dst_region_, 0, len}}).ok());
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  // At least the bytes' pages (whole huge pages where the kernel used them).
  EXPECT_GE(Resident(ShadowOf(*sender_, src_region_), kBytes), len / page);
  EXPECT_GE(Resident(ShadowOf(*receiver_, dst_region_), kBytes), len / page);
  EXPECT_EQ(sender_->stats().pages_released + receiver_->stats().pages_released, 0u);
  EXPECT_EQ(std::memcmp(dst_->data(), src_->data(), len), 0);
}

TEST_F(HostStagingTest, AGranuleStaysWhileAnotherBatchInFlightUsesIt) {
  Start();
  // A second receiver, paused: its batch stays in flight, reading the same
  // granule of the sender's shadow as a batch to the first receiver.
  auto dst2 = std::make_shared<FakeDevice>(kBytes, 0xEE);
  HostStagingAgent receiver2(std::make_unique<LoopbackAgent>());
  const RegionId region2 = *receiver2.RegisterStaged(dst2->data(), kBytes, dst2);
  const PeerId peer2 = *sender_->Connect(*receiver2.LocalDescriptor(""));
  auto* inner2 = static_cast<LoopbackAgent*>(receiver2.inner());
  inner2->SetPaused(true);
  absl::StatusOr<BatchId> b = sender_->PostWrite(
      peer2, {Segment{src_region_, 4096, region2, 4096, 8192}}, nullptr);
  ASSERT_TRUE(b.ok());
  absl::Mutex mu;
  bool a_done = false;
  absl::StatusOr<BatchId> a =
      sender_->PostWrite(peer_, {Seg(0, 0, 8192)}, [&](BatchId, const absl::Status&) {
        absl::MutexLock l(&mu);
        a_done = true;
      });
  ASSERT_TRUE(a.ok());
  {
    // a's completion (and its granule release) ran: b still holds the granule.
    absl::MutexLock l(&mu);
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&a_done), absl::Seconds(10)));
  }
  EXPECT_EQ(sender_->stats().pages_released, 0u);
  uint8_t* send_shadow = ShadowOf(*sender_, src_region_);
  EXPECT_GT(Resident(send_shadow, 16384), 0u);
  inner2->SetPaused(false);
  ASSERT_TRUE(sender_->Wait(*b, absl::Now() + absl::Seconds(10)).ok());
  ASSERT_TRUE(receiver2.StageIn({{region2, 4096, 8192}}).ok());
  // b read its bytes from the shadow before anything was given back.
  EXPECT_EQ(std::memcmp(dst2->data() + 4096, src_->data() + 4096, 8192), 0);
  EXPECT_EQ(ResidentSettled(send_shadow, kBytes, 0), 0u);
  ASSERT_TRUE(sender_->Disconnect(peer2).ok());
}

TEST_F(HostStagingTest, BadRangesAreRefusedBeforeAnyCopy) {
  Start();
  EXPECT_EQ(sender_->PostWrite(peer_, {Seg(0, 0, 16), Seg(kBytes - 8, 0, 9)}, nullptr)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(src_->to_host_.load(), 0u);
  EXPECT_EQ(receiver_->StageIn({{dst_region_, 0, 16}, {dst_region_, kBytes, 1}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(receiver_->StageIn({{dst_region_ + 1000, 0, 16}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(dst_->to_device_.load(), 0u);
  EXPECT_EQ(sender_->PostRead(peer_, {Seg(0, 0, 16)}, nullptr).status().code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_EQ(sender_->RegisterStaged(nullptr, 16, src_).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sender_->RegisterStaged(src_->data(), 16, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Still usable afterwards.
  ASSERT_TRUE(Send({Seg(0, 0, 4096)}).ok());
}

TEST_F(HostStagingTest, ACopierFailureFailsThePostAndLeavesNothingCounted) {
  Start();
  src_->fail_ = true;
  absl::StatusOr<BatchId> b = sender_->PostWrite(peer_, {Seg(0, 0, 200000)}, nullptr);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("device lost"), std::string::npos);
  src_->fail_ = false;
  ASSERT_TRUE(Send({Seg(0, 0, 200000)}).ok());
  // The failed post's granules were dropped: everything went back.
  EXPECT_EQ(ResidentSettled(ShadowOf(*sender_, src_region_), kBytes, 0), 0u);
  dst_->fail_ = true;
  EXPECT_EQ(receiver_->StageIn({{dst_region_, 0, 200000}}).code(),
            absl::StatusCode::kInternal);
}

TEST_F(HostStagingTest, HostRegionsPassThroughAndStagedOnesDeregister) {
  Start();
  std::vector<uint8_t> host(8192, 3);
  const size_t before = sender_->NumRegisteredRegions();
  absl::StatusOr<RegionId> h = sender_->RegisterMemory(host.data(), host.size());
  ASSERT_TRUE(h.ok());
  EXPECT_FALSE(sender_->IsStaged(*h));
  EXPECT_TRUE(sender_->IsStaged(src_region_));
  absl::StatusOr<BatchId> b =
      sender_->PostWrite(peer_, {Segment{*h, 0, dst_region_, 0, 8192}}, nullptr);
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(sender_->Wait(*b, absl::Now() + absl::Seconds(10)).ok());
  EXPECT_EQ(src_->to_host_.load(), 0u);  // no staging for host memory
  ASSERT_TRUE(sender_->DeregisterMemory(*h).ok());
  ASSERT_TRUE(sender_->DeregisterMemory(src_region_).ok());
  EXPECT_EQ(sender_->NumRegisteredRegions(), before - 1);
  EXPECT_FALSE(sender_->IsStaged(src_region_));
  EXPECT_EQ(sender_->stats().staged_regions, 0u);
}

// Device to device between processes (IPC): both devices share their memory.
class DirectTest : public ::testing::Test {
 protected:
  void Start(HostStagingOptions options = {}, bool receiver_exports = true,
             bool sender_opens = true) {
    sender_ =
        std::make_unique<HostStagingAgent>(std::make_unique<LoopbackAgent>(), options);
    receiver_ =
        std::make_unique<HostStagingAgent>(std::make_unique<LoopbackAgent>(), options);
    src_ = std::make_shared<FakeIpcDevice>(kBytes, 0);
    std::mt19937 rng(11);
    for (size_t i = 0; i < kBytes; ++i) src_->data()[i] = static_cast<uint8_t>(rng());
    dst_ = std::make_shared<FakeIpcDevice>(kBytes, 0xEE);
    dst_->export_ = receiver_exports;
    src_->open_ = sender_opens;
    src_region_ = *sender_->RegisterStaged(src_->data(), kBytes, src_);
    dst_region_ = *receiver_->RegisterStaged(dst_->data(), kBytes, dst_);
    receiver_->SetNotificationCallback([this](const Notification& n) {
      absl::MutexLock l(&mu_);
      notes_.push_back(n);
    });
    peer_ = *sender_->Connect(*receiver_->LocalDescriptor("meta"));
  }
  absl::Status Send(const std::vector<Segment>& segs) {
    absl::StatusOr<BatchId> b = sender_->PostWrite(peer_, segs, nullptr);
    if (!b.ok()) return b.status();
    TANDEM_RETURN_IF_ERROR(sender_->Wait(*b, absl::Now() + absl::Seconds(10)));
    return sender_->Notify(peer_, "req", "token-7", absl::Now() + absl::Seconds(10));
  }
  Segment Seg(uint64_t src_off, uint64_t dst_off, uint64_t len) {
    return Segment{src_region_, src_off, dst_region_, dst_off, len};
  }
  std::vector<Notification> Notes() {
    absl::MutexLock l(&mu_);
    return notes_;
  }

  std::unique_ptr<HostStagingAgent> sender_, receiver_;
  std::shared_ptr<FakeIpcDevice> src_, dst_;
  RegionId src_region_ = 0, dst_region_ = 0;
  PeerId peer_ = 0;
  absl::Mutex mu_;
  std::vector<Notification> notes_;
};

// A receiver that shares its device memory publishes it; a sender that maps it
// writes device to device, in one copier call, and nothing passes through
// either shadow; the notification is handed on marked on_device with the
// payload as sent.
TEST_F(DirectTest, WritesGoDeviceToDeviceAndTheNotificationSaysSo) {
  Start();
  auto d = ParseDescriptor(*receiver_->LocalDescriptor("meta"));
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_NE(d->FindExtension(kExtensionDeviceIpc), nullptr);
  EXPECT_EQ(d->metadata, "meta");
  EXPECT_TRUE(sender_->IsDirect(peer_));
  EXPECT_EQ(src_->opened_, 1);
  const std::vector<Segment> segs = {Seg(0, 1 << 20, 65536), Seg(3 << 20, 5, 4099),
                                     Seg(100, 2 << 20, 1)};
  const absl::Status sent = Send(segs);
  ASSERT_TRUE(sent.ok()) << sent.ToString();
  for (const Segment& g : segs) {
    EXPECT_EQ(std::memcmp(dst_->data() + g.remote_offset, src_->data() + g.local_offset,
                          g.length),
              0);
  }
  EXPECT_EQ(dst_->data()[0], 0xEE);  // untouched elsewhere
  EXPECT_EQ(src_->peer_batches_, 1);
  EXPECT_EQ(src_->to_peer_, 65536u + 4099u + 1u);
  EXPECT_EQ(src_->to_host_, 0u);
  const HostStagingStats st = sender_->stats();
  EXPECT_EQ(st.bytes_direct, 65536u + 4099u + 1u);
  EXPECT_EQ(st.bytes_to_host, 0u);
  EXPECT_EQ(st.direct_peers, 1u);
  EXPECT_EQ(receiver_->stats().exported_regions, 1u);
  EXPECT_EQ(Resident(ShadowOf(*receiver_, dst_region_), kBytes), 0u);
  const std::vector<Notification> notes = Notes();
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].request_id, "req");
  EXPECT_EQ(notes[0].payload, "token-7");
  EXPECT_TRUE(notes[0].on_device);
  // Disconnecting closes the mappings.
  ASSERT_TRUE(sender_->Disconnect(peer_).ok());
  EXPECT_EQ(src_->closed_, 1);
  EXPECT_FALSE(sender_->IsDirect(peer_));
}

// A peer's published list is checked against its descriptor: empty, or
// naming a region it does not have or with another length, it is refused
// (staged, the reason kept), never written directly.
TEST_F(DirectTest, AnInconsistentPublishedListIsRefused) {
  Start();
  auto d = ParseDescriptor(*receiver_->LocalDescriptor(""));
  ASSERT_TRUE(d.ok());
  auto with_ext = [&](const std::string& bytes) {
    AgentDescriptor x = *d;
    x.extensions = {{kExtensionDeviceIpc, bytes}};
    return SerializeDescriptor(x);
  };
  auto le = [](uint64_t v, int n) {
    std::string s;
    for (int i = 0; i < n; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    return s;
  };
  const std::string handle =
      absl::StrCat("fake-ipc:", reinterpret_cast<uintptr_t>(dst_->data()), ":", kBytes);
  auto entry = [&](uint64_t id, uint64_t len) {
    return le(id, 4) + le(len, 8) + le(handle.size(), 4) + handle;
  };
  const std::vector<std::pair<std::string, std::string>> bad = {
      {le(0, 4), "region count 0"},
      {le(1, 4) + entry(dst_region_ + 7, kBytes), "does not have"},
      {le(1, 4) + entry(dst_region_, kBytes * 2), "has with"},
      {le(2, 4) + entry(dst_region_, kBytes) + entry(dst_region_, kBytes), "twice"},
      {le(1, 4) + entry(dst_region_, kBytes) + "x", "trailing"},
  };
  for (const auto& [bytes, why] : bad) {
    SCOPED_TRACE(why);
    HostStagingAgent other(std::make_unique<LoopbackAgent>());
    auto dev = std::make_shared<FakeIpcDevice>(4096, 1);
    ASSERT_TRUE(other.RegisterStaged(dev->data(), 4096, dev).ok());
    auto peer = other.Connect(with_ext(bytes));
    ASSERT_TRUE(peer.ok()) << peer.status();
    EXPECT_FALSE(other.IsDirect(*peer));
    EXPECT_NE(other.last_direct_refusal().message().find(why), std::string::npos)
        << other.last_direct_refusal();
    EXPECT_EQ(dev->opened_, 0);
  }
}

// A batch with a bad segment among direct ones moves nothing: the segments for
// the inner agent (a region the peer did not publish) are checked first too.
TEST_F(DirectTest, ABadSegmentForTheInnerAgentStopsTheDirectCopies) {
  Start();
  std::vector<uint8_t> host_dst(4096, 0);
  auto host_region = receiver_->RegisterMemory(host_dst.data(), host_dst.size());
  ASSERT_TRUE(host_region.ok());
  peer_ = *sender_->Connect(*receiver_->LocalDescriptor(""));
  ASSERT_TRUE(sender_->IsDirect(peer_));
  auto b = sender_->PostWrite(
      peer_,
      std::vector<Segment>{Seg(0, 0, 64), {src_region_, 0, *host_region, 4000, 200}},
      nullptr);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << b.status();
  EXPECT_EQ(src_->to_peer_, 0u);
  EXPECT_EQ(dst_->data()[0], 0xEE);
  // A good one of each kind goes: the mapped one directly, the other through
  // the shadow and the inner agent.
  ASSERT_TRUE(Send({Seg(0, 0, 64), {src_region_, 100, *host_region, 0, 32}}).ok());
  EXPECT_EQ(src_->to_peer_, 64u);
  EXPECT_EQ(std::memcmp(host_dst.data(), src_->data() + 100, 32), 0);
}

// TP ranks: a sender with regions on two devices maps the peer through each
// device, and each region's bytes are copied by its own device.
TEST(DirectTpTest, EachLocalDeviceCopiesItsOwnRegionsThroughItsOwnMapping) {
  HostStagingAgent sender(std::make_unique<LoopbackAgent>());
  HostStagingAgent receiver(std::make_unique<LoopbackAgent>());
  auto dev0 = std::make_shared<FakeIpcDevice>(kBytes, 0x10);
  auto dev1 = std::make_shared<FakeIpcDevice>(kBytes, 0x11);
  auto dst = std::make_shared<FakeIpcDevice>(kBytes, 0xEE);
  const RegionId r0 = *sender.RegisterStaged(dev0->data(), kBytes, dev0);
  const RegionId r1 = *sender.RegisterStaged(dev1->data(), kBytes, dev1);
  const RegionId d = *receiver.RegisterStaged(dst->data(), kBytes, dst);
  const PeerId peer = *sender.Connect(*receiver.LocalDescriptor(""));
  ASSERT_TRUE(sender.IsDirect(peer));
  EXPECT_EQ(dev0->opened_, 1);  // the receiver's one region, through each device
  EXPECT_EQ(dev1->opened_, 1);
  auto b = sender.PostWrite(
      peer, std::vector<Segment>{{r0, 0, d, 0, 100}, {r1, 0, d, 100, 50}}, nullptr);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE(sender.Wait(*b, absl::Now() + absl::Seconds(10)).ok());
  EXPECT_EQ(dev0->to_peer_, 100u);
  EXPECT_EQ(dev1->to_peer_, 50u);
  EXPECT_EQ(dst->data()[99], 0x10);
  EXPECT_EQ(dst->data()[100], 0x11);
  EXPECT_EQ(dst->data()[150], 0xEE);
}

// A peer whose memory this side cannot map (another host, no peer access) is
// staged as before, and says why; its notification is not marked.
TEST_F(DirectTest, APeerThatCannotBeMappedIsStaged) {
  Start({}, /*receiver_exports=*/true, /*sender_opens=*/false);
  EXPECT_FALSE(sender_->IsDirect(peer_));
  EXPECT_EQ(sender_->stats().direct_refused_peers, 1u);
  EXPECT_NE(sender_->last_direct_refusal().message().find("another host"),
            std::string::npos)
      << sender_->last_direct_refusal();
  ASSERT_TRUE(Send({Seg(0, 0, 8192)}).ok());
  EXPECT_EQ(src_->to_host_, 8192u);
  EXPECT_EQ(src_->to_peer_, 0u);
  EXPECT_EQ(dst_->data()[0], 0xEE);  // in the shadow until StageIn
  ASSERT_TRUE(receiver_->StageIn({{dst_region_, 0, 8192}}).ok());
  EXPECT_EQ(std::memcmp(dst_->data(), src_->data(), 8192), 0);
  const std::vector<Notification> notes = Notes();
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_FALSE(notes[0].on_device);
  EXPECT_EQ(notes[0].payload, "token-7");
}

// Nothing is published with device_ipc off, nor when a staged region cannot
// be shared (a direct writer would skip that region's shadow).
TEST_F(DirectTest, PublishedOnlyWhenOnAndForEveryStagedRegion) {
  HostStagingOptions off;
  off.device_ipc = false;
  Start(off);
  EXPECT_EQ(ParseDescriptor(*receiver_->LocalDescriptor(""))->extensions.size(), 0u);
  EXPECT_FALSE(sender_->IsDirect(peer_));
  Start({}, /*receiver_exports=*/false);
  EXPECT_EQ(ParseDescriptor(*receiver_->LocalDescriptor(""))->extensions.size(), 0u);
  EXPECT_NE(receiver_->ipc_export_status().message().find("not a shareable"),
            std::string::npos)
      << receiver_->ipc_export_status();
  EXPECT_FALSE(sender_->IsDirect(peer_));
  // One region shared, a second not: none published.
  Start();
  auto other = std::make_shared<FakeIpcDevice>(4096, 0);
  other->export_ = false;
  ASSERT_TRUE(receiver_->RegisterStaged(other->data(), 4096, other).ok());
  EXPECT_EQ(ParseDescriptor(*receiver_->LocalDescriptor(""))->extensions.size(), 0u);
}

// Bad segments are refused before anything is copied; a copier failure fails
// the post and leaves the regions free to deregister; a host region is copied
// host to device.
TEST_F(DirectTest, BadSegmentsAndFailuresLeaveNothingBehind) {
  Start();
  auto post = [&](const Segment& g) {
    return sender_->PostWrite(peer_, std::vector<Segment>{g}, nullptr);
  };
  EXPECT_EQ(post(Seg(0, kBytes - 10, 11)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(post(Seg(kBytes - 10, 0, 11)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(post(Segment{99, 0, dst_region_, 0, 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(post(Seg(0, 0, 0)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(src_->to_peer_, 0u);
  src_->fail_ = true;
  absl::StatusOr<BatchId> b = post(Seg(0, 0, 64));
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInternal) << b.status();
  EXPECT_NE(b.status().message().find("peer's device memory"), std::string::npos);
  src_->fail_ = false;
  std::vector<uint8_t> host(4096, 0x5A);
  absl::StatusOr<RegionId> h = sender_->RegisterMemory(host.data(), host.size());
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(Send({{*h, 0, dst_region_, 100, 4096}}).ok());
  EXPECT_EQ(src_->to_peer_host_, 1);
  EXPECT_EQ(dst_->data()[100], 0x5A);
  EXPECT_EQ(dst_->data()[4195], 0x5A);
  EXPECT_TRUE(sender_->DeregisterMemory(*h).ok());
  EXPECT_TRUE(sender_->DeregisterMemory(src_region_).ok());
  sender_.reset();  // closes the peer's mappings
  EXPECT_EQ(src_->closed_, src_->opened_);
}

}  // namespace
}  // namespace tandem::kvtransfer
