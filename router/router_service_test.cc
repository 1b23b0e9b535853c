// The router's services over a real in-process gRPC server.
#include "router/router_service.h"

#include <grpcpp/grpcpp.h>

#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::router {
namespace {

class RouterServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_.info.set_id("kimi-k3");
    model_.info.set_vocab_size(163840);
    model_.info.set_max_context_tokens(4096);
    model_.info.add_eos_token_ids(163586);
    model_.fingerprint = "fp";
    router_ = std::make_unique<RouterService>(model_, &workers_, &metrics_, &handoff_);
    registry_service_ =
        std::make_unique<RegistryService>(&workers_, &metrics_, "fp", absl::Seconds(1));
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(router_.get());
    b.RegisterService(registry_service_.get());
    server_ = b.BuildAndStart();
    ASSERT_GT(port, 0);
    auto ch = grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                  grpc::InsecureChannelCredentials());
    router_stub_ = tandem::v1::Router::NewStub(ch);
    registry_stub_ = tandem::v1::Registry::NewStub(ch);
  }
  void TearDown() override { server_->Shutdown(); }

  static void Deadline(grpc::ClientContext* ctx) {
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  }

  grpc::Status Generate(const tandem::v1::GenerateRequest& req) {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    auto reader = router_stub_->Generate(&ctx, req);
    tandem::v1::GenerateResponse resp;
    int n = 0;
    while (reader->Read(&resp)) ++n;
    EXPECT_EQ(n, 0);
    return reader->Finish();
  }

  grpc::Status Register(const std::string& id, const std::string& fp,
                        int64_t max_context_tokens = 0) {
    tandem::v1::RegisterRequest r;
    r.set_max_context_tokens(max_context_tokens);
    r.set_worker_id(id);
    r.set_role(tandem::v1::WORKER_ROLE_DECODE);
    r.set_grpc_address("127.0.0.1:1");
    r.set_model_fingerprint(fp);
    grpc::ClientContext ctx;
    Deadline(&ctx);
    tandem::v1::RegisterResponse resp;
    grpc::Status s = registry_stub_->Register(&ctx, r, &resp);
    if (s.ok()) {
      EXPECT_EQ(resp.heartbeat_interval_ms(), 1000);
    }
    return s;
  }

  double Requests(const std::string& outcome) {
    return metrics_.requests->Add({{"outcome", outcome}}).Value();
  }

  FakeClock clock_;
  WorkerRegistry workers_{&clock_, absl::Seconds(10)};
  metrics::Registry metric_registry_;
  RouterMetrics metrics_{&metric_registry_};
  HandoffMetrics handoff_metrics_{&metric_registry_};
  Handoff handoff_{&workers_, &handoff_metrics_, HandoffOptions{}};
  model::ServedModel model_;
  std::unique_ptr<RouterService> router_;
  std::unique_ptr<RegistryService> registry_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<tandem::v1::Router::Stub> router_stub_;
  std::unique_ptr<tandem::v1::Registry::Stub> registry_stub_;
};

tandem::v1::GenerateRequest Prompt() {
  tandem::v1::GenerateRequest req;
  req.mutable_prompt_token_ids()->add_ids(100);
  req.mutable_stop()->set_max_tokens(8);
  return req;
}

TEST_F(RouterServiceTest, ListModels) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  tandem::v1::ListModelsResponse resp;
  ASSERT_TRUE(router_stub_->ListModels(&ctx, {}, &resp).ok());
  ASSERT_EQ(resp.models_size(), 1);
  EXPECT_EQ(resp.models(0).id(), "kimi-k3");
  EXPECT_EQ(resp.models(0).max_context_tokens(), 4096);
}

TEST_F(RouterServiceTest, ServedContextIsTheSmallestWorkerLimit) {
  auto served_context = [&] {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    tandem::v1::ListModelsResponse resp;
    EXPECT_TRUE(router_stub_->ListModels(&ctx, {}, &resp).ok());
    return resp.models(0).max_context_tokens();
  };
  EXPECT_EQ(served_context(), 4096);  // the model's own
  ASSERT_TRUE(Register("decode-0", "fp", /*max_context_tokens=*/100).ok());
  ASSERT_TRUE(Register("decode-1", "fp", /*max_context_tokens=*/0).ok());  // model's
  EXPECT_EQ(served_context(), 100);
  tandem::v1::GenerateRequest req = Prompt();  // 1 prompt token
  req.mutable_stop()->set_max_tokens(100);     // 101 > 100
  grpc::Status s = Generate(req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("100 tokens"), std::string::npos)
      << s.error_message();
}

