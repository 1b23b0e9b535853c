// Concurrency end to end with real processes on localhost (router_main +
// prefill_main + decode_main, tiny checkpoint):
//   - 64 concurrent Generate streams (mixed prompt lengths, greedy and seeded)
//     all complete, and each stream's tokens equal the same request run alone
//     afterwards: no token is lost, duplicated or mixed between streams;
//   - afterwards every KV block, landing block and reservation is free again;
//   - a router with --max_in_flight=2 refuses excess requests with
//     RESOURCE_EXHAUSTED while the admitted ones complete.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <atomic>
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
#include "tests/testing/subprocess.h"

namespace tandem {
namespace {

constexpr char kModel[] = "engine/model/tiny_checkpoint";

// The port a child logged in its "<msg>" line (JSON logs), polled with a bound.
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

absl::StatusOr<double> Metric(int port, const std::string& name,
                              const std::map<std::string, std::string>& labels) {
  auto get = metrics::HttpGet("127.0.0.1", port, "/metrics", absl::Seconds(5));
  if (!get.ok()) return get.status();
  auto parsed = metrics::ParseText(get->body);
  if (!parsed.ok()) return parsed.status();
  return parsed->Value(name, labels);
}

// Polls until the metric reaches `want` (bounded: gauges update asynchronously).
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
  std::string request_id;
};

Result Drain(grpc::ClientReaderInterface<tandem::v1::GenerateResponse>* reader,
             std::function<void(int)> after_message = nullptr) {
  Result r;
  tandem::v1::GenerateResponse m;
  while (reader->Read(&m)) {
    ++r.messages;
    if (!m.request_id().empty()) r.request_id = m.request_id();
    r.tokens.insert(r.tokens.end(), m.token_ids().begin(), m.token_ids().end());
    if (after_message) after_message(r.messages);
  }
  r.status = reader->Finish();
  return r;
}

tandem::v1::GenerateRequest Request(int len, uint64_t seed, int max_tokens,
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

// Router + one prefill + one decode worker, every port picked by the kernel.
class Cluster {
 public:
  // Returns an empty string when up, else what went wrong (with the logs).
  std::string Start(const std::vector<std::string>& router_flags, int decode_slots) {
    tmp_ = std::getenv("TEST_TMPDIR");
    std::vector<std::string> argv = {testing::RunfilePath("router/router_main"),
                                     std::string("--model=") + kModel,
                                     "--port=0",
                                     "--metrics_port=0",
                                     "--heartbeat_interval_s=0.2",
                                     "--heartbeat_timeout_s=30",
                                     "--log_format=json"};
    argv.insert(argv.end(), router_flags.begin(), router_flags.end());
    auto router = testing::Subprocess::Start(argv, tmp_ + "/router.log");
    if (!router.ok()) return std::string(router.status().message());
    router_ = std::make_unique<testing::Subprocess>(std::move(*router));
    router_port_ = LoggedPort(*router_, "router serving", "grpc_port");
    router_metrics_ = LoggedPort(*router_, "router serving", "metrics_port");
    if (router_port_ == 0) return "router did not log its port\n" + router_->ReadLog();
    for (const char* role : {"decode", "prefill"}) {
      auto w = testing::Subprocess::Start(
          {testing::RunfilePath(std::string(role) + "/" + role + "_main"),
           std::string("--model=") + kModel, std::string("--worker_id=") + role + "-0",
           "--router=127.0.0.1:" + std::to_string(router_port_), "--port=0",
           "--metrics_port=0",
           "--num_slots=" +
               std::to_string(std::string(role) == "decode" ? decode_slots : 8),
           "--max_context_tokens=512",
           // Every prompt is prefilled in one chunk however many arrive together:
           // the engine guarantees equal tokens for equal per-sequence chunk
           // schedules, while a different split of a prompt differs in fp32
           // rounding, enough to flip a seeded sample now and then.
           std::string(role) == "prefill" ? "--max_tokens_per_step=16384"
                                          : "--max_tokens_per_step=256",
           "--log_format=json"},
          tmp_ + "/" + role + ".log");
      if (!w.ok()) return std::string(w.status().message());
      (std::string(role) == "decode" ? decode_ : prefill_) =
          std::make_unique<testing::Subprocess>(std::move(*w));
    }
    decode_metrics_ = LoggedPort(*decode_, "worker serving", "metrics_port");
    prefill_metrics_ = LoggedPort(*prefill_, "worker serving", "metrics_port");
    if (decode_metrics_ == 0 || prefill_metrics_ == 0)
      return "no worker ports\n" + Logs();
    for (const char* role : {"prefill", "decode"}) {
      if (!WaitMetric(router_metrics_, "tandem_router_workers", {{"role", role}}, 1)) {
        return std::string(role) + " did not register\n" + Logs();
      }
    }
    stub_ = tandem::v1::Router::NewStub(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(router_port_),
                            grpc::InsecureChannelCredentials()));
    return "";
  }

  Result Generate(const tandem::v1::GenerateRequest& req,
                  std::function<void(int)> after_message = nullptr) {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(60));
    return Drain(stub_->Generate(&ctx, req).get(), std::move(after_message));
  }

  std::string Logs() const {
    std::string out;
    if (router_) out += "--- router\n" + router_->ReadLog();
    if (prefill_) out += "--- prefill\n" + prefill_->ReadLog();
    if (decode_) out += "--- decode\n" + decode_->ReadLog();
    return out;
  }

  std::string tmp_;
  int router_port_ = 0, router_metrics_ = 0, decode_metrics_ = 0, prefill_metrics_ = 0;
  std::unique_ptr<testing::Subprocess> router_, prefill_, decode_;
  std::unique_ptr<tandem::v1::Router::Stub> stub_;
};

