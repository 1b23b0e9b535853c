// One behavioural suite for every TransferAgent: LoopbackAgent, UcxAgent with the
// transports UCX picks by default (shared memory on one host) and with tcp forced,
// LibfabricAgent on the tcp (ofi_rxm) and shm providers, one rail and three.
// Two agents in one process play initiator and target.
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/libfabric_agent.h"
#include "kvtransfer/loopback_agent.h"
#include "kvtransfer/transfer_agent.h"
#include "kvtransfer/ucx_agent.h"

namespace tandem::kvtransfer {
namespace {

struct AgentKindParam {
  std::string name;
  std::function<std::unique_ptr<TransferAgent>()> make;
};

std::unique_ptr<TransferAgent> MakeUcx(const std::string& tls,
                                       bool detect_failures = true) {
  UcxAgentConfig config;
  config.tls = tls;
  config.peer_failure_detection = detect_failures;
  config.max_inflight_ops = 16;  // exercise the refill window
  auto agent = UcxAgent::Create(config);
  EXPECT_TRUE(agent.ok()) << agent.status();
  return agent.ok() ? std::move(*agent) : nullptr;
}

std::unique_ptr<TransferAgent> MakeLibfabric(const std::string& provider,
                                             int rails = 1) {
  LibfabricAgentConfig config;
  config.provider = provider;
  config.rails = rails;
  config.max_inflight_ops = 16;  // exercise the refill window
  auto agent = LibfabricAgent::Create(config);
  EXPECT_TRUE(agent.ok()) << agent.status();
  return agent.ok() ? std::move(*agent) : nullptr;
}

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

absl::Time Soon() { return absl::Now() + absl::Seconds(20); }

class AgentConformanceTest : public ::testing::TestWithParam<AgentKindParam> {
 protected:
  void SetUp() override {
    initiator_ = GetParam().make();
    target_ = GetParam().make();
    ASSERT_NE(initiator_, nullptr);
    ASSERT_NE(target_, nullptr);
  }

  // Registers `src` on the initiator and `dst` on the target and connects.
  void Wire(std::vector<uint8_t>* src, std::vector<uint8_t>* dst) {
    auto s = initiator_->RegisterMemory(src->data(), src->size());
    ASSERT_TRUE(s.ok()) << s.status();
    src_region_ = *s;
    auto d = target_->RegisterMemory(dst->data(), dst->size());
    ASSERT_TRUE(d.ok()) << d.status();
    dst_region_ = *d;
    auto desc = target_->LocalDescriptor();
    ASSERT_TRUE(desc.ok()) << desc.status();
    auto peer = initiator_->Connect(*desc);
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
  }

