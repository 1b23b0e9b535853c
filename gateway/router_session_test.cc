#include "gateway/router_session.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "metrics/registry.h"
#include "proto/router.grpc.pb.h"
#include "rpc/session_stream.h"

namespace tandem::gateway {
namespace {

using tandem::v1::GenerateRequest;
using tandem::v1::GenerateResponse;

// A router whose sessions hand each request's sink to the test, and record
// cancellations.
class HeldRouter final : public tandem::v1::Router::CallbackService {
 public:
  grpc::ServerBidiReactor<tandem::v1::SessionRequest, tandem::v1::SessionResponse>*
  GenerateSession(grpc::CallbackServerContext*) override {
    return new rpc::SessionStream(
        [this](GenerateRequest request, rpc::ResponseSink* sink) {
          sink->SetOnCancel([this, id = request.request_id()] {
            absl::MutexLock l(&mu_);
            cancelled_.push_back(id);
          });
          absl::MutexLock l(&mu_);
          sinks_[request.request_id()] = sink;
        });
  }

  rpc::ResponseSink* WaitForSink(const std::string& id) {
    absl::MutexLock l(&mu_);
    auto has = [&]()
                   ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return sinks_.count(id) > 0; };
    mu_.AwaitWithTimeout(absl::Condition(&has), absl::Seconds(10));
    return sinks_.count(id) ? sinks_[id] : nullptr;
  }
  bool WaitForCancel(const std::string& id) {
    absl::MutexLock l(&mu_);
    auto has = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return std::find(cancelled_.begin(), cancelled_.end(), id) != cancelled_.end();
    };
    return mu_.AwaitWithTimeout(absl::Condition(&has), absl::Seconds(10));
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, rpc::ResponseSink*> sinks_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> cancelled_ ABSL_GUARDED_BY(mu_);
};

// What one call received.
struct Received {
  absl::Mutex mu;
  std::vector<int> tokens ABSL_GUARDED_BY(mu);
  int responses_after_done ABSL_GUARDED_BY(mu) = 0;
  int dones ABSL_GUARDED_BY(mu) = 0;
  grpc::Status status ABSL_GUARDED_BY(mu);

  RouterClient::StreamCallbacks Callbacks() {
    return {.on_response =
                [this](const GenerateResponse& r) {
                  absl::MutexLock l(&mu);
                  if (dones > 0) ++responses_after_done;
                  tokens.insert(tokens.end(), r.token_ids().begin(),
                                r.token_ids().end());
                },
            .on_done =
                [this](const grpc::Status& s) {
                  absl::MutexLock l(&mu);
                  ++dones;
                  status = s;
                }};
  }
  // Waits (10 s at most) for the end; its status.
  grpc::Status Wait() {
    absl::MutexLock l(&mu);
    auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return dones > 0; };
    if (!mu.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(10))) {
      return grpc::Status(grpc::StatusCode::INTERNAL, "the call never ended");
    }
    return status;
  }
};

GenerateRequest Request(const std::string& id) {
  GenerateRequest r;
  r.set_request_id(id);
  return r;
}

