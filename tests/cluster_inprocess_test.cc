// The disaggregated hand-off in one process: router (Router + Handoff), a prefill
// worker and a decode worker, each a real gRPC server on 127.0.0.1, the KV state
// moving through LoopbackAgents. Covers the orchestration state machine:
//   - disaggregated output == colocated output, token for token (greedy and
//     seeded sampling, mixed prompt lengths, prefill block 16 -> decode block 8)
//   - the same for multi-chunk prompts, whose state streams layer by layer
//     while the prefill computes (the decode worker verifies the checksums)
//   - a lost prefill worker: Release + retry on another
//   - a corrupt transfer: DATA_LOSS, nothing leaked on either side
//   - client cancel mid-stream: the decode engine's blocks return to idle
//   - bad input: INVALID_ARGUMENT
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/clock.h"
#include "decode/decode_service.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/test_util.h"
#include "engine/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "kvtransfer/loopback_agent.h"
#include "metrics/registry.h"
#include "prefill/prefill_service.h"
#include "router/handoff.h"
#include "router/router_service.h"
#include "router/worker_registry.h"
#include "worker/engine_loop.h"
#include "worker/worker_metrics.h"

namespace tandem {
namespace {

using engine::testing::TinyWeights;

std::chrono::system_clock::time_point In(int seconds) {
  return std::chrono::system_clock::now() + std::chrono::seconds(seconds);
}

const tokenizer::Tokenizer& Tok() {
  static const tokenizer::Tokenizer* t =
      tokenizer::Tokenizer::Load(engine::testing::kTinyCheckpointDir)->release();
  return *t;
}

std::unique_ptr<grpc::Server> Serve(grpc::Service* service, std::string* address) {
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(service);
  auto server = b.BuildAndStart();
  *address = "127.0.0.1:" + std::to_string(port);
  return server;
}

engine::EngineOptions Options(int block_size) {
  engine::EngineOptions o;
  o.block_size = block_size;
  o.num_slots = 4;
  o.max_context_tokens = 512;
  o.max_tokens_per_step = 256;
  return o;
}

// A prefill worker: engine thread, loopback agent, service, server.
struct PrefillNode {
  explicit PrefillNode(const std::string& id, bool corrupt = false) {
    backend = engine::testing::MakeBackend("cpu");
    auto e = engine::Engine::Create(&TinyWeights(), backend.get(), &Tok(), Options(16));
    cache = &(*e)->cache();
    loop = std::make_unique<worker::EngineLoop>(std::move(*e));
    prefill::PrefillServiceOptions o;
    o.worker_id = id;
    o.test_corrupt_transfer = corrupt;
    service = *prefill::PrefillService::Create(loop.get(), cache, &agent, &metrics, o);
    server = Serve(service.get(), &address);
  }
  ~PrefillNode() {
    server->Shutdown(In(5));
    loop.reset();
  }
  std::unique_ptr<kernels::Backend> backend;
  engine::KvCache* cache = nullptr;
  kvtransfer::LoopbackAgent agent;
  metrics::Registry registry;
  worker::WorkerMetrics metrics{&registry};
  std::unique_ptr<worker::EngineLoop> loop;
  std::unique_ptr<prefill::PrefillService> service;
  std::unique_ptr<grpc::Server> server;
  std::string address;
};

struct DecodeNode {
  DecodeNode() {
    backend = engine::testing::MakeBackend("cpu");
    auto e = engine::Engine::Create(&TinyWeights(), backend.get(), &Tok(), Options(8));
    engine = e->get();
    loop = std::make_unique<worker::EngineLoop>(std::move(*e));
    decode::DecodeServiceOptions o;
    o.worker_id = "decode-0";
    // Short, so that tests of failed hand-offs see the reserved blocks free soon.
    o.unlanded_quarantine = absl::Milliseconds(300);
    service = *decode::DecodeService::Create(loop.get(), {&engine->cache()}, &agent,
                                             &metrics, o);
    server = Serve(service.get(), &address);
    stub = tandem::v1::DecodeWorker::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  }
  ~DecodeNode() {
    server->Shutdown(In(5));
    service->Stop();
    loop.reset();
    service.reset();
  }
  int32_t num_slots() const { return engine->scheduler().config().num_slots; }
  std::unique_ptr<kernels::Backend> backend;
  engine::Engine* engine = nullptr;  // owned by the loop
  kvtransfer::LoopbackAgent agent;
  metrics::Registry registry;
  worker::WorkerMetrics metrics{&registry};
  std::unique_ptr<worker::EngineLoop> loop;
  std::unique_ptr<decode::DecodeService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<tandem::v1::DecodeWorker::Stub> stub;
  std::string address;
};

struct Result {
  std::vector<int32_t> tokens;
  std::string text;
  tandem::v1::FinishReason finish = tandem::v1::FINISH_REASON_UNSPECIFIED;
  int completion_tokens = 0;
  grpc::Status status;
  int messages = 0;
  std::vector<tandem::v1::TokenLogprob> prompt_logprobs;
  int messages_with_prompt_logprobs = 0;
};

Result Drain(grpc::ClientReaderInterface<tandem::v1::GenerateResponse>* reader) {
  Result r;
  tandem::v1::GenerateResponse m;
  while (reader->Read(&m)) {
    ++r.messages;
    r.tokens.insert(r.tokens.end(), m.token_ids().begin(), m.token_ids().end());
    r.text += m.text();
    if (m.prompt_logprobs_size() > 0) {
      ++r.messages_with_prompt_logprobs;
      r.prompt_logprobs.assign(m.prompt_logprobs().begin(), m.prompt_logprobs().end());
    }
    if (m.finish_reason() != tandem::v1::FINISH_REASON_UNSPECIFIED) {
      r.finish = m.finish_reason();
      r.completion_tokens = m.usage().completion_tokens();
    }
  }
  r.status = reader->Finish();
  return r;
}

class ClusterTest : public ::testing::Test {
 protected:
  void SetUp() override { StartRouter(0); }

