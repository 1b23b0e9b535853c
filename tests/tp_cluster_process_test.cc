// Tensor parallelism across real processes (router_main, prefill_main and
// decode_main on localhost, UCX between the workers, tiny checkpoint):
//   - prefill TP 2 -> decode TP 2 gives the greedy tokens of a colocated TP 1
//     run, for short prompts and one of several prefill chunks (so the state is
//     streamed layer by layer, rank r -> rank r); the decode worker verified
//     every rank's checksums (the router asks for them; DATA_LOSS otherwise);
//     the same with the whole-state transfer (--kv_stream_layers=false)
//   - a TP 1 prefill worker next to a TP 2 decode worker is refused at
//     registration with both sizes named, and exits non-zero
//   - the rank-death drill (--tp_fail_rank_at_step) on the decode worker: the
//     client gets UNAVAILABLE naming the rank within its deadline, the worker
//     reports itself unhealthy and refuses work, the router stops routing to it;
//     on the prefill worker: the router drops it and serves the request
//     elsewhere (colocated on the decode worker, the only worker left)
#include <grpcpp/grpcpp.h>
#include <sys/wait.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "proto/router.grpc.pb.h"
#include "proto/worker.grpc.pb.h"
#include "tests/testing/process_cluster.h"
#include "tests/testing/subprocess.h"

namespace tandem {
namespace {

using testing::In;
using testing::LoggedPort;
using testing::MakeRequest;
using testing::Metric;
using testing::ProcessCluster;
using testing::StreamResult;
using testing::WaitMetric;

// A decode worker on its own (no router) at TP 1: the colocated reference.
class Reference {
 public:
  std::string Start() {
    const std::string tmp = std::getenv("TEST_TMPDIR");
    auto p = testing::Subprocess::Start(
        {testing::RunfilePath("decode/decode_main"),
         std::string("--model=") + testing::kTinyModel, "--worker_id=reference",
         "--port=0", "--metrics_port=0", "--max_num_seqs=4", "--max_model_len=512",
         "--kv_cache_memory=64MiB", "--log_format=json"},
        tmp + "/reference.log");
    if (!p.ok()) return std::string(p.status().message());
    proc_ = std::make_unique<testing::Subprocess>(std::move(*p));
    const int port = LoggedPort(*proc_, "worker serving", "grpc_port");
    if (port == 0)
      return "the reference worker did not log its port\n" + proc_->ReadLog();
    stub_ = tandem::v1::DecodeWorker::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
    return "";
  }
  StreamResult Generate(const tandem::v1::GenerateRequest& req) {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(60));
    return testing::Drain(stub_->Generate(&ctx, req).get());
  }