class RouterSessionTest : public ::testing::Test {
 protected:
  void SetUp() override { StartServer(0); }
  void TearDown() override {
    pool_.reset();
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
  }
  void StartServer(int port) {
    router_ = std::make_unique<HeldRouter>();
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:" + std::to_string(port),
                             grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(router_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    if (stub_ == nullptr) {
      stub_ = tandem::v1::Router::NewStub(grpc::CreateChannel(
          "127.0.0.1:" + std::to_string(port_), grpc::InsecureChannelCredentials()));
      pool_ = std::make_unique<SessionPool>(stub_.get(), 2, &registry_);
    }
  }

  double Counter(const char* name) {
    auto family = registry_.AddCounter(name, "");  // the pool's family
    return family.ok() ? (*family)->Add({}).Value() : -1;
  }

  metrics::Registry registry_;
  std::unique_ptr<HeldRouter> router_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::unique_ptr<tandem::v1::Router::Stub> stub_;
  std::unique_ptr<SessionPool> pool_;
};

TEST_F(RouterSessionTest, ManyCallsGetTheirOwnTokensInOrderAndOneEnd) {
  constexpr int kCalls = 100;
  constexpr int kTokens = 20;
  std::vector<std::unique_ptr<Received>> got;
  std::vector<std::shared_ptr<GenerateCall>> calls;
  for (int i = 0; i < kCalls; ++i) {
    got.push_back(std::make_unique<Received>());
    calls.push_back(pool_->Generate(Request("r" + std::to_string(i)),
                                    absl::Now() + absl::Seconds(30),
                                    got.back()->Callbacks()));
  }
  std::vector<rpc::ResponseSink*> sinks;
  for (int i = 0; i < kCalls; ++i) {
    sinks.push_back(router_->WaitForSink("r" + std::to_string(i)));
    ASSERT_NE(sinks.back(), nullptr);
  }
  // Interleaved, as a decode step makes them: token t of every call, then t+1.
  for (int t = 0; t < kTokens; ++t) {
    for (int i = 0; i < kCalls; ++i) {
      GenerateResponse m;
      m.set_request_id("r" + std::to_string(i));
      m.add_token_ids(i * 1000 + t);
      sinks[i]->Push(m);
    }
  }
  for (int i = 0; i < kCalls; ++i) {
    sinks[i]->Close(i % 10 == 9
                        ? grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "x")
                        : grpc::Status::OK);
  }
  for (int i = 0; i < kCalls; ++i) {
    const grpc::Status s = got[i]->Wait();
    EXPECT_EQ(s.error_code(),
              i % 10 == 9 ? grpc::StatusCode::RESOURCE_EXHAUSTED : grpc::StatusCode::OK)
        << i;
    absl::MutexLock l(&got[i]->mu);
    ASSERT_EQ(got[i]->tokens.size(), static_cast<size_t>(kTokens)) << i;
    for (int t = 0; t < kTokens; ++t) EXPECT_EQ(got[i]->tokens[t], i * 1000 + t);
    EXPECT_EQ(got[i]->dones, 1);
  }
  const SessionPool::Stats stats = pool_->stats();
  EXPECT_EQ(stats.sessions_opened, 2);  // round robin over two slots
  // Every call got its end and at least one message of tokens; at most one
  // event per push and end; never an empty message.
  EXPECT_GE(stats.events_received, 2 * kCalls);
  EXPECT_LE(stats.events_received, kCalls * (kTokens + 1));
  EXPECT_GE(stats.messages_received, 1);
  EXPECT_LE(stats.messages_received, stats.events_received);
  // The exported counters say the same.
  EXPECT_EQ(Counter("tandem_gateway_router_sessions_opened_total"), 2);
  EXPECT_EQ(Counter("tandem_gateway_router_session_messages_total"),
            stats.messages_received);
  EXPECT_EQ(Counter("tandem_gateway_router_session_events_total"),
            stats.events_received);
}

