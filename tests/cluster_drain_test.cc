// Graceful termination of a worker, end to end with real processes (router_main
// + prefill_main + decode_main, tiny checkpoint), as Kubernetes stops a pod:
//   - SIGTERM to the decode worker while it streams a long generation: the
//     worker reports itself draining, the router places nothing new on it (a
//     request sent meanwhile waits in the router's queue instead), the running
//     stream finishes with every token, and then the worker exits 0;
//   - with --drain_timeout_s=1 the wait is bounded: the worker stops within the
//     timeout plus the server's shutdown grace even though a stream is still
//     running, and that stream ends with an error, not a hang.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <atomic>
#include <future>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "proto/router.grpc.pb.h"
#include "tests/testing/process_cluster.h"

namespace tandem {
namespace {

using testing::MakeRequest;
using testing::ProcessCluster;
using testing::StreamResult;

// Long enough that decoding outlasts the server's 5 s shutdown grace (about
// 20 s on a 2-core machine, 8 s or more on a CI runner): without the drain,
// the stream would be cut there.
constexpr int kLongTokens = 10000;
const std::vector<std::string> kLongContext = {"--max_model_len=12288"};
// The bounded-drain test must still be streaming when the timeout and the
// grace have passed (6 s), on any machine: a CI runner once decoded 6000
// tokens within that. The stream is cut, so its length costs no test time.
constexpr int kCutTokens = 120000;
const std::vector<std::string> kCutContext = {"--max_model_len=131072"};

TEST(ClusterDrainTest, SigtermFinishesRunningStreamsAndTakesNoNewRequests) {
  ProcessCluster c;
  ASSERT_EQ(c.Start({}, /*decode_slots=*/4, kLongContext, kLongContext), "");
  tandem::v1::GenerateRequest long_req = MakeRequest(12, 7, kLongTokens, 0.0f);
  long_req.set_request_id("long");
  long_req.mutable_stop()->set_ignore_eos(true);
  absl::Time signalled = absl::InfiniteFuture();
  std::future<StreamResult> late;
  const StreamResult a = c.Generate(long_req, [&](int n) {
    if (n != 5) return;
    signalled = absl::Now();
    c.decode().Signal(SIGTERM);
    // Sent while the worker drains: the router has no available decode
    // worker, so it queues the request until its deadline.
    late = std::async(std::launch::async, [&c] {
      absl::SleepFor(absl::Milliseconds(500));
      tandem::v1::GenerateRequest r = MakeRequest(8, 9, 4, 0.0f);
      r.set_request_id("late");
      return c.GenerateWithin(r, absl::Seconds(3));
    });
  });
  const absl::Time a_done = absl::Now();
  ASSERT_TRUE(a.status.ok()) << a.status.error_message() << c.Logs();
  EXPECT_EQ(a.tokens.size(), static_cast<size_t>(kLongTokens)) << c.Logs();
  // The stream outlived the 5 s the server's shutdown would have given it.
  EXPECT_GT(a_done - signalled, absl::Seconds(5))
      << "decoding was too fast for the test";
  ASSERT_TRUE(late.valid());
  const StreamResult b = late.get();
  EXPECT_EQ(b.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << b.status.error_message();
  EXPECT_TRUE(b.tokens.empty());
  auto rc = c.decode().Wait(absl::Seconds(30));
  ASSERT_TRUE(rc.ok()) << rc.status() << c.Logs();
  EXPECT_EQ(*rc, 0);
  const std::string log = c.decode().ReadLog();
  EXPECT_NE(log.find("draining: no new requests"), std::string::npos) << log;
  EXPECT_NE(log.find("\"drained\""), std::string::npos) << log;
}

TEST(ClusterDrainTest, DrainTimeoutBoundsTheWait) {
  ProcessCluster c;
  std::vector<std::string> decode_flags = kCutContext;
  decode_flags.push_back("--drain_timeout_s=1");
  ASSERT_EQ(c.Start({}, /*decode_slots=*/4, kCutContext, decode_flags), "");
  tandem::v1::GenerateRequest long_req = MakeRequest(12, 7, kCutTokens, 0.0f);
  long_req.mutable_stop()->set_ignore_eos(true);
  absl::Time signalled = absl::InfiniteFuture();
  std::future<absl::StatusOr<int>> exited;
  const StreamResult a = c.Generate(long_req, [&](int n) {
    if (n != 5) return;
    signalled = absl::Now();
    c.decode().Signal(SIGTERM);
    exited = std::async(std::launch::async,
                        [&c] { return c.decode().Wait(absl::Seconds(30)); });
  });
  EXPECT_FALSE(a.status.ok()) << "the stream was expected to be cut";
  EXPECT_LT(a.tokens.size(), static_cast<size_t>(kCutTokens));
  ASSERT_TRUE(exited.valid());
  auto rc = exited.get();
  ASSERT_TRUE(rc.ok()) << rc.status() << c.Logs();
  EXPECT_EQ(*rc, 0);
  // 1 s of drain, at most 5 s of shutdown grace, and start-up slack.
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(12));
  const std::string log = c.decode().ReadLog();
  EXPECT_NE(log.find("drain ended with requests in flight"), std::string::npos) << log;
}

}  // namespace
}  // namespace tandem
