// The GPU serving path end to end on the emulator: router_main + prefill_main +
// decode_main as real processes, both workers on --backend cuda_sim (weights,
// MLA cache, KDA pool and activations in emulated device memory; the caches
// registered with the UCX agents where they live), against a colocated decode
// worker on the CPU backend:
//   - greedy requests (one prompt in one prefill step, one split over several
//     steps, so its state streams per layer and chunk) and one seeded sampling
//     request give the CPU's tokens;
//   - every request took the disaggregated path, its transfer succeeded, and
//     the decode worker verified the state's checksums on landing (the router
//     asks for them; a mismatch would end the request DATA_LOSS);
//   - both workers say their cache is on the cuda_sim device, and the prefill
//     worker's vision tower runs there too;
//   - the KV moved device to device between the two processes
//     (--kv_buffer=host: the emulator's device memory staged as a GPU's is
//     where the transport cannot register it; --kv_device_ipc, the default:
//     the decode worker's cache is shareable device memory, published in its
//     descriptor, which the prefill worker maps and writes into): every byte
//     sent went straight into the decode worker's device memory, none through
//     host memory on either side, before the checksums (computed on the
//     device) matched;
//   - at TP 2 with --kv_device_ipc=false, the KV moved through host memory:
//     every byte the prefill worker sent was copied device -> host there, and
//     the same count host -> device on the decode worker.
//
// Tolerance: the GPU kernels differ from the CPU's only in summation order
// (logits within 1e-3 relative, engine/runtime/gpu_engine_test.cc), which moves
// neither a greedy argmax with a margin nor a seeded draw unless the uniform
// falls within that of a boundary; for these fixed prompts and seed the tokens
// are equal, and the test asserts equality.
//
// The emulator is slow: a few short prompts and tokens (the test's time is
// mostly the SIMT emulation of the forward steps).
//
// TANDEM_CLUSTER_BACKEND=cuda (or cuda:N) runs the same test on a GPU, with
// binaries built --config=cuda (the GPU check does), and --kv_buffer=auto
// there: in place where the UCX has CUDA support, else staged through host
// memory (the log says which; the staging counters are checked when staged).
// TANDEM_CLUSTER_KV_BUFFER overrides the mode; with "device" on a UCX without
// CUDA support the workers refuse to start and the test is skipped with that
// message.
#include <grpcpp/grpcpp.h>

#include <cstdlib>
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

