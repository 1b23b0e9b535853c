// LoopbackAgent-specific behaviour: fault injection makes deadlines, cancellation
// and peer death deterministic (the shared suite covers the common semantics).
#include "kvtransfer/loopback_agent.h"

#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace tandem::kvtransfer {
namespace {

absl::Time Soon() { return absl::Now() + absl::Seconds(10); }

class LoopbackFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    src_.assign(1 << 20, 7);
    dst_.assign(1 << 20, 0);
    src_region_ = *a_.RegisterMemory(src_.data(), src_.size());
    dst_region_ = *b_.RegisterMemory(dst_.data(), dst_.size());
    auto peer = a_.Connect(*b_.LocalDescriptor());
    ASSERT_TRUE(peer.ok());
    peer_ = *peer;
  }
  std::vector<Segment> All() { return {{src_region_, 0, dst_region_, 0, src_.size()}}; }

  LoopbackAgent a_, b_;
  std::vector<uint8_t> src_, dst_;
  RegionId src_region_ = 0, dst_region_ = 0;
  PeerId peer_ = 0;
};

TEST_F(LoopbackFaultTest, PausedPeerHitsTheDeadlineThenCompletes) {
  b_.SetPaused(true);
  auto batch = a_.PostWrite(peer_, All());
  ASSERT_TRUE(batch.ok());
  const absl::Time t0 = absl::Now();
  EXPECT_EQ(a_.Wait(*batch, t0 + absl::Milliseconds(50)).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(50));
  EXPECT_EQ(a_.Poll(*batch).value_or(true), false);
  // The region is still in use.
  EXPECT_EQ(a_.DeregisterMemory(src_region_).code(),
            absl::StatusCode::kFailedPrecondition);
  // Notify cannot overtake the stalled batch.
  EXPECT_EQ(a_.Notify(peer_, "r", "", absl::Now() + absl::Milliseconds(20)).code(),
            absl::StatusCode::kDeadlineExceeded);
  b_.SetPaused(false);
  EXPECT_TRUE(a_.Wait(*batch, Soon()).ok());
  EXPECT_EQ(dst_, src_);
  EXPECT_TRUE(a_.DeregisterMemory(src_region_).ok());
}

TEST_F(LoopbackFaultTest, CancelWhilePausedEndsCancelled) {
  b_.SetPaused(true);
  auto first = a_.PostWrite(peer_, All());
  auto queued = a_.PostWrite(peer_, All());
  ASSERT_TRUE(first.ok() && queued.ok());
  ASSERT_TRUE(a_.Cancel(*queued).ok());
  ASSERT_TRUE(a_.Cancel(*first).ok());
  EXPECT_EQ(a_.Wait(*queued, Soon()).code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(a_.Wait(*first, Soon()).code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(dst_, std::vector<uint8_t>(dst_.size(), 0));
  b_.SetPaused(false);
}

TEST_F(LoopbackFaultTest, KilledPeerFailsUnavailable) {
  b_.SetPaused(true);
  auto batch = a_.PostWrite(peer_, All());
  ASSERT_TRUE(batch.ok());
  b_.Kill();
  const absl::Status st = a_.Wait(*batch, Soon());
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  auto again = a_.PostWrite(peer_, All());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(a_.Wait(*again, Soon()).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(a_.Notify(peer_, "r", "", Soon()).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(a_.Connect(*b_.LocalDescriptor()).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_TRUE(a_.Disconnect(peer_).ok());
  EXPECT_TRUE(a_.DeregisterMemory(src_region_).ok());
  EXPECT_EQ(a_.NumPeers(), 0u);
  EXPECT_EQ(a_.NumRegisteredRegions(), 0u);
}

TEST_F(LoopbackFaultTest, DestroyedPeerIsUnreachable) {
  std::string desc;
  {
    LoopbackAgent gone;
    desc = *gone.LocalDescriptor();
  }
  EXPECT_EQ(a_.Connect(desc).status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(LoopbackFaultTest, CallbackReceivesQueuedNotifications) {
  ASSERT_TRUE(a_.Notify(peer_, "early", "x", Soon()).ok());
  std::vector<std::string> seen;
  b_.SetNotificationCallback(
      [&](const Notification& n) { seen.push_back(n.request_id); });
  ASSERT_EQ(seen.size(), 1u);  // handed over at registration
  ASSERT_TRUE(a_.Notify(peer_, "late", "y", Soon()).ok());
  EXPECT_EQ(seen, (std::vector<std::string>{"early", "late"}));
  EXPECT_TRUE(b_.PollNotifications().empty());
}

}  // namespace
}  // namespace tandem::kvtransfer
