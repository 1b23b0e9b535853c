// AgentCore over a scripted backend: every piece stays pending until the test
// completes it and every notification arrives when the test says, so the
// bookkeeping's states are stepped deterministically (window, pieces, fence,
// cancel with operations pending, peer failure, the notification fence,
// disconnect, clearing the notification callback, destruction with live batches,
// racing reporters). The conformance suite runs the same core over
// the real backends.
#include "kvtransfer/agent_core.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kvtransfer/backend.h"

namespace tandem::kvtransfer {
namespace {

constexpr absl::Duration kWait = absl::Seconds(10);
absl::Time Soon() { return absl::Now() + kWait; }

struct PostedPiece {
  void* local;
  RegionId remote_region;
  uint64_t remote_offset;
  uint64_t length;
};

// Records what the core asks for; completes pending operations only when told.
class ScriptedBackend final : public Backend {
 public:
  explicit ScriptedBackend(BackendLimits limits) : limits_(limits) {}

  // Test side (any thread).
  void CompleteOldest(int n, absl::Status status = absl::OkStatus()) {
    absl::MutexLock l(&mu_);
    for (int i = 0; i < n; ++i) to_complete_.push_back(status);
    woken_ = true;
  }
  // `n` arrives from the peer, in the same progress pass as the next `complete`
  // requested completions.
  void Receive(Notification n, int complete = 0) {
    absl::MutexLock l(&mu_);
    incoming_.push_back(std::move(n));
    for (int i = 0; i < complete; ++i) to_complete_.push_back(absl::OkStatus());
    woken_ = true;
  }
  // Waits (bounded) until `n` notifications were handed to the agent.
  bool AwaitReceived(size_t n) {
    absl::MutexLock l(&mu_);
    auto enough = [this, n]()
                      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return received_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), kWait);
  }
  // The agent's progress thread (the one thread that calls ProgressLocked).
  std::thread::id progress_thread() {
    absl::MutexLock l(&mu_);
    return progress_thread_;
  }
  void FailPeer(PeerId peer) {
    absl::MutexLock l(&mu_);
    fail_peer_ = peer;
    woken_ = true;
  }
  // Waits (bounded) until `n` pieces were posted.
  bool AwaitPieces(size_t n) {
    absl::MutexLock l(&mu_);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return pieces_.size() >= n;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(10));
  }
  // Waits (bounded) until every requested completion was delivered.
  bool AwaitDelivered() {
    absl::MutexLock l(&mu_);
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return to_complete_.empty() && fail_peer_ == 0;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(10));
  }
  std::vector<PostedPiece> pieces() {
    absl::MutexLock l(&mu_);
    return pieces_;
  }
  int fences() {
    absl::MutexLock l(&mu_);
    return fences_;
  }
  int max_pending_pieces() {
    absl::MutexLock l(&mu_);
    return max_pending_pieces_;
  }
  std::vector<std::pair<PeerId, bool>> closes() {
    absl::MutexLock l(&mu_);
    return closes_;
  }
  std::vector<Notification> sent() {
    absl::MutexLock l(&mu_);
    return sent_;
  }

  // Backend.
  void Start(BackendHost* host, uint64_t) override { host_ = host; }
  void ShutdownLocked(absl::Time) override {}
  AgentKind Kind() const override { return AgentKind::kLoopback; }
  absl::string_view Name() const override { return "scripted"; }
  std::string Address() const override { return "scripted"; }
  BackendLimits Limits() const override { return limits_; }
  absl::StatusOr<std::string> RegisterMemoryLocked(RegionId, void*, size_t,
                                                   MemoryKind) override {
    return std::string("key");
  }
  absl::StatusOr<Allocated> AllocateMemoryLocked(RegionId, size_t) override {
    return absl::UnimplementedError("scripted");
  }
  void DeregisterMemoryLocked(RegionId) override {}
  absl::Status ConnectLocked(PeerId, const AgentDescriptor&) override {
    return absl::OkStatus();
  }
  void ClosePeerLocked(PeerId peer, bool graceful, bool, absl::Time) override {
    absl::MutexLock l(&mu_);
    closes_.push_back({peer, graceful});
  }
  void ForgetPeerLocked(PeerId) override {}
  std::string TransportLocked(PeerId) override { return "scripted"; }
  absl::StatusOr<PostResult> PostPieceLocked(PeerId, bool, const Piece& piece,
                                             OpToken op) override {
    absl::MutexLock l(&mu_);
    pieces_.push_back(
        {piece.local, piece.remote->id, piece.remote_offset, piece.length});
    pending_.push_back({op, /*fence=*/false});
    int n = 0;
    for (const auto& p : pending_) n += p.second ? 0 : 1;
    max_pending_pieces_ = std::max(max_pending_pieces_, n);
    return piece_result_;
  }
  absl::StatusOr<PostResult> PostFenceLocked(PeerId, OpToken op) override {
    absl::MutexLock l(&mu_);
    ++fences_;
    pending_.push_back({op, /*fence=*/true});
    return PostResult::kPending;
  }
  absl::Status SendNotificationLocked(PeerId, const Notification& n, absl::Time,
                                      std::function<absl::Status()>*) override {
    absl::MutexLock l(&mu_);
    sent_.push_back(n);
    return absl::OkStatus();
  }
  bool ProgressLocked() override {
    std::vector<std::pair<OpToken, absl::Status>> done;
    std::vector<Notification> notes;
    PeerId failed = 0;
    {
      absl::MutexLock l(&mu_);
      progress_thread_ = std::this_thread::get_id();
      notes.swap(incoming_);
      while (!to_complete_.empty() && !pending_.empty()) {
        done.push_back({pending_.front().first, to_complete_.front()});
        pending_.pop_front();
        to_complete_.pop_front();
      }
      std::swap(failed, fail_peer_);
    }
    if (failed != 0) host_->PeerFailedLocked(failed, absl::UnavailableError("gone"));
    for (auto& [op, st] : done) ReportOpDone(op, st);
    for (Notification& n : notes) host_->NotificationReceivedLocked(std::move(n));
    {
      absl::MutexLock l(&mu_);
      received_ += notes.size();
    }
    return !done.empty() || failed != 0 || !notes.empty();
  }
  absl::Duration ArmLocked() override { return absl::Milliseconds(100); }
  void Sleep(absl::Duration timeout) override {
    absl::MutexLock l(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&woken_), timeout);
    woken_ = false;
  }
  void Wake() override {
    absl::MutexLock l(&mu_);
    woken_ = true;
  }

  PostResult piece_result_ = PostResult::kPending;  // set before use

 private:
  const BackendLimits limits_;
  BackendHost* host_ = nullptr;
  absl::Mutex mu_;
  bool woken_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<std::pair<OpToken, bool>> pending_ ABSL_GUARDED_BY(mu_);  // FIFO
  std::deque<absl::Status> to_complete_ ABSL_GUARDED_BY(mu_);
  PeerId fail_peer_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Notification> incoming_ ABSL_GUARDED_BY(mu_);
  size_t received_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread::id progress_thread_ ABSL_GUARDED_BY(mu_);
  std::vector<PostedPiece> pieces_ ABSL_GUARDED_BY(mu_);
  int fences_ ABSL_GUARDED_BY(mu_) = 0;
  int max_pending_pieces_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::pair<PeerId, bool>> closes_ ABSL_GUARDED_BY(mu_);
  std::vector<Notification> sent_ ABSL_GUARDED_BY(mu_);
};

