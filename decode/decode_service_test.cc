// DecodeService over gRPC with a LoopbackAgent, the tiny model and a FakeClock
// (the janitor off: the test calls Tick): a reservation is the engine's own
// blocks and slot (Load shows them used), the state written there and notified
// decodes exactly like the colocated Generate, and lease expiry, wait expiry,
// release and quarantine give the memory back to the engine when they should;
// client cancels (LANDING, decoding), a checksum mismatch (DATA_LOSS), a
// Release of a waiting Decode (ABORTED) and a first token that ends the request
// each end the stream once and free or quarantine the memory.
#include "decode/decode_service.h"

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/test_util.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvtransfer/checksum.h"
#include "kvtransfer/loopback_agent.h"
#include "metrics/registry.h"
#include "worker/cache_layout.h"
#include "worker/engine_loop.h"
#include "worker/worker_metrics.h"

namespace tandem::decode {
namespace {

using engine::testing::MakePrompt;
using engine::testing::TinyWeights;

constexpr absl::Duration kQuarantine = absl::Seconds(5);
constexpr int kTokens = 6;

std::chrono::system_clock::time_point In(int seconds) {
  return std::chrono::system_clock::now() + std::chrono::seconds(seconds);
}

struct Output {
  grpc::Status status;
  std::vector<int32_t> tokens;
  std::vector<tandem::v1::GenerateResponse> messages;
};

class DecodeServiceTest : public ::testing::Test {
 protected:
  DecodeServiceTest() : clock_(absl::Now()) {
    backend_ = engine::testing::MakeBackend("cpu");
    engine::EngineOptions o;
    o.block_size = 8;
    o.num_slots = 3;
    o.max_context_tokens = 256;
    auto e = engine::Engine::Create(&TinyWeights(), backend_.get(), nullptr, o);
    EXPECT_TRUE(e.ok()) << e.status();
    engine_ = e->get();
    loop_ = std::make_unique<worker::EngineLoop>(std::move(*e));
    DecodeServiceOptions so;
    so.unlanded_quarantine = kQuarantine;
    so.default_lease = absl::Seconds(10);
    so.max_landing_wait = absl::Seconds(3);
    so.clock = &clock_;
    so.start_janitor = false;
    so.max_landing_tokens = max_landing_tokens_;
    // The landed state's checksums through the backend's ChunkHashes (the path
    // of a device cache; the host path is the cluster tests').
    so.checksum_backends = {backend_.get()};
    auto s =
        DecodeService::Create(loop_.get(), {&engine_->cache()}, &agent_, &metrics_, so);
    EXPECT_TRUE(s.ok()) << s.status();
    service_ = std::move(*s);
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(service_.get());
    server_ = b.BuildAndStart();
    stub_ = tandem::v1::DecodeWorker::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  }
  ~DecodeServiceTest() override {
    server_->Shutdown(In(5));
    service_->Stop();
    loop_.reset();
    service_.reset();
  }

  // A barrier: every command posted before has run and its batch's stats are
  // published (the second command runs in a later batch than the first).
  void Sync() {
    for (int i = 0; i < 2; ++i) {
      absl::Notification done;
      loop_->Post([&](engine::Engine&) { done.Notify(); });
      ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    }
  }
  int32_t FreeBlocks() {
    Sync();
    return service_->Load().free_kv_blocks();
  }
  // Polls the reservation's state (bounded): RPCs reach the service on its
  // threads.
  bool WaitForState(const std::string& id, ReservationState want) {
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (absl::Now() < end) {
      if (service_->state(id) == want) return true;
      absl::SleepFor(absl::Milliseconds(1));
    }
    return false;
  }
  int32_t TotalBlocks() { return service_->Load().total_kv_blocks(); }
  // How many Decodes the service ended with `outcome` (its requests counter).
  double Decodes(const char* outcome) {
    return metrics_.requests->Add({{"rpc", "Decode"}, {"outcome", outcome}}).Value();
  }
  // Polls (bounded) until `want` Decodes ended with `outcome`: the service ends
  // a stream on its own threads.
  bool WaitForDecodes(const char* outcome, double want) {
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (absl::Now() < end) {
      if (Decodes(outcome) >= want) return Decodes(outcome) == want;
      absl::SleepFor(absl::Milliseconds(1));
    }
    return false;
  }

