// SendSession placed in each state and stepped, with an injected clock and a
// fake agent whose batches end only when the test says so:
//   - accounting: batches, segments, bytes and timings of a streamed, a whole
//     and a restarted transfer against hand-computed values (and the metrics)
//   - a restart waits for the earlier batches before the whole state goes
//   - cancel, the deadline and peer loss (a failed batch, a failed PostWrite,
//     a failed Notify) in every live state: the right end state and code, the
//     batches in flight cancelled and drained, no notification, peers dropped
//   - Run: the deadline on the injected clock ends a stalled wait; a batch that
//     does not drain has its peer dropped
//   - over a LoopbackAgent: a restarted transfer lands bit-exact
#include "prefill/send_session.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "gtest/gtest.h"
#include "kvtransfer/checksum.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/loopback_agent.h"
#include "kvtransfer/plan.h"
#include "metrics/registry.h"
#include "prefill/peer_cache.h"
#include "worker/worker_metrics.h"

namespace tandem::prefill {
namespace {

using kvtransfer::BatchId;
using kvtransfer::PeerId;
using kvtransfer::Segment;

// A single-threaded TransferAgent: a batch runs until Complete() ends it; a
// Wait on a running batch returns DEADLINE_EXCEEDED at once and moves the
// clock by the time it would have waited (time passes while the session
// waits). Cancel ends a batch CANCELLED at once unless SetStuck(true).
class FakeAgent final : public kvtransfer::TransferAgent {
 public:
  explicit FakeAgent(FakeClock* clock) : clock_(clock) {}

  struct Batch {
    PeerId peer = 0;
    std::vector<Segment> segments;
    kvtransfer::CompletionCallback on_done;
    bool ended = false;
    bool cancel_requested = false;
    absl::Status status;
  };

  // Ends a running batch (its completion callback runs).
  void Complete(BatchId b, absl::Status s = absl::OkStatus()) {
    Batch& batch = batches_.at(b);
    if (batch.ended) return;
    batch.ended = true;
    batch.status = s;
    if (batch.on_done) batch.on_done(b, s);
  }
  void CompleteAll() {
    for (auto& [id, b] : batches_) Complete(id);
  }
  // The n-th PostWrite from now on (1 = the next) fails with `s`.
  void FailPost(int n, absl::Status s) {
    fail_post_at_ = posts_ + n;
    post_error_ = std::move(s);
  }
  void SetNotifyError(absl::Status s) { notify_error_ = std::move(s); }
  void SetConnectError(absl::Status s) { connect_error_ = std::move(s); }
  void SetStuck(bool stuck) { stuck_ = stuck; }

  int posts() const { return posts_; }
  int connects() const { return connects_; }
  int disconnects() const { return disconnects_; }
  std::vector<BatchId> running() const {
    std::vector<BatchId> out;
    for (const auto& [id, b] : batches_) {
      if (!b.ended) out.push_back(id);
    }
    return out;
  }
  // Batches that Cancel was called on.
  int cancelled() const {
    int n = 0;
    for (const auto& [id, b] : batches_) n += b.cancel_requested ? 1 : 0;
    return n;
  }
  const std::vector<std::string>& notified() const { return notified_; }
  const std::vector<std::string>& payloads() const { return payloads_; }
  const Batch& batch(BatchId b) const { return batches_.at(b); }
  BatchId last_batch() const { return batches_.rbegin()->first; }
  // Batches not yet reported ended to the caller (Poll/Wait).
  size_t unreported() const { return batches_.size() - reported_; }