class ScriptedAgent final : public AgentCore {
 public:
  explicit ScriptedAgent(ScriptedBackend* backend)
      : AgentCore(std::unique_ptr<Backend>(backend)) {}
};

class AgentCoreTest : public ::testing::Test {
 protected:
  void Make(BackendLimits limits,
            Backend::PostResult piece_result = Backend::PostResult::kPending) {
    backend_ = new ScriptedBackend(limits);
    backend_->piece_result_ = piece_result;
    agent_ = std::make_unique<ScriptedAgent>(backend_);
    src_.assign(10000, 1);
    dst_.assign(10000, 0);
    src_region_ = *agent_->RegisterMemory(src_.data(), src_.size());
    dst_region_ = *agent_->RegisterMemory(dst_.data(), dst_.size());
    auto peer = agent_->Connect(*agent_->LocalDescriptor());
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
  }
  // One segment of `len` bytes from src[0] to dst[100].
  std::vector<Segment> Seg(uint64_t len) {
    return {{src_region_, 0, dst_region_, 100, len}};
  }

  ScriptedBackend* backend_ = nullptr;  // owned by agent_
  std::unique_ptr<ScriptedAgent> agent_;
  std::vector<uint8_t> src_, dst_;
  RegionId src_region_ = 0, dst_region_ = 0;
  PeerId peer_ = 0;
};

