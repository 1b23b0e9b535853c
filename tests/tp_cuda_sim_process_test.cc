// Tensor parallelism on the GPU backend's emulator across a real worker process
// (decode_main on its own, no router, tiny checkpoint): --backend=cuda_sim
// --tp=2 runs two ranks, each on an emulated device of its own, joined by Gloo.
//   - its greedy tokens equal a --backend=cpu TP 1 worker's;
//   - the rank-death drill (--tp_fail_rank_at_step=1:3): the request fails
//     UNAVAILABLE naming rank 1 within its deadline, the worker logs that it is
//     unhealthy and refuses further work naming the rank.
#include <grpcpp/grpcpp.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "proto/worker.grpc.pb.h"
#include "tests/testing/process_cluster.h"
#include "tests/testing/subprocess.h"

namespace tandem {
namespace {

using testing::In;
using testing::LoggedPort;
using testing::MakeRequest;
using testing::StreamResult;

// One decode worker on its own, serving Generate colocated.
class Worker {
 public:
  std::string Start(const std::string& name, const std::vector<std::string>& flags) {
    const std::string tmp = std::getenv("TEST_TMPDIR");
    std::vector<std::string> args = {testing::RunfilePath("decode/decode_main"),
                                     std::string("--model=") + testing::kTinyModel,
                                     "--worker_id=" + name,
                                     "--port=0",
                                     "--metrics_port=0",
                                     "--max_num_seqs=2",
                                     "--max_model_len=256",
                                     "--kv_cache_memory=32MiB",
                                     "--log_format=json"};
    args.insert(args.end(), flags.begin(), flags.end());
    auto p = testing::Subprocess::Start(args, tmp + "/" + name + ".log");
    if (!p.ok()) return std::string(p.status().message());
    proc_ = std::make_unique<testing::Subprocess>(std::move(*p));
    const int port = LoggedPort(*proc_, "worker serving", "grpc_port");
    if (port == 0) return name + " did not log its port\n" + proc_->ReadLog();
    metrics_port_ = LoggedPort(*proc_, "worker serving", "metrics_port");
    stub_ = tandem::v1::DecodeWorker::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
    return "";
  }
  StreamResult Generate(const tandem::v1::GenerateRequest& req, int deadline_s = 120) {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(deadline_s));
    return testing::Drain(stub_->Generate(&ctx, req).get());
  }
  tandem::v1::DecodeWorker::Stub& stub() { return *stub_; }
  std::string Log() { return proc_->ReadLog(); }
  // The metric's value once it is above zero (the worker publishes its
  // engine's counters after steps), or 0 when it stays there for 20 s.
  double Positive(const std::string& name,
                  const std::map<std::string, std::string>& labels) {
    const absl::Time end = absl::Now() + absl::Seconds(20);
    while (absl::Now() < end) {
      absl::StatusOr<double> v = testing::Metric(metrics_port_, name, labels);
      if (v.ok() && *v > 0) return *v;
      absl::SleepFor(absl::Milliseconds(50));
    }
    return 0;
  }

 private:
  std::unique_ptr<testing::Subprocess> proc_;
  std::unique_ptr<tandem::v1::DecodeWorker::Stub> stub_;
  int metrics_port_ = 0;
};

// True when `log` has a line with every one of `parts`.
bool LogLineHas(const std::string& log, const std::vector<std::string>& parts) {
  size_t begin = 0;
  while (begin < log.size()) {
    size_t end = log.find('\n', begin);
    if (end == std::string::npos) end = log.size();
    const std::string line = log.substr(begin, end - begin);
    bool all = true;
    for (const std::string& p : parts) all = all && line.find(p) != std::string::npos;
    if (all) return true;
    begin = end + 1;
  }
  return false;
}

TEST(TpCudaSimProcessTest, Tp2OnCudaSimGivesTheCpuTp1Tokens) {
  Worker cpu, sim;
  ASSERT_EQ(cpu.Start("cpu-tp1", {"--backend=cpu"}), "");
  ASSERT_EQ(sim.Start("cuda-sim-tp2", {"--backend=cuda_sim", "--tp=2"}), "");
  for (int len : {5, 23}) {
    const tandem::v1::GenerateRequest req = MakeRequest(len, 60 + len, 4, 0.0f);
    StreamResult want = cpu.Generate(req);
    ASSERT_TRUE(want.status.ok()) << want.status.error_message();
    StreamResult got = sim.Generate(req);
    ASSERT_TRUE(got.status.ok()) << got.status.error_message() << sim.Log();
    EXPECT_EQ(got.tokens.size(), 4u) << "prompt of " << len;
    EXPECT_EQ(got.tokens, want.tokens) << "prompt of " << len;
  }
  // The decode steps ran as CUDA graphs with the ranks' collectives inside
  // (Gloo on the emulator: host functions in the graph), every collective in
  // stream order (no hooks on a decode worker).
  EXPECT_GT(sim.Positive("tandem_worker_cuda_graph_steps_total", {{"mode", "graph"}}),
            0)
      << sim.Log();
  EXPECT_GT(
      sim.Positive("tandem_worker_tp_collectives_total", {{"mode", "stream_ordered"}}),
      0);
  EXPECT_GT(sim.Positive("tandem_worker_tp_collective_bytes_total", {}), 0);
  // Both ranks' caches live on the emulated device.
  for (const char* rank : {"\"tp_rank\":0", "\"tp_rank\":1"}) {
    EXPECT_TRUE(LogLineHas(sim.Log(), {"KV cache registered with the transfer agent",
                                       "\"device\":\"cuda_sim\"", rank}))
        << rank << "\n"
        << sim.Log();
  }
}

TEST(TpCudaSimProcessTest, RankDeathFailsTheRequestAndTheWorkerStopsTakingWork) {
  Worker w;
  // Rank 1 stops at the 4th forward: the prefill and two decode steps succeed.
  ASSERT_EQ(w.Start("cuda-sim-drill",
                    {"--backend=cuda_sim", "--tp=2", "--tp_fail_rank_at_step=1:3"}),
            "");
  tandem::v1::GenerateRequest req = MakeRequest(10, 7, 32, 0.0f);
  req.mutable_stop()->set_ignore_eos(true);
  const absl::Time start = absl::Now();
  StreamResult r = w.Generate(req, 60);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << r.status.error_message() << w.Log();
  EXPECT_NE(r.status.error_message().find("tensor-parallel rank 1"), std::string::npos)
      << r.status.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(45));  // no hang
  EXPECT_LT(r.tokens.size(), 32u);

  tandem::v1::ReserveRequest rr;
  rr.set_request_id("after-death");
  rr.set_prompt_tokens(10);
  rr.set_max_new_tokens(4);
  tandem::v1::KvTarget target;
  grpc::ClientContext rctx;
  rctx.set_deadline(In(10));
  grpc::Status rs = w.stub().Reserve(&rctx, rr, &target);
  EXPECT_EQ(rs.error_code(), grpc::StatusCode::UNAVAILABLE) << rs.error_message();
  EXPECT_NE(rs.error_message().find("tensor-parallel rank 1"), std::string::npos)
      << rs.error_message();
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (absl::Now() < until && w.Log().find("worker unhealthy") == std::string::npos) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_NE(w.Log().find("worker unhealthy"), std::string::npos) << w.Log();
}

}  // namespace
}  // namespace tandem