  std::unique_ptr<TransferAgent> initiator_;
  std::unique_ptr<TransferAgent> target_;
  RegionId src_region_ = 0;
  RegionId dst_region_ = 0;
  PeerId peer_ = 0;
};

// Scattered segments: piece i of `n` random-length pieces goes to a shuffled slot.
std::vector<Segment> Scatter(RegionId src, RegionId dst, size_t bytes, int pieces,
                             uint32_t seed) {
  std::mt19937 rng(seed);
  const size_t piece = bytes / pieces;
  std::vector<int> order(pieces);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<Segment> segs;
  for (int i = 0; i < pieces; ++i) {
    const uint64_t len = 1 + rng() % piece;
    segs.push_back(Segment{src, static_cast<uint64_t>(i) * piece, dst,
                           static_cast<uint64_t>(order[i]) * piece, len});
  }
  return segs;
}

TEST_P(AgentConformanceTest, WriteManySegmentsArrivesExactly) {
  std::vector<uint8_t> src = RandomBytes(1 << 20, 1);
  std::vector<uint8_t> dst(1 << 20, 0);
  Wire(&src, &dst);
  const std::vector<Segment> segs =
      Scatter(src_region_, dst_region_, src.size(), 300, 2);
  std::vector<uint8_t> expected(dst.size(), 0);
  for (const Segment& s : segs) {
    std::copy_n(src.begin() + s.local_offset, s.length,
                expected.begin() + s.remote_offset);
  }
  auto batch = initiator_->PostWrite(peer_, segs);
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_TRUE(initiator_->Wait(*batch, Soon()).ok());
  EXPECT_EQ(dst, expected);
  // Reported once, then forgotten.
  EXPECT_EQ(initiator_->Wait(*batch, Soon()).code(), absl::StatusCode::kNotFound);
}

// A receiver cache from AllocateMemory: zero-filled, written and read like any
// region (over shared memory UCX copies into it directly), freed on deregistration.
TEST_P(AgentConformanceTest, AllocatedMemoryIsWrittenAndReadExactly) {
  const size_t bytes = (3 << 20) + 123;
  EXPECT_EQ(target_->AllocateMemory(0).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto alloc = target_->AllocateMemory(bytes);
  ASSERT_TRUE(alloc.ok()) << alloc.status();
  auto* mem = static_cast<uint8_t*>(alloc->base);
  EXPECT_TRUE(std::all_of(mem, mem + bytes, [](uint8_t b) { return b == 0; }));
  std::vector<uint8_t> src = RandomBytes(bytes, 11);
  auto s = initiator_->RegisterMemory(src.data(), src.size());
  ASSERT_TRUE(s.ok()) << s.status();
  auto desc = target_->LocalDescriptor();
  ASSERT_TRUE(desc.ok()) << desc.status();
  auto peer = initiator_->Connect(*desc);
  ASSERT_TRUE(peer.ok()) << peer.status();
  // Small and large pieces (the large ones take UCX's bandwidth protocols).
  std::vector<Segment> segs = Scatter(*s, alloc->region, bytes, 40, 12);
  segs.push_back(Segment{*s, 0, alloc->region, bytes - 7, 7});
  std::vector<uint8_t> expected(bytes, 0);
  for (const Segment& g : segs) {
    std::copy_n(src.begin() + g.local_offset, g.length,
                expected.begin() + g.remote_offset);
  }
  auto batch = initiator_->PostWrite(*peer, segs);
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_TRUE(initiator_->Wait(*batch, Soon()).ok());
  EXPECT_TRUE(std::equal(expected.begin(), expected.end(), mem));
  // Read it back into a fresh local buffer.
  std::vector<uint8_t> back(bytes, 0);
  auto b = initiator_->RegisterMemory(back.data(), back.size());
  ASSERT_TRUE(b.ok()) << b.status();
  batch = initiator_->PostRead(*peer, {{*b, 0, alloc->region, 0, bytes}});
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_TRUE(initiator_->Wait(*batch, Soon()).ok());
  EXPECT_EQ(back, expected);
  const size_t regions = target_->NumRegisteredRegions();
  EXPECT_TRUE(target_->DeregisterMemory(alloc->region).ok());
  EXPECT_EQ(target_->NumRegisteredRegions(), regions - 1);
  EXPECT_TRUE(initiator_->Disconnect(*peer).ok());
}

TEST_P(AgentConformanceTest, ReadPullsRemoteBytes) {
  std::vector<uint8_t> local(256 << 10, 0);
  std::vector<uint8_t> remote = RandomBytes(256 << 10, 3);
  Wire(&local, &remote);
  std::vector<Segment> segs = {{src_region_, 0, dst_region_, 4096, 100000},
                               {src_region_, 100000, dst_region_, 0, 4096}};
  auto batch = initiator_->PostRead(peer_, segs);
  ASSERT_TRUE(batch.ok()) << batch.status();
  // Poll until done (bounded by the deadline).
  const absl::Time deadline = Soon();
  absl::StatusOr<bool> done = false;
  while (done.ok() && !*done && absl::Now() < deadline) done = initiator_->Poll(*batch);
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_TRUE(*done);
  EXPECT_TRUE(std::equal(local.begin(), local.begin() + 100000, remote.begin() + 4096));
  EXPECT_TRUE(
      std::equal(local.begin() + 100000, local.begin() + 104096, remote.begin()));
}

TEST_P(AgentConformanceTest, CompletionCallbackRunsOnce) {
  std::vector<uint8_t> src = RandomBytes(64 << 10, 4);
  std::vector<uint8_t> dst(64 << 10, 0);
  Wire(&src, &dst);
  absl::Mutex mu;
  int calls = 0;
  absl::Status seen = absl::UnknownError("not called");
  BatchId seen_id = 0;
  auto batch =
      initiator_->PostWrite(peer_, {{src_region_, 0, dst_region_, 0, src.size()}},
                            [&](BatchId id, const absl::Status& st) {
                              absl::MutexLock l(&mu);
                              ++calls;
                              seen = st;
                              seen_id = id;
                            });
  ASSERT_TRUE(batch.ok());
  ASSERT_TRUE(initiator_->Wait(*batch, Soon()).ok());
  absl::MutexLock l(&mu);
  ASSERT_TRUE(mu.AwaitWithDeadline(absl::Condition(
                                       +[](int* c) { return *c > 0; }, &calls),
                                   Soon()));
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(seen.ok()) << seen;
  EXPECT_EQ(seen_id, *batch);
}

TEST_P(AgentConformanceTest, NotificationSeesEveryPriorWrite) {
  std::vector<uint8_t> src = RandomBytes(2 << 20, 5);
  std::vector<uint8_t> dst(2 << 20, 0);
  Wire(&src, &dst);
  const uint64_t want = XXH3_64bits(src.data(), src.size());
  absl::Mutex mu;
  std::vector<std::pair<Notification, uint64_t>> got;
  target_->SetNotificationCallback([&](const Notification& n) {
    // The bytes must already be there when the notification arrives.
    const uint64_t h = XXH3_64bits(dst.data(), dst.size());
    absl::MutexLock l(&mu);
    got.push_back({n, h});
  });
  // Two batches, not waited for: Notify itself orders after them.
  auto b1 = initiator_->PostWrite(peer_, {{src_region_, 0, dst_region_, 0, 1 << 20}});
  auto b2 = initiator_->PostWrite(
      peer_, {{src_region_, 1 << 20, dst_region_, 1 << 20, 1 << 20}});
  ASSERT_TRUE(b1.ok() && b2.ok());
  ASSERT_TRUE(
      initiator_->Notify(peer_, "req-42", std::string("pay\0load", 8), Soon()).ok());
  {
    absl::MutexLock l(&mu);
    ASSERT_TRUE(
        mu.AwaitWithDeadline(absl::Condition(
                                 +[](decltype(got)* g) { return !g->empty(); }, &got),
                             Soon()));
    ASSERT_EQ(got.size(), 1u);
    EXPECT_EQ(got[0].first.request_id, "req-42");
    EXPECT_EQ(got[0].first.payload, std::string("pay\0load", 8));
    EXPECT_EQ(got[0].first.sender_agent_id, initiator_->AgentId());
    EXPECT_EQ(got[0].second, want);
  }
  EXPECT_TRUE(initiator_->Wait(*b1, Soon()).ok());
  EXPECT_TRUE(initiator_->Wait(*b2, Soon()).ok());
}

TEST_P(AgentConformanceTest, PollNotificationsWithoutCallback) {
  std::vector<uint8_t> src = RandomBytes(4096, 6);
  std::vector<uint8_t> dst(4096, 0);
  Wire(&src, &dst);
  ASSERT_TRUE(initiator_->Notify(peer_, "a", "1", Soon()).ok());
  ASSERT_TRUE(initiator_->Notify(peer_, "b", "", Soon()).ok());
  std::vector<Notification> all;
  const absl::Time deadline = Soon();
  while (all.size() < 2 && absl::Now() < deadline) {
    for (Notification& n : target_->PollNotifications()) all.push_back(std::move(n));
  }
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].request_id, "a");
  EXPECT_EQ(all[0].payload, "1");
  EXPECT_EQ(all[1].request_id, "b");
  EXPECT_TRUE(target_->PollNotifications().empty());
  EXPECT_EQ(
      initiator_->Notify(peer_, "big", std::string(kMaxNotificationBytes, 'x'), Soon())
          .code(),
      absl::StatusCode::kInvalidArgument);
}

// A batch without segments moves nothing and completes OK, once, beside a
// write posted before it.
TEST_P(AgentConformanceTest, AnEmptyBatchCompletesBesideTheWritesBeforeIt) {
  std::vector<uint8_t> src(8192);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + 1);
  std::vector<uint8_t> dst(8192, 0);
  Wire(&src, &dst);
  std::atomic<int> done{0};
  auto write = initiator_->PostWrite(peer_, {{src_region_, 0, dst_region_, 0, 8192}});
  ASSERT_TRUE(write.ok()) << write.status();
  auto fence = initiator_->PostWrite(
      peer_, {}, [&done](BatchId, const absl::Status& s) { done += s.ok() ? 1 : 100; });
  ASSERT_TRUE(fence.ok()) << fence.status();
  ASSERT_TRUE(initiator_->Wait(*fence, Soon()).ok());
  ASSERT_TRUE(initiator_->Wait(*write, Soon()).ok());
  EXPECT_EQ(dst, src);
  const absl::Time end = Soon();
  while (done.load() == 0 && absl::Now() < end) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(done.load(), 1);  // once, OK
}