BackendLimits Limits(uint64_t piece, int window, uint64_t inline_bytes = 0) {
  BackendLimits l;
  l.max_piece_bytes = piece;
  l.max_inflight_ops = window;
  l.inline_post_bytes = inline_bytes;
  return l;
}

TEST_F(AgentCoreTest, PiecesGoThroughTheWindowThenTheFence) {
  Make(Limits(1000, 2));
  auto batch = agent_->PostWrite(peer_, Seg(4500));
  ASSERT_TRUE(batch.ok()) << batch.status();
  // Pieces 1..5 (1000 x 4 + 500), two pending at a time; the fence after the last.
  for (size_t posted = 2; posted <= 4; ++posted) {
    ASSERT_TRUE(backend_->AwaitPieces(posted));
    EXPECT_EQ(agent_->Poll(*batch).value_or(true), false);
    EXPECT_EQ(backend_->fences(), 0);
    backend_->CompleteOldest(1);
  }
  ASSERT_TRUE(backend_->AwaitPieces(5));
  EXPECT_EQ(agent_->Poll(*batch).value_or(true), false);
  backend_->CompleteOldest(3);  // pieces 4, 5 and the fence
  ASSERT_TRUE(agent_->Wait(*batch, Soon()).ok());
  EXPECT_EQ(backend_->fences(), 1);
  EXPECT_LE(backend_->max_pending_pieces(), 2);
  const std::vector<PostedPiece> pieces = backend_->pieces();
  ASSERT_EQ(pieces.size(), 5u);
  for (size_t i = 0; i < pieces.size(); ++i) {
    EXPECT_EQ(pieces[i].local, src_.data() + 1000 * i);
    EXPECT_EQ(pieces[i].remote_region, dst_region_);
    EXPECT_EQ(pieces[i].remote_offset, 100 + 1000 * i);
    EXPECT_EQ(pieces[i].length, i < 4 ? 1000u : 500u);
  }
  EXPECT_EQ(agent_->NumBatchesForTesting(), 0u);
}

TEST_F(AgentCoreTest, CancelEndsOnlyOncePendingPiecesDrained) {
  Make(Limits(1000, 2));
  auto batch = agent_->PostWrite(peer_, Seg(4500));
  ASSERT_TRUE(batch.ok());
  ASSERT_TRUE(backend_->AwaitPieces(2));
  ASSERT_TRUE(agent_->Cancel(*batch).ok());
  EXPECT_EQ(agent_->Poll(*batch).value_or(true), false);  // two still pending
  EXPECT_EQ(agent_->Wait(*batch, absl::Now() + absl::Milliseconds(20)).code(),
            absl::StatusCode::kDeadlineExceeded);
  // The region stays in use until then.
  EXPECT_EQ(agent_->DeregisterMemory(src_region_).code(),
            absl::StatusCode::kFailedPrecondition);
  backend_->CompleteOldest(2);
  EXPECT_EQ(agent_->Wait(*batch, Soon()).code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(backend_->pieces().size(), 2u);  // nothing posted after the cancel
  EXPECT_EQ(backend_->fences(), 0);
  EXPECT_TRUE(agent_->DeregisterMemory(src_region_).ok());
}

TEST_F(AgentCoreTest, SmallBatchIsPostedByTheCaller) {
  Make(Limits(1000, 2, /*inline_bytes=*/4096), Backend::PostResult::kDone);
  absl::Mutex mu;
  int calls = 0;
  auto batch = agent_->PostWrite(peer_, Seg(300), [&](BatchId, const absl::Status& st) {
    absl::MutexLock l(&mu);
    calls += st.ok() ? 1 : 100;
  });
  ASSERT_TRUE(batch.ok());
  // Posted inside PostWrite: the piece is there before any progress pass.
  EXPECT_EQ(backend_->pieces().size(), 1u);
  EXPECT_EQ(backend_->fences(), 1);
  backend_->CompleteOldest(1);  // the fence
  ASSERT_TRUE(agent_->Wait(*batch, Soon()).ok());
  absl::MutexLock l(&mu);
  ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(
                                      +[](int* c) { return *c > 0; }, &calls),
                                  absl::Seconds(10)));
  EXPECT_EQ(calls, 1);
}