  grpc::Status Reserve(const std::string& id, int prompt_tokens,
                       tandem::v1::KvTarget* target) {
    tandem::v1::ReserveRequest r;
    r.set_request_id(id);
    r.set_prompt_tokens(prompt_tokens);
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10));
    return stub_->Reserve(&ctx, r, target);
  }
  bool Release(const std::string& id) {
    tandem::v1::ReleaseRequest r;
    r.set_request_id(id);
    tandem::v1::ReleaseResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10));
    EXPECT_TRUE(stub_->Release(&ctx, r, &resp).ok());
    return resp.found();
  }
  static void Greedy(tandem::v1::SamplingParams* s, tandem::v1::StopConditions* stop) {
    s->set_temperature(0);
    stop->set_max_tokens(kTokens);
    stop->set_ignore_eos(true);
  }
  template <typename Reader>
  static Output ReadAll(Reader* reader) {
    Output out;
    tandem::v1::GenerateResponse m;
    while (reader->Read(&m)) {
      out.tokens.insert(out.tokens.end(), m.token_ids().begin(), m.token_ids().end());
      out.messages.push_back(m);
    }
    out.status = reader->Finish();
    return out;
  }
  Output Generate(const std::vector<int32_t>& prompt) {
    tandem::v1::GenerateRequest r;
    r.set_request_id("colocated");
    for (int32_t t : prompt) r.mutable_prompt_token_ids()->add_ids(t);
    Greedy(r.mutable_sampling(), r.mutable_stop());
    grpc::ClientContext ctx;
    ctx.set_deadline(In(30));
    auto reader = stub_->Generate(&ctx, r);
    return ReadAll(reader.get());
  }
  tandem::v1::DecodeRequest DecodeRequest(const std::string& id,
                                          const std::vector<int32_t>& prompt,
                                          int32_t first) {
    tandem::v1::DecodeRequest r;
    r.set_request_id(id);
    for (int32_t t : prompt) r.add_prompt_token_ids(t);
    r.set_first_token_id(first);
    Greedy(r.mutable_sampling(), r.mutable_stop());
    return r;
  }
  // What a prefill worker sends: the prompt's state and its first token.
  struct Prefilled {
    std::unique_ptr<kernels::Backend> backend;
    std::unique_ptr<engine::Engine> engine;
    engine::ExportedState state;
  };
  static Prefilled Prefill(const std::vector<int32_t>& prompt) {
    Prefilled p;
    p.backend = engine::testing::MakeBackend("cpu");
    p.engine = *engine::Engine::Create(&TinyWeights(), p.backend.get(), nullptr, {});
    engine::SamplingParams sp;
    sp.max_tokens = kTokens;
    sp.ignore_eos = true;
    EXPECT_TRUE(p.engine->AddRequest(1, prompt, sp).ok());
    for (int step = 0; step < 100 && !p.engine->ExportState(1).ok(); ++step) {
      EXPECT_TRUE(p.engine->Step().ok());
    }
    p.state = *p.engine->ExportState(1);
    return p;
  }
  // The prefill worker's puts (into the target's blocks and slot of this
  // engine's cache) and its notification through a peer agent.
  void Land(const std::string& id, const tandem::v1::KvTarget& target,
            const engine::ExportedState& state) {
    const tandem::v1::RankTarget& t = target.ranks(0);
    std::vector<int32_t> blocks(t.block_ids().begin(), t.block_ids().end());
    auto dst = engine_->cache().ExportSequence(blocks, state.num_cached_tokens,
                                               t.state_slot());
    ASSERT_TRUE(dst.ok()) << dst.status();
    ASSERT_TRUE(engine::CopyStateRanges(state.ranges, *dst).ok());
    auto peer = sender_.Connect(t.transfer_descriptor());
    ASSERT_TRUE(peer.ok()) << peer.status();
    // The notification carries the reservation's token, as a prefill worker's.
    ASSERT_NE(target.reservation_token(), 0u);
    ASSERT_TRUE(sender_
                    .Notify(*peer, id, absl::StrCat(target.reservation_token()),
                            absl::Now() + absl::Seconds(10))
                    .ok());
  }

  // HandoffsQueuedBehindABusyEngineLandTogether's scenario;
  // `batches_after_first`: the batches b and c land in.
  void Run(int batches_after_first);

  // The checksums of the state landed in the target's blocks, as the prefill
  // worker computes them over its own copy (the host's view of the cache).
  tandem::v1::StateChecksums LandedChecksums(const tandem::v1::KvTarget& target,
                                             int32_t prompt_tokens) {
    kvtransfer::LoopbackAgent view;
    auto regions = worker::RegisterCache(&view, &engine_->cache());
    EXPECT_TRUE(regions.ok()) << regions.status();
    if (!regions.ok()) return {};
    const tandem::v1::RankTarget& t = target.ranks(0);
    const std::vector<int32_t> blocks(t.block_ids().begin(), t.block_ids().end());
    auto sums = kvtransfer::ComputeChecksums(
        worker::CacheRankLayout(engine_->cache(), *regions, blocks, t.state_slot()),
        prompt_tokens, worker::CacheRegionBytes(&engine_->cache(), *regions));
    EXPECT_TRUE(sums.ok()) << sums.status();
    return sums.ok() ? *sums : tandem::v1::StateChecksums();
  }

  // DecodeServiceOptions::max_landing_tokens of the suite (a suite sets it in
  // SetUpTestSuite, before its fixtures are made).
  inline static int64_t max_landing_tokens_ = DecodeServiceOptions().max_landing_tokens;

  FakeClock clock_;
  std::unique_ptr<kernels::Backend> backend_;
  engine::Engine* engine_ = nullptr;  // owned by the loop
  kvtransfer::LoopbackAgent agent_;
  kvtransfer::LoopbackAgent sender_;
  metrics::Registry registry_;
  worker::WorkerMetrics metrics_{&registry_};
  std::unique_ptr<worker::EngineLoop> loop_;
  std::unique_ptr<DecodeService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<tandem::v1::DecodeWorker::Stub> stub_;
};