TEST_F(RouterServiceTest, BadInputIsInvalidArgument) {
  tandem::v1::GenerateRequest req = Prompt();
  req.mutable_prompt_token_ids()->add_ids(999999);
  grpc::Status s = Generate(req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("999999"), std::string::npos);
  EXPECT_EQ(Requests("invalid"), 1);
}

TEST_F(RouterServiceTest, UnknownModelIsNotFound) {
  tandem::v1::GenerateRequest req = Prompt();
  req.set_model("gpt-9");
  EXPECT_EQ(Generate(req).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(RouterServiceTest, NoWorkersThenUnreachableWorkerAreUnavailable) {
  EXPECT_EQ(Generate(Prompt()).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Requests("unavailable"), 1);
  ASSERT_TRUE(Register("decode-0", "fp").ok());
  EXPECT_EQ(metrics_.workers->Add({{"role", "decode"}}).Value(), 1);
  // The registered worker listens nowhere: the call fails naming it, and the
  // router drops it from its registry.
  grpc::Status s = Generate(Prompt());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(s.error_message().find("decode-0"), std::string::npos) << s.error_message();
  EXPECT_EQ(Requests("unavailable"), 2);
  EXPECT_TRUE(workers_.Live(tandem::v1::WORKER_ROLE_DECODE).empty());
}

TEST_F(RouterServiceTest, PromptTextWithoutTokenizerIsInvalid) {
  tandem::v1::GenerateRequest req;
  req.set_prompt_text("hello");
  grpc::Status s = Generate(req);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("tokenizer"), std::string::npos);
}

TEST_F(RouterServiceTest, SessionAnswersEachStreamAsGenerateWould) {
  grpc::ClientContext ctx;
  Deadline(&ctx);
  auto session = router_stub_->GenerateSession(&ctx);
  tandem::v1::SessionRequest r;
  tandem::v1::GenerateRequest bad = Prompt();
  bad.mutable_prompt_token_ids()->add_ids(999999);
  tandem::v1::GenerateRequest unknown = Prompt();
  unknown.set_model("gpt-9");
  const std::vector<std::pair<tandem::v1::GenerateRequest, grpc::StatusCode>> cases = {
      {bad, grpc::StatusCode::INVALID_ARGUMENT},
      {unknown, grpc::StatusCode::NOT_FOUND},
      {Prompt(), grpc::StatusCode::UNAVAILABLE},  // no decode worker registered
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    auto* start = r.add_starts();
    start->set_stream_id(100 + i);
    *start->mutable_request() = cases[i].first;
  }
  ASSERT_TRUE(session->Write(r));
  ASSERT_TRUE(session->WritesDone());
  std::map<uint64_t, tandem::v1::SessionEnd> ends;
  tandem::v1::SessionResponse resp;
  while (session->Read(&resp)) {
    for (const auto& e : resp.events()) {
      ASSERT_TRUE(e.has_end()) << "a refused request streams nothing";
      EXPECT_TRUE(ends.emplace(e.stream_id(), e.end()).second) << "two ends";
    }
  }
  EXPECT_TRUE(session->Finish().ok());  // half-closed with nothing running
  ASSERT_EQ(ends.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(ends[100 + i].code(), cases[i].second) << ends[100 + i].message();
  }
  EXPECT_NE(ends[100].message().find("999999"), std::string::npos);
  EXPECT_EQ(Requests("invalid"), 1);
  EXPECT_EQ(Requests("not_found"), 1);
  EXPECT_EQ(Requests("unavailable"), 1);
  EXPECT_GE(metrics_.session_events->Value(), 3);  // counted before each write
}

TEST_F(RouterServiceTest, RegistryRefusesOtherWeightsAndHeartbeatsReportKnown) {
  grpc::Status s = Register("decode-1", "other");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("other"), std::string::npos);
  ASSERT_TRUE(Register("decode-1", "fp").ok());
  for (const char* id : {"decode-1", "nobody"}) {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    tandem::v1::HeartbeatRequest hb;
    hb.set_worker_id(id);
    tandem::v1::HeartbeatResponse resp;
    ASSERT_TRUE(registry_stub_->Heartbeat(&ctx, hb, &resp).ok());
    EXPECT_EQ(resp.known(), std::string(id) == "decode-1");
  }
}

