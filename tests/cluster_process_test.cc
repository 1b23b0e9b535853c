// End to end with real processes on localhost: router_main + prefill_main +
// decode_main (UCX between the workers), checked through the router's gRPC API:
//   - disaggregated output == colocated output (DecodeWorker.Generate)
//   - SIGKILL of the prefill worker while it holds a request: the router
//     releases the reservation and serves the request elsewhere (here: colocated
//     on the decode worker, the only worker left)
//   - SIGKILL of the decode worker mid-stream: the client gets UNAVAILABLE
//     naming the worker, well within its deadline
//   - multi-chunk prompts (several engine steps each) streamed layer by layer:
//     the decode worker verifies the state's checksums (DATA_LOSS otherwise) and
//     the tokens equal the colocated ones; one batch per layer and chunk
//   - the same with --kv_stream_layers=false (one whole-state batch per request)
//   - over shared memory (--ucx_peer_failure_detection=false, ./tandem up's
//     default): the same tokens, the connection counted under its shared-memory
//     transports on /metrics; the decode worker killed while the prefill worker
//     streams a prompt's state to it: the client gets a clear error within its
//     deadline, and the prefill worker releases every block and keeps serving
//   - --kv_require_rdma=true over UCX's tcp (peer-failure detection on one host):
//     the connection is refused, the client gets FAILED_PRECONDITION naming the
//     lanes, no KV moves, nothing stays reserved
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "metrics/http_get.h"
#include "metrics/text_parse.h"
#include "proto/router.grpc.pb.h"
#include "proto/worker.grpc.pb.h"
#include "tests/testing/subprocess.h"

namespace tandem {
namespace {

// The port a child logged in its "<msg>" line (JSON logs), polled with a bound:
// every process listens on port 0, so no port is ever raced for.
int LoggedPort(const testing::Subprocess& proc, const std::string& msg,
               const std::string& field, absl::Duration timeout = absl::Seconds(30)) {
  const std::regex re("\"msg\":\"" + msg + "\".*\"" + field + "\":([0-9]+)");
  const absl::Time end = absl::Now() + timeout;
  while (absl::Now() < end) {
    std::smatch m;
    const std::string log = proc.ReadLog();
    if (std::regex_search(log, m, re)) return std::stoi(m[1]);
    absl::SleepFor(absl::Milliseconds(10));
  }
  return 0;
}

std::chrono::system_clock::time_point In(int seconds) {
  return std::chrono::system_clock::now() + std::chrono::seconds(seconds);
}

constexpr char kModel[] = "engine/model/tiny_checkpoint";

absl::StatusOr<double> Metric(int port, const std::string& name,
                              const std::map<std::string, std::string>& labels) {
  auto get = metrics::HttpGet("127.0.0.1", port, "/metrics", absl::Seconds(5));
  if (!get.ok()) return get.status();
  auto parsed = metrics::ParseText(get->body);
  if (!parsed.ok()) return parsed.status();
  return parsed->Value(name, labels);
}

// Polls until the metric reaches `want` (bounded).
bool WaitMetric(int port, const std::string& name,
                const std::map<std::string, std::string>& labels, double want,
                absl::Duration timeout = absl::Seconds(30)) {
  const absl::Time end = absl::Now() + timeout;
  while (absl::Now() < end) {
    auto v = Metric(port, name, labels);
    if (v.ok() && *v == want) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

struct Result {
  std::vector<int32_t> tokens;
  grpc::Status status;
  int messages = 0;
};

Result Drain(grpc::ClientReaderInterface<tandem::v1::GenerateResponse>* reader,
             std::function<void(int)> after_message = nullptr) {
  Result r;
  tandem::v1::GenerateResponse m;
  while (reader->Read(&m)) {
    ++r.messages;
    r.tokens.insert(r.tokens.end(), m.token_ids().begin(), m.token_ids().end());
    if (after_message) after_message(r.messages);
  }
  r.status = reader->Finish();
  return r;
}

class ClusterProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = std::getenv("TEST_TMPDIR");
    auto router = testing::Subprocess::Start(
        {testing::RunfilePath("router/router_main"), std::string("--model=") + kModel,
         "--port=" + std::to_string(router_port_),
         "--metrics_port=" + std::to_string(router_metrics_),
         "--heartbeat_interval_s=0.2", "--heartbeat_timeout_s=30",
         // Disaggregated: the prompts are shorter than the router's default
         // --colocate_below_tokens (1000), and the hand-off is what is tested.
         "--colocate_below_tokens=0", "--log_format=json"},
        tmp_ + "/router.log");
    ASSERT_TRUE(router.ok()) << router.status();
    router_ = std::make_unique<testing::Subprocess>(std::move(*router));
    router_port_ = LoggedPort(*router_, "router serving", "grpc_port");
    router_metrics_ = LoggedPort(*router_, "router serving", "metrics_port");
    ASSERT_GT(router_port_, 0) << router_->ReadLog();
    auto decode = StartWorker("decode");
    ASSERT_TRUE(decode.ok()) << decode.status();
    decode_ = std::make_unique<testing::Subprocess>(std::move(*decode));
    auto prefill = StartWorker("prefill");
    ASSERT_TRUE(prefill.ok()) << prefill.status();
    prefill_ = std::make_unique<testing::Subprocess>(std::move(*prefill));
    decode_port_ = LoggedPort(*decode_, "worker serving", "grpc_port");
    decode_metrics_ = LoggedPort(*decode_, "worker serving", "metrics_port");
    prefill_metrics_ = LoggedPort(*prefill_, "worker serving", "metrics_port");
    ASSERT_GT(decode_port_, 0) << Logs();
    ASSERT_GT(prefill_metrics_, 0) << Logs();
    for (const char* role : {"prefill", "decode"}) {
      ASSERT_TRUE(
          WaitMetric(router_metrics_, "tandem_router_workers", {{"role", role}}, 1))
          << role << " did not register\n"
          << router_->ReadLog() << prefill_->ReadLog() << decode_->ReadLog();
    }
    auto ch = grpc::CreateChannel("127.0.0.1:" + std::to_string(router_port_),
                                  grpc::InsecureChannelCredentials());
    router_stub_ = tandem::v1::Router::NewStub(ch);
    decode_stub_ = tandem::v1::DecodeWorker::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(decode_port_),
                            grpc::InsecureChannelCredentials()));
  }

