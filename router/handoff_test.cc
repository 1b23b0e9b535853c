// The hand-off's gRPC glue against scripted prefill and decode workers on an
// in-process server: each Placement action becomes the right call with the right
// fields, each call's end goes back as the right event, and the request ends
// once (sink closed, on_finish, one latency sample). The fake can hold Releases
// until the test lets them go, to step the awaited Release of a prefill retry.
#include "router/handoff.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "metrics/registry.h"
#include "proto/worker.grpc.pb.h"

namespace tandem::router {
namespace {

using tandem::v1::GenerateResponse;

constexpr absl::Duration kWait = absl::Seconds(30);

// A worker's response stream: the scripted messages, or (hold) nothing until the
// client cancels.
class ScriptedStream final : public grpc::ServerWriteReactor<GenerateResponse> {
 public:
  ScriptedStream(bool hold, absl::Notification* cancelled)
      : hold_(hold), cancelled_(cancelled) {
    if (hold_) return;
    GenerateResponse a, b;
    a.add_token_ids(42);  // the first token (from Prefill on the disaggregated path)
    b.add_token_ids(43);
    b.set_finish_reason(tandem::v1::FINISH_REASON_LENGTH);
    messages_ = {a, b};
    Next();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) return Finish(grpc::Status(grpc::StatusCode::UNKNOWN, "write failed"));
    Next();
  }
  void OnCancel() override {
    if (cancelled_ != nullptr && !cancelled_->HasBeenNotified()) cancelled_->Notify();
    if (hold_) Finish(grpc::Status::CANCELLED);
  }
  void OnDone() override { delete this; }