// The Registry service feeds the Handoff's prefix index: the registration's
// snapshot, then the heartbeats' events (acknowledged), and a gap answered by
// a resync, counted; the index's size per worker is exported.
TEST_F(RouterServiceTest, RegistryAppliesPrefixReportsAndAsksResyncOnAGap) {
  RegistryService registry(&workers_, &metrics_, "fp", absl::Seconds(1), &handoff_);
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(&registry);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  ASSERT_GT(port, 0);
  auto stub = tandem::v1::Registry::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  std::vector<int32_t> prompt(300);
  for (int i = 0; i < 300; ++i) prompt[i] = i * 7 % 1000;
  const std::vector<uint64_t> h = RouterBlockHashes(prompt, "");
  auto stored = [&](int blocks) {
    tandem::v1::PrefixCacheEvent e;
    e.set_kind(tandem::v1::PrefixCacheEvent::KIND_STORED);
    e.set_tokens(blocks * 64);
    e.set_route_hash(h[blocks - 1]);
    return e;
  };
  tandem::v1::RegisterRequest r;
  r.set_worker_id("prefill-0");
  r.set_role(tandem::v1::WORKER_ROLE_PREFILL);
  r.set_grpc_address("127.0.0.1:1");
  r.set_model_fingerprint("fp");
  r.set_reports_prefix_cache(true);
  r.set_prefix_epoch(9);
  r.set_prefix_seq(5);
  *r.add_prefix_snapshot() = stored(1);
  {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    tandem::v1::RegisterResponse resp;
    ASSERT_TRUE(stub->Register(&ctx, r, &resp).ok());
  }
  // The registry's record keeps no snapshot; the index has it.
  EXPECT_EQ(workers_.Live(tandem::v1::WORKER_ROLE_PREFILL)[0]
                .registration.prefix_snapshot_size(),
            0);
  EXPECT_EQ(handoff_.prefill_router()->Match("prefill-0", h, 300), 64);
  auto heartbeat = [&](uint64_t first, std::vector<tandem::v1::PrefixCacheEvent> evs) {
    tandem::v1::HeartbeatRequest hb;
    hb.set_worker_id("prefill-0");
    hb.set_prefix_epoch(9);
    hb.set_prefix_first_seq(first);
    for (auto& e : evs) *hb.add_prefix_events() = e;
    grpc::ClientContext ctx;
    Deadline(&ctx);
    tandem::v1::HeartbeatResponse resp;
    EXPECT_TRUE(stub->Heartbeat(&ctx, hb, &resp).ok());
    return resp;
  };
  tandem::v1::HeartbeatResponse a = heartbeat(6, {stored(4)});
  EXPECT_TRUE(a.known());
  EXPECT_FALSE(a.resync_prefix_index());
  EXPECT_EQ(a.prefix_acked_seq(), 6u);
  EXPECT_EQ(handoff_.prefill_router()->Match("prefill-0", h, 300), 256);
  EXPECT_EQ(
      handoff_metrics_.prefix_index_entries->Add({{"worker", "prefill-0"}}).Value(), 2);
  EXPECT_EQ(handoff_metrics_.prefix_events->Value(), 2);  // snapshot + event
  // Seq 7 never arrived.
  tandem::v1::HeartbeatResponse g = heartbeat(8, {stored(2)});
  EXPECT_TRUE(g.resync_prefix_index());
  EXPECT_EQ(g.prefix_acked_seq(), 6u);
  EXPECT_EQ(handoff_metrics_.prefix_resyncs->Add({{"reason", "gap"}}).Value(), 1);
  EXPECT_EQ(handoff_.prefill_router()->Match("prefill-0", h, 300), 256);  // unchanged
  server->Shutdown();
}

}  // namespace
}  // namespace tandem::router

