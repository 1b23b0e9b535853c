// Concurrency end to end with real processes on localhost (router_main +
// prefill_main + decode_main, tiny checkpoint):
//   - 64 concurrent Generate streams (mixed prompt lengths, greedy and seeded)
//     all complete, and each stream's tokens equal the same request run alone
//     afterwards: no token is lost, duplicated or mixed between streams;
//   - afterwards every KV block, reserved block and reservation is free again;
//   - a router with --max_in_flight=2 queues excess requests (up to
//     --max_queued_requests=3) and refuses the rest with RESOURCE_EXHAUSTED
//     while the admitted ones complete; the queued ones complete after them.
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
#include "proto/router.grpc.pb.h"
#include "tests/testing/process_cluster.h"

namespace tandem {
namespace {

using testing::In;
using testing::MakeRequest;
using testing::Metric;
using testing::ProcessCluster;
using testing::StreamResult;
using testing::WaitMetric;

TEST(ClusterConcurrencyTest, SixtyFourConcurrentStreamsMatchTheirSoloRuns) {
  ProcessCluster c;
  // Exactly as many decode slots as streams: the router must not count a running
  // request twice (its own placements and the worker's reported load).
  // Every prompt is prefilled in one chunk however many arrive together: the
  // engine guarantees equal tokens for equal per-sequence chunk schedules,
  // while a different split of a prompt differs in fp32 rounding, enough to
  // flip a seeded sample now and then.
  const std::string err =
      c.Start({}, /*decode_slots=*/64, {"--max_tokens_per_step=16384"});
  ASSERT_EQ(err, "");
  constexpr int kStreams = 64;
  std::vector<tandem::v1::GenerateRequest> reqs;
  for (int i = 0; i < kStreams; ++i) {
    // Prompt lengths 2..~190 tokens (several KV blocks), outputs 3..10 tokens;
    // every third stream greedy, the others seeded at temperature 0.8.
    tandem::v1::GenerateRequest req =
        MakeRequest(2 + (i * 37) % 190, 1000 + i, 3 + i % 8, i % 3 == 0 ? 0.0f : 0.8f);
    req.set_request_id("conc-" + std::to_string(i));
    reqs.push_back(req);
  }
  const std::vector<StreamResult> concurrent = c.GenerateAll(reqs);
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
    StreamResult r = c.Generate(solo);
    ASSERT_TRUE(r.status.ok()) << "solo " << i << ": " << r.status.error_message();
    EXPECT_EQ(concurrent[i].tokens, r.tokens) << "stream " << i;
  }
  EXPECT_EQ(*Metric(c.router_metrics(), "tandem_router_paths_total",
                    {{"path", "disaggregated"}}),
            2 * kStreams);
  // Every engine block, reserved block and reservation is free again.
  for (int port : {c.decode_metrics(), c.prefill_metrics()}) {
    EXPECT_TRUE(
        WaitMetric(port, "tandem_worker_kv_cache_blocks", {{"state", "used"}}, 0))
        << "port " << port;
  }
  EXPECT_TRUE(WaitMetric(c.decode_metrics(), "tandem_worker_landing_blocks",
                         {{"state", "used"}}, 0));
  EXPECT_TRUE(WaitMetric(c.decode_metrics(), "tandem_worker_reservations", {}, 0));
  EXPECT_TRUE(
      WaitMetric(c.router_metrics(), "tandem_router_requests_in_flight", {}, 0));
}

TEST(ClusterConcurrencyTest, ExcessRequestsQueueThenGetResourceExhausted) {
  ProcessCluster c;
  const std::string err =
      c.Start({"--max_in_flight=2", "--max_queued_requests=3"}, /*decode_slots=*/4);
  ASSERT_EQ(err, "");
  // Two long streams take the router's two places; once both have streamed a
  // token the decode worker is frozen (SIGSTOP), so they stay in flight...
  std::atomic<int> started{0};
  std::vector<std::future<StreamResult>> admitted;
  for (int i = 0; i < 2; ++i) {
    tandem::v1::GenerateRequest req = MakeRequest(10 + i, 7 + i, 300, 0.0f);
    req.mutable_stop()->set_ignore_eos(true);
    admitted.push_back(std::async(std::launch::async, [&c, &started, req] {
      return c.Generate(req, [&c, &started](int n) {
        if (n == 1 && ++started == 2) c.decode().Signal(SIGSTOP);
      });
    }));
  }
  ASSERT_TRUE(WaitMetric(c.router_metrics(), "tandem_router_requests_in_flight", {}, 2))
      << c.Logs();
  const absl::Time end = absl::Now() + absl::Seconds(30);
  while (started.load() < 2 && absl::Now() < end) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(started.load(), 2) << c.Logs();
  // ...and of six concurrent extra requests three wait, three are refused.
  std::vector<std::future<StreamResult>> extra;
  for (int i = 0; i < 6; ++i) {
    extra.push_back(std::async(std::launch::async, [&c, i] {
      return c.Generate(MakeRequest(5, 100 + i, 4, 0.0f));
    }));
  }
  ASSERT_TRUE(WaitMetric(c.router_metrics(), "tandem_router_rejections_total",
                         {{"reason", "queue_full"}}, 3))
      << c.Logs();
  EXPECT_EQ(*Metric(c.router_metrics(), "tandem_router_queue_depth", {}), 3);
  EXPECT_EQ(*Metric(c.router_metrics(), "tandem_router_requests_in_flight", {}), 2);
  c.decode().Signal(SIGCONT);
  int refused = 0;
  for (auto& f : extra) {
    StreamResult r = f.get();
    if (r.status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++refused;
      EXPECT_NE(r.status.error_message().find("queue is full"), std::string::npos)
          << r.status.error_message();
      EXPECT_TRUE(r.tokens.empty());
    } else {
      EXPECT_TRUE(r.status.ok()) << r.status.error_message();
      EXPECT_EQ(r.tokens.size(), 4u);
    }
  }
  EXPECT_EQ(refused, 3);
  for (auto& f : admitted) {
    StreamResult r = f.get();
    ASSERT_TRUE(r.status.ok()) << r.status.error_message() << c.Logs();
    EXPECT_EQ(r.tokens.size(), 300u);
  }
  // Places are given back: a new request is admitted again.
  ASSERT_TRUE(
      WaitMetric(c.router_metrics(), "tandem_router_requests_in_flight", {}, 0));
  StreamResult after = c.Generate(MakeRequest(5, 100, 4, 0.0f));
  EXPECT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(*Metric(c.router_metrics(), "tandem_router_requests_total",
                    {{"outcome", "resource_exhausted"}}),
            3);
}

}  // namespace
}  // namespace tandem