 private:
  void Next() {
    if (next_ == messages_.size()) return Finish(grpc::Status::OK);
    StartWrite(&messages_[next_++]);
  }
  const bool hold_;
  absl::Notification* const cancelled_;
  std::vector<GenerateResponse> messages_;
  size_t next_ = 0;
};

// One fake process that is both a prefill and a decode worker.
class FakeWorker final : public tandem::v1::DecodeWorker::CallbackService,
                         public tandem::v1::PrefillWorker::CallbackService {
 public:
  grpc::ServerUnaryReactor* Reserve(grpc::CallbackServerContext* ctx,
                                    const tandem::v1::ReserveRequest* req,
                                    tandem::v1::KvTarget* target) override {
    absl::MutexLock l(&mu);
    reserves.push_back(*req);
    calls.push_back("reserve");
    auto* r = ctx->DefaultReactor();
    if (full_reserves > 0) {
      --full_reserves;
      r->Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "full"));
      return r;
    }
    target->set_request_id(req->request_id());
    target->set_decode_worker_id("d0");
    r->Finish(grpc::Status::OK);
    return r;
  }
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* ctx,
                                    const tandem::v1::ReleaseRequest* req,
                                    tandem::v1::ReleaseResponse*) override {
    absl::MutexLock l(&mu);
    releases.push_back(req->request_id());
    calls.push_back("release");
    auto* r = ctx->DefaultReactor();
    if (hold_releases > 0) {
      --hold_releases;
      held_releases_.push_back(r);
      if (!release_held.HasBeenNotified()) release_held.Notify();
      return r;
    }
    calls.push_back("release done");
    r->Finish(grpc::Status::OK);
    return r;
  }
  grpc::ServerUnaryReactor* Prefill(grpc::CallbackServerContext* ctx,
                                    const tandem::v1::PrefillRequest* req,
                                    tandem::v1::PrefillResponse* resp) override {
    absl::MutexLock l(&mu);
    prefills.push_back(*req);
    calls.push_back("prefill");
    resp->set_request_id(req->request_id());
    resp->set_first_token_id(42);
    resp->set_seed(7);
    resp->mutable_transfer()->set_seconds(0.25);
    auto* r = ctx->DefaultReactor();
    r->Finish(prefill_unavailable ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "lost")
                                  : grpc::Status::OK);
    return r;
  }
  grpc::ServerWriteReactor<GenerateResponse>* Decode(
      grpc::CallbackServerContext*, const tandem::v1::DecodeRequest* req) override {
    absl::MutexLock l(&mu);
    decodes.push_back(*req);
    calls.push_back("decode");
    if (hold && !stream_started.HasBeenNotified()) stream_started.Notify();
    return new ScriptedStream(hold, &stream_cancelled);
  }
  grpc::ServerWriteReactor<GenerateResponse>* Generate(
      grpc::CallbackServerContext*, const tandem::v1::GenerateRequest* req) override {
    absl::MutexLock l(&mu);
    generates.push_back(*req);
    calls.push_back("generate");
    if (hold && !stream_started.HasBeenNotified()) stream_started.Notify();
    return new ScriptedStream(hold, &stream_cancelled);
  }

  // Ends the held Releases (OK).
  void LetReleasesGo() {
    std::vector<grpc::ServerUnaryReactor*> go;
    {
      absl::MutexLock l(&mu);
      go.swap(held_releases_);
      for (size_t i = 0; i < go.size(); ++i) calls.push_back("release done");
    }
    for (grpc::ServerUnaryReactor* r : go) r->Finish(grpc::Status::OK);
  }
  std::vector<std::string> Calls() {
    absl::MutexLock l(&mu);
    return calls;
  }

  absl::Mutex mu;
  // Every call in arrival order; "release done" when a Release's end is sent.
  std::vector<std::string> calls ABSL_GUARDED_BY(mu);
  int hold_releases ABSL_GUARDED_BY(mu) = 0;  // the next ones wait for LetReleasesGo
  int full_reserves ABSL_GUARDED_BY(mu) = 0;  // the next ones: RESOURCE_EXHAUSTED
  absl::Notification release_held;            // one was held
  std::vector<tandem::v1::ReserveRequest> reserves ABSL_GUARDED_BY(mu);
  std::vector<std::string> releases ABSL_GUARDED_BY(mu);
  std::vector<tandem::v1::PrefillRequest> prefills ABSL_GUARDED_BY(mu);
  std::vector<tandem::v1::DecodeRequest> decodes ABSL_GUARDED_BY(mu);
  std::vector<tandem::v1::GenerateRequest> generates ABSL_GUARDED_BY(mu);
  std::atomic<bool> prefill_unavailable{false};
  std::atomic<bool> hold{false};  // streams wait for the client's cancel
  absl::Notification stream_started, stream_cancelled;

 private:
  std::vector<grpc::ServerUnaryReactor*> held_releases_ ABSL_GUARDED_BY(mu);
};

// Records what the hand-off writes; Cancel() plays the client going away.
class RecordingSink final : public rpc::ResponseSink {
 public:
  void SetOnCancel(std::function<void()> on_cancel) override {
    absl::MutexLock l(&mu_);
    on_cancel_ = std::move(on_cancel);
  }
  void Push(GenerateResponse message) override {
    absl::MutexLock l(&mu_);
    messages_.push_back(std::move(message));
  }
  void Close(const grpc::Status& status) override {
    absl::MutexLock l(&mu_);
    ++closes_;
    status_ = status;
    if (!closed_.HasBeenNotified()) closed_.Notify();
  }
  bool cancelled() const override { return cancelled_.load(); }

  void Cancel() {
    std::function<void()> hook;
    {
      absl::MutexLock l(&mu_);
      hook = on_cancel_;
    }
    cancelled_ = true;
    if (hook) hook();
  }
  bool WaitClosed() { return closed_.WaitForNotificationWithTimeout(kWait); }
  grpc::Status status() {
    absl::MutexLock l(&mu_);
    return status_;
  }
  std::vector<GenerateResponse> messages() {
    absl::MutexLock l(&mu_);
    return messages_;
  }
  int closes() {
    absl::MutexLock l(&mu_);
    return closes_;
  }