TEST_F(DecodeServiceTest, StateLandsInTheEnginesBlocksAndDecodesLikeColocated) {
  const std::vector<int32_t> prompt = MakePrompt(29, 5);
  const Output want = Generate(prompt);
  ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  ASSERT_EQ(want.tokens.size(), static_cast<size_t>(kTokens));
  const int32_t total = TotalBlocks();
  ASSERT_EQ(FreeBlocks(), total);

  tandem::v1::KvTarget target;
  ASSERT_TRUE(Reserve("r1", 29, &target).ok());
  ASSERT_EQ(target.ranks_size(), 1);
  EXPECT_EQ(target.ranks(0).block_ids_size(), 4);  // 29 positions, blocks of 8
  // The reservation is the engine's memory: not free, not schedulable.
  EXPECT_EQ(FreeBlocks(), total - 4);
  EXPECT_EQ(service_->Load().free_state_slots(), 2);
  EXPECT_EQ(service_->reserved_blocks(), 4);
  EXPECT_EQ(engine_->scheduler().num_reserved(), 1);
  tandem::v1::KvTarget again;
  EXPECT_EQ(Reserve("r1", 29, &again).error_code(), grpc::StatusCode::ALREADY_EXISTS);

  Prefilled p = Prefill(prompt);
  ASSERT_EQ(p.state.generated.size(), 1u);
  Land("r1", target, p.state);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(30));
  auto reader = stub_->Decode(&ctx, DecodeRequest("r1", prompt, p.state.generated[0]));
  const Output got = ReadAll(reader.get());
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(service_->num_reservations(), 0);
  EXPECT_EQ(service_->reserved_blocks(), 0);
  EXPECT_EQ(FreeBlocks(), total);
  EXPECT_EQ(engine_->scheduler().num_reserved(), 0);
}

TEST_F(DecodeServiceTest, DecodeWaitsForTheNotification) {
  const std::vector<int32_t> prompt = MakePrompt(17, 6);
  const Output want = Generate(prompt);
  tandem::v1::KvTarget target;
  ASSERT_TRUE(Reserve("r2", 17, &target).ok());
  Prefilled p = Prefill(prompt);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(30));
  auto reader = stub_->Decode(&ctx, DecodeRequest("r2", prompt, p.state.generated[0]));
  EXPECT_TRUE(WaitForState("r2", ReservationState::kLanding));
  Land("r2", target, p.state);  // LANDING → ADMITTED
  const Output got = ReadAll(reader.get());
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.tokens, want.tokens);
}