TEST_F(AgentCoreTest, PeerFailureFailsItsBatchesAndForcesTheClose) {
  Make(Limits(1000, 2));
  auto batch = agent_->PostWrite(peer_, Seg(4500));
  ASSERT_TRUE(batch.ok());
  ASSERT_TRUE(backend_->AwaitPieces(2));
  backend_->FailPeer(peer_);
  ASSERT_TRUE(backend_->AwaitDelivered());
  // Later posts and notifies fail at once.
  EXPECT_EQ(agent_->PostWrite(peer_, Seg(10)).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(agent_->Notify(peer_, "r", "", Soon()).code(),
            absl::StatusCode::kUnavailable);
  // The pending pieces fail as the transport force-closes the endpoint.
  backend_->CompleteOldest(2, absl::UnavailableError("reset"));
  EXPECT_EQ(agent_->Wait(*batch, Soon()).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(backend_->pieces().size(), 2u);
  const auto closes = backend_->closes();
  ASSERT_EQ(closes.size(), 1u);
  EXPECT_EQ(closes[0], std::make_pair(peer_, false));  // forced
  EXPECT_TRUE(backend_->sent().empty());
}

TEST_F(AgentCoreTest, NotifyWaitsForEveryEarlierBatch) {
  Make(Limits(1000, 4));
  auto batch = agent_->PostWrite(peer_, Seg(1500));
  ASSERT_TRUE(batch.ok());
  ASSERT_TRUE(backend_->AwaitPieces(2));
  EXPECT_EQ(
      agent_->Notify(peer_, "r", "p", absl::Now() + absl::Milliseconds(20)).code(),
      absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(backend_->sent().empty());
  backend_->CompleteOldest(3);  // two pieces and the fence
  ASSERT_TRUE(agent_->Notify(peer_, "r", "p", Soon()).ok());
  const std::vector<Notification> sent = backend_->sent();
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].sender_agent_id, agent_->AgentId());
  EXPECT_EQ(sent[0].request_id, "r");
  EXPECT_EQ(sent[0].payload, "p");
  EXPECT_TRUE(agent_->Wait(*batch, Soon()).ok());
}

TEST_F(AgentCoreTest, DisconnectCancelsLiveBatches) {
  Make(Limits(1000, 2));
  auto batch = agent_->PostWrite(peer_, Seg(4500));
  ASSERT_TRUE(batch.ok());
  ASSERT_TRUE(backend_->AwaitPieces(2));
  ASSERT_TRUE(agent_->Disconnect(peer_).ok());
  EXPECT_EQ(agent_->NumPeers(), 0u);
  const auto closes = backend_->closes();
  ASSERT_EQ(closes.size(), 1u);
  EXPECT_EQ(closes[0], std::make_pair(peer_, false));  // busy: forced
  backend_->CompleteOldest(2, absl::CancelledError("closed"));
  EXPECT_EQ(agent_->Wait(*batch, Soon()).code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(agent_->PostWrite(peer_, Seg(10)).status().code(),
            absl::StatusCode::kNotFound);
}

Notification Note(absl::string_view request_id) {
  return Notification{/*sender_agent_id=*/1, std::string(request_id), ""};
}

// Waits (bounded) until `*n` reaches `want`; `mu` guards it.
bool AwaitCount(absl::Mutex* mu, const size_t* n, size_t want) {
  absl::MutexLock l(mu);
  struct Args {
    const size_t* n;
    size_t want;
  } args{n, want};
  return mu->AwaitWithTimeout(absl::Condition(
                                  +[](Args* a) { return *a->n >= a->want; }, &args),
                              kWait);
}

TEST_F(AgentCoreTest, ClearingTheNotificationCallbackWaitsForTheRunningCall) {
  Make(Limits(1000, 2));
  absl::Mutex mu;
  std::vector<std::string> log;  // guarded by mu
  absl::Notification entered, proceed, cleared;
  // The agent goes before the locals its callback uses (also on early returns).
  absl::Cleanup release = [&] {
    if (!proceed.HasBeenNotified()) proceed.Notify();
    agent_.reset();
  };
  agent_->SetNotificationCallback([&](const Notification& n) {
    {
      absl::MutexLock l(&mu);
      log.push_back("call " + n.request_id);
    }
    if (n.request_id == "n1") {
      entered.Notify();
      proceed.WaitForNotificationWithTimeout(kWait);
    }
    absl::MutexLock l(&mu);
    log.push_back("return " + n.request_id);
  });
  backend_->Receive(Note("n1"));
  ASSERT_TRUE(entered.WaitForNotificationWithTimeout(kWait));
  std::thread clearer([&] {
    agent_->SetNotificationCallback(nullptr);
    {
      absl::MutexLock l(&mu);
      log.push_back("cleared");
    }
    cleared.Notify();
  });
  // Clearing waits for the call on the progress thread to return.
  EXPECT_FALSE(cleared.WaitForNotificationWithTimeout(absl::Milliseconds(50)));
  proceed.Notify();
  EXPECT_TRUE(cleared.WaitForNotificationWithTimeout(kWait));
  clearer.join();  // bounded: the callback waits at most kWait
  // Notifications keep arriving: they go to the queue, not the old callback.
  backend_->Receive(Note("n2"));
  ASSERT_TRUE(backend_->AwaitReceived(2));
  const std::vector<Notification> polled = agent_->PollNotifications();
  ASSERT_EQ(polled.size(), 1u);
  EXPECT_EQ(polled[0].request_id, "n2");
  absl::MutexLock l(&mu);
  EXPECT_EQ(log, (std::vector<std::string>{"call n1", "return n1", "cleared"}));
}

TEST_F(AgentCoreTest, NotificationTakenInBeforeTheClearGoesToTheQueue) {
  Make(Limits(1000, 2));
  absl::Mutex mu;
  std::vector<std::string> calls;  // guarded by mu
  absl::Notification done_entered, proceed, second_done;
  absl::Cleanup release = [&] {
    if (!proceed.HasBeenNotified()) proceed.Notify();
    agent_.reset();
  };
  agent_->SetNotificationCallback([&](const Notification& n) {
    absl::MutexLock l(&mu);
    calls.push_back(n.request_id);
  });
  auto first = agent_->PostWrite(peer_, Seg(500), [&](BatchId, const absl::Status&) {
    done_entered.Notify();
    proceed.WaitForNotificationWithTimeout(kWait);
  });
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(backend_->AwaitPieces(1));  // the piece and the fence are pending
  // "n" arrives (a callback is set: it is taken in for the callback) in the pass
  // that ends the batch; the progress thread then blocks in the batch's
  // completion callback, before it dispatches "n".
  backend_->Receive(Note("n"), /*complete=*/2);
  ASSERT_TRUE(done_entered.WaitForNotificationWithTimeout(kWait));
  agent_->SetNotificationCallback(nullptr);  // no notification call running
  proceed.Notify();
  // A later pass (this batch is posted by the progress thread after "n" went out).
  auto second = agent_->PostWrite(
      peer_, Seg(500), [&](BatchId, const absl::Status&) { second_done.Notify(); });
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE(backend_->AwaitPieces(2));
  backend_->CompleteOldest(2);
  ASSERT_TRUE(second_done.WaitForNotificationWithTimeout(kWait));
  {
    absl::MutexLock l(&mu);
    EXPECT_TRUE(calls.empty()) << "the cleared callback got " << calls[0];
  }
  const std::vector<Notification> polled = agent_->PollNotifications();
  ASSERT_EQ(polled.size(), 1u);
  EXPECT_EQ(polled[0].request_id, "n");
  EXPECT_TRUE(agent_->Wait(*first, Soon()).ok());
  EXPECT_TRUE(agent_->Wait(*second, Soon()).ok());
}

TEST_F(AgentCoreTest, NotificationsQueuedWithoutACallbackGoToTheNextOne) {
  Make(Limits(1000, 2));
  absl::Mutex mu;
  std::vector<std::pair<std::string, std::thread::id>> calls;  // guarded by mu
  size_t num_calls = 0;                                        // guarded by mu
  absl::Cleanup release = [&] { agent_.reset(); };
  backend_->Receive(Note("n1"));
  backend_->Receive(Note("n2"));
  ASSERT_TRUE(backend_->AwaitReceived(2));  // queued: no callback yet
  agent_->SetNotificationCallback([&](const Notification& n) {
    absl::MutexLock l(&mu);
    calls.push_back({n.request_id, std::this_thread::get_id()});
    ++num_calls;
  });
  const std::thread::id test_thread = std::this_thread::get_id();
  {
    // Delivered in order by SetNotificationCallback itself, before it returned.
    absl::MutexLock l(&mu);
    EXPECT_EQ(calls, (std::vector<std::pair<std::string, std::thread::id>>{
                         {"n1", test_thread}, {"n2", test_thread}}));
  }
  EXPECT_TRUE(agent_->PollNotifications().empty());
  // Later ones go to it from the progress thread.
  backend_->Receive(Note("n3"));
  ASSERT_TRUE(AwaitCount(&mu, &num_calls, 3));
  absl::MutexLock l(&mu);
  ASSERT_EQ(calls.size(), 3u);
  EXPECT_EQ(calls[2].first, "n3");
  EXPECT_EQ(calls[2].second, backend_->progress_thread());
}

TEST_F(AgentCoreTest, DestroyingTheAgentDropsLiveBatchesWithoutTheirCallbacks) {
  Make(Limits(1000, 2));
  std::atomic<int> calls{0};
  auto count = [&](BatchId, const absl::Status&) { ++calls; };
  auto running = agent_->PostWrite(peer_, Seg(4500), count);
  ASSERT_TRUE(running.ok()) << running.status();
  auto cancelled = agent_->PostRead(peer_, Seg(2000), count);
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  ASSERT_TRUE(backend_->AwaitPieces(4));         // two of each, all pending
  ASSERT_TRUE(agent_->Cancel(*cancelled).ok());  // still draining its pieces
  EXPECT_EQ(agent_->NumBatchesForTesting(), 2u);
  absl::Notification destroyed;
  std::thread destroyer([&] {
    agent_.reset();
    destroyed.Notify();
  });
  if (!destroyed.WaitForNotificationWithTimeout(kWait)) {
    // Joining would hang the test; end it here instead.
    ADD_FAILURE() << "destroying the agent with live batches did not return";
    std::abort();
  }
  destroyer.join();
  EXPECT_EQ(calls.load(), 0);
}

TEST_F(AgentCoreTest, CancelCallsBackOnceWithCancelledOnTheProgressThread) {
  Make(Limits(1000, 2));
  absl::Mutex mu;
  std::vector<std::pair<absl::StatusCode, std::thread::id>> calls;  // guarded by mu
  size_t num_calls = 0;                                             // guarded by mu
  absl::Notification later_done;
  absl::Cleanup release = [&] { agent_.reset(); };
  auto batch =
      agent_->PostWrite(peer_, Seg(4500), [&](BatchId id, const absl::Status& st) {
        absl::MutexLock l(&mu);
        calls.push_back({st.code(), std::this_thread::get_id()});
        ++num_calls;
      });
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_TRUE(backend_->AwaitPieces(2));
  ASSERT_TRUE(agent_->Cancel(*batch).ok());
  ASSERT_TRUE(agent_->Cancel(*batch).ok());  // again: no second end
  backend_->CompleteOldest(2);               // the pending pieces drain
  ASSERT_TRUE(AwaitCount(&mu, &num_calls, 1));
  // A batch ended in a later pass: its callback comes after any second call.
  auto later = agent_->PostWrite(
      peer_, Seg(10), [&](BatchId, const absl::Status&) { later_done.Notify(); });
  ASSERT_TRUE(later.ok()) << later.status();
  ASSERT_TRUE(backend_->AwaitPieces(3));
  backend_->CompleteOldest(2);
  ASSERT_TRUE(later_done.WaitForNotificationWithTimeout(kWait));
  {
    absl::MutexLock l(&mu);
    ASSERT_EQ(calls.size(), 1u);
    EXPECT_EQ(calls[0].first, absl::StatusCode::kCancelled);
    EXPECT_EQ(calls[0].second, backend_->progress_thread());
    EXPECT_NE(calls[0].second, std::this_thread::get_id());
  }
  EXPECT_EQ(agent_->Wait(*batch, Soon()).code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(agent_->Wait(*later, Soon()).ok());
}

TEST_F(AgentCoreTest, CancelThatEndsTheBatchAtOnceStillCallsBackOnTheProgressThread) {
  // Every piece waits for its target: nothing is pending when the cancel comes,
  // so the batch ends inside Cancel.
  Make(Limits(1000, 2), Backend::PostResult::kRetryLater);
  absl::Mutex mu;
  std::vector<std::pair<absl::StatusCode, std::thread::id>> calls;  // guarded by mu
  absl::Notification later_done;
  absl::Cleanup release = [&] { agent_.reset(); };
  auto batch =
      agent_->PostWrite(peer_, Seg(4500), [&](BatchId, const absl::Status& st) {
        absl::MutexLock l(&mu);
        calls.push_back({st.code(), std::this_thread::get_id()});
      });
  ASSERT_TRUE(batch.ok()) << batch.status();
  ASSERT_TRUE(backend_->AwaitPieces(1));  // tried, stalled
  ASSERT_TRUE(agent_->Cancel(*batch).ok());
  auto later = agent_->PostWrite(
      peer_, Seg(10), [&](BatchId, const absl::Status&) { later_done.Notify(); });
  ASSERT_TRUE(later.ok()) << later.status();
  ASSERT_TRUE(agent_->Cancel(*later).ok());  // queued after the first's callback
  ASSERT_TRUE(later_done.WaitForNotificationWithTimeout(kWait));
  {
    absl::MutexLock l(&mu);
    ASSERT_EQ(calls.size(), 1u);
    EXPECT_EQ(calls[0].first, absl::StatusCode::kCancelled);
    EXPECT_EQ(calls[0].second, backend_->progress_thread());
    EXPECT_NE(calls[0].second, std::this_thread::get_id());
  }
  EXPECT_EQ(agent_->Wait(*batch, Soon()).code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(agent_->Wait(*later, Soon()).code(), absl::StatusCode::kCancelled);
}

TEST_F(AgentCoreTest, WaitForABatchReportedElsewhereMeanwhileIsNotFound) {
  Make(Limits(1000, 2));
  // Two waiters and a poller race for each batch: exactly one reports it, the
  // others get NOT_FOUND (not a read of the forgotten batch). Which one wins is
  // up to the scheduler; whichever does, there is a loser that was waiting.
  constexpr int kRounds = 5;
  int poll_won = 0;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(round);
    auto batch = agent_->PostWrite(peer_, Seg(500));
    ASSERT_TRUE(batch.ok()) << batch.status();
    ASSERT_TRUE(backend_->AwaitPieces(round + 1));
    absl::Status waited[2];
    absl::Notification returned[2];
    std::vector<std::thread> waiters;
    for (int w = 0; w < 2; ++w) {
      waiters.emplace_back([&, w] {
        waited[w] = agent_->Wait(*batch, Soon());
        returned[w].Notify();
      });
    }
    // Both are waiting (the batch is still running).
    EXPECT_FALSE(returned[0].WaitForNotificationWithTimeout(absl::Milliseconds(20)));
    EXPECT_FALSE(returned[1].HasBeenNotified());
    backend_->CompleteOldest(2);  // the piece and the fence
    absl::StatusOr<bool> polled = false;
    const absl::Time end = Soon();
    while (polled.ok() && !*polled && absl::Now() < end) {
      polled = agent_->Poll(*batch);
      if (polled.ok() && !*polled) std::this_thread::yield();
    }
    for (std::thread& t : waiters) t.join();  // bounded by the Wait deadline
    int reporters = 0;
    if (polled.ok()) {
      EXPECT_TRUE(*polled) << "still running at the deadline";
      ++reporters;
      ++poll_won;
    } else {
      EXPECT_EQ(polled.status().code(), absl::StatusCode::kNotFound) << polled.status();
    }
    for (const absl::Status& st : waited) {
      if (st.ok()) {
        ++reporters;
      } else {
        EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
      }
    }
    EXPECT_EQ(reporters, 1);
  }
  EXPECT_EQ(agent_->NumBatchesForTesting(), 0u);
  RecordProperty("poll_won", poll_won);
}

}  // namespace
}  // namespace tandem::kvtransfer