 private:
  absl::Mutex mu_;
  std::function<void()> on_cancel_ ABSL_GUARDED_BY(mu_);
  std::vector<GenerateResponse> messages_ ABSL_GUARDED_BY(mu_);
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
  int closes_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<bool> cancelled_{false};
  absl::Notification closed_;
};

class HandoffTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(static_cast<tandem::v1::DecodeWorker::CallbackService*>(&fake_));
    b.RegisterService(static_cast<tandem::v1::PrefillWorker::CallbackService*>(&fake_));
    server_ = b.BuildAndStart();
    ASSERT_GT(port, 0);
    address_ = "127.0.0.1:" + std::to_string(port);
  }
  void TearDown() override {
    fake_.LetReleasesGo();  // a held call would keep the server from shutting down
    // The request is dropped before the fixture it points into goes.
    if (started_) EXPECT_TRUE(call_gone_->WaitForNotificationWithTimeout(kWait));
    server_->Shutdown(absl::ToChronoTime(absl::Now()));
  }

  void Register(const std::string& id, tandem::v1::WorkerRole role,
                const std::string& address) {
    tandem::v1::RegisterRequest r;
    r.set_worker_id(id);
    r.set_role(role);
    r.set_grpc_address(address);
    r.set_model_fingerprint("fp");
    ASSERT_TRUE(registry_.Register(r).ok());
  }

  // Starts request "r1" (3 prompt tokens) on the hand-off, writing to sink_.
  // *call_gone_ is notified once the hand-off has dropped the request (its last
  // call ended and nothing was started after it).
  // The next `n` Reserves answer RESOURCE_EXHAUSTED.
  void FillReserves(int n) {
    absl::MutexLock l(&fake_.mu);
    fake_.full_reserves = n;
  }
  // d0 (decode) and p0 (prefill), both this fake, then the request.
  void StartOnOnePair() {
    Register("d0", tandem::v1::WORKER_ROLE_DECODE, address_);
    Register("p0", tandem::v1::WORKER_ROLE_PREFILL, address_);
    Start();
  }
  void Start(absl::Duration timeout = kWait) {
    struct Gone {
      explicit Gone(std::shared_ptr<absl::Notification> n) : n(std::move(n)) {}
      ~Gone() { n->Notify(); }
      const std::shared_ptr<absl::Notification> n;
    };
    auto gone = std::make_shared<Gone>(call_gone_);
    started_ = true;
    tandem::v1::GenerateRequest req;
    req.set_request_id("r1");
    for (int t : {1, 2, 3}) req.mutable_prompt_token_ids()->add_ids(t);
    req.mutable_stop()->set_max_tokens(2);
    const absl::Time now = absl::Now();
    handoff_.Start(req, &sink_, now + timeout, now,
                   [this, gone = std::move(gone)](const absl::Status& s) {
                     absl::MutexLock l(&mu_);
                     finishes_.push_back(s);
                   });
  }
  std::vector<absl::Status> Finishes() {
    absl::MutexLock l(&mu_);
    return finishes_;
  }
  double Retries(const char* reason) {
    return metrics_.retries->Add({{"reason", reason}}).Value();
  }
  // Polls the queue's depth (the request is queued on a gRPC callback thread).
  bool QueueDepthBecomes(size_t n) {
    const absl::Time end = absl::Now() + kWait;
    while (handoff_.queue()->depth() != n) {
      if (absl::Now() > end) return false;
      absl::SleepFor(absl::Milliseconds(1));
    }
    return true;
  }

  FakeWorker fake_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  FakeClock registry_clock_;
  WorkerRegistry registry_{&registry_clock_, absl::Hours(1)};
  metrics::Registry metric_registry_;
  HandoffMetrics metrics_{&metric_registry_};
  Handoff handoff_{&registry_, &metrics_, HandoffOptions{}};
  RecordingSink sink_;
  // Shared with the request's token: notified when the hand-off drops it.
  std::shared_ptr<absl::Notification> call_gone_ =
      std::make_shared<absl::Notification>();
  bool started_ = false;
  absl::Mutex mu_;
  std::vector<absl::Status> finishes_ ABSL_GUARDED_BY(mu_);
};