TEST_F(DecodeServiceTest, LeaseExpiryQuarantinesThenReturnsTheBlocks) {
  const int32_t total = TotalBlocks();
  tandem::v1::KvTarget target;
  ASSERT_TRUE(Reserve("r3", 20, &target).ok());
  clock_.Advance(absl::Seconds(10) + absl::Milliseconds(1));
  service_->Tick(clock_.Now());
  EXPECT_EQ(service_->num_reservations(), 0);
  EXPECT_EQ(service_->quarantined(), 1);
  EXPECT_EQ(FreeBlocks(), total - 3);  // held out of the engine's free list
  clock_.Advance(kQuarantine);
  service_->Tick(clock_.Now());
  EXPECT_EQ(service_->quarantined(), 0);
  EXPECT_EQ(FreeBlocks(), total);
  EXPECT_EQ(engine_->scheduler().num_reserved(), 0);
}

// Peer loss: the state never arrives; the Decode ends at its wait deadline.
TEST_F(DecodeServiceTest, WaitExpiryIsDeadlineExceededAndQuarantines) {
  const int32_t total = TotalBlocks();
  tandem::v1::KvTarget target;
  ASSERT_TRUE(Reserve("r4", 20, &target).ok());
  grpc::ClientContext ctx;
  ctx.set_deadline(In(30));
  auto reader = stub_->Decode(&ctx, DecodeRequest("r4", MakePrompt(20, 1), 3));
  // Once the Decode waits (LANDING), its wait can expire.
  ASSERT_TRUE(WaitForState("r4", ReservationState::kLanding));
  clock_.Advance(absl::Seconds(3));
  service_->Tick(clock_.Now());
  EXPECT_EQ(service_->state("r4"), ReservationState::kLanding);  // at the deadline
  clock_.Advance(absl::Milliseconds(1));
  service_->Tick(clock_.Now());
  const Output got = ReadAll(reader.get());
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << got.status.error_message();
  EXPECT_EQ(service_->quarantined(), 1);
  EXPECT_EQ(FreeBlocks(), total - 3);
  clock_.Advance(kQuarantine);
  service_->Tick(clock_.Now());
  EXPECT_EQ(FreeBlocks(), total);
}

TEST_F(DecodeServiceTest, ReleaseBeforeLandingQuarantinesAfterLandingFrees) {
  const int32_t total = TotalBlocks();
  tandem::v1::KvTarget a, b;
  ASSERT_TRUE(Reserve("unlanded", 20, &a).ok());
  ASSERT_TRUE(Reserve("landed", 20, &b).ok());
  const std::vector<int32_t> prompt = MakePrompt(20, 2);
  Prefilled p = Prefill(prompt);
  Land("landed", b, p.state);
  EXPECT_TRUE(Release("unlanded"));
  EXPECT_TRUE(Release("landed"));
  EXPECT_FALSE(Release("nobody"));
  EXPECT_EQ(service_->num_reservations(), 0);
  EXPECT_EQ(service_->quarantined(), 1);
  EXPECT_EQ(FreeBlocks(), total - 3);  // only the unlanded one is held
  clock_.Advance(kQuarantine);
  service_->Tick(clock_.Now());
  EXPECT_EQ(FreeBlocks(), total);
}

TEST_F(DecodeServiceTest, FullEngineRefusesAndUnknownNotificationIsIgnored) {
  tandem::v1::KvTarget t;
  for (int i = 0; i < 3; ++i) {  // every slot
    ASSERT_TRUE(Reserve("s" + std::to_string(i), 8, &t).ok()) << i;
  }
  grpc::Status full = Reserve("s3", 8, &t);
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << full.error_message();
  auto peer = sender_.Connect(t.ranks(0).transfer_descriptor());
  ASSERT_TRUE(peer.ok());
  ASSERT_TRUE(sender_.Notify(*peer, "nobody", "", absl::Now() + absl::Seconds(5)).ok());
  EXPECT_EQ(service_->num_reservations(), 3);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(10));
  auto reader = stub_->Decode(&ctx, DecodeRequest("nobody", {1, 2}, 3));
  EXPECT_EQ(ReadAll(reader.get()).status.error_code(), grpc::StatusCode::NOT_FOUND);
}