  void StartRouter(int colocate_below) {
    router::HandoffOptions ho;
    ho.colocate_below_tokens = colocate_below;
    ho.max_context_tokens = 512;
    handoff_ = std::make_unique<router::Handoff>(&workers_, &handoff_metrics_, ho);
    served_.info.set_id("kimi-k3");
    served_.info.set_vocab_size(TinyWeights().config.text.vocab_size);
    served_.info.set_max_context_tokens(512);
    served_.fingerprint = "fp";
    router_ = std::make_unique<router::RouterService>(
        served_, &workers_, &router_metrics_, handoff_.get(),
        router::RouterServiceOptions{}, &Tok());
    router_server_ = Serve(router_.get(), &router_address_);
    router_stub_ = tandem::v1::Router::NewStub(
        grpc::CreateChannel(router_address_, grpc::InsecureChannelCredentials()));
  }
  void TearDown() override { router_server_->Shutdown(In(5)); }

  // As prefill_main and decode_main register (current: false is an older
  // worker's registration, without the later capability flags).
  void Register(const std::string& id, tandem::v1::WorkerRole role,
                const std::string& address, const tandem::v1::WorkerLoad& load,
                bool current = true) {
    tandem::v1::RegisterRequest r;
    r.set_worker_id(id);
    r.set_role(role);
    r.set_grpc_address(address);
    r.set_model_fingerprint("fp");
    r.set_samples_logit_bias(current);
    r.set_computes_prompt_logprobs(current);
    *r.mutable_load() = load;
    ASSERT_TRUE(workers_.Register(r).ok());
  }

  // prefill-0 and decode-0, as their mains register them.
  void RegisterBoth(PrefillNode& prefill, DecodeNode& decode) {
    Register("prefill-0", tandem::v1::WORKER_ROLE_PREFILL, prefill.address,
             prefill.service->Load());
    Register("decode-0", tandem::v1::WORKER_ROLE_DECODE, decode.address,
             decode.service->Load());
  }

  Result RouterGenerate(const tandem::v1::GenerateRequest& req, int cancel_after = -1) {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(60));
    auto reader = router_stub_->Generate(&ctx, req);
    if (cancel_after < 0) return Drain(reader.get());
    Result r;
    tandem::v1::GenerateResponse m;
    while (r.messages < cancel_after && reader->Read(&m)) ++r.messages;
    ctx.TryCancel();
    while (reader->Read(&m)) {
    }
    r.status = reader->Finish();
    return r;
  }