  absl::StatusOr<testing::Subprocess> StartWorker(const std::string& role) {
    std::vector<std::string> argv = {
        testing::RunfilePath(role + "/" + role + "_main"),
        std::string("--model=") + kModel,
        "--worker_id=" + role + "-0",
        "--router=127.0.0.1:" + std::to_string(router_port_),
        "--port=0",
        "--metrics_port=0",
        "--max_num_seqs=4",
        "--max_model_len=1024",
        "--kv_cache_memory=64MiB",
        "--log_format=json"};
    if (role == "prefill") {
      argv.insert(argv.end(), prefill_flags_.begin(), prefill_flags_.end());
    }
    argv.insert(argv.end(), worker_flags_.begin(), worker_flags_.end());
    return testing::Subprocess::Start(argv, tmp_ + "/" + role + ".log");
  }

  // Multi-chunk prompts (300..700 tokens; the prefill worker's step budget is
  // 256 tokens) through the router: each equals the colocated run, and the
  // decode worker verified the state's checksums (the router asks for them).
  void ExpectMultiChunkPromptsMatchColocated(int count) {
    for (int i = 0; i < count; ++i) {
      tandem::v1::GenerateRequest req = Request(300 + i * 200, 80 + i, 4, 0.0f);
      grpc::ClientContext ctx;
      ctx.set_deadline(In(120));
      Result disagg = Drain(router_stub_->Generate(&ctx, req).get());
      ASSERT_TRUE(disagg.status.ok()) << disagg.status.error_message() << Logs();
      Result colocated = Colocated(req);
      ASSERT_TRUE(colocated.status.ok()) << colocated.status.error_message();
      EXPECT_EQ(disagg.tokens, colocated.tokens) << "prompt " << i;
      EXPECT_EQ(disagg.tokens.size(), 4u);
    }
    EXPECT_EQ(*Metric(router_metrics_, "tandem_router_paths_total",
                      {{"path", "disaggregated"}}),
              count);
    EXPECT_EQ(
        *Metric(prefill_metrics_, "tandem_worker_transfers_total", {{"outcome", "ok"}}),
        count);
    EXPECT_TRUE(WaitMetric(decode_metrics_, "tandem_worker_reservations", {}, 0));
    EXPECT_TRUE(WaitMetric(prefill_metrics_, "tandem_worker_kv_cache_blocks",
                           {{"state", "used"}}, 0));
  }

