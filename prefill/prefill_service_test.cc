// PrefillService against an in-process receiver (a LoopbackAgent with a landing
// KvCache of another block size, as a decode worker has), over gRPC on 127.0.0.1:
//   - a multi-chunk prompt's streamed state arrives bit-exact (the receiver's
//     checksums over its landing cache == the sender's), in one batch per MLA
//     layer and chunk plus one per KDA layer; streaming off lands the same bytes
//   - a batch failing while the layers are sent (the receiver dies) fails the request
//     UNAVAILABLE, every posted batch has ended by the answer, nothing leaks
//   - a stalled receiver: the deadline and a Cancel each end the request, every
//     batch ended, the engine's blocks free
//   - a prefill preempted and recomputed: its transfer restarts whole, bit-exact
#include "prefill/prefill_service.h"

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"
#include "kvtransfer/checksum.h"
#include "kvtransfer/loopback_agent.h"
#include "metrics/registry.h"
#include "worker/cache_layout.h"
#include "worker/engine_loop.h"
#include "worker/worker_metrics.h"

namespace tandem::prefill {
namespace {

using engine::testing::TinyWeights;

// Forwards to a LoopbackAgent; counts posted and ended batches and can run a
// hook before the n-th PostWrite (fault injection mid-transfer).
class CountingAgent final : public kvtransfer::TransferAgent {
 public:
  explicit CountingAgent(kvtransfer::TransferAgent* inner) : inner_(inner) {}

  void BeforePost(int n, std::function<void()> hook) {
    absl::MutexLock l(&mu_);
    hook_at_ = n;
    hook_ = std::move(hook);
  }
  int posted() const {
    absl::MutexLock l(&mu_);
    return posted_;
  }
  // Batches known to have ended: a Wait returned something other than
  // DEADLINE_EXCEEDED, or the completion callback ran.
  int ended() const {
    absl::MutexLock l(&mu_);
    return static_cast<int>(ended_.size());
  }
  // Blocks until at least n Connect calls were made (bounded).
  bool AwaitConnects(int n, absl::Duration timeout) {
    absl::MutexLock l(&mu_);
    auto enough = [this, n]()
                      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return connects_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
  }
  // Blocks until at least n batches were posted (bounded).
  bool AwaitPosted(int n, absl::Duration timeout) {
    absl::MutexLock l(&mu_);
    auto enough = [this, n]()
                      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return posted_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
  }

  using kvtransfer::TransferAgent::RegisterMemory;
  absl::StatusOr<kvtransfer::RegionId> RegisterMemory(
      void* base, size_t len, kvtransfer::MemoryKind kind) override {
    return inner_->RegisterMemory(base, len, kind);
  }
  absl::Status DeregisterMemory(kvtransfer::RegionId region) override {
    return inner_->DeregisterMemory(region);
  }
  size_t NumRegisteredRegions() const override {
    return inner_->NumRegisteredRegions();
  }
  uint64_t AgentId() const override { return inner_->AgentId(); }
  absl::StatusOr<std::string> LocalDescriptor(absl::string_view metadata) override {
    return inner_->LocalDescriptor(metadata);
  }
  absl::StatusOr<kvtransfer::PeerId> Connect(absl::string_view d) override {
    {
      absl::MutexLock l(&mu_);
      ++connects_;
    }
    return inner_->Connect(d);
  }
  absl::Status Disconnect(kvtransfer::PeerId peer) override {
    return inner_->Disconnect(peer);
  }
  size_t NumPeers() const override { return inner_->NumPeers(); }
  absl::StatusOr<kvtransfer::BatchId> PostWrite(
      kvtransfer::PeerId peer, absl::Span<const kvtransfer::Segment> segments,
      kvtransfer::CompletionCallback on_done) override {
    std::function<void()> hook;
    {
      absl::MutexLock l(&mu_);
      if (++posts_seen_ == hook_at_) hook = hook_;
    }
    if (hook) hook();
    auto b = inner_->PostWrite(
        peer, segments, [this, on_done](kvtransfer::BatchId id, const absl::Status& s) {
          {
            absl::MutexLock l(&mu_);
            ended_.insert(id);
          }
          if (on_done) on_done(id, s);
        });
    if (b.ok()) {
      absl::MutexLock l(&mu_);
      ++posted_;
    }
    return b;
  }
  absl::StatusOr<kvtransfer::BatchId> PostRead(
      kvtransfer::PeerId peer, absl::Span<const kvtransfer::Segment> segments,
      kvtransfer::CompletionCallback on_done) override {
    return inner_->PostRead(peer, segments, std::move(on_done));
  }
  absl::StatusOr<bool> Poll(kvtransfer::BatchId batch) override {
    return inner_->Poll(batch);
  }
  absl::Status Wait(kvtransfer::BatchId batch, absl::Time deadline) override {
    absl::Status s = inner_->Wait(batch, deadline);
    if (!absl::IsDeadlineExceeded(s)) {
      absl::MutexLock l(&mu_);
      ended_.insert(batch);
    }
    return s;
  }
  absl::Status Cancel(kvtransfer::BatchId batch) override {
    return inner_->Cancel(batch);
  }
  absl::Status Notify(kvtransfer::PeerId peer, absl::string_view request_id,
                      absl::string_view payload, absl::Time deadline) override {
    return inner_->Notify(peer, request_id, payload, deadline);
  }
  void SetNotificationCallback(kvtransfer::NotificationCallback cb) override {
    inner_->SetNotificationCallback(std::move(cb));
  }
  std::vector<kvtransfer::Notification> PollNotifications() override {
    return inner_->PollNotifications();
  }
  std::string Transport(kvtransfer::PeerId peer) override {
    return inner_->Transport(peer);
  }