TEST_P(AgentConformanceTest, SegmentsAreBoundsCheckedOnBothSides) {
  std::vector<uint8_t> src(8192, 1);
  std::vector<uint8_t> dst(4096, 0);
  Wire(&src, &dst);
  auto code = [&](std::vector<Segment> segs) {
    return initiator_->PostWrite(peer_, segs).status().code();
  };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(code({{src_region_, 0, dst_region_, 0, 0}}), kInvalid);
  EXPECT_EQ(code({{src_region_, 0, dst_region_, 0, 4097}}),
            kInvalid);  // remote overflow
  EXPECT_EQ(code({{src_region_, 8000, dst_region_, 0, 200}}),
            kInvalid);  // local overflow
  EXPECT_EQ(code({{src_region_, ~0ull, dst_region_, 0, 2}}), kInvalid);  // wrap-around
  EXPECT_EQ(code({{src_region_, 0, dst_region_, ~0ull - 1, 4}}),
            kInvalid);  // wrap-around
  EXPECT_EQ(code({{src_region_ + 99, 0, dst_region_, 0, 1}}),
            kInvalid);  // unknown local
  EXPECT_EQ(code({{src_region_, 0, dst_region_ + 99, 0, 1}}),
            kInvalid);  // unknown remote
  // A bad segment anywhere rejects the whole batch before anything moves.
  EXPECT_EQ(code({{src_region_, 0, dst_region_, 0, 4096},
                  {src_region_, 0, dst_region_, 1, 4096}}),
            kInvalid);
  EXPECT_EQ(dst, std::vector<uint8_t>(4096, 0));
  EXPECT_EQ(initiator_->PostWrite(peer_ + 1000, {{src_region_, 0, dst_region_, 0, 1}})
                .status()
                .code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(initiator_->Wait(12345, Soon()).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(initiator_->Cancel(12345).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(initiator_->Poll(12345).status().code(), absl::StatusCode::kNotFound);
}

TEST_P(AgentConformanceTest, BadDescriptorsAreRejected) {
  auto good = target_->LocalDescriptor("meta");
  ASSERT_TRUE(good.ok());
  auto parsed = ParseDescriptor(*good);
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(parsed->metadata, "meta");
  EXPECT_EQ(parsed->agent_id, target_->AgentId());
  for (const std::string& bad :
       {std::string(), std::string("garbage"), good->substr(0, good->size() / 2),
        *good + "tail", std::string(4096, '\0')}) {
    EXPECT_EQ(initiator_->Connect(bad).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  std::string flipped = *good;
  flipped[flipped.size() / 2] ^= 1;
  EXPECT_EQ(initiator_->Connect(flipped).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The other implementation's descriptor is refused too.
  LoopbackAgent loop;
  auto ucx = UcxAgent::Create(UcxAgentConfig{});
  ASSERT_TRUE(ucx.ok());
  const std::string foreign =
      initiator_->Transport(0).empty() && dynamic_cast<LoopbackAgent*>(initiator_.get())
          ? *(*ucx)->LocalDescriptor()
          : *loop.LocalDescriptor();
  EXPECT_EQ(initiator_->Connect(foreign).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(initiator_->NumPeers(), 0u);
}

TEST_P(AgentConformanceTest, CancelEndsTheBatch) {
  const size_t bytes = 32 << 20;
  std::vector<uint8_t> src = RandomBytes(bytes, 7);
  std::vector<uint8_t> dst(bytes, 0);
  Wire(&src, &dst);
  std::vector<Segment> segs;
  for (size_t off = 0; off < bytes; off += 4096)
    segs.push_back({src_region_, off, dst_region_, off, 4096});
  auto batch = initiator_->PostWrite(peer_, segs);
  ASSERT_TRUE(batch.ok());
  ASSERT_TRUE(initiator_->Cancel(*batch).ok());
  const absl::Status st = initiator_->Wait(*batch, Soon());
  // Either cancelled in flight or already complete; never anything else.
  EXPECT_TRUE(st.ok() || st.code() == absl::StatusCode::kCancelled) << st;
  if (st.ok()) EXPECT_EQ(src, dst);
  // The agent is still usable and the regions can be released.
  auto again = initiator_->PostWrite(peer_, {{src_region_, 0, dst_region_, 0, 4096}});
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(initiator_->Wait(*again, Soon()).ok());
  EXPECT_TRUE(initiator_->DeregisterMemory(src_region_).ok());
  EXPECT_EQ(initiator_->NumRegisteredRegions(), 0u);
}

TEST_P(AgentConformanceTest, WaitPastDeadlineKeepsTheBatch) {
  const size_t bytes = 16 << 20;
  std::vector<uint8_t> src = RandomBytes(bytes, 8);
  std::vector<uint8_t> dst(bytes, 0);
  Wire(&src, &dst);
  std::vector<Segment> segs;
  for (size_t off = 0; off < bytes; off += 8192)
    segs.push_back({src_region_, off, dst_region_, off, 8192});
  auto batch = initiator_->PostWrite(peer_, segs);
  ASSERT_TRUE(batch.ok());
  const absl::Status early = initiator_->Wait(*batch, absl::InfinitePast());
  EXPECT_TRUE(early.ok() || early.code() == absl::StatusCode::kDeadlineExceeded)
      << early;
  if (!early.ok()) {
    ASSERT_TRUE(initiator_->Wait(*batch, Soon()).ok());
  }
  EXPECT_EQ(src, dst);
}

TEST_P(AgentConformanceTest, ReleasesEverything) {
  std::vector<uint8_t> a(4096), b(4096), c(4096);
  auto r1 = initiator_->RegisterMemory(a.data(), a.size());
  auto r2 = initiator_->RegisterMemory(b.data(), b.size());
  auto r3 = target_->RegisterMemory(c.data(), c.size());
  ASSERT_TRUE(r1.ok() && r2.ok() && r3.ok());
  EXPECT_NE(*r1, *r2);
  EXPECT_EQ(initiator_->RegisterMemory(nullptr, 10).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(initiator_->RegisterMemory(a.data(), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto peer = initiator_->Connect(*target_->LocalDescriptor());
  ASSERT_TRUE(peer.ok());
  EXPECT_EQ(initiator_->NumPeers(), 1u);
  EXPECT_EQ(initiator_->NumRegisteredRegions(), 2u);
  EXPECT_TRUE(initiator_->DeregisterMemory(*r1).ok());
  EXPECT_EQ(initiator_->DeregisterMemory(*r1).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(initiator_->DeregisterMemory(*r2).ok());
  EXPECT_TRUE(initiator_->Disconnect(*peer).ok());
  EXPECT_EQ(initiator_->Disconnect(*peer).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(initiator_->NumPeers(), 0u);
  EXPECT_EQ(initiator_->NumRegisteredRegions(), 0u);
  // A descriptor no longer lists deregistered regions.
  auto d = ParseDescriptor(*initiator_->LocalDescriptor());
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->regions.empty());
}

TEST_P(AgentConformanceTest, SelfConnectionWorks) {
  std::vector<uint8_t> src = RandomBytes(8192, 9);
  std::vector<uint8_t> dst(8192, 0);
  auto s = initiator_->RegisterMemory(src.data(), src.size());
  auto d = initiator_->RegisterMemory(dst.data(), dst.size());
  ASSERT_TRUE(s.ok() && d.ok());
  auto peer = initiator_->Connect(*initiator_->LocalDescriptor());
  ASSERT_TRUE(peer.ok()) << peer.status();
  auto batch = initiator_->PostWrite(*peer, {{*s, 0, *d, 0, 8192}});
  ASSERT_TRUE(batch.ok());
  ASSERT_TRUE(initiator_->Wait(*batch, Soon()).ok());
  EXPECT_EQ(src, dst);
  EXPECT_FALSE(initiator_->Transport(*peer).empty());
}

INSTANTIATE_TEST_SUITE_P(
    Agents, AgentConformanceTest,
    ::testing::Values(
        AgentKindParam{"loopback", [] { return std::make_unique<LoopbackAgent>(); }},
        AgentKindParam{"ucx_default", [] { return MakeUcx(""); }},
        AgentKindParam{"ucx_tcp", [] { return MakeUcx("tcp"); }},
        // Without peer-failure detection UCX uses shared memory (posix + cma).
        AgentKindParam{"ucx_shm",
                       [] { return MakeUcx("", /*detect_failures=*/false); }},
        AgentKindParam{"libfabric_tcp", [] { return MakeLibfabric("tcp"); }},
        AgentKindParam{"libfabric_shm", [] { return MakeLibfabric("shm"); }},
        AgentKindParam{"libfabric_tcp_3rails",
                       [] { return MakeLibfabric("tcp", /*rails=*/3); }},
        AgentKindParam{"libfabric_shm_2rails",
                       [] { return MakeLibfabric("shm", /*rails=*/2); }}),
    [](const ::testing::TestParamInfo<AgentKindParam>& info) {
      return info.param.name;
    });

}  // namespace
}  // namespace tandem::kvtransfer
