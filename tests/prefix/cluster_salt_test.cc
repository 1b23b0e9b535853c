// Prefix-cache namespaces through the cluster (issue 17): the router passes a
// request's cache_salt to the worker that computes its prompt, and the worker's
// engine hashes the prompt's blocks under it. The same prompt again with the same
// salt hits the cache; with another salt, or none, it does not (tenants never
// share cached state); and the tokens are the same either way. The request's
// usage carries the hit (Usage.cached_prompt_tokens).
#include <string>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "proto/router.grpc.pb.h"
#include "tests/prefix/prefix_metrics.h"
#include "tests/testing/process_cluster.h"

namespace tandem {
namespace {

using testing::MakeRequest;
using testing::ProcessCluster;
using testing::StreamResult;

TEST(ClusterSaltTest, SameSaltHitsAnotherSaltOrNoneDoesNot) {
  ProcessCluster c;
  ASSERT_EQ(c.Start({}, /*decode_slots=*/4), "");
  auto req = [](const std::string& salt, const std::string& id) {
    tandem::v1::GenerateRequest r = MakeRequest(300, 11, 3, 0.0f);
    if (!salt.empty()) r.set_cache_salt(salt);
    r.set_request_id(id);
    return r;
  };
  const StreamResult first = c.Generate(req("tenant-a", "a1"));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message() << c.Logs();
  const double h0 = testing::SettledPrefixHitTokens(c);
  const StreamResult again = c.Generate(req("tenant-a", "a2"));
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  const double h1 = testing::SettledPrefixHitTokens(c);
  EXPECT_GT(h1, h0) << "the same prompt under the same salt did not hit";
  EXPECT_EQ(again.tokens, first.tokens);
  // The router reports the hit in the request's usage (the gateway's
  // usage.prompt_tokens_details.cached_tokens): a multiple of the KDA chunk.
  EXPECT_EQ(first.usage.cached_prompt_tokens(), 0);
  EXPECT_GT(again.usage.cached_prompt_tokens(), 0);
  EXPECT_LT(again.usage.cached_prompt_tokens(), 300);
  EXPECT_EQ(again.usage.cached_prompt_tokens(), h1 - h0);
  for (const std::string salt : {"tenant-b", ""}) {
    const StreamResult other = c.Generate(req(salt, "other-" + salt));
    ASSERT_TRUE(other.status.ok()) << other.status.error_message();
    EXPECT_EQ(other.tokens, first.tokens);
    EXPECT_EQ(other.usage.cached_prompt_tokens(), 0) << "salt '" << salt << "'";
    EXPECT_EQ(testing::SettledPrefixHitTokens(c), h1)
        << "salt '" << salt << "' hit tenant-a's prefix";
  }
}

}  // namespace
}  // namespace tandem