 private:
  std::unique_ptr<testing::Subprocess> proc_;
  std::unique_ptr<tandem::v1::DecodeWorker::Stub> stub_;
};

TEST(TpClusterProcessTest, DisaggregatedTp2EqualsColocatedTp1) {
  Reference ref;
  ASSERT_EQ(ref.Start(), "");
  ProcessCluster cluster;
  // The prefill worker's step budget of 64 tokens splits the 150-token prompt
  // into 3 chunks: its MLA rows are streamed per chunk, per layer, per rank.
  ASSERT_EQ(cluster.Start({}, 4, {"--tp=2", "--max_tokens_per_step=64"}, {"--tp=2"}),
            "");
  const std::vector<int> lengths = {3, 29, 150};
  for (size_t i = 0; i < lengths.size(); ++i) {
    const tandem::v1::GenerateRequest req = MakeRequest(lengths[i], 40 + i, 6, 0.0f);
    StreamResult disagg = cluster.Generate(req);
    ASSERT_TRUE(disagg.status.ok()) << disagg.status.error_message() << cluster.Logs();
    StreamResult colocated = ref.Generate(req);
    ASSERT_TRUE(colocated.status.ok()) << colocated.status.error_message();
    EXPECT_EQ(disagg.tokens.size(), 6u) << "prompt " << i;
    EXPECT_EQ(disagg.tokens, colocated.tokens) << "prompt " << i;
  }
  const double n = static_cast<double>(lengths.size());
  EXPECT_EQ(*Metric(cluster.router_metrics(), "tandem_router_paths_total",
                    {{"path", "disaggregated"}}),
            n);
  EXPECT_EQ(*Metric(cluster.prefill_metrics(), "tandem_worker_transfers_total",
                    {{"outcome", "ok"}}),
            n);
  // Checksums were verified on admission (a mismatch ends the request DATA_LOSS).
  EXPECT_EQ(*Metric(cluster.decode_metrics(), "tandem_worker_requests_total",
                    {{"rpc", "Decode"}, {"outcome", "ok"}}),
            n);
  // Streamed per rank: at least one batch per layer and rank for every request
  // (the tiny model has 4 layers; the long prompt adds more per chunk).
  EXPECT_GE(
      *Metric(cluster.prefill_metrics(), "tandem_worker_transfer_batches_total", {}),
      n * 4 * 2);
  EXPECT_TRUE(
      WaitMetric(cluster.decode_metrics(), "tandem_worker_reservations", {}, 0));
}

TEST(TpClusterProcessTest, WholeStateTransferTp2EqualsColocatedTp1) {
  Reference ref;
  ASSERT_EQ(ref.Start(), "");
  ProcessCluster cluster;
  ASSERT_EQ(
      cluster.Start({}, 4,
                    {"--tp=2", "--max_tokens_per_step=64", "--kv_stream_layers=false"},
                    {"--tp=2"}),
      "");
  const std::vector<int> lengths = {11, 150};
  for (size_t i = 0; i < lengths.size(); ++i) {
    const tandem::v1::GenerateRequest req = MakeRequest(lengths[i], 60 + i, 5, 0.0f);
    StreamResult disagg = cluster.Generate(req);
    ASSERT_TRUE(disagg.status.ok()) << disagg.status.error_message() << cluster.Logs();
    StreamResult colocated = ref.Generate(req);
    ASSERT_TRUE(colocated.status.ok()) << colocated.status.error_message();
    EXPECT_EQ(disagg.tokens, colocated.tokens) << "prompt " << i;
  }
  // One whole-state batch per rank and request.
  EXPECT_EQ(
      *Metric(cluster.prefill_metrics(), "tandem_worker_transfer_batches_total", {}),
      2.0 * lengths.size());
  EXPECT_EQ(*Metric(cluster.decode_metrics(), "tandem_worker_requests_total",
                    {{"rpc", "Decode"}, {"outcome", "ok"}}),
            static_cast<double>(lengths.size()));
}

// The decode worker of the issue: speculative (n-gram) and tensor-parallel (TP 2)
// at once, fed by a TP 2 prefill worker; its greedy tokens equal a plain TP 1
// colocated decode, and its speculative metrics show drafts were verified.
TEST(TpClusterProcessTest, SpeculativeTp2DecodeWorkerEqualsPlainTp1) {
  Reference ref;
  ASSERT_EQ(ref.Start(), "");
  ProcessCluster cluster;
  ASSERT_EQ(
      cluster.Start({}, 4, {"--tp=2"},
                    {"--tp=2", "--speculative=ngram", "--num_speculative_tokens=3"}),
      "");
  for (int i = 0; i < 3; ++i) {
    tandem::v1::GenerateRequest req = MakeRequest(20 + 30 * i, 80 + i, 24, 0.0f);
    // A repetition penalty below 1 makes the tiny model loop, so the n-gram
    // proposer finds matches and drafts get accepted and rejected.
    req.mutable_sampling()->set_repetition_penalty(0.2f);
    StreamResult spec = cluster.Generate(req);
    ASSERT_TRUE(spec.status.ok()) << spec.status.error_message() << cluster.Logs();
    StreamResult plain = ref.Generate(req);
    ASSERT_TRUE(plain.status.ok()) << plain.status.error_message();
    EXPECT_EQ(spec.tokens.size(), 24u) << "prompt " << i;
    EXPECT_EQ(spec.tokens, plain.tokens) << "prompt " << i;
  }
  EXPECT_TRUE(
      WaitMetric(cluster.decode_metrics(), "tandem_worker_reservations", {}, 0));
  // Metrics are refreshed with the heartbeat: wait for the drafts to show.
  double drafted = 0;
  for (int t = 0; t < 100 && drafted == 0; ++t) {
    auto m =
        Metric(cluster.decode_metrics(), "tandem_worker_spec_drafted_tokens_total", {});
    drafted = m.ok() ? *m : 0;
    if (drafted == 0) absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_GT(drafted, 0);
  const double accepted =
      *Metric(cluster.decode_metrics(), "tandem_worker_spec_accepted_tokens_total", {});
  EXPECT_LE(accepted, drafted);
  const double rate =
      *Metric(cluster.decode_metrics(), "tandem_worker_spec_acceptance_rate", {});
  EXPECT_GE(rate, 0.0);
  EXPECT_LE(rate, 1.0);
}

TEST(TpClusterProcessTest, MismatchedTpSizesAreRefusedAtRegistration) {
  const std::string tmp = std::getenv("TEST_TMPDIR");
  auto router = testing::Subprocess::Start(
      {testing::RunfilePath("router/router_main"),
       std::string("--model=") + testing::kTinyModel, "--port=0", "--metrics_port=0",
       "--heartbeat_interval_s=0.2", "--heartbeat_timeout_s=30", "--log_format=json"},
      tmp + "/router.log");
  ASSERT_TRUE(router.ok()) << router.status();
  const int router_port = LoggedPort(*router, "router serving", "grpc_port");
  const int router_metrics = LoggedPort(*router, "router serving", "metrics_port");
  ASSERT_NE(router_port, 0) << router->ReadLog();
  auto worker = [&](const std::string& role, int tp) {
    return testing::Subprocess::Start(
        {testing::RunfilePath(role + "/" + role + "_main"),
         std::string("--model=") + testing::kTinyModel, "--worker_id=" + role + "-0",
         "--router=127.0.0.1:" + std::to_string(router_port), "--port=0",
         "--metrics_port=0", "--max_num_seqs=2", "--max_model_len=256",
         "--kv_cache_memory=64MiB", "--tp=" + std::to_string(tp), "--log_format=json"},
        tmp + "/" + role + ".log");
  };
  auto decode = worker("decode", 2);
  ASSERT_TRUE(decode.ok()) << decode.status();
  ASSERT_TRUE(
      WaitMetric(router_metrics, "tandem_router_workers", {{"role", "decode"}}, 1))
      << router->ReadLog() << decode->ReadLog();
  auto prefill = worker("prefill", 1);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  absl::StatusOr<int> exit = prefill->Wait(absl::Seconds(60));
  ASSERT_TRUE(exit.ok()) << "the refused prefill worker kept running\n"
                         << prefill->ReadLog();
  EXPECT_TRUE(WIFEXITED(*exit) && WEXITSTATUS(*exit) != 0) << *exit;
  const std::string log = prefill->ReadLog();
  EXPECT_NE(log.find("registration refused by the router"), std::string::npos) << log;
  EXPECT_NE(log.find("TP 1"), std::string::npos) << log;
  EXPECT_NE(log.find("TP 2"), std::string::npos) << log;
  EXPECT_NE(log.find("tensor-parallel size"), std::string::npos) << log;
  EXPECT_EQ(*Metric(router_metrics, "tandem_router_workers", {{"role", "prefill"}}), 0);
  EXPECT_EQ(*Metric(router_metrics, "tandem_router_registrations_total",
                    {{"role", "WORKER_ROLE_PREFILL"}, {"result", "rejected"}}),
            1);
}

TEST(TpClusterProcessTest, RankDeathFailsRequestsCleanlyAndStopsRouting) {
  ProcessCluster cluster;
  // Decode rank 1 dies at its 4th forward step (the request decodes a few
  // tokens first: admission imports the state without a forward).
  ASSERT_EQ(cluster.Start({}, 4, {"--tp=2"}, {"--tp=2", "--tp_fail_rank_at_step=1:3"}),
            "");
  tandem::v1::GenerateRequest req = MakeRequest(20, 7, 64, 0.0f);
  req.mutable_stop()->set_ignore_eos(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(40));
  const absl::Time start = absl::Now();
  StreamResult r = testing::Drain(
      tandem::v1::Router::NewStub(
          grpc::CreateChannel("127.0.0.1:" + std::to_string(cluster.router_port()),
                              grpc::InsecureChannelCredentials()))
          ->Generate(&ctx, req)
          .get());
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << r.status.error_message() << cluster.Logs();
  EXPECT_NE(r.status.error_message().find("tensor-parallel rank 1"), std::string::npos)
      << r.status.error_message();
  EXPECT_NE(r.status.error_message().find("decode-0"), std::string::npos)
      << r.status.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));  // no hang
  EXPECT_LT(r.tokens.size(), 64u);