 private:
  kvtransfer::TransferAgent* const inner_;  // not owned
  mutable absl::Mutex mu_;
  int connects_ ABSL_GUARDED_BY(mu_) = 0;
  int posts_seen_ ABSL_GUARDED_BY(mu_) = 0;
  int posted_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_set<kvtransfer::BatchId> ended_ ABSL_GUARDED_BY(mu_);
  int hook_at_ ABSL_GUARDED_BY(mu_) = -1;
  std::function<void()> hook_ ABSL_GUARDED_BY(mu_);
};

constexpr int kChunk = 32;  // engine token budget per step: prompts span chunks

// The sender: engine (block 16, steps of kChunk tokens) + service + server.
struct Sender {
  explicit Sender(bool stream, int num_blocks = 0, int max_prefill_chunk = 0,
                  absl::Duration default_deadline = absl::Seconds(60),
                  bool write_after_held_prefix = true) {
    backend = engine::testing::MakeBackend("cpu");
    engine::EngineOptions o;
    o.block_size = 16;
    o.num_slots = 2;
    o.max_context_tokens = 512;
    o.max_tokens_per_step = kChunk;
    o.num_blocks = num_blocks;
    if (max_prefill_chunk > 0) {
      o.max_prefill_chunk = max_prefill_chunk;
      o.max_tokens_per_step = 4 * max_prefill_chunk;
    }
    auto e = engine::Engine::Create(&TinyWeights(), backend.get(), nullptr, o);
    cache = &(*e)->cache();
    loop = std::make_unique<worker::EngineLoop>(std::move(*e));
    PrefillServiceOptions po;
    po.stream_layers = stream;
    po.default_deadline = default_deadline;
    po.write_after_held_prefix = write_after_held_prefix;
    service = *PrefillService::Create(loop.get(), cache, &agent, &metrics, po);
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(service.get());
    server = b.BuildAndStart();
    stub = tandem::v1::PrefillWorker::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  }
  ~Sender() {
    server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    loop.reset();
  }
  // Free blocks and slots back at their totals (aborts are asynchronous).
  bool Idle() {
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (absl::Now() < end) {
      const worker::EngineLoopStats s = loop->stats();
      if (s.free_blocks == s.total_blocks && s.free_slots == s.total_slots &&
          s.running == 0 && s.waiting == 0) {
        return true;
      }
      absl::SleepFor(absl::Milliseconds(2));
    }
    return false;
  }
  std::unique_ptr<kernels::Backend> backend;
  engine::KvCache* cache = nullptr;
  kvtransfer::LoopbackAgent inner;
  CountingAgent agent{&inner};
  metrics::Registry registry;
  worker::WorkerMetrics metrics{&registry};
  std::unique_ptr<worker::EngineLoop> loop;
  std::unique_ptr<PrefillService> service;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<tandem::v1::PrefillWorker::Stub> stub;
};

// The receiver: a landing cache of block size 8 registered with its agent.
struct Receiver {
  Receiver() {
    engine::KvCacheOptions lo;
    lo.block_size = 8;
    lo.num_blocks = 80;
    lo.num_slots = 3;
    landing = *engine::KvCache::Create(TinyWeights().config, lo);
    regions = *worker::RegisterCache(&agent, landing.get());
  }
  // A target for n tokens: scattered blocks (descending), slot 2.
  tandem::v1::RankTarget Target(int64_t n) {
    tandem::v1::RankTarget t;
    block_ids.clear();
    for (int64_t b = 0; b < (n + 7) / 8; ++b) {
      block_ids.push_back(static_cast<int32_t>(landing->num_blocks() - 1 - 2 * b));
    }
    kvtransfer::RankLayout side = worker::CacheRankLayout(*landing, regions, {}, 0);
    t.set_transfer_descriptor(*agent.LocalDescriptor(worker::PoolsMetadata(side)));
    t.set_transfer_address("loopback");
    for (int32_t b : block_ids) t.add_block_ids(b);
    t.set_state_slot(2);
    *t.mutable_layout() = worker::KvLayoutOf(*landing);
    return t;
  }
  // The receiver's checksums over what landed.
  tandem::v1::StateChecksums Landed(int64_t n) {
    const kvtransfer::RankLayout side =
        worker::CacheRankLayout(*landing, regions, block_ids, 2);
    return *kvtransfer::ComputeChecksums(
        side, n, worker::CacheRegionBytes(landing.get(), regions));
  }
  std::unique_ptr<engine::KvCache> landing;
  kvtransfer::LoopbackAgent agent;
  worker::CacheRegions regions;
  std::vector<int32_t> block_ids;
};

tandem::v1::PrefillRequest MakeRequest(const std::string& id, int n, Receiver& r,
                                       uint64_t seed = 11) {
  tandem::v1::PrefillRequest req;
  req.set_request_id(id);
  for (int32_t t : engine::testing::MakePrompt(n, seed)) req.add_prompt_token_ids(t);
  req.mutable_sampling()->set_temperature(0);
  *req.mutable_target()->add_ranks() = r.Target(n);
  req.mutable_target()->set_request_id(id);
  req.set_checksums(true);
  return req;
}

grpc::Status Call(Sender& s, const tandem::v1::PrefillRequest& req,
                  tandem::v1::PrefillResponse* resp, int timeout_s = 60) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(timeout_s)));
  return s.stub->Prefill(&ctx, req, resp);
}