  std::string Logs() {
    return "--- router\n" + router_->ReadLog() + "--- prefill\n" + prefill_->ReadLog() +
           "--- decode\n" + decode_->ReadLog();
  }

  static tandem::v1::GenerateRequest Request(int len, uint64_t seed, int max_tokens,
                                             float temperature) {
    tandem::v1::GenerateRequest req;
    for (int i = 0; i < len; ++i) {
      req.mutable_prompt_token_ids()->add_ids(
          static_cast<int32_t>((seed * 7919 + i * 104729) % 100000));
    }
    req.mutable_stop()->set_max_tokens(max_tokens);
    req.mutable_sampling()->set_temperature(temperature);
    if (temperature > 0) req.mutable_sampling()->set_seed(seed);
    return req;
  }

  Result Colocated(const tandem::v1::GenerateRequest& req) {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(60));
    return Drain(decode_stub_->Generate(&ctx, req).get());
  }
  // `n` prompts (lengths 3, 16, 29, ...; seeds from `seed`; every other one
  // sampled at 0.7 when `sample_odd`) through the router's hand-off equal the
  // same requests colocated on the decode worker.
  void ExpectHandOffEqualsColocated(int n, uint64_t seed, bool sample_odd) {
    for (int i = 0; i < n; ++i) {
      tandem::v1::GenerateRequest req =
          Request(3 + i * 13, seed + i, 6, sample_odd && i % 2 ? 0.7f : 0.0f);
      grpc::ClientContext ctx;
      ctx.set_deadline(In(60));
      Result disagg = Drain(router_stub_->Generate(&ctx, req).get());
      ASSERT_TRUE(disagg.status.ok()) << disagg.status.error_message() << Logs();
      Result colocated = Colocated(req);
      ASSERT_TRUE(colocated.status.ok()) << colocated.status.error_message();
      EXPECT_EQ(disagg.tokens, colocated.tokens) << "prompt " << i;
    }
  }

  std::vector<std::string> prefill_flags_;  // extra prefill_main flags
  std::vector<std::string> worker_flags_;   // extra flags of both workers
  std::string tmp_;
  int router_port_ = 0, router_metrics_ = 0, decode_port_ = 0, decode_metrics_ = 0,
      prefill_metrics_ = 0;
  std::unique_ptr<testing::Subprocess> router_, prefill_, decode_;
  std::unique_ptr<tandem::v1::Router::Stub> router_stub_;
  std::unique_ptr<tandem::v1::DecodeWorker::Stub> decode_stub_;
};

TEST_F(ClusterProcessTest, DisaggregatedEqualsColocatedOverUcx) {
  ExpectHandOffEqualsColocated(8, 50, /*sample_odd=*/true);
  if (HasFatalFailure()) return;
  EXPECT_EQ(*Metric(router_metrics_, "tandem_router_paths_total",
                    {{"path", "disaggregated"}}),
            8);
  EXPECT_EQ(*Metric(decode_metrics_, "tandem_worker_requests_total",
                    {{"rpc", "Decode"}, {"outcome", "ok"}}),
            8);
  EXPECT_GT(*Metric(prefill_metrics_, "tandem_worker_transfer_bytes_total", {}), 0);
  // With peer-failure detection on (the workers' default) UCX 1.13 carries the
  // KV over tcp on one host: the prefill worker's one connection says so.
  EXPECT_EQ(Metric(prefill_metrics_, "tandem_worker_kv_peer_connections_total",
                   {{"agent", "ucx"}, {"transports", "tcp"}, {"tcp_only", "true"}})
                .value_or(-1),
            1);
  // Allowed (--kv_require_rdma=auto on a host without RDMA): none refused.
  EXPECT_EQ(Metric(prefill_metrics_, "tandem_worker_kv_peer_refused_total",
                   {{"agent", "ucx"}, {"transports", "tcp"}})
                .value_or(-1),
            0);
  // Every reservation and engine block is free again.
  EXPECT_TRUE(WaitMetric(decode_metrics_, "tandem_worker_reservations", {}, 0));
  EXPECT_TRUE(WaitMetric(decode_metrics_, "tandem_worker_kv_cache_blocks",
                         {{"state", "used"}}, 0));
}