  // The router dropped the worker, and it does not come back (it stopped
  // heartbeating): the next request is refused at once.
  EXPECT_TRUE(WaitMetric(cluster.router_metrics(), "tandem_router_workers",
                         {{"role", "decode"}}, 0))
      << cluster.Logs();
  StreamResult next = cluster.Generate(MakeRequest(10, 8, 4, 0.0f));
  EXPECT_EQ(next.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << next.status.error_message();
  EXPECT_NE(next.status.error_message().find("no decode workers"), std::string::npos)
      << next.status.error_message();

  // The worker itself refuses work, naming the dead rank.
  auto decode = tandem::v1::DecodeWorker::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(cluster.decode_port()),
                          grpc::InsecureChannelCredentials()));
  tandem::v1::ReserveRequest rr;
  rr.set_request_id("after-death");
  rr.set_prompt_tokens(10);
  rr.set_max_new_tokens(4);
  tandem::v1::KvTarget target;
  grpc::ClientContext rctx;
  rctx.set_deadline(In(10));
  grpc::Status rs = decode->Reserve(&rctx, rr, &target);
  EXPECT_EQ(rs.error_code(), grpc::StatusCode::UNAVAILABLE) << rs.error_message();
  EXPECT_NE(rs.error_message().find("tensor-parallel rank 1"), std::string::npos)
      << rs.error_message();
  // It logged that it stopped taking work (health NOT_SERVING, no heartbeats).
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (absl::Now() < until &&
         cluster.decode().ReadLog().find("worker unhealthy") == std::string::npos) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_NE(cluster.decode().ReadLog().find("worker unhealthy"), std::string::npos)
      << cluster.decode().ReadLog();
}

