// Queueing instead of refusing, end to end with real processes on localhost
// (router_main + prefill_main + decode_main, tiny checkpoint): a decode worker
// with room for two requests at once gets sixteen concurrent greedy requests;
// the router queues the rest (tandem_router_queue_*), every one completes, and
// each stream's tokens equal the same request run alone.
#include <grpcpp/grpcpp.h>

#include <string>
#include <vector>

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

}  // namespace
}  // namespace tandem