TEST_F(HandoffTest, DisaggregatedCallsCarryTheHandOff) {
  StartOnOnePair();
  ASSERT_TRUE(sink_.WaitClosed());
  EXPECT_TRUE(sink_.status().ok()) << sink_.status().error_message();
  {
    absl::MutexLock l(&fake_.mu);
    ASSERT_EQ(fake_.reserves.size(), 1u);
    EXPECT_EQ(fake_.reserves[0].request_id(), "r1");
    EXPECT_EQ(fake_.reserves[0].prompt_tokens(), 3);
    EXPECT_EQ(fake_.reserves[0].max_new_tokens(), 2);
    EXPECT_EQ(fake_.reserves[0].prefill_tp_size(), 1);
    ASSERT_EQ(fake_.prefills.size(), 1u);
    EXPECT_EQ(fake_.prefills[0].target().decode_worker_id(), "d0");  // from Reserve
    EXPECT_EQ(fake_.prefills[0].prompt_token_ids_size(), 3);
    EXPECT_GT(fake_.prefills[0].deadline_unix_ms(), 0);
    EXPECT_TRUE(fake_.prefills[0].checksums());
    ASSERT_EQ(fake_.decodes.size(), 1u);
    EXPECT_EQ(fake_.decodes[0].first_token_id(), 42);  // from Prefill
    EXPECT_EQ(fake_.decodes[0].sampling().seed(), 7);
    EXPECT_EQ(fake_.decodes[0].deadline_unix_ms(),
              fake_.prefills[0].deadline_unix_ms());
    EXPECT_TRUE(fake_.releases.empty());
    EXPECT_TRUE(fake_.generates.empty());
  }
  const std::vector<GenerateResponse> m = sink_.messages();
  ASSERT_EQ(m.size(), 2u);
  for (const GenerateResponse& r : m) EXPECT_EQ(r.request_id(), "r1");
  EXPECT_EQ(m[1].usage().prompt_tokens(), 3);  // the router's usage on the last
  EXPECT_GT(m[1].usage().total_seconds(), 0);
  EXPECT_GE(m[1].usage().total_seconds(), m[1].usage().ttft_seconds());
  EXPECT_EQ(sink_.closes(), 1);
  ASSERT_EQ(Finishes().size(), 1u);
  EXPECT_TRUE(Finishes()[0].ok());
  EXPECT_EQ(metrics_.latency->Count(), 1u);
  EXPECT_EQ(metrics_.ttft->Count(), 1u);
  EXPECT_EQ(metrics_.transfer_seconds->Count(), 1u);
  EXPECT_DOUBLE_EQ(metrics_.transfer_seconds->Sum(), 0.25);
  EXPECT_EQ(metrics_.paths->Add({{"path", "disaggregated"}}).Value(), 1);
}

TEST_F(HandoffTest, LostPrefillWorkerIsReleasedThenColocated) {
  fake_.prefill_unavailable = true;
  StartOnOnePair();
  ASSERT_TRUE(sink_.WaitClosed());
  EXPECT_TRUE(sink_.status().ok()) << sink_.status().error_message();
  {
    absl::MutexLock l(&fake_.mu);
    // Reserve, Prefill (lost), Release; Reserve again, no prefill worker left:
    // Release, then Generate on the decode worker.
    EXPECT_EQ(fake_.reserves.size(), 2u);
    EXPECT_EQ(fake_.prefills.size(), 1u);
    EXPECT_EQ(fake_.releases, (std::vector<std::string>{"r1", "r1"}));
    ASSERT_EQ(fake_.generates.size(), 1u);
    EXPECT_EQ(fake_.generates[0].request_id(), "r1");
    EXPECT_TRUE(fake_.decodes.empty());
  }
  EXPECT_EQ(Retries("prefill_unavailable"), 1);
  EXPECT_EQ(Retries("colocated_fallback"), 1);
  EXPECT_TRUE(registry_.Live(tandem::v1::WORKER_ROLE_PREFILL).empty());
  EXPECT_EQ(sink_.messages().size(), 2u);
  EXPECT_EQ(metrics_.latency->Count(), 1u);
}