  using kvtransfer::TransferAgent::RegisterMemory;
  absl::StatusOr<kvtransfer::RegionId> RegisterMemory(void*, size_t,
                                                      kvtransfer::MemoryKind) override {
    return absl::UnimplementedError("fake");
  }
  absl::Status DeregisterMemory(kvtransfer::RegionId) override {
    return absl::OkStatus();
  }
  size_t NumRegisteredRegions() const override { return 0; }
  uint64_t AgentId() const override { return 1; }
  absl::StatusOr<std::string> LocalDescriptor(absl::string_view) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<PeerId> Connect(absl::string_view) override {
    if (!connect_error_.ok()) return connect_error_;
    return static_cast<PeerId>(++connects_);
  }
  absl::Status Disconnect(PeerId peer) override {
    ++disconnects_;
    for (auto& [id, b] : batches_) {
      if (b.peer == peer) Complete(id, absl::CancelledError("disconnected"));
    }
    return absl::OkStatus();
  }
  size_t NumPeers() const override { return 0; }
  absl::StatusOr<BatchId> PostWrite(PeerId peer, absl::Span<const Segment> segments,
                                    kvtransfer::CompletionCallback on_done) override {
    if (++posts_ == fail_post_at_) return post_error_;
    const BatchId id = next_++;
    Batch& b = batches_[id];
    b.peer = peer;
    b.segments.assign(segments.begin(), segments.end());
    b.on_done = std::move(on_done);
    return id;
  }
  absl::StatusOr<BatchId> PostRead(PeerId, absl::Span<const Segment>,
                                   kvtransfer::CompletionCallback) override {
    return absl::UnimplementedError("fake");
  }
  absl::StatusOr<bool> Poll(BatchId id) override {
    auto it = batches_.find(id);
    if (it == batches_.end() || reported_ids_.contains(id)) {
      return absl::NotFoundError("unknown batch");
    }
    if (!it->second.ended) return false;
    Forget(id);
    if (!it->second.status.ok()) return it->second.status;
    return true;
  }
  absl::Status Wait(BatchId id, absl::Time deadline) override {
    auto it = batches_.find(id);
    if (it == batches_.end() || reported_ids_.contains(id)) {
      return absl::NotFoundError("unknown batch");
    }
    if (!it->second.ended) {
      // At least 1 ms, so that waits up to a deadline always get there.
      clock_->Advance(std::max(deadline - absl::Now(), absl::Milliseconds(1)));
      return absl::DeadlineExceededError("still running");
    }
    Forget(id);
    return it->second.status;
  }
  absl::Status Cancel(BatchId id) override {
    Batch& b = batches_.at(id);
    if (b.ended) return absl::OkStatus();
    b.cancel_requested = true;
    if (!stuck_) Complete(id, absl::CancelledError("cancelled"));
    return absl::OkStatus();
  }
  absl::Status Notify(PeerId, absl::string_view request_id, absl::string_view payload,
                      absl::Time) override {
    if (!notify_error_.ok()) return notify_error_;
    notified_.emplace_back(request_id);
    payloads_.emplace_back(payload);
    return absl::OkStatus();
  }
  void SetNotificationCallback(kvtransfer::NotificationCallback) override {}
  std::vector<kvtransfer::Notification> PollNotifications() override { return {}; }
  std::string Transport(PeerId) override { return "fake"; }

 private:
  // Marks a batch reported (forgotten, as a real agent does).
  void Forget(BatchId id) {
    reported_ids_.insert(id);
    ++reported_;
  }

  FakeClock* const clock_;  // not owned
  std::map<BatchId, Batch> batches_;
  absl::flat_hash_set<BatchId> reported_ids_;
  size_t reported_ = 0;
  BatchId next_ = 1;
  int posts_ = 0;
  int fail_post_at_ = -1;
  absl::Status post_error_;
  absl::Status notify_error_;
  absl::Status connect_error_;
  bool stuck_ = false;
  int connects_ = 0;
  int disconnects_ = 0;
  std::vector<std::string> notified_;
  std::vector<std::string> payloads_;
};

// Block size 4, MLA rows of 8 bytes, one KDA layer (16 state + 8 conv bytes);
// model layers MLA, KDA, MLA. A 10-token prompt in two chunks [0, 4), [4, 10),
// from source blocks {0, 1, 2} to target blocks {6, 3, 0} (slot 1):
//   chunk 1: each MLA layer 4 rows = 32 bytes in target block 6: 1 segment
//   chunk 2: each MLA layer 6 rows = 48 bytes in blocks 3 and 0: 2 segments;
//            the KDA slot, 24 bytes contiguous on both sides: 1 segment
//   streamed: 5 batches, 2 * (1 + 2) + 1 = 7 segments, 2 * 80 + 24 = 184 bytes
constexpr int64_t kTokens = 10;
constexpr uint64_t kWholeBytes = 2 * kTokens * 8 + 24;
constexpr kvtransfer::RegionId kSrcRegion = 1;
constexpr kvtransfer::RegionId kDstRegion = 9;
constexpr absl::Duration kDeadline = absl::Seconds(10);

tandem::v1::KvLayout SmallLayout() {
  tandem::v1::KvLayout l;
  l.set_block_size(4);
  l.set_num_mla_layers(2);
  l.set_num_kda_layers(1);
  l.set_mla_token_bytes(8);
  l.set_kda_state_bytes(16);
  l.set_kda_conv_bytes(8);
  l.set_tp_rank(0);
  l.set_tp_size(1);
  return l;
}

std::string Descriptor(uint64_t agent_id) {
  kvtransfer::AgentDescriptor d;
  d.kind = kvtransfer::AgentKind::kLoopback;
  d.agent_id = agent_id;
  d.address = "decode-0";
  return kvtransfer::SerializeDescriptor(d);
}

struct Harness {
  Harness() {
    const tandem::v1::KvLayout l = SmallLayout();
    source.resize(kvtransfer::ContiguousRegionBytes(l, 8, 2));
    for (size_t i = 0; i < source.size(); ++i) source[i] = static_cast<uint8_t>(i * 7);
    context.agent = &agent;
    context.peers = &peers;
    context.clock = &clock;
    context.metrics = &metrics;
    context.sources = {{kvtransfer::ContiguousRankLayout(l, 8, 2, kSrcRegion),
                        [this](kvtransfer::RegionId r) {
                          if (r != kSrcRegion) return absl::Span<const uint8_t>();
                          return absl::Span<const uint8_t>(source);
                        }}};
    context.layers = {{kvtransfer::LayerKind::kMla, 0},
                      {kvtransfer::LayerKind::kKda, 0},
                      {kvtransfer::LayerKind::kMla, 1}};
  }