  double Paths(const char* path) {
    return handoff_metrics_.paths->Add({{"path", path}}).Value();
  }

  FakeClock clock_;
  router::WorkerRegistry workers_{&clock_, absl::Hours(1)};
  metrics::Registry metric_registry_;
  router::RouterMetrics router_metrics_{&metric_registry_};
  router::HandoffMetrics handoff_metrics_{&metric_registry_};
  std::unique_ptr<router::Handoff> handoff_;
  model::ServedModel served_;
  std::unique_ptr<router::RouterService> router_;
  std::unique_ptr<grpc::Server> router_server_;
  std::unique_ptr<tandem::v1::Router::Stub> router_stub_;
  std::string router_address_;
};

tandem::v1::GenerateRequest Request(const std::vector<int32_t>& prompt, int max_tokens,
                                    float temperature, uint64_t seed) {
  tandem::v1::GenerateRequest req;
  for (int32_t t : prompt) req.mutable_prompt_token_ids()->add_ids(t);
  req.mutable_stop()->set_max_tokens(max_tokens);
  req.mutable_sampling()->set_temperature(temperature);
  if (temperature > 0) {
    req.mutable_sampling()->set_seed(seed);
    req.mutable_sampling()->set_top_p(0.9f);
  }
  req.set_return_text(true);
  return req;
}

// Waits until no engine block of `service` is held for a hand-off any more
// (failed hand-offs hold theirs for the unlanded quarantine).
bool ReservedIdle(decode::DecodeService* service, absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  while (absl::Now() < end) {
    if (service->reserved_blocks() == 0) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return false;
}

// The engine's free blocks and slots return to their totals (asynchronous
// aborts): polled with a bounded deadline.
bool EngineIdle(worker::EngineLoop* loop, absl::Duration timeout) {
  const absl::Time end = absl::Now() + timeout;
  while (absl::Now() < end) {
    worker::EngineLoopStats s = loop->stats();
    if (s.free_blocks == s.total_blocks && s.free_slots == s.total_slots &&
        s.running == 0 && s.waiting == 0) {
      return true;
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
  return false;
}

TEST_F(ClusterTest, DisaggregatedEqualsColocatedTokenForToken) {
  PrefillNode prefill("prefill-0");
  DecodeNode decode;
  RegisterBoth(prefill, decode);
  const int kPrompts = 50;
  int compared_tokens = 0;
  for (int i = 0; i < kPrompts; ++i) {
    // Mixed lengths: 1 .. ~120 tokens, across block boundaries of both sides.
    const int len = 1 + (i * 37) % 121;
    const std::vector<int32_t> prompt = engine::testing::MakePrompt(len, 100 + i);
    const float temperature = i % 2 == 0 ? 0.0f : 0.8f;
    tandem::v1::GenerateRequest req = Request(prompt, 6 + i % 5, temperature, 7000 + i);
    req.set_request_id("req-" + std::to_string(i));
    Result disagg = RouterGenerate(req);
    ASSERT_TRUE(disagg.status.ok()) << i << ": " << disagg.status.error_message();

    grpc::ClientContext ctx;
    ctx.set_deadline(In(60));
    req.set_request_id("colocated-" + std::to_string(i));
    Result colocated = Drain(decode.stub->Generate(&ctx, req).get());
    ASSERT_TRUE(colocated.status.ok()) << colocated.status.error_message();

    EXPECT_EQ(disagg.tokens, colocated.tokens)
        << "prompt " << i << " (len " << len << ", temperature " << temperature << ")";
    EXPECT_EQ(disagg.text, colocated.text) << i;
    EXPECT_EQ(disagg.finish, colocated.finish) << i;
    EXPECT_EQ(disagg.completion_tokens, static_cast<int>(disagg.tokens.size())) << i;
    compared_tokens += colocated.tokens.size();
  }
  EXPECT_EQ(Paths("disaggregated"), kPrompts);
  EXPECT_GT(compared_tokens, kPrompts * 3);
  // Nothing leaked: no reserved blocks, both engines idle.
  EXPECT_TRUE(EngineIdle(decode.loop.get(), absl::Seconds(10)));
  EXPECT_TRUE(EngineIdle(prefill.loop.get(), absl::Seconds(10)));
  EXPECT_EQ(decode.service->num_reservations(), 0);
  EXPECT_EQ(decode.service->reserved_blocks(), 0);
  EXPECT_GT(prefill.metrics.transfer_bytes->Value(), 0);
}

// logit_bias reaches the prefill worker's first token and every decode token,
// on the disaggregated and the colocated path, greedy and sampled; while a
// worker that predates it is live, a request with a bias is refused rather
// than sent where the bias would be dropped.
TEST_F(ClusterTest, LogitBiasReachesEveryTokenOnBothPaths) {
  PrefillNode prefill("prefill-0");
  DecodeNode decode;
  RegisterBoth(prefill, decode);
  const std::vector<int32_t> prompt = engine::testing::MakePrompt(40, 5);
  const Result plain = RouterGenerate(Request(prompt, 6, 0.0f, 0));
  ASSERT_TRUE(plain.status.ok()) << plain.status.error_message();
  ASSERT_EQ(plain.tokens.size(), 6u);
  // A token the model does not choose, pushed to the top: every token is it.
  int32_t forced = 1000;
  while (std::find(plain.tokens.begin(), plain.tokens.end(), forced) !=
         plain.tokens.end()) {
    ++forced;
  }
  for (const float temperature : {0.0f, 0.8f}) {
    tandem::v1::GenerateRequest req = Request(prompt, 6, temperature, 99);
    (*req.mutable_sampling()->mutable_logit_bias())[forced] = 100.0f;
    const Result disagg = RouterGenerate(req);
    ASSERT_TRUE(disagg.status.ok()) << disagg.status.error_message();
    EXPECT_EQ(disagg.tokens, std::vector<int32_t>(6, forced)) << temperature;
    grpc::ClientContext ctx;
    ctx.set_deadline(In(60));
    req.set_request_id("colocated-bias-" + std::to_string(temperature));
    const Result colocated = Drain(decode.stub->Generate(&ctx, req).get());
    ASSERT_TRUE(colocated.status.ok()) << colocated.status.error_message();
    EXPECT_EQ(colocated.tokens, std::vector<int32_t>(6, forced)) << temperature;
  }
  // The greedy choice banned: the first token (the prefill worker's) changes.
  tandem::v1::GenerateRequest ban = Request(prompt, 6, 0.0f, 0);
  (*ban.mutable_sampling()->mutable_logit_bias())[plain.tokens[0]] = -100.0f;
  const Result banned = RouterGenerate(ban);
  ASSERT_TRUE(banned.status.ok()) << banned.status.error_message();
  ASSERT_FALSE(banned.tokens.empty());
  EXPECT_NE(banned.tokens[0], plain.tokens[0]);
  EXPECT_EQ(std::count(banned.tokens.begin(), banned.tokens.end(), plain.tokens[0]), 0);
  EXPECT_EQ(Paths("disaggregated"), 4);
  // Out of the vocabulary: refused by the router, naming the field.
  tandem::v1::GenerateRequest bad = Request(prompt, 6, 0.0f, 0);
  (*bad.mutable_sampling()->mutable_logit_bias())[1 << 30] = 1.0f;
  const Result refused = RouterGenerate(bad);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.status.error_message().find("sampling.logit_bias: token id"),
            std::string::npos)
      << refused.status.error_message();
  // An older decode worker joins: requests with a bias are refused, naming it.
  Register("decode-old", tandem::v1::WORKER_ROLE_DECODE, decode.address,
           decode.service->Load(), /*current=*/false);
  tandem::v1::GenerateRequest late = Request(prompt, 6, 0.0f, 0);
  (*late.mutable_sampling()->mutable_logit_bias())[forced] = 100.0f;
  const Result old = RouterGenerate(late);
  EXPECT_EQ(old.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(old.status.error_message().find("worker 'decode-old' predates logit_bias"),
            std::string::npos)
      << old.status.error_message();
  tandem::v1::GenerateRequest scored = Request(prompt, 6, 0.0f, 0);
  scored.mutable_sampling()->set_prompt_logprobs(0);
  const Result old_scored = RouterGenerate(scored);
  EXPECT_EQ(old_scored.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(old_scored.status.error_message().find(
                "worker 'decode-old' predates prompt_logprobs"),
            std::string::npos)
      << old_scored.status.error_message();
  EXPECT_TRUE(EngineIdle(decode.loop.get(), absl::Seconds(10)));
  EXPECT_TRUE(EngineIdle(prefill.loop.get(), absl::Seconds(10)));
}

// Prompt logprobs on both paths: computed by the prefill worker and relayed by
// the decode worker on its first message, or computed by the decode worker
// itself when colocated; equal between the two, one per prompt token after
// the first, the tokens themselves scored.
TEST_F(ClusterTest, PromptLogprobsOnBothPathsAreEqual) {
  PrefillNode prefill("prefill-0");
  DecodeNode decode;
  RegisterBoth(prefill, decode);
  const std::vector<int32_t> prompt = engine::testing::MakePrompt(150, 8);
  tandem::v1::GenerateRequest req = Request(prompt, 4, 0.0f, 0);
  req.mutable_sampling()->set_prompt_logprobs(2);
  const Result disagg = RouterGenerate(req);
  ASSERT_TRUE(disagg.status.ok()) << disagg.status.error_message();
  EXPECT_EQ(Paths("disaggregated"), 1);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(60));
  req.set_request_id("colocated-scored");
  const Result colocated = Drain(decode.stub->Generate(&ctx, req).get());
  ASSERT_TRUE(colocated.status.ok()) << colocated.status.error_message();
  EXPECT_EQ(disagg.tokens, colocated.tokens);
  for (const Result* r : {&disagg, &colocated}) {
    EXPECT_EQ(r->messages_with_prompt_logprobs, 1);
    ASSERT_EQ(r->prompt_logprobs.size(), prompt.size() - 1);
    for (size_t k = 0; k + 1 < prompt.size(); ++k) {
      EXPECT_EQ(r->prompt_logprobs[k].token_id(), prompt[k + 1]) << k;
      EXPECT_LT(r->prompt_logprobs[k].logprob(), 0.0f) << k;
      EXPECT_GE(r->prompt_logprobs[k].rank(), 1) << k;
      EXPECT_EQ(r->prompt_logprobs[k].top_size(), 2) << k;
    }
  }
  for (size_t k = 0; k + 1 < prompt.size(); ++k) {
    EXPECT_NEAR(disagg.prompt_logprobs[k].logprob(),
                colocated.prompt_logprobs[k].logprob(), 1e-4)
        << k;
    EXPECT_EQ(disagg.prompt_logprobs[k].rank(), colocated.prompt_logprobs[k].rank())
        << k;
  }
  // Without the field nothing is scored.
  const Result plain = RouterGenerate(Request(prompt, 4, 0.0f, 0));
  ASSERT_TRUE(plain.status.ok()) << plain.status.error_message();
  EXPECT_EQ(plain.messages_with_prompt_logprobs, 0);
  EXPECT_EQ(plain.tokens, disagg.tokens);
  // Out of range: refused by the router.
  tandem::v1::GenerateRequest bad = Request(prompt, 4, 0.0f, 0);
  bad.mutable_sampling()->set_prompt_logprobs(21);
  EXPECT_EQ(RouterGenerate(bad).status.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(EngineIdle(decode.loop.get(), absl::Seconds(10)));
  EXPECT_TRUE(EngineIdle(prefill.loop.get(), absl::Seconds(10)));
}

TEST_F(ClusterTest, ShortPromptsAreColocatedBelowTheThreshold) {
  router_server_->Shutdown(In(5));
  StartRouter(/*colocate_below=*/10);
  PrefillNode prefill("prefill-0");
  DecodeNode decode;
  RegisterBoth(prefill, decode);
  ASSERT_TRUE(
      RouterGenerate(Request(engine::testing::MakePrompt(5, 1), 4, 0, 0)).status.ok());
  ASSERT_TRUE(
      RouterGenerate(Request(engine::testing::MakePrompt(30, 2), 4, 0, 0)).status.ok());
  EXPECT_EQ(Paths("colocated"), 1);
  EXPECT_EQ(Paths("disaggregated"), 1);
}

TEST_F(ClusterTest, LostPrefillWorkerIsReleasedAndRetriedElsewhere) {
  PrefillNode prefill("prefill-1");
  DecodeNode decode;
  // "prefill-0" is preferred (same load, lower id) but listens nowhere.
  std::string dead_address;
  {
    PrefillNode dead("prefill-0");
    dead_address = dead.address;
  }
  Register("prefill-0", tandem::v1::WORKER_ROLE_PREFILL, dead_address, {});
  Register("prefill-1", tandem::v1::WORKER_ROLE_PREFILL, prefill.address,
           prefill.service->Load());
  Register("decode-0", tandem::v1::WORKER_ROLE_DECODE, decode.address,
           decode.service->Load());
  const std::vector<int32_t> prompt = engine::testing::MakePrompt(40, 3);
  Result r = RouterGenerate(Request(prompt, 5, 0, 0));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.tokens.size(), 5u);
  EXPECT_EQ(handoff_metrics_.retries->Add({{"reason", "prefill_unavailable"}}).Value(),
            1);
  EXPECT_EQ(workers_.Live(tandem::v1::WORKER_ROLE_PREFILL).size(), 1u);
  EXPECT_EQ(decode.service->num_reservations(), 0);
  // The first reservation was released before any state landed: quarantined
  // (the lost prefill worker might still write), then freed.
  EXPECT_TRUE(ReservedIdle(decode.service.get(), absl::Seconds(10)));
  EXPECT_TRUE(EngineIdle(decode.loop.get(), absl::Seconds(10)));
}

// A reservation released before its state landed keeps its memory out of use
// for the quarantine (a prefill worker the router gave up on may still be
// writing into it), then gets it back; a landed one is freed at once.
TEST_F(ClusterTest, UnlandedReservationIsQuarantinedThenFreed) {
  DecodeNode decode;
  const int slots = decode.num_slots();
  auto reserve = [&](const std::string& id) {
    tandem::v1::ReserveRequest rr;
    rr.set_request_id(id);
    rr.set_prompt_tokens(20);
    tandem::v1::KvTarget target;
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10));
    return decode.stub->Reserve(&ctx, rr, &target);
  };
  auto release = [&](const std::string& id) {
    tandem::v1::ReleaseRequest rr;
    rr.set_request_id(id);
    tandem::v1::ReleaseResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10));
    return decode.stub->Release(&ctx, rr, &resp);
  };
  for (int i = 0; i < slots; ++i) {
    ASSERT_TRUE(reserve("q" + std::to_string(i)).ok()) << i;
  }
  for (int i = 0; i < slots; ++i) {
    ASSERT_TRUE(release("q" + std::to_string(i)).ok()) << i;
  }
  EXPECT_EQ(decode.service->num_reservations(), 0);
  // Every slot is quarantined: a new reservation is refused for now...
  grpc::Status held = reserve("next");
  EXPECT_EQ(held.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << held.error_message();
  EXPECT_GT(decode.service->reserved_blocks(), 0);
  EXPECT_EQ(decode.service->quarantined(), slots);
  EXPECT_EQ(decode.service->Load().free_state_slots(), 0);  // held, not free
  // ...and accepted once the quarantine (300 ms here) has passed.
  EXPECT_TRUE(ReservedIdle(decode.service.get(), absl::Seconds(10)));
  EXPECT_TRUE(EngineIdle(decode.loop.get(), absl::Seconds(10)));
  EXPECT_TRUE(reserve("next").ok());
  EXPECT_TRUE(release("next").ok());
}

TEST_F(ClusterTest, CorruptTransferIsDataLossAndNothingLeaks) {
  PrefillNode prefill("prefill-0", /*corrupt=*/true);
  DecodeNode decode;
  RegisterBoth(prefill, decode);
  Result r = RouterGenerate(Request(engine::testing::MakePrompt(33, 4), 5, 0, 0));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::DATA_LOSS)
      << r.status.error_message();
  EXPECT_NE(r.status.error_message().find("corrupt"), std::string::npos);
  EXPECT_TRUE(r.tokens.empty());
  EXPECT_EQ(decode.service->num_reservations(), 0);
  EXPECT_EQ(decode.service->reserved_blocks(), 0);
  EXPECT_TRUE(EngineIdle(decode.loop.get(), absl::Seconds(10)));
  EXPECT_TRUE(EngineIdle(prefill.loop.get(), absl::Seconds(10)));
  EXPECT_EQ(router_metrics_.requests->Add({{"outcome", "data_loss"}}).Value(), 1);
}

