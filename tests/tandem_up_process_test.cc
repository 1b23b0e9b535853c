// `./tandem up` end to end, as a user starts it: the script itself (with the
// test's prebuilt binaries, TANDEM_BIN_DIR) brings up a router, a prefill and a
// decode worker on free ports with the tiny model. `--speculative ngram` serves the
// same greedy tokens as a cluster started without it, and the decode worker's
// speculative metrics show that the option reached it and drafts were verified.
// The router runs its default --colocate_below_tokens (1000): short prompts are
// prefilled on the decode worker, a 1100-token one disaggregated, its KV state
// carried over shared memory (the prefill worker's /metrics counts its one
// connection under UCX's shared-memory transports, issue 19).
//
//   test → TandemUp::Start (tandem up ... &, waits for "cluster up") → Generate over
//   the router's gRPC → decode worker /metrics → SIGTERM (tandem stops everything).
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "metrics/http_get.h"
#include "proto/router.grpc.pb.h"
#include "tests/testing/process_cluster.h"
#include "tests/testing/subprocess.h"

namespace tandem {
namespace {

using testing::Metric;
using testing::RunfilePath;
using testing::StreamResult;
using testing::Subprocess;

// True when a TCP port on 127.0.0.1 can be bound now.
bool PortFree(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

// Claims `port` among the processes that claim ports this way (several runs of
// this test at once: --runs_per_test): an exclusive flock on
// /tmp/tandem-test-port-N.lock, which the kernel drops when its descriptor is
// closed or the process ends, so a crashed run leaves no claim behind. Returns
// the descriptor to keep open, -1 when another process holds the claim, or
// kNoLock when no lock can be taken (the probe alone decides).
constexpr int kNoLock = -2;
int ClaimPort(int port) {
  const std::string path = absl::StrCat("/tmp/tandem-test-port-", port, ".lock");
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (fd < 0) return kNoLock;
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// A base port B with B + o free and claimed for every offset o (the kernel's
// ephemeral range is avoided: outgoing connections take their ports from it).
// A port another program binds between this check and the start still fails
// the start; two runs of this test never pick the same ports (ClaimPort: the
// claims of the ports used are kept for the process's life).
int FreeBase(const std::vector<int>& offsets) {
  static int next = 20000 + static_cast<int>(getpid() % 500) * 40;
  for (int tries = 0; tries < 500; ++tries, next += 23) {
    if (next > 32000) next = 20000;
    bool all = true;
    for (int o : offsets) all = all && PortFree(next + o);
    std::vector<int> claims;
    for (int o : offsets) {
      if (!all) break;
      const int fd = ClaimPort(next + o);
      all = fd != -1;
      if (fd >= 0) claims.push_back(fd);
    }
    if (all) {
      const int base = next;
      next += 23;
      return base;
    }
    for (int fd : claims) close(fd);  // a partial claim is given back
  }
  return 0;
}

// One `./tandem up` (router, 1 prefill, 1 decode; no gateway), stopped with SIGTERM
// (tandem then stops its processes) when it goes.
class TandemUp {
 public:
  std::string Start(const std::string& name, const std::vector<std::string>& options) {
    const std::string tmp = std::getenv("TEST_TMPDIR");
    router_port_ = FreeBase({0});
    metrics_port_ = FreeBase({0});
    const int worker_base = FreeBase({0, 10});  // prefill-0, decode-0
    const int worker_metrics = FreeBase({0, 1});
    if (router_port_ == 0 || metrics_port_ == 0 || worker_base == 0 ||
        worker_metrics == 0) {
      return "no free ports";
    }
    prefill_metrics_ = worker_metrics;
    decode_metrics_ = worker_metrics + 1;
    // The script runs the binaries of this test's runfiles and keeps its logs here.
    setenv("TANDEM_BIN_DIR", RunfilePath("").c_str(), 1);
    setenv("TANDEM_CACHE_DIR", (tmp + "/" + name).c_str(), 1);
    std::vector<std::string> argv = {
        "/bin/bash",
        RunfilePath("tandem"),
        "up",
        "--no-setup",
        "--no-gateway",
        "--model=" + RunfilePath(testing::kTinyModel),
        absl::StrCat("--router-port=", router_port_),
        absl::StrCat("--metrics-port=", metrics_port_),
        absl::StrCat("--worker-port-base=", worker_base),
        absl::StrCat("--worker-metrics-port-base=", worker_metrics),
        "--router-arg=--heartbeat_interval_s=0.2"};
    argv.insert(argv.end(), options.begin(), options.end());
    auto proc = Subprocess::Start(argv, tmp + "/" + name + ".log");
    if (!proc.ok()) return std::string(proc.status().message());
    proc_ = std::make_unique<Subprocess>(std::move(*proc));
    const absl::Time end = absl::Now() + absl::Seconds(60);
    while (proc_->ReadLog().find("tandem: cluster up") == std::string::npos) {
      if (absl::Now() > end) return "not up in 60 s\n" + proc_->ReadLog();
      if (proc_->Wait(absl::Milliseconds(50)).ok()) {
        return "tandem up exited\n" + proc_->ReadLog();
      }
    }
    stub_ = v1::Router::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", router_port_), grpc::InsecureChannelCredentials()));
    return "";
  }

  ~TandemUp() {
    if (proc_ == nullptr) return;
    proc_->Signal(SIGTERM);
    auto status = proc_->Wait(absl::Seconds(30));
    EXPECT_TRUE(status.ok()) << "tandem up did not stop\n" << proc_->ReadLog();
  }

  StreamResult Generate(const v1::GenerateRequest& req) {
    grpc::ClientContext ctx;
    ctx.set_deadline(testing::In(60));
    return testing::Drain(stub_->Generate(&ctx, req).get());
  }

  // A counter of the decode worker, once its heartbeat-refreshed value is above 0
  // (or 0 after a bounded wait).
  double DecodeCounter(const std::string& name, absl::Duration wait) {
    const absl::Time end = absl::Now() + wait;
    double v = 0;
    do {
      auto m = Metric(decode_metrics_, name, {});
      v = m.ok() ? *m : 0;
      if (v > 0) break;
      absl::SleepFor(absl::Milliseconds(50));
    } while (absl::Now() < end);
    return v;
  }

  // A sample of the router's /metrics (-1 when it cannot be read).
  double RouterMetric(const std::string& name,
                      const std::map<std::string, std::string>& labels) {
    auto m = Metric(metrics_port_, name, labels);
    return m.ok() ? *m : -1;
  }

  // A gauge of the decode worker (-1 when it cannot be read).
  double DecodeGauge(const std::string& name) {
    auto m = Metric(decode_metrics_, name, {});
    return m.ok() ? *m : -1;
  }

  // The counters once they have stopped moving: the engine publishes its totals
  // between steps and the counters are scraped one at a time, so a view is
  // consistent only when two consecutive reads of all of them agree.
  std::vector<double> SettledDecodeCounters(const std::vector<std::string>& names,
                                            absl::Duration wait) {
    const absl::Time end = absl::Now() + wait;
    std::vector<double> last;
    while (true) {
      std::vector<double> now;
      for (const std::string& n : names) {
        auto m = Metric(decode_metrics_, n, {});
        now.push_back(m.ok() ? *m : 0);
      }
      if (now == last || absl::Now() >= end) return now;
      last = std::move(now);
      absl::SleepFor(absl::Milliseconds(300));
    }
  }

  // The prefill worker's /metrics text ("" when it cannot be read).
  std::string PrefillMetricsText() {
    auto get =
        metrics::HttpGet("127.0.0.1", prefill_metrics_, "/metrics", absl::Seconds(5));
    return get.ok() ? get->body : "";
  }

  std::string Log() const { return proc_ ? proc_->ReadLog() : ""; }

 private:
  int router_port_ = 0, metrics_port_ = 0, prefill_metrics_ = 0, decode_metrics_ = 0;
  std::unique_ptr<Subprocess> proc_;
  std::unique_ptr<v1::Router::Stub> stub_;
};

std::vector<v1::GenerateRequest> Requests() {
  std::vector<v1::GenerateRequest> reqs;
  for (int i = 0; i < 2; ++i) {
    v1::GenerateRequest req = testing::MakeRequest(20 + 30 * i, 90 + i, 24, 0.0f);
    // A repetition penalty below 1 makes the tiny model loop, so the n-gram
    // proposer finds matches and drafts get accepted and rejected.
    req.mutable_sampling()->set_repetition_penalty(0.2f);
    reqs.push_back(req);
  }
  return reqs;
}

TEST(TandemUpProcessTest, SpeculativeNgramServesThePlainGreedyTokens) {
  std::vector<std::vector<int32_t>> plain_tokens;
  {
    TandemUp plain;
    // The default sizing (--kv_cache_memory's default share of the available
    // memory): --max_num_seqs' 256 slots and the model's whole 1M context.
    ASSERT_EQ(plain.Start("plain", {"--speculative", "none"}), "");
    EXPECT_EQ(plain.DecodeGauge("tandem_worker_state_slots_capacity"), 256);
    EXPECT_EQ(plain.DecodeGauge("tandem_worker_max_model_len_tokens"), 1048576);
    EXPECT_GT(plain.DecodeGauge("tandem_worker_kv_cache_capacity_tokens"), 1048576);
    EXPECT_GT(plain.DecodeGauge("tandem_worker_kv_cache_budget_bytes"), 0);
    EXPECT_NE(plain.Log().find("KV cache sized from memory"), std::string::npos);
    for (const v1::GenerateRequest& req : Requests()) {
      StreamResult r = plain.Generate(req);
      ASSERT_TRUE(r.status.ok()) << r.status.error_message() << plain.Log();
      ASSERT_EQ(r.tokens.size(), 24u);
      plain_tokens.push_back(r.tokens);
    }
    EXPECT_EQ(
        plain.DecodeCounter("tandem_worker_spec_verifications_total", absl::Seconds(1)),
        0);
    // `./tandem up` runs the router's default --colocate_below_tokens (1000):
    // those short prompts were prefilled on the decode worker, a longer one goes
    // through the prefill worker (the hand-off).
    StreamResult longer = plain.Generate(testing::MakeRequest(1100, 5, 4, 0.0f));
    ASSERT_TRUE(longer.status.ok()) << longer.status.error_message() << plain.Log();
    EXPECT_EQ(longer.tokens.size(), 4u);
    EXPECT_EQ(plain.RouterMetric("tandem_router_paths_total", {{"path", "colocated"}}),
              2);
    EXPECT_EQ(
        plain.RouterMetric("tandem_router_paths_total", {{"path", "disaggregated"}}),
        1);
    // ... over shared memory, ./tandem up's default: the prefill worker's one
    // connection to the decode worker, under UCX's sysv/posix transports.
    const std::string prefill_metrics = plain.PrefillMetricsText();
    EXPECT_TRUE(std::regex_search(
        prefill_metrics,
        std::regex("tandem_worker_kv_peer_connections_total\\{agent=\"ucx\",transports="
                   "\"[^\"]*(sysv|posix)[^\"]*\",tcp_only=\"false\"\\} 1\n")))
        << prefill_metrics << plain.Log();
    // None over TCP (the series is exported at 0 from the start).
    EXPECT_NE(
        prefill_metrics.find("tandem_worker_kv_peer_connections_total{agent=\"ucx\","
                             "transports=\"tcp\",tcp_only=\"true\"} 0\n"),
        std::string::npos)
        << prefill_metrics;
  }
  TandemUp spec;
  ASSERT_EQ(spec.Start("ngram", {"--speculative", "ngram", "--num-speculative-tokens",
                                 "3", "--prefill-arg=--kv_cache_memory=64MiB",
                                 "--decode-arg=--kv_cache_memory=64MiB"}),
            "");
  const std::vector<v1::GenerateRequest> reqs = Requests();
  for (size_t i = 0; i < reqs.size(); ++i) {
    StreamResult r = spec.Generate(reqs[i]);
    ASSERT_TRUE(r.status.ok()) << r.status.error_message() << spec.Log();
    EXPECT_EQ(r.tokens, plain_tokens[i]) << "prompt " << i;
  }
  // Metrics are refreshed with the heartbeat: wait for the drafts to show.
  const double drafted =
      spec.DecodeCounter("tandem_worker_spec_drafted_tokens_total", absl::Seconds(10));
  ASSERT_GT(drafted, 0) << spec.Log();
  const std::vector<double> settled =
      spec.SettledDecodeCounters({"tandem_worker_spec_drafted_tokens_total",
                                  "tandem_worker_spec_verifications_total",
                                  "tandem_worker_spec_accepted_tokens_total"},
                                 absl::Seconds(10));
  const double verifications = settled[1];
  const double accepted = settled[2];
  EXPECT_GE(settled[0], drafted);
  std::cout << "decode worker: " << settled[0] << " drafted, " << accepted
            << " accepted, " << verifications << " verifications\n";
  EXPECT_GT(verifications, 0);
  EXPECT_GT(accepted, 0);
  EXPECT_LE(accepted, settled[0]);
}

}  // namespace
}  // namespace tandem