  SendSpec Spec(bool stream = true) {
    SendSpec spec;
    spec.request_id = "r1";
    spec.num_tokens = kTokens;
    spec.reservation_token = 4242;
    SendTarget t;
    t.layout = kvtransfer::ContiguousRankLayout(SmallLayout(), 8, 2, kDstRegion);
    t.layout.block_ids = {6, 3, 0};
    t.layout.state_slot = 1;
    t.descriptor = Descriptor(77);
    t.address = "decode-0";
    spec.targets.push_back(std::move(t));
    spec.stream_layers = stream;
    spec.checksums = true;
    spec.deadline = clock.Now() + kDeadline;
    return spec;
  }
  std::unique_ptr<SendSession> Make(bool stream = true) {
    auto s = SendSession::Create(&context, Spec(stream));
    EXPECT_TRUE(s.ok()) << s.status();
    return std::move(*s);
  }
  // One prefill chunk: every model layer's rows [start, end).
  void Chunk(SendSession& s, int64_t start, int64_t end, bool last) {
    for (int layer = 0; layer < 3; ++layer) {
      s.OnLayer(layer, {.start = start,
                        .end = end,
                        .block_table = kBlocks,
                        .slot = 0,
                        .completes_prefill = last});
    }
  }
  void Computed(SendSession& s) {
    s.Computed({.block_ids = kBlocks, .slot = 0, .num_cached_tokens = kTokens});
  }
  // A new session placed in `state` (the live ones):
  //   STREAMING:  chunk 1 posted (2 batches running)
  //   RESTARTED:  + layer 0 restarts at 0 (2 batches running)
  //   DRAINING:   both chunks posted (5 running), computed
  //   FINISHING:  restarted, computed, the streamed batches ended, the whole
  //               state posted (1 running)
  std::unique_ptr<SendSession> In(SendState state) {
    std::unique_ptr<SendSession> s = Make();
    switch (state) {
      case SendState::kComputing:
        break;
      case SendState::kStreaming:
        Chunk(*s, 0, 4, false);
        break;
      case SendState::kRestarted:
        Chunk(*s, 0, 4, false);
        s->OnLayer(0, {.start = 0, .end = 10, .block_table = kBlocks});
        break;
      case SendState::kDraining:
        Chunk(*s, 0, 4, false);
        Chunk(*s, 4, 10, true);
        Computed(*s);
        break;
      case SendState::kFinishing:
        Chunk(*s, 0, 4, false);
        s->OnLayer(0, {.start = 0, .end = 10, .block_table = kBlocks});
        Computed(*s);
        agent.CompleteAll();
        s->Step();
        break;
      default:
        ADD_FAILURE() << "not a live state";
    }
    EXPECT_EQ(s->state(), state);
    return s;
  }
  int64_t Transfers(const char* outcome) {
    return static_cast<int64_t>(metrics.transfers->Add({{"outcome", outcome}}).Value());
  }