TEST_F(ClusterProcessTest, KilledPrefillWorkerIsRetriedElsewhere) {
  // Freeze the prefill worker so that it holds the request, then kill it once
  // the decode worker has reserved for it.
  prefill_->Signal(SIGSTOP);
  tandem::v1::GenerateRequest req = Request(40, 9, 5, 0.0f);
  auto call = std::async(std::launch::async, [&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(60));
    return Drain(router_stub_->Generate(&ctx, req).get());
  });
  ASSERT_TRUE(WaitMetric(decode_metrics_, "tandem_worker_reservations", {}, 1))
      << Logs();
  prefill_->Signal(SIGKILL);
  Result r = call.get();
  ASSERT_TRUE(r.status.ok()) << r.status.error_message() << Logs();
  EXPECT_EQ(r.tokens, Colocated(req).tokens);
  EXPECT_EQ(*Metric(router_metrics_, "tandem_router_retries_total",
                    {{"reason", "prefill_unavailable"}}),
            1);
  EXPECT_TRUE(WaitMetric(decode_metrics_, "tandem_worker_reservations", {}, 0));
}

TEST_F(ClusterProcessTest, KilledDecodeWorkerIsAClearStatusWithinTheDeadline) {
  tandem::v1::GenerateRequest req = Request(20, 3, 100000, 0.0f);
  req.mutable_stop()->set_max_tokens(900);
  req.mutable_stop()->set_ignore_eos(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(30));
  const absl::Time start = absl::Now();
  Result r = Drain(router_stub_->Generate(&ctx, req).get(), [&](int n) {
    if (n == 3) decode_->Signal(SIGKILL);
  });
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << r.status.error_message();
  EXPECT_NE(r.status.error_message().find("decode-0"), std::string::npos)
      << r.status.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  EXPECT_GE(r.messages, 3);
  EXPECT_LT(r.tokens.size(), 900u);
}

TEST_F(ClusterProcessTest, MultiChunkPromptsStreamLayerByLayerBitExactOverUcx) {
  ExpectMultiChunkPromptsMatchColocated(3);
  // Streamed: one batch per layer and chunk (the tiny model has several layers
  // and these prompts 2..3 chunks), far more than one per request.
  EXPECT_GT(*Metric(prefill_metrics_, "tandem_worker_transfer_batches_total", {}),
            3 * 4);
  EXPECT_EQ(*Metric(prefill_metrics_, "tandem_worker_transfer_restarts_total", {}), 0);
}

// The same cluster with layer streaming off on the prefill worker.
class ClusterProcessWholeTransferTest : public ClusterProcessTest {
 protected:
  ClusterProcessWholeTransferTest() { prefill_flags_ = {"--kv_stream_layers=false"}; }
};

TEST_F(ClusterProcessWholeTransferTest, DisaggregatedEqualsColocatedWithStreamingOff) {
  ExpectMultiChunkPromptsMatchColocated(3);
  // One whole-state batch per request.
  EXPECT_EQ(*Metric(prefill_metrics_, "tandem_worker_transfer_batches_total", {}), 3);
}

// The same hand-off over the libfabric agent (tcp provider, issue 19): set in
// the constructor, so both workers start with it.
class ClusterProcessLibfabricTest : public ClusterProcessTest {
 protected:
  ClusterProcessLibfabricTest() { worker_flags_ = {"--kv_transport=libfabric:tcp"}; }
};

