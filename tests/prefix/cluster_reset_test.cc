// Router.ResetPrefixCache through the cluster (issue 17, item 7): the router
// fans the reset out to every live worker, and each drops its cached prefixes
// on its engine thread. A repeated prompt hits; after the reset the same prompt
// misses (the workers' hit counter does not move, the usage says 0 cached
// tokens), then hits again once recomputed. A request running while the cache
// is reset keeps its blocks (its tokens equal an undisturbed run's). A worker
// that cannot be reached is listed as failed, not counted as reset.
#include <signal.h>

#include <string>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "proto/router.grpc.pb.h"
#include "tests/prefix/prefix_metrics.h"
#include "tests/testing/process_cluster.h"

namespace tandem {
namespace {

using testing::In;
using testing::MakeRequest;
using testing::ProcessCluster;
using testing::StreamResult;

struct ResetResult {
  grpc::Status status;
  tandem::v1::ResetPrefixCacheResponse response;
};

ResetResult Reset(tandem::v1::Router::Stub& stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(In(30));
  ResetResult r;
  r.status = stub.ResetPrefixCache(&ctx, {}, &r.response);
  return r;
}

std::vector<std::string> Ids(const google::protobuf::RepeatedPtrField<std::string>& f) {
  return {f.begin(), f.end()};
}

TEST(ClusterResetTest, ResetMakesTheNextRepeatMissThenItHitsAgain) {
  ProcessCluster c;
  ASSERT_EQ(c.Start({}, /*decode_slots=*/4), "");
  auto stub = tandem::v1::Router::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(c.router_port()),
                          grpc::InsecureChannelCredentials()));
  auto req = [](const std::string& id) {
    tandem::v1::GenerateRequest r = MakeRequest(300, 11, 3, 0.0f);
    r.set_request_id(id);
    return r;
  };
  const StreamResult first = c.Generate(req("r1"));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message() << c.Logs();
  EXPECT_EQ(first.usage.cached_prompt_tokens(), 0);
  const double h0 = testing::SettledPrefixHitTokens(c);
  const StreamResult hit = c.Generate(req("r2"));
  ASSERT_TRUE(hit.status.ok()) << hit.status.error_message();
  const double h1 = testing::SettledPrefixHitTokens(c);
  ASSERT_GT(hit.usage.cached_prompt_tokens(), 0) << "the repeat did not hit";
  EXPECT_EQ(h1 - h0, hit.usage.cached_prompt_tokens());

  const ResetResult reset = Reset(*stub);
  ASSERT_TRUE(reset.status.ok()) << reset.status.error_message();
  EXPECT_EQ(Ids(reset.response.reset()),
            (std::vector<std::string>{"prefill-0", "decode-0"}));
  EXPECT_EQ(reset.response.failed_size(), 0) << reset.response.DebugString();

  const StreamResult miss = c.Generate(req("r3"));
  ASSERT_TRUE(miss.status.ok()) << miss.status.error_message();
  EXPECT_EQ(miss.usage.cached_prompt_tokens(), 0) << "hit a prefix the reset dropped";
  EXPECT_EQ(testing::SettledPrefixHitTokens(c), h1);
  EXPECT_EQ(miss.tokens, first.tokens);

  const StreamResult again = c.Generate(req("r4"));
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_EQ(again.usage.cached_prompt_tokens(), hit.usage.cached_prompt_tokens());
  EXPECT_EQ(testing::SettledPrefixHitTokens(c), h1 + hit.usage.cached_prompt_tokens());
  EXPECT_EQ(again.tokens, first.tokens);

  // A reset while a request decodes: the request keeps its blocks, so its
  // tokens are an undisturbed run's.
  tandem::v1::GenerateRequest longer = MakeRequest(200, 12, 24, 0.0f);
  longer.set_request_id("long-1");
  const StreamResult reference = c.Generate(longer);
  ASSERT_TRUE(reference.status.ok()) << reference.status.error_message();
  ASSERT_GT(reference.tokens.size(), 4u);
  longer.set_request_id("long-2");
  ResetResult during;
  const StreamResult disturbed = c.Generate(longer, [&](int n) {
    if (n == 2) during = Reset(*stub);
  });
  ASSERT_TRUE(disturbed.status.ok()) << disturbed.status.error_message();
  ASSERT_TRUE(during.status.ok()) << during.status.error_message();
  EXPECT_EQ(during.response.reset_size(), 2);
  EXPECT_EQ(disturbed.tokens, reference.tokens);

  // A dead worker (still registered: the router's heartbeat timeout is 30 s
  // here) is reported as failed; the live one is reset.
  c.prefill().Signal(SIGKILL);
  ASSERT_TRUE(c.prefill().Wait(absl::Seconds(10)).ok());
  const ResetResult partial = Reset(*stub);
  ASSERT_TRUE(partial.status.ok()) << partial.status.error_message();
  EXPECT_EQ(Ids(partial.response.reset()), std::vector<std::string>{"decode-0"});
  ASSERT_EQ(partial.response.failed_size(), 1) << partial.response.DebugString();
  EXPECT_EQ(partial.response.failed(0).worker_id(), "prefill-0");
  EXPECT_EQ(partial.response.failed(0).role(), "prefill");
  EXPECT_NE(partial.response.failed(0).error().find("UNAVAILABLE"), std::string::npos)
      << partial.response.failed(0).error();
}

}  // namespace
}  // namespace tandem