  const std::vector<int32_t> kBlocks = {0, 1, 2};
  FakeClock clock;
  FakeAgent agent{&clock};
  PeerCache peers{&agent};
  metrics::Registry registry;
  worker::WorkerMetrics metrics{&registry};
  std::vector<uint8_t> source;
  SendContext context;
};

TEST(SendSessionTest, StreamedTransferAccountsEveryPieceAndNotifiesOnce) {
  Harness h;
  const absl::Time t0 = h.clock.Now();
  std::unique_ptr<SendSession> s = h.Make();
  EXPECT_EQ(s->state(), SendState::kComputing);
  EXPECT_EQ(h.agent.connects(), 1);  // streaming: connected at creation
  h.clock.Advance(absl::Seconds(1));
  h.Chunk(*s, 0, 4, false);
  EXPECT_EQ(s->state(), SendState::kStreaming);
  EXPECT_EQ(s->stats().batches, 2);  // the KDA slot waits for the last chunk
  EXPECT_EQ(s->stats().bytes, 64u);
  EXPECT_EQ(s->stats().segments, 2);
  h.Chunk(*s, 4, 10, true);
  EXPECT_EQ(s->stats().batches, 5);
  EXPECT_EQ(s->stats().segments, 7);
  EXPECT_EQ(s->stats().bytes, kWholeBytes);
  EXPECT_EQ(std::vector<int64_t>(s->rows().begin(), s->rows().end()),
            (std::vector<int64_t>{10, 10, 10}));
  EXPECT_EQ(s->in_flight(), 5u);
  // The KDA piece: state and conv tails of slot 0 to slot 1, one segment.
  const FakeAgent::Batch& kda = h.agent.batch(4);
  ASSERT_EQ(kda.segments.size(), 1u);
  EXPECT_EQ(kda.segments[0].length, 24u);

  h.clock.Advance(absl::Seconds(2));
  h.Computed(*s);
  EXPECT_EQ(s->state(), SendState::kDraining);
  EXPECT_FALSE(s->stats().whole);
  EXPECT_EQ(s->checksums().mla_layer_size(), 2);
  EXPECT_FALSE(s->Step());  // nothing ended yet
  h.agent.CompleteAll();
  h.clock.Advance(absl::Milliseconds(500));
  EXPECT_TRUE(s->Step());
  EXPECT_EQ(s->state(), SendState::kDone);
  EXPECT_TRUE(s->status().ok());
  EXPECT_EQ(h.agent.notified(), std::vector<std::string>{"r1"});
  // The reservation's token rides on the notification (decode/reservations.h).
  EXPECT_EQ(h.agent.payloads(), std::vector<std::string>{"4242"});
  EXPECT_EQ(h.agent.posts(), 5);  // nothing more after the prefill
  EXPECT_EQ(h.agent.unreported(), 0u);
  EXPECT_EQ(s->stats().prefill, absl::Seconds(3));
  EXPECT_EQ(s->stats().transfer, absl::Milliseconds(2500));
  EXPECT_EQ(s->stats().exposed, absl::Milliseconds(500));
  EXPECT_EQ(s->stats().transport, "fake");
  EXPECT_EQ(h.clock.Now() - t0, absl::Milliseconds(3500));
  // Terminal: later calls change nothing.
  s->Cancel();
  h.Chunk(*s, 0, 4, false);
  EXPECT_TRUE(s->Step());
  EXPECT_EQ(s->state(), SendState::kDone);
  EXPECT_EQ(h.agent.posts(), 5);
  EXPECT_EQ(h.agent.notified().size(), 1u);
  // Metrics: every batch, one transfer, its bytes and times.
  EXPECT_EQ(h.metrics.transfer_batches->Value(), 5);
  EXPECT_EQ(h.Transfers("ok"), 1);
  EXPECT_EQ(h.Transfers("error"), 0);
  EXPECT_EQ(h.metrics.transfer_bytes->Value(), static_cast<double>(kWholeBytes));
  EXPECT_DOUBLE_EQ(h.metrics.transfer_seconds->Value(), 2.5);
  EXPECT_EQ(h.metrics.exposed_transfer_seconds->Count(), 1u);
  EXPECT_EQ(h.metrics.prefill_seconds->Count(), 1u);
}

TEST(SendSessionTest, StreamingOffSendsTheWholeStateAfterThePrefill) {
  Harness h;
  std::unique_ptr<SendSession> s = h.Make(/*stream=*/false);
  EXPECT_EQ(h.agent.connects(), 0);  // connects only once there is a state
  h.Chunk(*s, 0, 4, false);          // not streaming: layers are ignored
  EXPECT_EQ(h.agent.posts(), 0);
  h.Computed(*s);
  EXPECT_EQ(h.agent.connects(), 1);
  EXPECT_EQ(s->state(), SendState::kDraining);
  EXPECT_TRUE(s->stats().whole);
  EXPECT_FALSE(s->Step());
  EXPECT_EQ(s->state(), SendState::kFinishing);
  EXPECT_EQ(s->stats().batches, 1);
  EXPECT_EQ(s->stats().bytes, kWholeBytes);
  h.agent.CompleteAll();
  EXPECT_TRUE(s->Step());
  EXPECT_EQ(s->state(), SendState::kDone);
  EXPECT_EQ(h.agent.notified().size(), 1u);
}

TEST(SendSessionTest, ARestartWaitsForTheEarlierBatchesThenSendsTheWholeState) {
  Harness h;
  std::unique_ptr<SendSession> s = h.Make();
  h.Chunk(*s, 0, 4, false);
  // Preempted and recomputed: layer 0 comes again from row 0.
  s->OnLayer(0, {.start = 0, .end = 10, .block_table = h.kBlocks});
  EXPECT_EQ(s->state(), SendState::kRestarted);
  EXPECT_EQ(h.metrics.transfer_restarts->Value(), 1);
  h.Chunk(*s, 4, 10, true);  // no more streaming
  EXPECT_EQ(h.agent.posts(), 2);
  h.Computed(*s);
  EXPECT_EQ(s->state(), SendState::kDraining);
  EXPECT_TRUE(s->stats().whole);
  // The earlier batches still run: nothing is rewritten under them.
  EXPECT_FALSE(s->Step());
  EXPECT_EQ(s->state(), SendState::kDraining);
  EXPECT_EQ(h.agent.posts(), 2);
  h.agent.CompleteAll();
  EXPECT_FALSE(s->Step());
  EXPECT_EQ(s->state(), SendState::kFinishing);
  EXPECT_EQ(h.agent.posts(), 3);
  EXPECT_EQ(s->stats().batches, 3);
  EXPECT_EQ(s->stats().bytes, 64u + kWholeBytes);
  h.agent.CompleteAll();
  EXPECT_TRUE(s->Step());
  EXPECT_EQ(s->state(), SendState::kDone);
}

// A decode-side prefix hit: the target holds tokens [0, 4) (its block 6), so
// only rows [4, 10) of each MLA layer and the KDA slot are written, streamed
// or whole; the checksums are still over all 10 rows.
TEST(SendSessionTest, HeldPrefixRowsAreNotWritten) {
  constexpr uint64_t kHeldBytes = 2 * (kTokens - 4) * 8 + 24;
  // Block 6 of the target: offset 6 * 4 * 8 in each MLA layer's pool.
  auto writes_block6 = [](const FakeAgent& agent, int batches) {
    const kvtransfer::RankLayout dst =
        kvtransfer::ContiguousRankLayout(SmallLayout(), 8, 2, kDstRegion);
    for (int b = 1; b <= batches; ++b) {
      for (const Segment& g : agent.batch(b).segments) {
        for (const kvtransfer::MlaPool& p : dst.mla) {
          const uint64_t lo = p.offset + 6 * 4 * 8, hi = lo + 4 * 8;
          if (g.remote_offset < hi && lo < g.remote_offset + g.length) return true;
        }
      }
    }
    return false;
  };
  for (bool stream : {true, false}) {
    SCOPED_TRACE(stream ? "streamed" : "whole");
    Harness h;
    SendSpec spec = h.Spec(stream);
    spec.held_tokens = 4;
    auto made = SendSession::Create(&h.context, spec);
    ASSERT_TRUE(made.ok()) << made.status();
    SendSession& s = **made;
    h.Chunk(s, 0, 4, false);  // every MLA row of it is held: nothing posted
    EXPECT_EQ(h.agent.posts(), 0);
    h.Chunk(s, 4, 10, true);
    h.Computed(s);
    EXPECT_EQ(s.stats().whole, !stream);
    h.agent.CompleteAll();
    while (!s.Step()) h.agent.CompleteAll();
    EXPECT_EQ(s.state(), SendState::kDone);
    EXPECT_EQ(s.stats().bytes, kHeldBytes);
    EXPECT_EQ(h.agent.posts(), stream ? 3 : 1);
    EXPECT_FALSE(writes_block6(h.agent, h.agent.posts()));
    EXPECT_EQ(s.checksums().mla_layer_size(), 2);
  }
}

// The prefill's own prefix hit: the first chunk starts past row 0 (its rows
// before are final in the shared cached blocks). They are streamed with it,
// from the receiver's held rows on; no restart, no whole-state resend.
TEST(SendSessionTest, APrefillHitStreamsTheCachedRowsWithTheFirstChunk) {
  for (int64_t held : {0, 4, 8}) {
    SCOPED_TRACE(held);
    Harness h;
    SendSpec spec = h.Spec();
    spec.held_tokens = held;
    auto made = SendSession::Create(&h.context, spec);
    ASSERT_TRUE(made.ok()) << made.status();
    SendSession& s = **made;
    h.Chunk(s, 8, 10, true);  // hit at 8: computes [8, 10) only
    EXPECT_EQ(s.state(), SendState::kStreaming);
    EXPECT_EQ(std::vector<int64_t>(s.rows().begin(), s.rows().end()),
              (std::vector<int64_t>{10, 10, 10}));
    h.Computed(s);
    EXPECT_FALSE(s.stats().whole);
    EXPECT_EQ(s.stats().bytes, 2 * static_cast<uint64_t>(kTokens - held) * 8 + 24);
    EXPECT_EQ(h.metrics.transfer_restarts->Value(), 0);
    h.agent.CompleteAll();
    EXPECT_TRUE(s.Step());
    EXPECT_EQ(s.state(), SendState::kDone);
  }
}

TEST(SendSessionTest, HeldTokensOutsideThePromptAreRefused) {
  Harness h;
  for (int64_t held : {int64_t{-1}, kTokens + 1}) {
    SendSpec spec = h.Spec();
    spec.held_tokens = held;
    auto made = SendSession::Create(&h.context, spec);
    EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument) << held;
  }
}

TEST(SendSessionTest, AShortLayerSendsTheWholeState) {
  Harness h;
  std::unique_ptr<SendSession> s = h.Make();
  h.Chunk(*s, 0, 4, false);  // the second chunk never reported
  h.Computed(*s);
  EXPECT_TRUE(s->stats().whole);
  h.agent.CompleteAll();
  s->Step();
  EXPECT_EQ(s->state(), SendState::kFinishing);
}

TEST(SendSessionTest, ComputedWithTheWrongTokenCountFails) {
  Harness h;
  std::unique_ptr<SendSession> s = h.Make();
  s->Computed({.block_ids = h.kBlocks, .slot = 0, .num_cached_tokens = kTokens - 1});
  EXPECT_EQ(s->state(), SendState::kFailed);
  EXPECT_EQ(s->status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(h.Transfers("error"), 1);
}

TEST(SendSessionTest, UnreachableDecodeWorkerFailsCreation) {
  Harness h;
  h.agent.SetConnectError(absl::UnavailableError("no route"));
  auto s = SendSession::Create(&h.context, h.Spec());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(
      s.status().message().find("cannot connect to the decode worker at decode-0"),
      std::string::npos)
      << s.status();
}

TEST(SendSessionTest, RunBeforeComputedIsRefused) {
  Harness h;
  std::unique_ptr<SendSession> s = h.In(SendState::kStreaming);
  EXPECT_EQ(s->Run().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s->state(), SendState::kStreaming);
}

class LiveStateTest : public ::testing::TestWithParam<SendState> {};

TEST_P(LiveStateTest, CancelEndsCancelledAndDrainsEveryBatch) {
  Harness h;
  std::unique_ptr<SendSession> s = h.In(GetParam());
  const size_t running = h.agent.running().size();
  EXPECT_EQ(s->in_flight(), running);
  s->Cancel();
  EXPECT_TRUE(s->Step());
  EXPECT_EQ(s->state(), SendState::kCancelled);
  EXPECT_EQ(s->status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(h.agent.cancelled(), static_cast<int>(running));
  s->End();
  EXPECT_EQ(s->in_flight(), 0u);
  EXPECT_TRUE(h.agent.running().empty());
  EXPECT_EQ(h.agent.unreported(), 0u);
  EXPECT_TRUE(h.agent.notified().empty());
  EXPECT_EQ(h.agent.disconnects(), 0);  // a cancel keeps the connection
  // Nothing is posted after a cancel.
  const int posts = h.agent.posts();
  h.Chunk(*s, 4, 10, true);
  h.Computed(*s);
  s->Step();
  EXPECT_EQ(h.agent.posts(), posts);
}

// The peer is dropped only when bytes were in flight to it at the deadline: with
// nothing in flight the connection (shared by every request to that decode
// worker) is healthy and stays.
TEST_P(LiveStateTest, DeadlineOnTheClockFailsAndDropsAPeerWithBytesInFlight) {
  Harness h;
  std::unique_ptr<SendSession> s = h.In(GetParam());
  const size_t running = h.agent.running().size();
  EXPECT_FALSE(s->Step());  // before the deadline nothing changes
  EXPECT_EQ(s->state(), GetParam());
  h.clock.Advance(kDeadline);
  EXPECT_TRUE(s->Step());
  EXPECT_EQ(s->state(), SendState::kFailed);
  EXPECT_EQ(s->status().code(), absl::StatusCode::kDeadlineExceeded) << s->status();
  EXPECT_NE(s->status().message().find("r1"), std::string::npos);
  EXPECT_EQ(h.agent.cancelled(), static_cast<int>(running));
  s->End();
  EXPECT_EQ(s->in_flight(), 0u);
  EXPECT_EQ(h.agent.unreported(), 0u);
  EXPECT_TRUE(h.agent.notified().empty());
  EXPECT_EQ(h.agent.disconnects(), running > 0 ? 1 : 0);
  EXPECT_EQ(h.peers.size(), running > 0 ? 0u : 1u);
}

TEST_P(LiveStateTest, PeerLossFailsUnavailableAndDropsThePeer) {
  Harness h;
  const SendState state = GetParam();
  std::unique_ptr<SendSession> s = h.In(state);
  const std::vector<BatchId> running = h.agent.running();
  const absl::Status lost = absl::UnavailableError("peer died");
  switch (state) {
    case SendState::kComputing:
      // The first PostWrite fails.
      h.agent.FailPost(1, lost);
      h.Chunk(*s, 0, 4, false);
      EXPECT_EQ(h.agent.posts(), 1);  // no more posts once failed
      break;
    case SendState::kStreaming: {
      // A running batch fails: the next layer sees it and posts nothing.
      h.agent.Complete(running[0], lost);
      const int posts = h.agent.posts();
      h.Chunk(*s, 4, 10, true);
      EXPECT_EQ(h.agent.posts(), posts);
      break;
    }
    default:
      h.agent.Complete(running[0], lost);
      break;
  }
  s->Step();
  EXPECT_EQ(s->state(), SendState::kFailed);
  EXPECT_EQ(s->status().code(), absl::StatusCode::kUnavailable) << s->status();
  EXPECT_NE(s->status().message().find("transfer of request r1 to decode-0"),
            std::string::npos)
      << s->status();
  s->End();
  EXPECT_EQ(s->in_flight(), 0u);
  EXPECT_TRUE(h.agent.running().empty());
  EXPECT_EQ(h.agent.unreported(), 0u);
  EXPECT_TRUE(h.agent.notified().empty());
  EXPECT_EQ(h.peers.size(), 0u);
  // At the first token a failed session stays failed and counts one error.
  h.Computed(*s);
  EXPECT_EQ(s->Run().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(h.Transfers("error"), 1);
  EXPECT_EQ(h.Transfers("ok"), 0);
}

INSTANTIATE_TEST_SUITE_P(States, LiveStateTest,
                         ::testing::Values(SendState::kComputing, SendState::kStreaming,
                                           SendState::kRestarted, SendState::kDraining,
                                           SendState::kFinishing),
                         [](const ::testing::TestParamInfo<SendState>& info) {
                           return std::string(SendStateName(info.param));
                         });

TEST(SendSessionTest, NotifyErrorFailsInDrainingAndFinishing) {
  for (SendState state : {SendState::kDraining, SendState::kFinishing}) {
    Harness h;
    std::unique_ptr<SendSession> s = h.In(state);
    h.agent.SetNotifyError(absl::UnavailableError("peer gone at notify"));
    h.agent.CompleteAll();
    EXPECT_TRUE(s->Step());
    EXPECT_EQ(s->state(), SendState::kFailed) << SendStateName(state);
    EXPECT_EQ(s->status().code(), absl::StatusCode::kUnavailable);
    s->End();
    EXPECT_EQ(h.peers.size(), 0u);
    EXPECT_EQ(h.Transfers("error"), 1);
  }
}

TEST(SendSessionTest, RunEndsAStalledWaitAtTheDeadlineOfTheInjectedClock) {
  Harness h;
  std::unique_ptr<SendSession> s = h.In(SendState::kDraining);
  const absl::Time start = h.clock.Now();
  // The fake agent's waits move the clock by the time waited: Run waits in
  // slices until the session's deadline, then fails.
  EXPECT_EQ(s->Run().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(h.clock.Now() - start, kDeadline);
  EXPECT_LT(h.clock.Now() - start, kDeadline + kDrainGrace + absl::Seconds(1));
  EXPECT_EQ(s->in_flight(), 0u);
  EXPECT_TRUE(h.agent.running().empty());
  EXPECT_TRUE(h.agent.notified().empty());
}

TEST(SendSessionTest, RunStopsAtACancel) {
  Harness h;
  std::unique_ptr<SendSession> s = h.In(SendState::kDraining);
  s->Cancel();
  EXPECT_EQ(s->Run().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(s->in_flight(), 0u);
  EXPECT_TRUE(h.agent.notified().empty());
}

TEST(SendSessionTest, ABatchThatDoesNotDrainHasItsPeerDropped) {
  Harness h;
  std::unique_ptr<SendSession> s = h.In(SendState::kStreaming);
  h.agent.SetStuck(true);  // a cancelled batch keeps running
  s->Cancel();
  s->Step();
  EXPECT_EQ(h.agent.running().size(), 2u);
  s->End();  // the drain times out: the peer is dropped, which ends them
  EXPECT_EQ(h.agent.disconnects(), 1);
  EXPECT_EQ(h.peers.size(), 0u);
  EXPECT_TRUE(h.agent.running().empty());
  EXPECT_EQ(s->in_flight(), 0u);
}

TEST(SendSessionTest, EndingALiveSessionCancelsIt) {
  Harness h;
  std::unique_ptr<SendSession> s = h.In(SendState::kStreaming);
  s->End();
  EXPECT_EQ(s->state(), SendState::kCancelled);
  EXPECT_TRUE(h.agent.running().empty());
  EXPECT_EQ(h.Transfers("error"), 0);  // never computed: no transfer counted
}

// Over a real in-process agent: chunk 1 streamed, a restart, the whole state
// after the prefill; the receiver's bytes match the sender's checksums.
TEST(SendSessionTest, RestartedTransferLandsBitExactOverLoopback) {
  const tandem::v1::KvLayout l = SmallLayout();
  kvtransfer::LoopbackAgent sender, receiver;
  std::vector<uint8_t> src(kvtransfer::ContiguousRegionBytes(l, 8, 2));
  std::vector<uint8_t> dst(src.size(), 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 13 + 1);
  const kvtransfer::RegionId src_region =
      *sender.RegisterMemory(src.data(), src.size());
  const kvtransfer::RegionId dst_region =
      *receiver.RegisterMemory(dst.data(), dst.size());
  FakeClock clock;
  PeerCache peers(&sender);
  SendContext context;
  context.agent = &sender;
  context.peers = &peers;
  context.clock = &clock;
  context.sources = {{kvtransfer::ContiguousRankLayout(l, 8, 2, src_region),
                      [&](kvtransfer::RegionId r) {
                        return r == src_region ? absl::Span<const uint8_t>(src)
                                               : absl::Span<const uint8_t>();
                      }}};
  context.layers = {{kvtransfer::LayerKind::kMla, 0},
                    {kvtransfer::LayerKind::kKda, 0},
                    {kvtransfer::LayerKind::kMla, 1}};
  SendSpec spec;
  spec.request_id = "lb";
  spec.num_tokens = kTokens;
  SendTarget t;
  t.layout = kvtransfer::ContiguousRankLayout(l, 8, 2, dst_region);
  t.layout.block_ids = {6, 3, 0};
  t.layout.state_slot = 1;
  t.descriptor = *receiver.LocalDescriptor();
  t.address = "loopback";
  spec.targets.push_back(t);
  spec.checksums = true;
  auto made = SendSession::Create(&context, spec);
  ASSERT_TRUE(made.ok()) << made.status();
  SendSession& s = **made;
  const std::vector<int32_t> blocks = {2, 0, 1};
  for (int layer = 0; layer < 3; ++layer) {
    s.OnLayer(layer, {.start = 0, .end = 4, .block_table = blocks});
  }
  s.OnLayer(0, {.start = 0, .end = 10, .block_table = blocks});
  ASSERT_EQ(s.state(), SendState::kRestarted);
  s.Computed({.block_ids = blocks, .slot = 0, .num_cached_tokens = kTokens});
  ASSERT_TRUE(s.Run().ok()) << s.status();
  EXPECT_EQ(s.state(), SendState::kDone);
  EXPECT_EQ(s.stats().bytes, 64u + kWholeBytes);
  const auto landed =
      kvtransfer::ComputeChecksums(t.layout, kTokens, [&](kvtransfer::RegionId r) {
        return r == dst_region ? absl::Span<const uint8_t>(dst)
                               : absl::Span<const uint8_t>();
      });
  ASSERT_TRUE(landed.ok()) << landed.status();
  EXPECT_TRUE(kvtransfer::Verify(s.checksums(), *landed).ok());
  auto notes = receiver.PollNotifications();
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].request_id, "lb");
}

}  // namespace
}  // namespace tandem::prefill