namespace tandem::router {
namespace {

// A router with no in-flight place (--max_in_flight=0): every request waits in
// the admission queue (one place, a 200 ms timeout) and ends there.
class RouterQueueTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_.info.set_id("kimi-k3");
    model_.info.set_vocab_size(163840);
    model_.info.set_max_context_tokens(4096);
    model_.fingerprint = "fp";
    tandem::v1::RegisterRequest w;
    w.set_worker_id("decode-0");
    w.set_role(tandem::v1::WORKER_ROLE_DECODE);
    w.set_grpc_address("127.0.0.1:1");
    w.set_model_fingerprint("fp");
    ASSERT_TRUE(workers_.Register(w).ok());
    router_ = std::make_unique<RouterService>(model_, &workers_, &metrics_, &handoff_,
                                              RouterServiceOptions{.max_in_flight = 0});
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(router_.get());
    server_ = b.BuildAndStart();
    ASSERT_GT(port, 0);
    stub_ = tandem::v1::Router::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override { server_->Shutdown(); }

  static HandoffOptions Options() {
    HandoffOptions o;
    o.queue = {.max_queued_requests = 1, .queue_timeout = absl::Milliseconds(200)};
    return o;
  }
  grpc::Status Generate(grpc::ClientContext* ctx) {
    tandem::v1::GenerateRequest req;
    req.mutable_prompt_token_ids()->add_ids(100);
    req.mutable_stop()->set_max_tokens(8);
    auto reader = stub_->Generate(ctx, req);
    tandem::v1::GenerateResponse resp;
    while (reader->Read(&resp)) {
    }
    return reader->Finish();
  }
  double Rejections(const std::string& reason) {
    return handoff_metrics_.queue.rejections->Add({{"reason", reason}}).Value();
  }
  // Polls the queue depth (the queue is filled on the server's threads).
  bool DepthBecomes(size_t n) {
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (handoff_.queue()->depth() != n) {
      if (absl::Now() > end) return false;
      absl::SleepFor(absl::Milliseconds(1));
    }
    return true;
  }

  FakeClock clock_;
  WorkerRegistry workers_{&clock_, absl::Hours(1)};
  metrics::Registry metric_registry_;
  RouterMetrics metrics_{&metric_registry_};
  HandoffMetrics handoff_metrics_{&metric_registry_};
  Handoff handoff_{&workers_, &handoff_metrics_, Options()};
  model::ServedModel model_;
  std::unique_ptr<RouterService> router_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<tandem::v1::Router::Stub> stub_;
};

TEST_F(RouterQueueTest, AtTheInFlightLimitARequestWaitsThenTimesOut) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  const absl::Time t0 = absl::Now();
  grpc::Status s = Generate(&ctx);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_NE(s.error_message().find("queue timeout"), std::string::npos)
      << s.error_message();
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(200));  // it waited
  EXPECT_EQ(Rejections("queue_timeout"), 1);
  EXPECT_EQ(handoff_.queue()->depth(), 0u);
  EXPECT_EQ(handoff_metrics_.queue.wait_seconds->Count(), 1u);
  EXPECT_EQ(metrics_.requests->Add({{"outcome", "resource_exhausted"}}).Value(), 1);
}

TEST_F(RouterQueueTest, AFullQueueRefusesAtOnceAndACancelFreesItsPlace) {
  grpc::ClientContext waiting;
  waiting.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  std::thread first([&] {
    grpc::Status s = Generate(&waiting);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  });
  ASSERT_TRUE(DepthBecomes(1));
  grpc::ClientContext refused;
  refused.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Status s = Generate(&refused);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_NE(s.error_message().find("queue is full"), std::string::npos)
      << s.error_message();
  EXPECT_EQ(Rejections("queue_full"), 1);
  waiting.TryCancel();
  first.join();
  EXPECT_TRUE(DepthBecomes(0));
  EXPECT_EQ(Rejections("queue_timeout"), 0);
}

TEST_F(RouterQueueTest, TheRequestsDeadlineWhileQueuedIsDeadlineExceeded) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(50));
  grpc::Status s = Generate(&ctx);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_TRUE(DepthBecomes(0));
  EXPECT_EQ(Rejections("queue_timeout"), 0);  // its own deadline, not the queue's
}

}  // namespace
}  // namespace tandem::router