// Many calls, some cancelled by the gateway at random moments, some past a
// short deadline, the rest ended by the router while tokens still flow: every
// call ends exactly once, with the status its fate says, and nothing is
// delivered after its end.
TEST_F(RouterSessionTest, RandomCancelsDeadlinesAndEndsEndEveryCallOnce) {
  constexpr int kCalls = 300;
  std::mt19937 rng(7);
  enum Fate { kRouterEnds, kCancelled, kDeadline };
  std::vector<Fate> fate(kCalls);
  std::vector<std::unique_ptr<Received>> got;
  std::vector<std::shared_ptr<GenerateCall>> calls;
  for (int i = 0; i < kCalls; ++i) {
    fate[i] = static_cast<Fate>(rng() % 3);
    got.push_back(std::make_unique<Received>());
    const absl::Duration timeout = fate[i] == kDeadline
                                       ? absl::Milliseconds(100 + rng() % 200)
                                       : absl::Seconds(30);
    calls.push_back(pool_->Generate(Request("x" + std::to_string(i)),
                                    absl::Now() + timeout, got.back()->Callbacks()));
  }
  std::vector<rpc::ResponseSink*> sinks;
  for (int i = 0; i < kCalls; ++i) {
    sinks.push_back(router_->WaitForSink("x" + std::to_string(i)));
    ASSERT_NE(sinks.back(), nullptr);
  }
  // Tokens for everyone while the gateway cancels a third of the calls.
  std::thread canceller([&] {
    for (int i = 0; i < kCalls; ++i) {
      if (fate[i] == kCancelled) calls[i]->Cancel();
    }
  });
  for (int t = 0; t < 10; ++t) {
    for (int i = 0; i < kCalls; ++i) {
      GenerateResponse m;
      m.set_request_id("x" + std::to_string(i));
      m.add_token_ids(t);
      sinks[i]->Push(m);
    }
  }
  canceller.join();
  for (int i = 0; i < kCalls; ++i) {
    if (fate[i] == kRouterEnds) sinks[i]->Close(grpc::Status::OK);
  }
  for (int i = 0; i < kCalls; ++i) {
    const grpc::Status s = got[i]->Wait();
    switch (fate[i]) {
      case kRouterEnds:
        EXPECT_TRUE(s.ok()) << i << ": " << s.error_message();
        break;
      case kCancelled:
        EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << i;
        break;
      case kDeadline:
        EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << i;
        break;
    }
  }
  // The router saw every cancel and deadline as a cancel; it closes them now.
  for (int i = 0; i < kCalls; ++i) {
    if (fate[i] != kRouterEnds) {
      EXPECT_TRUE(router_->WaitForCancel("x" + std::to_string(i))) << i;
      sinks[i]->Close(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
    }
  }
  for (int i = 0; i < kCalls; ++i) {
    absl::MutexLock l(&got[i]->mu);
    EXPECT_EQ(got[i]->dones, 1) << i;
    EXPECT_EQ(got[i]->responses_after_done, 0) << i;
    if (fate[i] == kRouterEnds) {
      ASSERT_EQ(got[i]->tokens.size(), 10u) << i;
      for (int t = 0; t < 10; ++t) EXPECT_EQ(got[i]->tokens[t], t) << i;
    } else {
      // A prefix of the tokens, in order.
      for (size_t t = 0; t < got[i]->tokens.size(); ++t)
        EXPECT_EQ(got[i]->tokens[t], t);
    }
  }
}

TEST_F(RouterSessionTest, CancelEndsTheCallAtOnceAndCancelsItUpstream) {
  Received got;
  auto call =
      pool_->Generate(Request("c"), absl::Now() + absl::Seconds(30), got.Callbacks());
  rpc::ResponseSink* sink = router_->WaitForSink("c");
  ASSERT_NE(sink, nullptr);
  call->Cancel();
  EXPECT_EQ(got.Wait().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(router_->WaitForCancel("c"));
  GenerateResponse late;
  late.set_request_id("c");
  late.add_token_ids(1);
  sink->Push(late);  // dropped: the sink was cancelled
  sink->Close(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
  call->Cancel();  // idempotent
  absl::MutexLock l(&got.mu);
  EXPECT_EQ(got.dones, 1);
  EXPECT_EQ(got.responses_after_done, 0);
}

TEST_F(RouterSessionTest, TheGatewayEndsACallPastItsDeadlineTheRouterNeverAnswers) {
  Received got;
  const absl::Time start = absl::Now();
  auto call =
      pool_->Generate(Request("d"), start + absl::Milliseconds(300), got.Callbacks());
  ASSERT_NE(router_->WaitForSink("d"), nullptr);  // started, then silent
  EXPECT_EQ(got.Wait().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(300));
  EXPECT_TRUE(router_->WaitForCancel("d"));  // and the router was told
  router_->WaitForSink("d")->Close(grpc::Status::OK);
}

TEST_F(RouterSessionTest, ALostSessionFailsItsCallsAndTheNextCallOpensANewOne) {
  Received first;
  auto call =
      pool_->Generate(Request("a"), absl::Now() + absl::Seconds(30), first.Callbacks());
  rpc::ResponseSink* sink = router_->WaitForSink("a");
  ASSERT_NE(sink, nullptr);
  // The router goes away (its calls are cancelled at once).
  server_->Shutdown(std::chrono::system_clock::now());
  const grpc::Status lost = first.Wait();
  EXPECT_EQ(lost.error_code(), grpc::StatusCode::UNAVAILABLE) << lost.error_message();
  sink->Close(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
  server_.reset();
  // A router is back on the same port: the next call opens a new session.
  const int port = port_;
  StartServer(port);
  ASSERT_EQ(port_, port);
  const int64_t opened = pool_->stats().sessions_opened;
  Received second;
  auto again = pool_->Generate(Request("b"), absl::Now() + absl::Seconds(30),
                               second.Callbacks());
  rpc::ResponseSink* b = router_->WaitForSink("b");
  ASSERT_NE(b, nullptr);
  GenerateResponse m;
  m.set_request_id("b");
  m.add_token_ids(7);
  b->Push(m);
  b->Close(grpc::Status::OK);
  EXPECT_TRUE(second.Wait().ok());
  EXPECT_EQ(pool_->stats().sessions_opened, opened + 1);
  absl::MutexLock l(&second.mu);
  EXPECT_EQ(second.tokens, std::vector<int>{7});
}

// Counts live ClientContexts; with `slow`, one destroyed on a thread other
// than the test's (a gRPC thread, inside a reactor's OnDone) takes 200 ms,
// which widens the window in which such a context outlives its owner.
class ContextCounter final : public grpc::ClientContext::GlobalCallbacks {
 public:
  void DefaultConstructor(grpc::ClientContext*) override { live.fetch_add(1); }
  void Destructor(grpc::ClientContext*) override {
    if (slow.load() && std::this_thread::get_id() != test_thread) {
      absl::SleepFor(absl::Milliseconds(200));
    }
    live.fetch_sub(1);
  }
  std::atomic<int> live{0};
  std::atomic<bool> slow{false};
  std::thread::id test_thread;
};

// ~SessionPool destroys its sessions (their ClientContexts, which hold the
// call and a grpc::Channel reference) before it returns, off gRPC's threads.
// Before, a session dropped its last reference at the end of its own OnDone,
// after the pool had seen it end: it outlived the pool, the stub and the
// caller's channel, and could release the channel on a gRPC thread while the
// process was shutting gRPC down and starting it again (the gateway test's
// "ref_counted.h:183 assertion failed: prior > 0" in grpc_cq_internal_unref).
TEST_F(RouterSessionTest, ThePoolDestroysItsSessionsBeforeItReturns) {
  static ContextCounter* const counter = [] {
    auto* c = new ContextCounter;
    grpc::ClientContext::SetGlobalCallbacks(c);  // once per process
    return c;
  }();
  counter->test_thread = std::this_thread::get_id();
  const int before = counter->live.load();
  counter->slow = true;
  Received got;
  std::shared_ptr<GenerateCall> call =
      pool_->Generate(Request("r"), absl::Now() + absl::Seconds(30), got.Callbacks());
  rpc::ResponseSink* sink = router_->WaitForSink("r");
  ASSERT_NE(sink, nullptr);
  sink->Close(grpc::Status::OK);
  EXPECT_TRUE(got.Wait().ok());
  call.reset();
  EXPECT_EQ(counter->live.load(), before + 1);  // the session's
  pool_.reset();
  EXPECT_EQ(counter->live.load(), before)
      << "a session's ClientContext outlived ~SessionPool";
  counter->slow = false;
}

}  // namespace
}  // namespace tandem::gateway