TEST_F(ClusterTest, ClientCancelMidStreamFreesTheDecodeWorkersBlocks) {
  PrefillNode prefill("prefill-0");
  DecodeNode decode;
  RegisterBoth(prefill, decode);
  tandem::v1::GenerateRequest req =
      Request(engine::testing::MakePrompt(50, 5), 400, 0, 0);
  req.mutable_stop()->set_ignore_eos(true);
  Result r = RouterGenerate(req, /*cancel_after=*/3);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(r.messages, 3);
  EXPECT_TRUE(EngineIdle(decode.loop.get(), absl::Seconds(10)))
      << decode.loop->stats().free_blocks << " of "
      << decode.loop->stats().total_blocks;
  EXPECT_EQ(decode.service->num_reservations(), 0);
}

TEST_F(ClusterTest, BadInputIsInvalidArgument) {
  DecodeNode decode;
  Register("decode-0", tandem::v1::WORKER_ROLE_DECODE, decode.address,
           decode.service->Load());
  tandem::v1::GenerateRequest req = Request({1, 2, -5}, 4, 0, 0);
  Result r = RouterGenerate(req);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  req = Request({1, 2, 3}, 4, 0, 0);
  req.mutable_sampling()->set_temperature(7);
  EXPECT_EQ(RouterGenerate(req).status.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  // Text prompts are tokenised by the router.
  tandem::v1::GenerateRequest text;
  text.set_prompt_text("Hello, tandem!");
  text.mutable_stop()->set_max_tokens(3);
  Result t = RouterGenerate(text);
  EXPECT_TRUE(t.status.ok()) << t.status.error_message();
  EXPECT_EQ(t.tokens.size(), 3u);
}

TEST_F(ClusterTest, MultiChunkPromptsStreamedLayerByLayerEqualColocated) {
  PrefillNode prefill("prefill-0");
  DecodeNode decode;
  RegisterBoth(prefill, decode);
  // 300..480 tokens: 2 chunks of the prefill engine's 256-token steps.
  for (int i = 0; i < 4; ++i) {
    const std::vector<int32_t> prompt =
        engine::testing::MakePrompt(300 + 60 * i, 500 + i);
    const float temperature = i % 2 == 0 ? 0.0f : 0.8f;
    tandem::v1::GenerateRequest req = Request(prompt, 5, temperature, 9000 + i);
    req.set_request_id("long-" + std::to_string(i));
    Result disagg = RouterGenerate(req);
    ASSERT_TRUE(disagg.status.ok()) << i << ": " << disagg.status.error_message();
    grpc::ClientContext ctx;
    ctx.set_deadline(In(60));
    req.set_request_id("long-colocated-" + std::to_string(i));
    Result colocated = Drain(decode.stub->Generate(&ctx, req).get());
    ASSERT_TRUE(colocated.status.ok()) << colocated.status.error_message();
    EXPECT_EQ(disagg.tokens, colocated.tokens) << "prompt " << i;
  }
  EXPECT_EQ(Paths("disaggregated"), 4);
  // Streamed: more than one batch per request (one per layer and chunk).
  EXPECT_GT(prefill.metrics.transfer_batches->Value(), 4 * 4);
  EXPECT_EQ(prefill.metrics.transfer_restarts->Value(), 0);
  EXPECT_EQ(prefill.metrics.exposed_transfer_seconds->Count(), 4u);
  EXPECT_TRUE(EngineIdle(decode.loop.get(), absl::Seconds(10)));
  EXPECT_TRUE(EngineIdle(prefill.loop.get(), absl::Seconds(10)));
  EXPECT_EQ(decode.service->num_reservations(), 0);
}

}  // namespace
}  // namespace tandem
