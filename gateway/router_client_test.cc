// RouterClient's shutdown: the last reference to its gRPC channel is dropped
// by the client's owner, never on a gRPC thread (rpc/channel_users.h), for
// both transports.
#include "gateway/router_client.h"

#include <grpcpp/grpcpp.h>

#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "proto/router.grpc.pb.h"
#include "rpc/session_stream.h"

namespace tandem::gateway {
namespace {

using tandem::v1::GenerateRequest;
using tandem::v1::GenerateResponse;

GenerateResponse OneToken() {
  GenerateResponse r;
  r.add_token_ids(7);
  return r;
}

// Answers every Generate (per-request or on a session) with one token, then
// the end.
class OneTokenRouter final : public tandem::v1::Router::CallbackService {
 public:
  grpc::ServerWriteReactor<GenerateResponse>* Generate(
      grpc::CallbackServerContext*, const GenerateRequest*) override {
    class Writer final : public grpc::ServerWriteReactor<GenerateResponse> {
     public:
      Writer() : response_(OneToken()) {
        StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
      }
      void OnDone() override { delete this; }

     private:
      GenerateResponse response_;
    };
    return new Writer;
  }
  grpc::ServerBidiReactor<tandem::v1::SessionRequest, tandem::v1::SessionResponse>*
  GenerateSession(grpc::CallbackServerContext*) override {
    return new rpc::SessionStream([](GenerateRequest, rpc::ResponseSink* sink) {
      sink->Push(OneToken());
      sink->Close(grpc::Status::OK);
    });
  }
  // Never answered until FinishHeld (a router that hangs).
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const tandem::v1::ListModelsRequest*,
                                       tandem::v1::ListModelsResponse*) override {
    auto* reactor = context->DefaultReactor();
    absl::MutexLock l(&mu_);
    held_.push_back(reactor);
    return reactor;
  }
  bool WaitHeld() {
    absl::MutexLock l(&mu_);
    auto some = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !held_.empty(); };
    return mu_.AwaitWithTimeout(absl::Condition(&some), absl::Seconds(30));
  }
  void FinishHeld() {
    absl::MutexLock l(&mu_);
    for (grpc::ServerUnaryReactor* r : held_) r->Finish(grpc::Status::CANCELLED);
    held_.clear();
  }

 private:
  absl::Mutex mu_;
  std::vector<grpc::ServerUnaryReactor*> held_ ABSL_GUARDED_BY(mu_);
};

// The router on a loopback server and a client of it (parameter: the client's
// Options::sessions).
class RouterClientShutdown : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    ASSERT_NE(port, 0);
    client = std::make_unique<RouterClient>(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                            grpc::InsecureChannelCredentials()),
        RouterClient::Options{.sessions = GetParam()});
  }
  void TearDown() override {
    service.FinishHeld();
    client.reset();
    if (server != nullptr) {
      server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    }
  }

  OneTokenRouter service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<RouterClient> client;
};

// The client is destroyed while a call's on_done still runs (on a gRPC
// thread) and after the server has gone, so that the call's ClientContext
// holds the last reference to the channel and to gRPC's callback queue.
// Dropped on that thread, the queue's thread would join itself and then read
// the freed queue (ref_counted.h "prior > 0"); the client's destructor waits
// for the call instead and drops the channel on its own thread.
TEST_P(RouterClientShutdown, TheDestructorWaitsForCallsStillHoldingTheChannel) {
  absl::Notification in_on_done, release, client_gone;
  int tokens = 0;
  grpc::Status status(grpc::StatusCode::UNKNOWN, "not done");
  client
      ->Generate(GenerateRequest(), absl::Now() + absl::Seconds(30),
                 {.on_response =
                      [&](const GenerateResponse& r) { tokens += r.token_ids_size(); },
                  .on_done =
                      [&](const grpc::Status& s) {
                        status = s;
                        in_on_done.Notify();
                        release.WaitForNotificationWithTimeout(absl::Seconds(30));
                      }})
      .reset();  // the caller keeps no handle
  ASSERT_TRUE(in_on_done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(tokens, 1);

  std::thread destroyer([&] {
    client.reset();
    client_gone.Notify();
  });
  // The call is still in its callback: the destructor must not have returned.
  EXPECT_FALSE(client_gone.WaitForNotificationWithTimeout(absl::Milliseconds(300)));
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  server.reset();
  release.Notify();
  EXPECT_TRUE(client_gone.WaitForNotificationWithTimeout(absl::Seconds(20)));
  destroyer.join();
}

// A call still running when the client goes (an admin RPC to a router that
// hangs) is cancelled by the destructor, which then returns at once instead of
// waiting out its bound (and keeping the channel).
TEST_P(RouterClientShutdown, TheDestructorCancelsCallsStillRunning) {
  absl::Notification done;
  absl::Status status;
  client->ListModels(absl::Now() + absl::Seconds(60),
                     [&](absl::StatusOr<tandem::v1::ListModelsResponse> r) {
                       status = r.status();
                       done.Notify();
                     });
  ASSERT_TRUE(service.WaitHeld());
  const absl::Time start = absl::Now();
  client.reset();
  EXPECT_LT(absl::Now() - start, RouterClient::kCallsEndWithin / 2);
  ASSERT_TRUE(done.HasBeenNotified());
  EXPECT_TRUE(absl::IsCancelled(status)) << status;
}

INSTANTIATE_TEST_SUITE_P(Transports, RouterClientShutdown, ::testing::Values(0, 1),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return info.param == 0 ? "PerRequestCalls" : "Sessions";
                         });

}  // namespace
}  // namespace tandem::gateway