int NumLayers() { return static_cast<int>(TinyWeights().layers.size()); }
int NumKda() { return TinyWeights().config.NumKdaLayers(); }

TEST(PrefillServiceTest, StreamedMultiChunkStateArrivesBitExact) {
  const int n = 150;  // 5 chunks of <= 32 tokens; 150 % 8 and % 16 != 0
  const int chunks = (n + kChunk - 1) / kChunk;
  Sender sender(/*stream=*/true);
  Receiver receiver;
  tandem::v1::PrefillResponse resp;
  grpc::Status st = Call(sender, MakeRequest("r1", n, receiver), &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_GT(NumKda(), 0);
  ASSERT_GT(NumLayers() - NumKda(), 0);
  // One batch per MLA layer and chunk, one per KDA layer (its last chunk).
  EXPECT_EQ(sender.agent.posted(), (NumLayers() - NumKda()) * chunks + NumKda());
  EXPECT_EQ(sender.agent.ended(), sender.agent.posted());
  EXPECT_EQ(resp.transfer().status(), tandem::v1::TRANSFER_STATUS_OK);
  // Exactly the whole-state bytes.
  const tandem::v1::KvLayout l = worker::KvLayoutOf(*receiver.landing);
  EXPECT_EQ(resp.transfer().bytes(),
            static_cast<int64_t>(l.num_mla_layers()) * n * l.mla_token_bytes() +
                l.num_kda_layers() * (l.kda_state_bytes() + l.kda_conv_bytes()));
  // Bit-exact: the receiver's checksums over its landing cache.
  ASSERT_EQ(resp.checksums().mla_layer_size(), l.num_mla_layers());
  EXPECT_TRUE(kvtransfer::Verify(resp.checksums(), receiver.Landed(n)).ok());
  // The notification came after the bytes.
  auto notes = receiver.agent.PollNotifications();
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0].request_id, "r1");
  EXPECT_EQ(sender.metrics.exposed_transfer_seconds->Count(), 1u);
  EXPECT_TRUE(sender.Idle());

  // Streaming off lands the same state (same prompt, fresh receiver).
  Sender whole(/*stream=*/false);
  Receiver receiver2;
  tandem::v1::PrefillResponse resp2;
  st = Call(whole, MakeRequest("r2", n, receiver2), &resp2);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(whole.agent.posted(), 1);
  EXPECT_EQ(resp2.first_token_id(), resp.first_token_id());
  EXPECT_EQ(resp2.checksums().total(), resp.checksums().total());
  EXPECT_EQ(receiver2.Landed(n).total(), receiver.Landed(n).total());
}