TEST_F(ClusterProcessLibfabricTest, DisaggregatedEqualsColocatedOverLibfabricTcp) {
  ExpectHandOffEqualsColocated(4, 70, /*sample_odd=*/false);
  if (HasFatalFailure()) return;
  EXPECT_EQ(*Metric(router_metrics_, "tandem_router_paths_total",
                    {{"path", "disaggregated"}}),
            4);
  EXPECT_GT(*Metric(prefill_metrics_, "tandem_worker_transfer_bytes_total", {}), 0);
  // Both workers said which agent carries the KV.
  EXPECT_NE(prefill_->ReadLog().find("libfabric/tcp;ofi_rxm"), std::string::npos)
      << Logs();
  EXPECT_NE(decode_->ReadLog().find("libfabric/tcp;ofi_rxm"), std::string::npos)
      << Logs();
  // ... and export it as a metric label: the provider actually opened.
  for (int port : {prefill_metrics_, decode_metrics_}) {
    EXPECT_EQ(
        Metric(port, "tandem_worker_kv_transport_info",
               {{"agent", "libfabric"}, {"provider", "tcp;ofi_rxm"}, {"rails", "1"}})
            .value_or(-1),
        1)
        << "port " << port;
  }
  EXPECT_TRUE(WaitMetric(decode_metrics_, "tandem_worker_reservations", {}, 0));
}

// Shared memory between the workers (what ./tandem up runs on one host): no
// peer-failure detection, so a dead decode worker is noticed by deadlines, the
// agent's progress timeout and the router, not by UCX.
class ClusterProcessShmTest : public ClusterProcessTest {
 protected:
  ClusterProcessShmTest() {
    // Hyphenated as operators type it; a shorter progress timeout than the
    // default (the flag reaches the real binaries; --kv_require_rdma=true passes
    // shared memory).
    worker_flags_ = {"--ucx_peer_failure_detection=false", "--kv-progress-timeout=3s",
                     "--kv-require-rdma=true"};
  }
};

TEST_F(ClusterProcessShmTest, DisaggregatedEqualsColocatedOverSharedMemory) {
  ExpectHandOffEqualsColocated(4, 90, /*sample_odd=*/true);
  if (HasFatalFailure()) return;
  EXPECT_EQ(*Metric(router_metrics_, "tandem_router_paths_total",
                    {{"path", "disaggregated"}}),
            4);
  // One connection, counted under the shared-memory transports UCX chose for it
  // ("sysv,posix,cma" here), none over TCP.
  auto get =
      metrics::HttpGet("127.0.0.1", prefill_metrics_, "/metrics", absl::Seconds(5));
  ASSERT_TRUE(get.ok()) << get.status();
  EXPECT_TRUE(std::regex_search(
      get->body,
      std::regex("tandem_worker_kv_peer_connections_total\\{agent=\"ucx\","
                 "transports=\"[^\"]*(sysv|posix)[^\"]*\",tcp_only=\"false\"\\} 1\n")))
      << get->body;
  EXPECT_EQ(Metric(prefill_metrics_, "tandem_worker_kv_peer_connections_total",
                   {{"agent", "ucx"}, {"transports", "tcp"}, {"tcp_only", "true"}})
                .value_or(-1),
            0)
      << get->body;
  EXPECT_TRUE(WaitMetric(decode_metrics_, "tandem_worker_reservations", {}, 0));
}

