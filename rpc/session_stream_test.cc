#include "rpc/session_stream.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "proto/router.grpc.pb.h"

namespace tandem::rpc {
namespace {

using tandem::v1::GenerateRequest;
using tandem::v1::GenerateResponse;
using tandem::v1::SessionEvent;
using tandem::v1::SessionRequest;
using tandem::v1::SessionResponse;

// A Router whose sessions hand each request's sink to the test.
class TestRouter final : public tandem::v1::Router::CallbackService {
 public:
  grpc::ServerBidiReactor<SessionRequest, SessionResponse>* GenerateSession(
      grpc::CallbackServerContext*) override {
    return new SessionStream(
        [this](GenerateRequest request, ResponseSink* sink) {
          sink->SetOnCancel([this, id = request.request_id()] {
            absl::MutexLock l(&mu_);
            cancelled_.push_back(id);
          });
          absl::MutexLock l(&mu_);
          sinks_[request.request_id()] = sink;
        },
        {.on_write = [this](int64_t events) { written_events_ += events; },
         .on_done =
             [this](const SessionStream::Stats& stats) {
               absl::MutexLock l(&mu_);
               stats_ = stats;
               done_ = true;
             }});
  }

  // Waits (5 s at most) for request `id` to start; returns its sink.
  ResponseSink* Sink(const std::string& id) {
    absl::MutexLock l(&mu_);
    auto started = [this, &id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return sinks_.count(id) > 0;
    };
    mu_.AwaitWithTimeout(absl::Condition(&started), absl::Seconds(5));
    auto it = sinks_.find(id);
    return it == sinks_.end() ? nullptr : it->second;
  }
  bool Started(const std::string& id) {
    absl::MutexLock l(&mu_);
    return sinks_.count(id) > 0;
  }
  // Waits (5 s at most) until `n` requests were cancelled.
  std::vector<std::string> Cancelled(size_t n) {
    absl::MutexLock l(&mu_);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return cancelled_.size() >= n;
    };
    mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(5));
    return cancelled_;
  }
  int64_t written_events() const { return written_events_.load(); }
  // Waits (5 s at most) for the session's end; its stats.
  std::optional<SessionStream::Stats> Done() {
    absl::MutexLock l(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&done_), absl::Seconds(5));
    if (!done_) return std::nullopt;
    return stats_;
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, ResponseSink*> sinks_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> cancelled_ ABSL_GUARDED_BY(mu_);
  SessionStream::Stats stats_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<int64_t> written_events_{0};
};

class SessionStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&router_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = tandem::v1::Router::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
    context_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    stream_ = stub_->GenerateSession(&context_);
  }
  void TearDown() override {
    context_.TryCancel();  // a test may leave the session open
    stream_.reset();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }

  void Start(uint64_t stream_id, const std::string& request_id) {
    SessionRequest r;
    auto* s = r.add_starts();
    s->set_stream_id(stream_id);
    s->mutable_request()->set_request_id(request_id);
    ASSERT_TRUE(stream_->Write(r));
  }

  // Reads events until every id in `ids` has ended; returns them in order.
  std::vector<SessionEvent> ReadUntilEnded(std::vector<uint64_t> ids) {
    std::vector<SessionEvent> events;
    SessionResponse r;
    while (!ids.empty() && stream_->Read(&r)) {
      for (const SessionEvent& e : r.events()) {
        events.push_back(e);
        if (e.has_end()) std::erase(ids, e.stream_id());
      }
    }
    EXPECT_TRUE(ids.empty()) << "the session ended before every stream did";
    return events;
  }

  static GenerateResponse Tokens(const std::string& id, std::vector<int> ids) {
    GenerateResponse m;
    m.set_request_id(id);
    for (int t : ids) m.add_token_ids(t);
    return m;
  }

  TestRouter router_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<tandem::v1::Router::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<SessionRequest, SessionResponse>> stream_;
};

TEST_F(SessionStreamTest, InterleavedRequestsKeepTheirOrderAndEndWithTheirStatus) {
  Start(1, "a");
  Start(2, "b");
  ResponseSink* a = router_.Sink("a");
  ResponseSink* b = router_.Sink("b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  a->Push(Tokens("a", {10}));
  b->Push(Tokens("b", {20}));
  a->Push(Tokens("a", {11, 12}));
  b->Push(Tokens("b", {21}));
  GenerateResponse last = Tokens("a", {13});
  last.set_finish_reason(tandem::v1::FINISH_REASON_STOP);
  a->Push(last);
  a->Close(grpc::Status::OK);
  b->Close(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "full"));

  std::map<uint64_t, std::vector<int>> tokens;
  std::map<uint64_t, SessionEvent> ends;
  bool a_finish_seen = false;
  for (const SessionEvent& e : ReadUntilEnded({1, 2})) {
    ASSERT_FALSE(ends.count(e.stream_id())) << "an event after the end";
    if (e.has_end()) {
      ends[e.stream_id()] = e;
      continue;
    }
    for (int t : e.response().token_ids()) tokens[e.stream_id()].push_back(t);
    if (e.response().finish_reason() == tandem::v1::FINISH_REASON_STOP) {
      EXPECT_EQ(e.stream_id(), 1u);
      a_finish_seen = true;
    }
  }
  EXPECT_EQ(tokens[1], (std::vector<int>{10, 11, 12, 13}));
  EXPECT_EQ(tokens[2], (std::vector<int>{20, 21}));
  EXPECT_TRUE(a_finish_seen);
  EXPECT_EQ(ends[1].end().code(), 0);
  EXPECT_EQ(ends[2].end().code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(ends[2].end().message(), "full");

  // Half-close: with nothing running the session finishes OK.
  ASSERT_TRUE(stream_->WritesDone());
  EXPECT_TRUE(stream_->Finish().ok());
  auto stats = router_.Done();
  ASSERT_TRUE(stats.has_value());
  EXPECT_EQ(stats->started, 2);
}

TEST_F(SessionStreamTest, CancelByIdRunsTheHookAndTheEndFollows) {
  Start(7, "c");
  ResponseSink* c = router_.Sink("c");
  ASSERT_NE(c, nullptr);
  SessionRequest cancel;
  cancel.add_cancels(7);
  cancel.add_cancels(99);  // unknown: ignored
  ASSERT_TRUE(stream_->Write(cancel));
  EXPECT_EQ(router_.Cancelled(1), std::vector<std::string>{"c"});
  EXPECT_TRUE(c->cancelled());
  c->Push(Tokens("c", {1}));  // dropped after the cancel
  c->Close(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
  std::vector<SessionEvent> events = ReadUntilEnded({7});
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].end().code(), grpc::StatusCode::CANCELLED);
}

