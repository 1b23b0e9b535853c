// HostStagingAgent over two LoopbackAgents: device memory (a buffer only the
// copier touches) goes out through the sender's shadow and lands in the
// receiver's shadow, then on the receiver's device with StageIn; the shadows'
// pages come back once their bytes moved; bad ranges, reads and copier
// failures are refused without copying or leaking.
#include "kvtransfer/host_staging_agent.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
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
  ASSERT_TRUE(Send(segs).ok());
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

}  // namespace
}  // namespace tandem::kvtransfer
