// PeerCache: one connection per decode agent, reconnect after a drop, the
// agent's connect errors passed through.
#include "prefill/peer_cache.h"

#include <string>

#include "gtest/gtest.h"
#include "kvtransfer/loopback_agent.h"

namespace tandem::prefill {
namespace {

TEST(PeerCacheTest, OneConnectionPerDecodeAgentUntilDropped) {
  kvtransfer::LoopbackAgent self, decode_a, decode_b;
  PeerCache cache(&self);
  const std::string a = *decode_a.LocalDescriptor("pools a");
  const std::string b = *decode_b.LocalDescriptor();
  auto pa = cache.Get(a);
  ASSERT_TRUE(pa.ok()) << pa.status();
  // The same agent, even with another descriptor (new metadata): same peer.
  auto again = cache.Get(*decode_a.LocalDescriptor("pools a, later"));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *pa);
  auto pb = cache.Get(b);
  ASSERT_TRUE(pb.ok());
  EXPECT_NE(*pb, *pa);
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_EQ(self.NumPeers(), 2u);
  cache.Drop(*pa);
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_EQ(self.NumPeers(), 1u);  // disconnected
  auto fresh = cache.Get(a);
  ASSERT_TRUE(fresh.ok());
  EXPECT_NE(*fresh, *pa);
  EXPECT_EQ(self.NumPeers(), 2u);
}

TEST(PeerCacheTest, ErrorsComeFromTheDescriptorAndTheAgent) {
  kvtransfer::LoopbackAgent self, decode;
  PeerCache cache(&self);
  EXPECT_EQ(cache.Get("not a descriptor").status().code(),
            absl::StatusCode::kInvalidArgument);
  const std::string d = *decode.LocalDescriptor();
  decode.Kill();
  EXPECT_EQ(cache.Get(d).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(cache.size(), 0u);
}

}  // namespace
}  // namespace tandem::prefill