TEST(PrefillServiceTest, BatchFailingWhileStreamingFailsTheRequestAndLeaksNothing) {
  Sender sender(/*stream=*/true);
  Receiver receiver;
  // The receiver dies just before the 5th batch (chunk 1 of the first layers).
  sender.agent.BeforePost(5, [&] { receiver.agent.Kill(); });
  tandem::v1::PrefillResponse resp;
  grpc::Status st = Call(sender, MakeRequest("r1", 120, receiver), &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  EXPECT_NE(st.error_message().find("r1"), std::string::npos) << st.error_message();
  // Every batch posted had ended before the answer (so before the blocks went).
  EXPECT_GE(sender.agent.posted(), 4);
  EXPECT_EQ(sender.agent.ended(), sender.agent.posted());
  EXPECT_TRUE(sender.Idle());
  EXPECT_EQ(sender.metrics.transfers->Add({{"outcome", "error"}}).Value(), 1);
  // The worker serves the next request (to a live receiver).
  Receiver other;
  st = Call(sender, MakeRequest("r2", 40, other), &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_TRUE(kvtransfer::Verify(resp.checksums(), other.Landed(40)).ok());
  EXPECT_TRUE(sender.Idle());
}

TEST(PrefillServiceTest, StalledReceiverEndsAtTheDeadlineWithEveryBatchEnded) {
  Sender sender(/*stream=*/true);
  Receiver receiver;
  receiver.agent.SetPaused(true);
  tandem::v1::PrefillRequest req = MakeRequest("r1", 100, receiver);
  req.set_deadline_unix_ms(absl::ToUnixMillis(absl::Now() + absl::Seconds(2)));
  tandem::v1::PrefillResponse resp;
  grpc::Status st = Call(sender, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
  EXPECT_GT(sender.agent.posted(), 0);
  EXPECT_EQ(sender.agent.ended(), sender.agent.posted());
  EXPECT_TRUE(sender.Idle());
  EXPECT_TRUE(receiver.agent.PollNotifications().empty());
}

// The service's default deadline is for calls that carry none, not a cap: a
// prefill may take longer (minutes for a 64k-token prompt on a CPU).
TEST(PrefillServiceTest, DefaultDeadlineOnlyForCallsWithoutOne) {
  Sender sender(/*stream=*/true, 0, 0, /*default_deadline=*/absl::Milliseconds(1));
  Receiver receiver;
  tandem::v1::PrefillResponse resp;
  // The call's own deadline (60 s) governs, far past the 1 ms default.
  grpc::Status st = Call(sender, MakeRequest("r1", 100, receiver), &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_TRUE(sender.Idle());
  // Without any deadline the default applies.
  Receiver stalled;
  stalled.agent.SetPaused(true);
  grpc::ClientContext ctx;  // no deadline
  st = sender.stub->Prefill(&ctx, MakeRequest("r2", 100, stalled), &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
  EXPECT_TRUE(sender.Idle());
}

TEST(PrefillServiceTest, CancelWhileStreamingEndsEveryBatch) {
  Sender sender(/*stream=*/true);
  Receiver receiver;
  receiver.agent.SetPaused(true);  // batches stay in flight
  tandem::v1::PrefillResponse resp;
  grpc::Status st;
  std::thread call([&] { st = Call(sender, MakeRequest("r1", 100, receiver), &resp); });
  ASSERT_TRUE(sender.agent.AwaitPosted(3, absl::Seconds(30)));
  tandem::v1::CancelRequest cancel;
  cancel.set_request_id("r1");
  tandem::v1::CancelResponse cancelled;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  ASSERT_TRUE(sender.stub->Cancel(&ctx, cancel, &cancelled).ok());
  call.join();
  // Cancel may land before or after the prefill's first token: either way the
  // request ends CANCELLED (a long way before its 60 s deadline).
  EXPECT_EQ(st.error_code(), grpc::StatusCode::CANCELLED) << st.error_message();
  EXPECT_EQ(sender.agent.ended(), sender.agent.posted());
  EXPECT_TRUE(sender.Idle());
  EXPECT_TRUE(receiver.agent.PollNotifications().empty());
}

// Two prompts of 300 tokens (19 blocks each) in a 28-block pool, prefilled side
// by side in chunks of 64: at the 4th chunk the newer one finds no free block
// and is preempted, then recomputed from position 0 once the older one is done.
// Its SendSession stops streaming at the recompute (RESTARTED), and the whole
// state is sent after its prefill (once the earlier batches ended): both land
// bit-exact.
TEST(PrefillServiceTest, PreemptedPrefillRestartsTheTransferWhole) {
  Sender sender(/*stream=*/true, /*num_blocks=*/28, /*max_prefill_chunk=*/64);
  Receiver ra, rb;
  // Hold the engine until both requests have arrived, so both run together.
  sender.loop->Post([&](engine::Engine&) {
    EXPECT_TRUE(sender.agent.AwaitConnects(2, absl::Seconds(30)));
  });
  tandem::v1::PrefillResponse resp_a, resp_b;
  grpc::Status st_a, st_b;
  std::thread a([&] { st_a = Call(sender, MakeRequest("a", 300, ra, 21), &resp_a); });
  std::thread b([&] { st_b = Call(sender, MakeRequest("b", 300, rb, 22), &resp_b); });
  a.join();
  b.join();
  ASSERT_TRUE(st_a.ok()) << st_a.error_message();
  ASSERT_TRUE(st_b.ok()) << st_b.error_message();
  EXPECT_EQ(sender.metrics.transfer_restarts->Value(), 1);
  EXPECT_TRUE(kvtransfer::Verify(resp_a.checksums(), ra.Landed(300)).ok());
  EXPECT_TRUE(kvtransfer::Verify(resp_b.checksums(), rb.Landed(300)).ok());
  EXPECT_EQ(sender.agent.ended(), sender.agent.posted());
  EXPECT_TRUE(sender.Idle());
}

// A worker that does not write after held rows (it did not register
// writes_after_held_prefix) refuses a target whose leading rows the decode
// worker shares, before computing or writing anything: writing every row from
// 0 would overwrite blocks other sequences use. A target without held rows it
// serves as before; this build's default writes only the rows after them.
TEST(PrefillServiceTest, ATargetWithHeldRowsIsRefusedByAWorkerThatWouldWriteThem) {
  Sender sender(/*stream=*/true, 0, 0, absl::Seconds(60),
                /*write_after_held_prefix=*/false);
  Receiver receiver;
  tandem::v1::PrefillRequest req = MakeRequest("held", 100, receiver);
  req.mutable_target()->set_cached_prefix_tokens(64);
  tandem::v1::PrefillResponse resp;
  grpc::Status st = Call(sender, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << st.error_message();
  EXPECT_NE(st.error_message().find("writes_after_held_prefix"), std::string::npos)
      << st.error_message();
  EXPECT_EQ(sender.agent.posted(), 0);
  EXPECT_TRUE(receiver.agent.PollNotifications().empty());
  EXPECT_TRUE(sender.Idle());
  // Nothing held: served.
  st = Call(sender, MakeRequest("plain", 100, receiver), &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_TRUE(kvtransfer::Verify(resp.checksums(), receiver.Landed(100)).ok());
  // The default worker takes the held target and writes after the held rows.
  Sender writer(/*stream=*/true);
  Receiver r2;
  tandem::v1::PrefillRequest req2 = MakeRequest("held", 100, r2);
  req2.mutable_target()->set_cached_prefix_tokens(64);
  tandem::v1::PrefillResponse resp2;
  st = Call(writer, req2, &resp2);
  ASSERT_TRUE(st.ok()) << st.error_message();
  const tandem::v1::KvLayout l = worker::KvLayoutOf(*r2.landing);
  EXPECT_EQ(
      resp2.transfer().bytes(),
      static_cast<int64_t>(l.num_mla_layers()) * (100 - 64) * l.mla_token_bytes() +
          l.num_kda_layers() * (l.kda_state_bytes() + l.kda_conv_bytes()));
}

}  // namespace
}  // namespace tandem::prefill