TEST(TpClusterProcessTest, PrefillRankDeathIsRetriedElsewhere) {
  ProcessCluster cluster;
  // Prefill rank 1 dies at the first forward step.
  ASSERT_EQ(cluster.Start({}, 4, {"--tp=2", "--tp_fail_rank_at_step=1:0"}, {"--tp=2"}),
            "");
  const absl::Time start = absl::Now();
  StreamResult r = cluster.Generate(MakeRequest(30, 9, 5, 0.0f));
  // The prefill worker failed the request UNAVAILABLE: the router dropped it and,
  // with no prefill worker left, ran the request colocated on the decode worker.
  ASSERT_TRUE(r.status.ok()) << r.status.error_message() << cluster.Logs();
  EXPECT_EQ(r.tokens.size(), 5u);
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  EXPECT_EQ(*Metric(cluster.router_metrics(), "tandem_router_retries_total",
                    {{"reason", "prefill_unavailable"}}),
            1);
  EXPECT_EQ(*Metric(cluster.router_metrics(), "tandem_router_paths_total",
                    {{"path", "colocated"}}),
            1);
  EXPECT_TRUE(WaitMetric(cluster.router_metrics(), "tandem_router_workers",
                         {{"role", "prefill"}}, 0))
      << cluster.Logs();
  const std::string log = cluster.prefill().ReadLog();
  EXPECT_NE(log.find("tensor-parallel rank 1"), std::string::npos) << log;
  // The next request does not go to the dead worker either.
  StreamResult next = cluster.Generate(MakeRequest(12, 10, 3, 0.0f));
  ASSERT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_EQ(*Metric(cluster.router_metrics(), "tandem_router_paths_total",
                    {{"path", "colocated"}}),
            2);
  EXPECT_EQ(*Metric(cluster.router_metrics(), "tandem_router_retries_total",
                    {{"reason", "prefill_unavailable"}}),
            1);
}

}  // namespace
}  // namespace tandem