TEST_F(SessionStreamTest, ADuplicateRunningIdIsRefusedAndTheFirstGoesOn) {
  Start(5, "first");
  ResponseSink* first = router_.Sink("first");
  ASSERT_NE(first, nullptr);
  Start(5, "second");
  std::vector<SessionEvent> events = ReadUntilEnded({5});
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].end().code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_FALSE(router_.Started("second"));  // refused before the start function
  first->Push(Tokens("first", {3}));
  first->Close(grpc::Status::OK);
  events = ReadUntilEnded({5});
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].response().token_ids(0), 3);
  EXPECT_EQ(events[1].end().code(), 0);
}

TEST_F(SessionStreamTest, EveryPushArrivesOnceEitherAsAnEventOrMergedIntoOne) {
  Start(3, "fast");
  ResponseSink* fast = router_.Sink("fast");
  ASSERT_NE(fast, nullptr);
  constexpr int kPushes = 3000;
  std::thread producer([fast] {
    for (int i = 0; i < kPushes; ++i) fast->Push(Tokens("fast", {i}));
    fast->Close(grpc::Status::OK);
  });
  std::vector<int> tokens;
  int response_events = 0;
  for (const SessionEvent& e : ReadUntilEnded({3})) {
    if (e.has_end()) continue;
    ++response_events;
    tokens.insert(tokens.end(), e.response().token_ids().begin(),
                  e.response().token_ids().end());
  }
  producer.join();
  ASSERT_EQ(tokens.size(), static_cast<size_t>(kPushes));
  for (int i = 0; i < kPushes; ++i) ASSERT_EQ(tokens[i], i);
  ASSERT_TRUE(stream_->WritesDone());
  EXPECT_TRUE(stream_->Finish().ok());
  auto stats = router_.Done();
  ASSERT_TRUE(stats.has_value());
  EXPECT_EQ(response_events + stats->coalesced, kPushes);
  EXPECT_EQ(stats->events, response_events + 1);  // + the end event
  EXPECT_EQ(router_.written_events(), stats->events);
}

TEST_F(SessionStreamTest, BigBatchesAreSplitUnderTheClientsMessageLimit) {
  // 48 requests x ~120 KB pushed at once: one batch would pass the 4 MiB a
  // gRPC client takes by default (this test's client) and break the session.
  constexpr int kRequests = 48;
  constexpr int kTokens = 40000;
  std::vector<ResponseSink*> sinks;
  for (int i = 0; i < kRequests; ++i) {
    Start(i + 1, "big" + std::to_string(i));
    sinks.push_back(router_.Sink("big" + std::to_string(i)));
    ASSERT_NE(sinks.back(), nullptr);
  }
  for (int i = 0; i < kRequests; ++i) {
    GenerateResponse m;
    m.set_request_id("big" + std::to_string(i));
    for (int t = 0; t < kTokens; ++t) m.add_token_ids(100000 + i);  // 3 bytes each
    sinks[i]->Push(std::move(m));
    sinks[i]->Close(grpc::Status::OK);
  }
  std::vector<uint64_t> ids;
  for (int i = 0; i < kRequests; ++i) ids.push_back(i + 1);
  std::map<uint64_t, int> tokens;
  for (const SessionEvent& e : ReadUntilEnded(ids)) {
    if (e.has_end()) {
      EXPECT_EQ(e.end().code(), 0);
      continue;
    }
    for (int t : e.response().token_ids()) {
      ASSERT_EQ(t, 100000 + static_cast<int>(e.stream_id()) - 1);
    }
    tokens[e.stream_id()] += e.response().token_ids_size();
  }
  for (int i = 0; i < kRequests; ++i) EXPECT_EQ(tokens[i + 1], kTokens) << i;
}

TEST_F(SessionStreamTest, ClientCancellingTheSessionCancelsEveryRunningRequest) {
  Start(1, "x");
  Start(2, "y");
  ResponseSink* x = router_.Sink("x");
  ResponseSink* y = router_.Sink("y");
  ASSERT_NE(x, nullptr);
  ASSERT_NE(y, nullptr);
  context_.TryCancel();
  std::vector<std::string> cancelled = router_.Cancelled(2);
  std::sort(cancelled.begin(), cancelled.end());
  EXPECT_EQ(cancelled, (std::vector<std::string>{"x", "y"}));
  EXPECT_TRUE(router_.Done().has_value());  // the call ended without the Closes
  // Producers may still push and close after the call is gone.
  x->Push(Tokens("x", {1}));
  x->Close(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
  y->Close(grpc::Status::OK);
  EXPECT_EQ(stream_->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

}  // namespace
}  // namespace tandem::rpc