// The client gives up while its Decode waits for the state: the stream ends
// CANCELLED once, and the memory stays quarantined (the prefill worker may
// still be writing into it) until Tick ends the quarantine.
TEST_F(DecodeServiceTest, CancelWhileLandingQuarantinesThenReturnsTheBlocks) {
  const int32_t total = TotalBlocks();
  tandem::v1::KvTarget target;
  ASSERT_TRUE(Reserve("c1", 20, &target).ok());
  grpc::ClientContext ctx;
  ctx.set_deadline(In(10));
  auto reader = stub_->Decode(&ctx, DecodeRequest("c1", MakePrompt(20, 1), 3));
  ASSERT_TRUE(WaitForState("c1", ReservationState::kLanding));
  ctx.TryCancel();
  const Output got = ReadAll(reader.get());
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::CANCELLED)
      << got.status.error_message();
  EXPECT_TRUE(got.messages.empty());
  ASSERT_TRUE(WaitForDecodes("cancelled", 1));
  EXPECT_EQ(service_->state("c1"), std::nullopt);
  EXPECT_EQ(service_->num_reservations(), 0);
  EXPECT_EQ(service_->quarantined(), 1);
  EXPECT_EQ(service_->reserved_blocks(), 3);
  EXPECT_EQ(FreeBlocks(), total - 3);  // not free at once
  EXPECT_EQ(service_->Load().free_state_slots(), 2);
  // The Decode's wait deadline (3 s) passes inside the quarantine: nothing is
  // left to expire, the stream is not ended again.
  clock_.Advance(kQuarantine - absl::Milliseconds(1));
  service_->Tick(clock_.Now());
  EXPECT_EQ(FreeBlocks(), total - 3);
  clock_.Advance(absl::Milliseconds(1));
  service_->Tick(clock_.Now());
  EXPECT_EQ(service_->quarantined(), 0);
  EXPECT_EQ(FreeBlocks(), total);
  EXPECT_EQ(service_->Load().free_state_slots(), 3);
  EXPECT_EQ(Decodes("cancelled"), 1);
  EXPECT_EQ(Decodes("deadline_exceeded"), 0);
}

// The client gives up while its request decodes: the engine cancels it and its
// blocks and slot (the reservation's, now the sequence's) come back.
TEST_F(DecodeServiceTest, CancelWhileDecodingReturnsTheEnginesBlocksAndSlot) {
  const int32_t total = TotalBlocks();
  const std::vector<int32_t> prompt = MakePrompt(20, 7);
  tandem::v1::KvTarget target;
  ASSERT_TRUE(Reserve("c2", 20, &target).ok());
  Prefilled p = Prefill(prompt);
  Land("c2", target, p.state);
  ASSERT_TRUE(WaitForState("c2", ReservationState::kLanded));
  tandem::v1::DecodeRequest r = DecodeRequest("c2", prompt, p.state.generated[0]);
  r.mutable_stop()->set_max_tokens(200);  // still decoding when the cancel comes
  grpc::ClientContext ctx;
  ctx.set_deadline(In(30));
  auto reader = stub_->Decode(&ctx, r);
  tandem::v1::GenerateResponse first;
  ASSERT_TRUE(reader->Read(&first));  // admitted: the first token was sent
  // Holds the engine between two steps while the client cancels (shared: the
  // command may outlive a failed wait).
  auto held = std::make_shared<absl::Notification>();
  auto resume = std::make_shared<absl::Notification>();
  loop_->Post([held, resume](engine::Engine&) {
    held->Notify();
    resume->WaitForNotificationWithTimeout(absl::Seconds(10));
  });
  const bool was_held = held->WaitForNotificationWithTimeout(absl::Seconds(10));
  const std::optional<ReservationState> state = service_->state("c2");
  ctx.TryCancel();
  resume->Notify();
  ASSERT_TRUE(was_held);
  EXPECT_EQ(state, ReservationState::kAdmitted);
  const Output got = ReadAll(reader.get());
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::CANCELLED)
      << got.status.error_message();
  ASSERT_TRUE(WaitForDecodes("cancelled", 1));
  EXPECT_EQ(service_->num_reservations(), 0);
  EXPECT_EQ(service_->reserved_blocks(), 0);
  EXPECT_EQ(service_->quarantined(), 0);
  EXPECT_EQ(FreeBlocks(), total);  // a barrier: the engine's stats are current
  EXPECT_EQ(service_->Load().free_state_slots(), 3);
  EXPECT_EQ(service_->Load().running_requests(), 0);
  EXPECT_EQ(Decodes("cancelled"), 1);
  EXPECT_EQ(Decodes("ok"), 0);
}