TEST_F(HandoffTest, FullDecodeWorkerQueuesTheRequestUntilCapacityFrees) {
  FillReserves(1);
  StartOnOnePair();
  ASSERT_TRUE(QueueDepthBecomes(1));
  EXPECT_EQ(sink_.closes(), 0);  // waiting, not refused
  handoff_.CapacityMayHaveFreed(1);
  ASSERT_TRUE(sink_.WaitClosed());
  EXPECT_TRUE(sink_.status().ok()) << sink_.status().error_message();
  EXPECT_EQ(fake_.Calls()[0], "reserve");
  EXPECT_EQ(fake_.Calls()[1], "reserve");  // again, once woken
  EXPECT_EQ(handoff_.queue()->depth(), 0u);
  EXPECT_EQ(metrics_.queue.wait_seconds->Count(), 1u);
  EXPECT_EQ(Retries("decode_full"), 1);
  ASSERT_EQ(Finishes().size(), 1u);
}

TEST_F(HandoffTest, ClientCancelWhileQueuedEndsAtOnceAndFreesThePlace) {
  FillReserves(1);
  StartOnOnePair();
  ASSERT_TRUE(QueueDepthBecomes(1));
  sink_.Cancel();
  ASSERT_TRUE(sink_.WaitClosed());
  EXPECT_EQ(sink_.status().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(handoff_.queue()->depth(), 0u);
  handoff_.CapacityMayHaveFreed(1);  // wakes nobody: it left
  EXPECT_EQ(fake_.Calls(), std::vector<std::string>{"reserve"});
  ASSERT_EQ(Finishes().size(), 1u);
  EXPECT_TRUE(absl::IsCancelled(Finishes()[0]));
}

TEST_F(HandoffTest, ClientCancelWhileDecodingCancelsTheStream) {
  fake_.hold = true;
  StartOnOnePair();
  ASSERT_TRUE(fake_.stream_started.WaitForNotificationWithTimeout(kWait));
  sink_.Cancel();
  ASSERT_TRUE(sink_.WaitClosed());
  EXPECT_EQ(sink_.status().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(fake_.stream_cancelled.WaitForNotificationWithTimeout(kWait));
  ASSERT_EQ(Finishes().size(), 1u);
  EXPECT_TRUE(absl::IsCancelled(Finishes()[0]));
  EXPECT_EQ(metrics_.latency->Count(), 1u);
  EXPECT_EQ(registry_.Live(tandem::v1::WORKER_ROLE_DECODE).size(), 1u);  // not lost
}

TEST_F(HandoffTest, DeadlineWhileColocatedIsDeadlineExceeded) {
  fake_.hold = true;
  Register("d0", tandem::v1::WORKER_ROLE_DECODE, address_);  // no prefill: colocated
  Start(absl::Milliseconds(300));
  ASSERT_TRUE(sink_.WaitClosed());
  EXPECT_EQ(sink_.status().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(metrics_.latency->Count(), 1u);
  EXPECT_GE(metrics_.latency->Sum(), 0.29);  // gRPC may fire microseconds early
}

TEST_F(HandoffTest, UnreachableDecodeWorkerIsUnavailableAndRemoved) {
  server_->Shutdown(absl::ToChronoTime(absl::Now()));  // nothing listens there now
  Register("d0", tandem::v1::WORKER_ROLE_DECODE, address_);
  Start();
  ASSERT_TRUE(sink_.WaitClosed());
  EXPECT_EQ(sink_.status().error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(sink_.status().error_message().find("decode worker d0"), std::string::npos)
      << sink_.status().error_message();
  EXPECT_TRUE(registry_.Live(tandem::v1::WORKER_ROLE_DECODE).empty());
  EXPECT_EQ(metrics_.latency->Count(), 1u);
}

TEST_F(HandoffTest, ClientCancelWhileReleasingFinishesOnceAndStartsNothingMore) {
  fake_.prefill_unavailable = true;
  {
    absl::MutexLock l(&fake_.mu);
    fake_.hold_releases = 1;
  }
  StartOnOnePair();
  // Prefill lost: RELEASING, the awaited Release held by the fake.
  ASSERT_TRUE(fake_.release_held.WaitForNotificationWithTimeout(kWait));
  sink_.Cancel();
  // No call to cancel: the request ends at once (on the cancelling thread),
  // with the Release still held.
  ASSERT_EQ(sink_.closes(), 1);
  EXPECT_EQ(sink_.status().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(fake_.Calls(), (std::vector<std::string>{"reserve", "prefill", "release"}));
  // Shutdown: WaitCallsEnded (what the router waits on after its server's
  // Shutdown, and ~Handoff before it drops the stubs and the channels) returns
  // only once the Release, still in flight for a request already ended, is over.
  EXPECT_FALSE(handoff_.WaitCallsEnded(absl::Milliseconds(200)));
  fake_.LetReleasesGo();
  EXPECT_TRUE(handoff_.WaitCallsEnded(kWait));
  // The Release's end is handled and the request dropped, nothing started after.
  ASSERT_TRUE(call_gone_->WaitForNotificationWithTimeout(kWait));
  EXPECT_EQ(fake_.Calls(), (std::vector<std::string>{"reserve", "prefill", "release",
                                                     "release done"}));
  EXPECT_EQ(sink_.closes(), 1);
  ASSERT_EQ(Finishes().size(), 1u);
  EXPECT_TRUE(absl::IsCancelled(Finishes()[0])) << Finishes()[0];
  EXPECT_EQ(metrics_.latency->Count(), 1u);
  EXPECT_TRUE(sink_.messages().empty());
}

TEST_F(HandoffTest, PrefillRetryReservesAgainOnlyAfterTheReleaseEnded) {
  fake_.prefill_unavailable = true;
  {
    absl::MutexLock l(&fake_.mu);
    fake_.hold_releases = 1;  // the retry's Release; the fallback's is not held
  }
  StartOnOnePair();
  ASSERT_TRUE(fake_.release_held.WaitForNotificationWithTimeout(kWait));
  {
    // While the Release is held, no second Reserve comes (a bounded look: an
    // unawaited Release would let it through within this time).
    absl::MutexLock l(&fake_.mu);
    auto second_reserve = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(fake_.mu) {
      return fake_.reserves.size() >= 2;
    };
    EXPECT_FALSE(fake_.mu.AwaitWithTimeout(absl::Condition(&second_reserve),
                                           absl::Milliseconds(100)));
  }
  fake_.LetReleasesGo();
  ASSERT_TRUE(sink_.WaitClosed());
  EXPECT_TRUE(sink_.status().ok()) << sink_.status().error_message();
  // Reserve, Prefill (lost), Release; once it ended, Reserve again; no prefill
  // worker left: Release, then Generate (colocated).
  EXPECT_EQ(fake_.Calls(), (std::vector<std::string>{
                               "reserve", "prefill", "release", "release done",
                               "reserve", "release", "release done", "generate"}));
  EXPECT_EQ(sink_.closes(), 1);
  EXPECT_EQ(Finishes().size(), 1u);
}

}  // namespace
}  // namespace tandem::router