TEST_F(ClusterProcessShmTest,
       KilledDecodeWorkerMidTransferIsAClearStatusWithinTheDeadline) {
  // A prompt of 4 prefill chunks, streamed layer by layer: the decode worker is
  // killed once the first batches are posted.
  tandem::v1::GenerateRequest req = Request(1000, 5, 4, 0.0f);
  const absl::Time start = absl::Now();
  auto call = std::async(std::launch::async, [&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(60));
    return Drain(router_stub_->Generate(&ctx, req).get());
  });
  bool posted = false;
  for (const absl::Time end = absl::Now() + absl::Seconds(30); absl::Now() < end;) {
    auto v = Metric(prefill_metrics_, "tandem_worker_transfer_batches_total", {});
    if (v.ok() && *v > 0) {
      posted = true;
      break;
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
  decode_->Signal(SIGKILL);
  ASSERT_TRUE(posted) << Logs();
  Result r = call.get();
  const absl::Duration took = absl::Now() - start;
  std::cerr << "status " << r.status.error_code() << " " << r.status.error_message()
            << " after " << took << "\n";
  EXPECT_FALSE(r.status.ok()) << Logs();
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << r.status.error_message();
  EXPECT_LT(took, absl::Seconds(30));
  // The prefill worker ended the transfer (landed in the dead worker's shared
  // memory, or failed), released every block, and is alive.
  EXPECT_TRUE(WaitMetric(prefill_metrics_, "tandem_worker_kv_cache_blocks",
                         {{"state", "used"}}, 0))
      << Logs();
  const double ok =
      Metric(prefill_metrics_, "tandem_worker_transfers_total", {{"outcome", "ok"}})
          .value_or(-1);
  const double failed =
      Metric(prefill_metrics_, "tandem_worker_transfers_total", {{"outcome", "error"}})
          .value_or(-1);
  std::cerr << "prefill transfers ok " << ok << " error " << failed << "\n";
  EXPECT_EQ(ok + failed, 1) << Logs();
  // The dead peer did not take the prefill worker down with it (UCX without
  // peer-failure detection may treat a transport error as fatal).
  EXPECT_FALSE(prefill_->Wait(absl::Milliseconds(200)).ok()) << Logs();
}

// --kv_require_rdma=true with the workers' default peer-failure detection: on
// one host UCX 1.13 then connects over tcp only, the fallback the flag refuses
// (issue 19 item 3). The request fails with the refusal's status (naming the
// peer's lanes), never moves KV over TCP, and the connection is still counted.
class ClusterProcessRequireRdmaTest : public ClusterProcessTest {
 protected:
  ClusterProcessRequireRdmaTest() { worker_flags_ = {"--kv_require_rdma=true"}; }
};

TEST_F(ClusterProcessRequireRdmaTest, TcpOnlyPeerIsRefused) {
  for (int attempt = 0; attempt < 2; ++attempt) {  // a refused peer is not kept
    tandem::v1::GenerateRequest req = Request(40, 9 + attempt, 5, 0.0f);
    grpc::ClientContext ctx;
    ctx.set_deadline(In(60));
    Result r = Drain(router_stub_->Generate(&ctx, req).get());
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
        << r.status.error_message() << Logs();
    for (const char* want : {"TCP only", "lanes tcp/", "--kv_require_rdma=true",
                             "--kv_require_rdma=false"}) {
      EXPECT_NE(r.status.error_message().find(want), std::string::npos)
          << want << ": " << r.status.error_message();
    }
    EXPECT_TRUE(r.tokens.empty());
  }
  // Each attempt connected (and was counted) over tcp, was refused (counted
  // again, for the alert), and none moved KV.
  EXPECT_EQ(Metric(prefill_metrics_, "tandem_worker_kv_peer_connections_total",
                   {{"agent", "ucx"}, {"transports", "tcp"}, {"tcp_only", "true"}})
                .value_or(-1),
            2);
  EXPECT_EQ(Metric(prefill_metrics_, "tandem_worker_kv_peer_refused_total",
                   {{"agent", "ucx"}, {"transports", "tcp"}})
                .value_or(-1),
            2);
  EXPECT_EQ(
      Metric(prefill_metrics_, "tandem_worker_transfer_bytes_total", {}).value_or(-1),
      0);
  EXPECT_EQ(*Metric(router_metrics_, "tandem_router_paths_total",
                    {{"path", "disaggregated"}}),
            0);
  // Nothing left reserved or held.
  EXPECT_TRUE(WaitMetric(decode_metrics_, "tandem_worker_reservations", {}, 0));
  EXPECT_TRUE(WaitMetric(prefill_metrics_, "tandem_worker_kv_cache_blocks",
                         {{"state", "used"}}, 0));
}

}  // namespace
}  // namespace tandem