// Checksums that the landed bytes do not have (one per layer, as a prefill
// worker sends): DATA_LOSS before admission, and the landed state is freed.
TEST_F(DecodeServiceTest, ChecksumMismatchIsDataLossAndFreesTheBlocks) {
  const int32_t total = TotalBlocks();
  const std::vector<int32_t> prompt = MakePrompt(20, 8);
  tandem::v1::KvTarget target;
  ASSERT_TRUE(Reserve("d1", 20, &target).ok());
  Prefilled p = Prefill(prompt);
  Land("d1", target, p.state);
  ASSERT_TRUE(WaitForState("d1", ReservationState::kLanded));
  tandem::v1::DecodeRequest r = DecodeRequest("d1", prompt, p.state.generated[0]);
  const tandem::v1::KvLayout& layout = target.ranks(0).layout();
  ASSERT_GT(layout.num_mla_layers(), 0);
  ASSERT_GT(layout.num_kda_layers(), 0);
  for (int l = 0; l < layout.num_mla_layers(); ++l) {
    r.mutable_checksums()->add_mla_layer(0x1000 + l);
  }
  for (int l = 0; l < layout.num_kda_layers(); ++l) {
    r.mutable_checksums()->add_kda_layer(0x2000 + l);
  }
  r.mutable_checksums()->set_total(0x3000);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(10));
  auto reader = stub_->Decode(&ctx, r);
  const Output got = ReadAll(reader.get());
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::DATA_LOSS)
      << got.status.error_message();
  EXPECT_TRUE(got.messages.empty());
  ASSERT_TRUE(WaitForDecodes("data_loss", 1));
  EXPECT_EQ(service_->num_reservations(), 0);
  EXPECT_EQ(service_->quarantined(), 0);  // it had landed: freed now
  EXPECT_EQ(service_->reserved_blocks(), 0);
  EXPECT_EQ(FreeBlocks(), total);
  EXPECT_EQ(service_->Load().free_state_slots(), 3);
}

// Checksums the host computed over the landed blocks equal the service's (its
// backend's ChunkHashes): the Decode runs and matches the colocated tokens.
TEST_F(DecodeServiceTest, ChecksumsFromTheBackendEqualTheHostsAndTheDecodeRuns) {
  const std::vector<int32_t> prompt = MakePrompt(27, 3);
  const Output want = Generate(prompt);
  ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  tandem::v1::KvTarget target;
  ASSERT_TRUE(Reserve("c1", 27, &target).ok());
  Prefilled p = Prefill(prompt);
  Land("c1", target, p.state);
  ASSERT_TRUE(WaitForState("c1", ReservationState::kLanded));
  const tandem::v1::StateChecksums sums = LandedChecksums(target, 27);
  tandem::v1::DecodeRequest r = DecodeRequest("c1", prompt, p.state.generated[0]);
  *r.mutable_checksums() = sums;
  grpc::ClientContext ctx;
  ctx.set_deadline(In(30));
  auto reader = stub_->Decode(&ctx, r);
  const Output got = ReadAll(reader.get());
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.tokens, want.tokens);
}

// Hand-offs never wait for the engine on the thread that completes them (the
// agent's progress thread, a gRPC thread): the lander thread makes them ready,
// and the ones queued while it waits are made ready together, in one pause of
// the engine, each with its own outcome. Here the engine is held busy while
// three Decodes of landed states arrive: the first is taken alone, the other
// two queue (their RPC threads free) and land in one batch, where one carries
// wrong checksums: it alone ends DATA_LOSS, the others decode as colocated.
TEST_F(DecodeServiceTest, HandoffsQueuedBehindABusyEngineLandTogether) { Run(1); }