// A decode worker on its own on the CPU backend (no router): the reference.
class CpuReference {
 public:
  std::string Start() {
    const std::string tmp = std::getenv("TEST_TMPDIR");
    auto p = testing::Subprocess::Start(
        {testing::RunfilePath("decode/decode_main"),
         std::string("--model=") + testing::kTinyModel, "--worker_id=cpu-reference",
         "--backend=cpu", "--port=0", "--metrics_port=0", "--max_num_seqs=2",
         "--max_model_len=512", "--kv_cache_memory=64MiB", "--log_format=json"},
        tmp + "/cpu_reference.log");
    if (!p.ok()) return std::string(p.status().message());
    proc_ = std::make_unique<testing::Subprocess>(std::move(*p));
    const int port = LoggedPort(*proc_, "worker serving", "grpc_port");
    if (port == 0) return "the reference did not log its port\n" + proc_->ReadLog();
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

// The workers' backend: cuda_sim unless $TANDEM_CLUSTER_BACKEND names another.
std::string WorkerBackend() {
  const char* b = std::getenv("TANDEM_CLUSTER_BACKEND");
  return b != nullptr && *b != '\0' ? b : "cuda_sim";
}

// The workers' --kv_buffer: $TANDEM_CLUSTER_KV_BUFFER, else host on the
// emulator (its memory is host-addressable, so only a forced staging takes
// the path a GPU without a CUDA-capable transport takes) and auto on a GPU.
std::string KvBuffer(const std::string& backend) {
  const char* b = std::getenv("TANDEM_CLUSTER_KV_BUFFER");
  if (b != nullptr && *b != '\0') return b;
  return backend.rfind("cuda_sim", 0) == 0 ? "host" : "auto";
}

// The device name a worker on `backend` logs for its cache.
std::string DeviceOf(const std::string& backend) {
  if (backend.rfind("cuda_sim", 0) == 0) return "cuda_sim";
  const size_t colon = backend.find(':');
  return colon == std::string::npos ? "cuda:0" : "cuda:" + backend.substr(colon + 1);
}

// Whether `log` (JSON lines) says the cache was registered from `device`.
bool CacheOnDevice(const std::string& log, const std::string& device) {
  for (size_t at = log.find("KV cache registered with the transfer agent");
       at != std::string::npos;
       at = log.find("KV cache registered with the transfer agent", at + 1)) {
    const size_t end = log.find('\n', at);
    const std::string line = log.substr(at, end == std::string::npos ? end : end - at);
    if (line.find("\"device\":\"" + device + "\"") != std::string::npos) return true;
  }
  return false;
}

// Each request through the cluster, then through the reference: the full
// length, the same tokens.
void ExpectTheCpuTokens(ProcessCluster& cluster, CpuReference& ref,
                        const std::vector<tandem::v1::GenerateRequest>& reqs) {
  for (size_t i = 0; i < reqs.size(); ++i) {
    StreamResult gpu = cluster.Generate(reqs[i]);
    ASSERT_TRUE(gpu.status.ok())
        << "request " << i << ": " << gpu.status.error_message() << cluster.Logs();
    StreamResult cpu = ref.Generate(reqs[i]);
    ASSERT_TRUE(cpu.status.ok()) << cpu.status.error_message();
    EXPECT_EQ(gpu.tokens.size(), static_cast<size_t>(reqs[i].stop().max_tokens()))
        << "request " << i;
    EXPECT_EQ(gpu.tokens, cpu.tokens) << "request " << i;
  }
}

// Every byte the prefill worker sent went straight into the decode worker's
// device memory (IPC): none through host memory on either side, and the decode
// worker published its cache (metrics refreshed every 500 ms).
void ExpectDeviceToDevice(ProcessCluster& cluster, double sent) {
  EXPECT_TRUE(WaitMetric(cluster.prefill_metrics(),
                         "tandem_worker_kv_staged_bytes_total",
                         {{"direction", "to_peer_device"}}, sent));
  EXPECT_EQ(*Metric(cluster.prefill_metrics(), "tandem_worker_kv_staged_bytes_total",
                    {{"direction", "to_host"}}),
            0);
  EXPECT_EQ(*Metric(cluster.decode_metrics(), "tandem_worker_kv_staged_bytes_total",
                    {{"direction", "to_device"}}),
            0);
  EXPECT_NE(cluster.decode().ReadLog().find("\"device_ipc\":\"published\""),
            std::string::npos)
      << cluster.Logs();
}

TEST(ClusterCudaSimTest, DeviceWorkersServeTheCpuTokens) {
  const absl::Time start = absl::Now();
  CpuReference ref;
  ASSERT_EQ(ref.Start(), "");
  const std::string backend = WorkerBackend();
  const std::string kv_buffer = KvBuffer(backend);
  ProcessCluster cluster;
  // A 16-token step budget on the prefill worker: the 40-token prompt takes 3
  // steps, its MLA rows and KDA state streamed after each layer of each.
  std::vector<std::string> prefill_flags = {
      "--backend=" + backend, "--max_tokens_per_step=16", "--kv_buffer=" + kv_buffer};
  std::vector<std::string> decode_flags = {"--backend=" + backend,
                                           "--kv_buffer=" + kv_buffer};
  if (backend.rfind("cuda_sim", 0) != 0) {
    // Both workers share the one GPU: a small cache each, not
    // --gpu_memory_utilization's 0.9 apiece (./tandem up gives 0.9/N).
    prefill_flags.push_back("--kv_cache_memory=2GiB");
    decode_flags.push_back("--kv_cache_memory=2GiB");
  }
  const std::string started = cluster.Start({}, 2, prefill_flags, decode_flags);
  if (!started.empty() &&
      started.find("this UCX build has no CUDA memory support") != std::string::npos) {
    GTEST_SKIP() << "backend " << backend
                 << ": the workers' UCX cannot register CUDA memory:\n"
                 << started;
  }
  ASSERT_EQ(started, "");
  const std::vector<tandem::v1::GenerateRequest> reqs = {
      MakeRequest(5, 11, 4, 0.0f),   // greedy, one prefill step
      MakeRequest(40, 12, 4, 0.0f),  // greedy, three prefill steps
      MakeRequest(9, 13, 5, 1.0f),   // seeded sampling (seed 13)
  };
  ExpectTheCpuTokens(cluster, ref, reqs);
  const double n = static_cast<double>(reqs.size());
  EXPECT_EQ(*Metric(cluster.router_metrics(), "tandem_router_paths_total",
                    {{"path", "disaggregated"}}),
            n);
  EXPECT_EQ(*Metric(cluster.prefill_metrics(), "tandem_worker_transfers_total",
                    {{"outcome", "ok"}}),
            n);
  // Checksums verified on landing (DATA_LOSS otherwise, counted apart).
  EXPECT_EQ(*Metric(cluster.decode_metrics(), "tandem_worker_requests_total",
                    {{"rpc", "Decode"}, {"outcome", "ok"}}),
            n);
  // Streamed by layer: at least one batch per layer (4) and request, more for
  // the three-step prompt.
  EXPECT_GE(
      *Metric(cluster.prefill_metrics(), "tandem_worker_transfer_batches_total", {}),
      n * 4 + 8);
  EXPECT_TRUE(
      WaitMetric(cluster.decode_metrics(), "tandem_worker_reservations", {}, 0));
  // The decode worker's decode steps ran as CUDA graphs (captured on first use
  // of a bucket, then replayed): its counters, refreshed every 500 ms.
  double replays = 0;
  for (int i = 0; i < 50 && replays == 0; ++i) {
    auto v = Metric(cluster.decode_metrics(), "tandem_worker_cuda_graph_steps_total",
                    {{"mode", "graph"}});
    if (v.ok()) replays = *v;
    if (replays == 0) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_GT(replays, 0) << "no decode step was replayed from a CUDA graph";
  EXPECT_GE(
      *Metric(cluster.decode_metrics(), "tandem_worker_cuda_graph_captures_total", {}),
      1);
  EXPECT_TRUE(CacheOnDevice(cluster.prefill().ReadLog(), DeviceOf(backend)))
      << cluster.Logs();
  // The prefill worker's vision tower runs on the device too (a backend of its
  // own there), its weights and one call's activations set aside from the
  // cache budget (the image path: tests/cluster_image_test.cc).
  {
    const std::string log = cluster.prefill().ReadLog();
    const size_t at = log.find("vision tower loaded");
    ASSERT_NE(at, std::string::npos) << cluster.Logs();
    const std::string line = log.substr(at, log.find('\n', at) - at);
    EXPECT_NE(line.find("\"backend\":\"cuda"), std::string::npos) << line;
    EXPECT_EQ(line.find("\"device_reserve_bytes\":0"), std::string::npos) << line;
  }
  EXPECT_TRUE(CacheOnDevice(cluster.decode().ReadLog(), DeviceOf(backend)))
      << cluster.Logs();
  // Staged regions, written device to device (IPC) where the prefill worker
  // maps the decode worker's memory: every byte sent went there and none
  // through host memory (metrics refreshed every 500 ms). Otherwise every
  // byte went device -> host on the prefill worker and host -> device on the
  // decode worker.
  const bool staged =
      cluster.prefill().ReadLog().find("\"kv_buffer\":\"staged\"") != std::string::npos;
  if (kv_buffer == "host") {
    EXPECT_TRUE(staged) << cluster.Logs();
  }
  if (kv_buffer == "device") {
    EXPECT_FALSE(staged) << cluster.Logs();
  }
  bool direct = false;
  if (staged) {
    const double sent =
        *Metric(cluster.prefill_metrics(), "tandem_worker_transfer_bytes_total", {});
    EXPECT_GT(sent, 0);
    for (int i = 0; i < 50 && !direct; ++i) {
      auto peers =
          Metric(cluster.prefill_metrics(), "tandem_worker_kv_direct_peers", {});
      direct = peers.ok() && *peers >= 1;
      if (!direct) absl::SleepFor(absl::Milliseconds(100));
    }
    // The emulator's shareable memory always maps between processes of one
    // host; a GPU machine may refuse (the check reports which path ran).
    if (backend.rfind("cuda_sim", 0) == 0) {
      EXPECT_TRUE(direct) << cluster.Logs();
    }
  }
  if (direct) {
    ExpectDeviceToDevice(cluster, *Metric(cluster.prefill_metrics(),
                                          "tandem_worker_transfer_bytes_total", {}));
  } else if (staged) {
    const double sent =
        *Metric(cluster.prefill_metrics(), "tandem_worker_transfer_bytes_total", {});
    EXPECT_TRUE(WaitMetric(cluster.prefill_metrics(),
                           "tandem_worker_kv_staged_bytes_total",
                           {{"direction", "to_host"}}, sent));
    EXPECT_TRUE(WaitMetric(cluster.decode_metrics(),
                           "tandem_worker_kv_staged_bytes_total",
                           {{"direction", "to_device"}}, sent));
    EXPECT_GT(*Metric(cluster.decode_metrics(), "tandem_worker_kv_staged_regions", {}),
              0);
  }
  std::printf("KV buffer: %s (%s)\n", kv_buffer.c_str(),
              direct   ? "device to device between the processes (IPC)"
              : staged ? "staged through host memory"
                       : "in place");
  std::printf("%s cluster: %zu requests in %.1f s (start-up included)\n",
              backend.c_str(), reqs.size(), absl::ToDoubleSeconds(absl::Now() - start));
}

// TP 2 on the emulator (each rank's cache on a device of its own), staged
// through host memory (--kv_device_ipc=false): each rank's rows go device ->
// host -> host -> device through its own copier, and the tokens are still the
// CPU's. Not on a GPU
// machine with one GPU (NCCL refuses two ranks on one device).
// The TP 2 cluster on the emulator, --kv_buffer=host, with --kv_device_ipc as
// given; the CPU's tokens; returns the prefill worker's bytes sent.
double RunTp2(ProcessCluster& cluster, bool ipc) {
  const std::string backend = WorkerBackend();
  CpuReference ref;
  EXPECT_EQ(ref.Start(), "");
  const std::string flag = ipc ? "--kv_device_ipc=true" : "--kv_device_ipc=false";
  EXPECT_EQ(cluster.Start({}, 2,
                          {"--backend=" + backend, "--tp=2", "--max_tokens_per_step=16",
                           "--kv_buffer=host", flag},
                          {"--backend=" + backend, "--tp=2", "--kv_buffer=host", flag}),
            "");
  const std::vector<tandem::v1::GenerateRequest> reqs = {
      MakeRequest(24, 21, 4, 0.0f),  // greedy, two prefill steps
      MakeRequest(7, 22, 4, 1.0f),   // seeded sampling
  };
  ExpectTheCpuTokens(cluster, ref, reqs);
  EXPECT_EQ(*Metric(cluster.decode_metrics(), "tandem_worker_requests_total",
                    {{"rpc", "Decode"}, {"outcome", "ok"}}),
            static_cast<double>(reqs.size()));
  const double sent =
      *Metric(cluster.prefill_metrics(), "tandem_worker_transfer_bytes_total", {});
  EXPECT_GT(sent, 0);
  return sent;
}

// TP 2 device to device (IPC): both ranks' regions are published by the one
// decode agent and mapped by the prefill worker's, each rank's rows written
// straight into the decode rank's device memory.
TEST(ClusterCudaSimTest, Tp2DeviceToDeviceServesTheCpuTokens) {
  if (WorkerBackend().rfind("cuda_sim", 0) != 0) {
    GTEST_SKIP() << "TP 2 runs on the emulator only (backend " << WorkerBackend()
                 << ")";
  }
  ProcessCluster cluster;
  ExpectDeviceToDevice(cluster, RunTp2(cluster, /*ipc=*/true));
}

TEST(ClusterCudaSimTest, Tp2StagedThroughHostMemoryServesTheCpuTokens) {
  const std::string backend = WorkerBackend();
  if (backend.rfind("cuda_sim", 0) != 0) {
    GTEST_SKIP() << "TP 2 runs on the emulator only (backend " << backend << ")";
  }
  ProcessCluster cluster;
  const double sent = RunTp2(cluster, /*ipc=*/false);
  EXPECT_TRUE(WaitMetric(cluster.prefill_metrics(),
                         "tandem_worker_kv_staged_bytes_total",
                         {{"direction", "to_host"}}, sent));
  EXPECT_TRUE(WaitMetric(cluster.decode_metrics(),
                         "tandem_worker_kv_staged_bytes_total",
                         {{"direction", "to_device"}}, sent));
  // Every rank's regions staged: the two ranks' registrations, each logging
  // its region count, add up to the gauge.
  const double regions =
      *Metric(cluster.decode_metrics(), "tandem_worker_kv_staged_regions", {});
  const std::string log = cluster.decode().ReadLog();
  int ranks = 0;
  double logged = 0;
  for (size_t at = log.find("KV cache registered with the transfer agent");
       at != std::string::npos;
       at = log.find("KV cache registered with the transfer agent", at + 1)) {
    const std::string line = log.substr(at, log.find('\n', at) - at);
    if (line.find("\"kv_buffer\":\"staged\"") == std::string::npos) continue;
    ++ranks;
    const size_t r = line.find("\"regions\":");
    if (r != std::string::npos) logged += std::atof(line.c_str() + r + 10);
  }
  EXPECT_EQ(ranks, 2) << "both ranks' caches staged";
  EXPECT_GT(regions, 0);
  EXPECT_EQ(regions, logged);
}

}  // namespace
}  // namespace tandem
