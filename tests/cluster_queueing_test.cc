// Queueing instead of refusing, end to end with real processes on localhost
// (router_main + prefill_main + decode_main, tiny checkpoint): a decode worker
// with room for two requests at once gets sixteen concurrent greedy requests;
// the router queues the rest (tandem_router_queue_*), every one completes, and
// each stream's tokens equal the same request run alone.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "proto/router.grpc.pb.h"
#include "tests/testing/process_cluster.h"

namespace tandem {
namespace {

using testing::MakeRequest;
using testing::Metric;
using testing::ProcessCluster;
using testing::StreamResult;
using testing::WaitMetric;

TEST(ClusterQueueingTest, SixteenRequestsOnTwoDecodeSlotsAllCompleteAsAlone) {
  ProcessCluster c;
  const std::string err = c.Start({}, /*decode_slots=*/2);
  ASSERT_EQ(err, "");
  constexpr int kStreams = 16;
  std::vector<tandem::v1::GenerateRequest> reqs;
  for (int i = 0; i < kStreams; ++i) {
    tandem::v1::GenerateRequest req =
        MakeRequest(3 + (i * 11) % 40, 2000 + i, 4 + i % 5, /*temperature=*/0.0f);
    req.set_request_id("queued-" + std::to_string(i));
    reqs.push_back(req);
  }
  const std::vector<StreamResult> concurrent = c.GenerateAll(reqs);
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(concurrent[i].status.ok())
        << "stream " << i << ": " << concurrent[i].status.error_message() << c.Logs();
    EXPECT_EQ(concurrent[i].request_id, reqs[i].request_id());
    EXPECT_GE(concurrent[i].tokens.size(), 1u) << "stream " << i;
  }
  // Some waited (two slots, sixteen requests), none was refused.
  EXPECT_GT(*Metric(c.router_metrics(), "tandem_router_queue_seconds_count", {}), 0);
  EXPECT_EQ(*Metric(c.router_metrics(), "tandem_router_requests_total",
                    {{"outcome", "resource_exhausted"}}),
            0);
  EXPECT_EQ(*Metric(c.router_metrics(), "tandem_router_rejections_total",
                    {{"reason", "queue_full"}}),
            0);
  EXPECT_TRUE(WaitMetric(c.router_metrics(), "tandem_router_queue_depth", {}, 0));
  for (int i = 0; i < kStreams; ++i) {
    tandem::v1::GenerateRequest solo = reqs[i];
    solo.set_request_id("solo-" + std::to_string(i));
    StreamResult r = c.Generate(solo);
    ASSERT_TRUE(r.status.ok()) << "solo " << i << ": " << r.status.error_message();
    EXPECT_EQ(concurrent[i].tokens, r.tokens) << "stream " << i;
  }
  EXPECT_TRUE(WaitMetric(c.decode_metrics(), "tandem_worker_reservations", {}, 0));
}

// The room a finished request leaves is used at once, not at the decode
// worker's next load report: two long requests fill both decode slots and run
// until a report counts them (heartbeats 4 s apart); two more queue. When the
// long ones end, the router credits their slots in its placement ledger, so the
// queued ones start then and end within a second, where waiting for the next
// report would add up to the 4 s interval.
TEST(ClusterQueueingTest, FreedRoomIsUsedBeforeTheNextHeartbeat) {
  ProcessCluster c;
  const std::string err =
      c.Start({"--heartbeat_interval_s=4", "--heartbeat_timeout_s=60"},
              /*decode_slots=*/2, {"--max_model_len=4096"}, {"--max_model_len=4096"});
  ASSERT_EQ(err, "");
  auto request = [](int i, int max_tokens) {
    tandem::v1::GenerateRequest req = MakeRequest(8 + i, 3000 + i, max_tokens, 0.0f);
    req.mutable_stop()->set_ignore_eos(true);
    req.set_request_id("paced-" + std::to_string(i));
    return req;
  };
  struct Run {
    StreamResult result;
    absl::Time end;
  };
  std::vector<Run> runs(4);
  auto start = [&](int i, int max_tokens) {
    return std::thread([&, i, max_tokens] {
      runs[i].result = c.Generate(request(i, max_tokens));
      runs[i].end = absl::Now();
    });
  };
  std::vector<std::thread> threads;
  threads.push_back(start(0, 2000));
  threads.push_back(start(1, 2000));
  // A load report with both running (the gauge is refreshed with the heartbeat).
  const bool covered = WaitMetric(c.decode_metrics(), "tandem_worker_running_requests",
                                  {}, 2, absl::Seconds(30));
  if (covered) {
    threads.push_back(start(2, 3));
    threads.push_back(start(3, 3));
  }
  for (std::thread& t : threads) t.join();
  ASSERT_TRUE(covered) << "no load report saw both long requests running\n" << c.Logs();
  for (const Run& r : runs) {
    ASSERT_TRUE(r.result.status.ok()) << r.result.status.error_message() << c.Logs();
  }
  ASSERT_EQ(runs[0].result.tokens.size(), 2000u);
  const absl::Time long_end = std::max(runs[0].end, runs[1].end);
  const absl::Time queued_end = std::max(runs[2].end, runs[3].end);
  std::cout << "queued requests ended " << (queued_end - long_end)
            << " after the long ones\n";
  EXPECT_GT(queued_end, long_end - absl::Seconds(1));  // they did wait
  EXPECT_LT(queued_end - long_end, absl::Seconds(1))
      << "the queued requests waited for a heartbeat";
}

}  // namespace
}  // namespace tandem