// With at most 25 prompt tokens per pause, b (20) and c (21) land one by one.
class DecodeServiceLandingCapTest : public DecodeServiceTest {
 protected:
  static void SetUpTestSuite() { max_landing_tokens_ = 25; }
  static void TearDownTestSuite() {
    max_landing_tokens_ = DecodeServiceOptions().max_landing_tokens;
  }
};

TEST_F(DecodeServiceLandingCapTest, ThePromptTokenCapSplitsTheBatch) { Run(2); }

void DecodeServiceTest::Run(int batches_after_first) {
  const int32_t total = TotalBlocks();
  const std::vector<std::string> ids = {"a", "b", "c"};
  std::vector<std::vector<int32_t>> prompts;
  std::vector<Output> want;
  std::vector<tandem::v1::DecodeRequest> requests;
  for (size_t i = 0; i < ids.size(); ++i) {
    prompts.push_back(MakePrompt(19 + static_cast<int>(i), 5 + static_cast<int>(i)));
    want.push_back(Generate(prompts[i]));
    ASSERT_TRUE(want[i].status.ok()) << want[i].status.error_message();
    tandem::v1::KvTarget target;
    ASSERT_TRUE(Reserve(ids[i], static_cast<int>(prompts[i].size()), &target).ok());
    Prefilled p = Prefill(prompts[i]);
    Land(ids[i], target, p.state);
    ASSERT_TRUE(WaitForState(ids[i], ReservationState::kLanded));
    requests.push_back(DecodeRequest(ids[i], prompts[i], p.state.generated[0]));
    *requests[i].mutable_checksums() =
        LandedChecksums(target, static_cast<int32_t>(prompts[i].size()));
    ASSERT_GT(requests[i].checksums().mla_layer_size(), 0);
  }
  // c's state is not what its checksums say.
  requests[2].mutable_checksums()->set_mla_layer(
      0, requests[2].checksums().mla_layer(0) ^ 1);
  const double batches_before = metrics_.landing_batches->Value();
  const uint64_t landed_before = metrics_.landing_seconds->Count();

  // The engine busy: a command that holds the loop until released.
  absl::Notification hold_entered, release;
  loop_->Post([&](engine::Engine&) {
    hold_entered.Notify();
    release.WaitForNotificationWithTimeout(absl::Seconds(30));
  });
  ASSERT_TRUE(hold_entered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  std::vector<Output> got(ids.size());
  std::vector<std::thread> clients;
  auto decode = [&](size_t i) {
    clients.emplace_back([&, i] {
      grpc::ClientContext ctx;
      ctx.set_deadline(In(30));
      auto reader = stub_->Decode(&ctx, requests[i]);
      got[i] = ReadAll(reader.get());
    });
  };
  decode(0);
  // The lander took a and waits for the engine.
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (service_->landings_taken() < 1 && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(service_->landings_taken(), 1);
  decode(1);
  decode(2);
  // b and c are handed over (their RPC threads returned) while the lander
  // still waits for a.
  while (service_->queued_landings() < 2 && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(service_->queued_landings(), 2u);
  EXPECT_EQ(service_->landings_taken(), 1);
  EXPECT_EQ(metrics_.landing_batches->Value(), batches_before);
  release.Notify();
  for (std::thread& t : clients) t.join();

  for (size_t i = 0; i < 2; ++i) {
    SCOPED_TRACE(ids[i]);
    ASSERT_TRUE(got[i].status.ok()) << got[i].status.error_message();
    EXPECT_EQ(got[i].tokens, want[i].tokens);
  }
  EXPECT_EQ(got[2].status.error_code(), grpc::StatusCode::DATA_LOSS)
      << got[2].status.error_message();
  EXPECT_TRUE(got[2].tokens.empty());
  // a alone, then b and c together (or, capped, one by one).
  EXPECT_EQ(service_->landings_taken(), 3);
  EXPECT_EQ(metrics_.landing_batches->Value(),
            batches_before + 1 + batches_after_first);
  EXPECT_EQ(metrics_.landing_seconds->Count(), landed_before + 3);
  EXPECT_EQ(Decodes("ok"), 2);
  EXPECT_EQ(Decodes("data_loss"), 1);
  EXPECT_EQ(service_->num_reservations(), 0);
  EXPECT_EQ(FreeBlocks(), total);
}

// checksum_backends: one per rank or none.
TEST_F(DecodeServiceTest, ChecksumBackendsAreOnePerRank) {
  DecodeServiceOptions so;
  so.start_janitor = false;
  so.checksum_backends = {backend_.get(), backend_.get()};
  kvtransfer::LoopbackAgent other;
  auto bad =
      DecodeService::Create(loop_.get(), {&engine_->cache()}, &other, nullptr, so);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  so.checksum_backends = {nullptr};
  kvtransfer::LoopbackAgent other2;
  bad = DecodeService::Create(loop_.get(), {&engine_->cache()}, &other2, nullptr, so);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
}

// The router releases a reservation whose Decode waits for the state (the
// prefill failed): the Decode ends ABORTED and the memory is quarantined.
TEST_F(DecodeServiceTest, ReleaseWhileLandingAbortsTheDecode) {
  const int32_t total = TotalBlocks();
  tandem::v1::KvTarget target;
  ASSERT_TRUE(Reserve("l1", 20, &target).ok());
  grpc::ClientContext ctx;
  ctx.set_deadline(In(10));
  auto reader = stub_->Decode(&ctx, DecodeRequest("l1", MakePrompt(20, 3), 3));
  ASSERT_TRUE(WaitForState("l1", ReservationState::kLanding));
  EXPECT_TRUE(Release("l1"));
  const Output got = ReadAll(reader.get());
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::ABORTED)
      << got.status.error_message();
  EXPECT_TRUE(got.messages.empty());
  EXPECT_EQ(service_->state("l1"), std::nullopt);
  EXPECT_EQ(service_->quarantined(), 1);
  EXPECT_EQ(FreeBlocks(), total - 3);
  clock_.Advance(kQuarantine);
  service_->Tick(clock_.Now());
  EXPECT_EQ(FreeBlocks(), total);
  EXPECT_EQ(Decodes("cancelled"), 0);
  EXPECT_EQ(Decodes("deadline_exceeded"), 0);
}

// The prefilled token alone ends the request (max_tokens 1, or it is a stop
// token): one message with the finish reason and usage, then OK, and the
// reservation's memory goes back to the engine.
TEST_F(DecodeServiceTest, FirstTokenThatEndsTheRequestIsOneMessageThenOk) {
  const int32_t total = TotalBlocks();
  const std::vector<int32_t> prompt = MakePrompt(20, 9);
  Prefilled p = Prefill(prompt);
  const int32_t first = p.state.generated[0];
  struct Case {
    std::string id;
    bool stop_token;  // false: max_tokens 1
    tandem::v1::FinishReason want;
  };
  const std::vector<Case> cases = {
      {"max-tokens-1", false, tandem::v1::FINISH_REASON_LENGTH},
      {"stop-token", true, tandem::v1::FINISH_REASON_STOP},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    SCOPED_TRACE(c.id);
    tandem::v1::KvTarget target;
    ASSERT_TRUE(Reserve(c.id, 20, &target).ok());
    Land(c.id, target, p.state);
    ASSERT_TRUE(WaitForState(c.id, ReservationState::kLanded));
    tandem::v1::DecodeRequest r = DecodeRequest(c.id, prompt, first);
    if (c.stop_token) {
      r.mutable_stop()->add_stop_token_ids(first);
    } else {
      r.mutable_stop()->set_max_tokens(1);
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10));
    auto reader = stub_->Decode(&ctx, r);
    const Output got = ReadAll(reader.get());
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    ASSERT_EQ(got.messages.size(), 1u);
    const tandem::v1::GenerateResponse& m = got.messages[0];
    EXPECT_EQ(got.tokens, std::vector<int32_t>{first});
    EXPECT_EQ(m.finish_reason(), c.want);
    ASSERT_TRUE(m.has_usage());
    EXPECT_EQ(m.usage().prompt_tokens(), 20);
    EXPECT_EQ(m.usage().completion_tokens(), 1);
    EXPECT_EQ(Decodes("ok"), static_cast<double>(i + 1));
    EXPECT_EQ(service_->num_reservations(), 0);
    EXPECT_EQ(service_->reserved_blocks(), 0);
    EXPECT_EQ(FreeBlocks(), total);
    EXPECT_EQ(service_->Load().free_state_slots(), 3);
  }
}

}  // namespace
}  // namespace tandem::decode