TEST(ClusterConcurrencyTest, SixtyFourConcurrentStreamsMatchTheirSoloRuns) {
  Cluster c;
  // More slots than streams: the router skips a decode worker whose heartbeat
  // free slots minus its own in-flight count reach 0, and both count running
  // requests (see the report), so 64 slots would refuse some of 64 streams.
  const std::string err = c.Start({}, /*decode_slots=*/160);
  ASSERT_EQ(err, "");
  constexpr int kStreams = 64;
  std::vector<tandem::v1::GenerateRequest> reqs;
  for (int i = 0; i < kStreams; ++i) {
    // Prompt lengths 2..~190 tokens (several KV blocks), outputs 3..10 tokens;
    // every third stream greedy, the others seeded at temperature 0.8.
    tandem::v1::GenerateRequest req =
        Request(2 + (i * 37) % 190, 1000 + i, 3 + i % 8, i % 3 == 0 ? 0.0f : 0.8f);
    req.set_request_id("conc-" + std::to_string(i));
    reqs.push_back(req);
  }
  std::vector<std::future<Result>> calls;
  for (int i = 0; i < kStreams; ++i) {
    calls.push_back(
        std::async(std::launch::async, [&c, &reqs, i] { return c.Generate(reqs[i]); }));
  }
  std::vector<Result> concurrent;
  for (auto& f : calls) concurrent.push_back(f.get());
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(concurrent[i].status.ok())
        << "stream " << i << ": " << concurrent[i].status.error_message() << c.Logs();
    EXPECT_EQ(concurrent[i].request_id, reqs[i].request_id());
    EXPECT_GE(concurrent[i].tokens.size(), 1u) << "stream " << i;
    EXPECT_LE(concurrent[i].tokens.size(), reqs[i].stop().max_tokens())
        << "stream " << i;
  }
  // The same requests alone, one at a time.
  for (int i = 0; i < kStreams; ++i) {
    tandem::v1::GenerateRequest solo = reqs[i];
    solo.set_request_id("solo-" + std::to_string(i));
    Result r = c.Generate(solo);
    ASSERT_TRUE(r.status.ok()) << "solo " << i << ": " << r.status.error_message();
    EXPECT_EQ(concurrent[i].tokens, r.tokens) << "stream " << i;
  }
  EXPECT_EQ(*Metric(c.router_metrics_, "tandem_router_paths_total",
                    {{"path", "disaggregated"}}),
            2 * kStreams);
  // Every engine block, landing block and reservation is free again.
  for (int port : {c.decode_metrics_, c.prefill_metrics_}) {
    EXPECT_TRUE(
        WaitMetric(port, "tandem_worker_kv_cache_blocks", {{"state", "used"}}, 0))
        << "port " << port;
  }
  EXPECT_TRUE(WaitMetric(c.decode_metrics_, "tandem_worker_landing_blocks",
                         {{"state", "used"}}, 0));
  EXPECT_TRUE(WaitMetric(c.decode_metrics_, "tandem_worker_reservations", {}, 0));
  EXPECT_TRUE(WaitMetric(c.router_metrics_, "tandem_router_requests_in_flight", {}, 0));
}

TEST(ClusterConcurrencyTest, ExcessRequestsGetResourceExhausted) {
  Cluster c;
  const std::string err = c.Start({"--max_in_flight=2"}, /*decode_slots=*/4);
  ASSERT_EQ(err, "");
  // Two long streams take the router's two places; once both have streamed a
  // token the decode worker is frozen (SIGSTOP), so they stay in flight...
  std::atomic<int> started{0};
  std::vector<std::future<Result>> admitted;
  for (int i = 0; i < 2; ++i) {
    tandem::v1::GenerateRequest req = Request(10 + i, 7 + i, 300, 0.0f);
    req.mutable_stop()->set_ignore_eos(true);
    admitted.push_back(std::async(std::launch::async, [&c, &started, req] {
      return c.Generate(req, [&c, &started](int n) {
        if (n == 1 && ++started == 2) c.decode_->Signal(SIGSTOP);
      });
    }));
  }
  ASSERT_TRUE(WaitMetric(c.router_metrics_, "tandem_router_requests_in_flight", {}, 2))
      << c.Logs();
  const absl::Time end = absl::Now() + absl::Seconds(30);
  while (started.load() < 2 && absl::Now() < end) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(started.load(), 2) << c.Logs();
  // ...and concurrent extra requests are refused.
  std::vector<std::future<Result>> extra;
  for (int i = 0; i < 6; ++i) {
    extra.push_back(std::async(std::launch::async, [&c, i] {
      return c.Generate(Request(5, 100 + i, 4, 0.0f));
    }));
  }
  for (auto& f : extra) {
    Result r = f.get();
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << r.status.error_message();
    EXPECT_NE(r.status.error_message().find("limit"), std::string::npos)
        << r.status.error_message();
    EXPECT_TRUE(r.tokens.empty());
  }
  EXPECT_EQ(*Metric(c.router_metrics_, "tandem_router_requests_in_flight", {}), 2);
  c.decode_->Signal(SIGCONT);
  for (auto& f : admitted) {
    Result r = f.get();
    ASSERT_TRUE(r.status.ok()) << r.status.error_message() << c.Logs();
    EXPECT_EQ(r.tokens.size(), 300u);
  }
  // Places are given back: a new request is admitted again.
  ASSERT_TRUE(WaitMetric(c.router_metrics_, "tandem_router_requests_in_flight", {}, 0));
  Result after = c.Generate(Request(5, 100, 4, 0.0f));
  EXPECT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(*Metric(c.router_metrics_, "tandem_router_requests_total",
                    {{"outcome", "resource_exhausted"}}),
            6);
}

}  // namespace
}  // namespace tandem
