// UcxAgent-specific checks (the shared behaviour is in agent_conformance_test).
#include "kvtransfer/ucx_agent.h"

#include <vector>

#include "gtest/gtest.h"

namespace tandem::kvtransfer {
namespace {

TEST(UcxTransportsTest, ParsesLaneLines) {
  const char* info =
      "#\n# UCP endpoint\n#\n#               peer: <no debug data>\n"
      "#                 lane[0]:  8:posix/memory.0 md[4]           -> "
      "md[4]/posix/sysdev[255] am am_bw#0\n"
      "#                 lane[1]:  3:cma/memory.0 md[2]             -> "
      "md[2]/cma/sysdev[255] rma_bw#0\n"
      "#                 lane[2]:  9:posix/memory.0 md[4]           -> "
      "md[4]/posix/sysdev[255] rma_bw#1\n"
      "#\n#                tag_send: 0..<egr/short>..inf\n";
  EXPECT_EQ(ParseUcxTransports(info), "posix,cma");
  EXPECT_EQ(ParseUcxTransports("#  lane[0]:  1:tcp/lo.0 md[1] -> md[1]/tcp am\n"),
            "tcp");
  EXPECT_EQ(ParseUcxTransports(""), "");
  EXPECT_EQ(ParseUcxTransports("lane[0]: garbage"), "");
}

TEST(UcxAgentTest, RejectsBadConfig) {
  UcxAgentConfig bad;
  bad.max_inflight_ops = 0;
  EXPECT_EQ(UcxAgent::Create(bad).status().code(), absl::StatusCode::kInvalidArgument);
  UcxAgentConfig garbled;
  garbled.ucx_options = {{"RNDV_THRESH", "not-a-size"}};
  auto agent = UcxAgent::Create(garbled);
  ASSERT_FALSE(agent.ok());
  EXPECT_NE(agent.status().message().find("RNDV_THRESH"), std::string::npos)
      << agent.status();
}

TEST(UcxAgentTest, TcpTransportIsReported) {
  UcxAgentConfig config;
  config.tls = "tcp";
  auto a = UcxAgent::Create(config);
  auto b = UcxAgent::Create(config);
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<uint8_t> mem(4096, 1);
  ASSERT_TRUE((*b)->RegisterMemory(mem.data(), mem.size()).ok());
  auto peer = (*a)->Connect(*(*b)->LocalDescriptor());
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ((*a)->Transport(*peer), "tcp");
}

TEST(UcxAgentTest, BatchesAreForgottenOnceReported) {
  auto a = UcxAgent::Create({});
  auto b = UcxAgent::Create({});
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<uint8_t> src(1 << 16, 3), dst(1 << 16, 0);
  auto s = (*a)->RegisterMemory(src.data(), src.size());
  auto d = (*b)->RegisterMemory(dst.data(), dst.size());
  auto peer = (*a)->Connect(*(*b)->LocalDescriptor());
  ASSERT_TRUE(s.ok() && d.ok() && peer.ok());
  for (int i = 0; i < 20; ++i) {
    auto batch = (*a)->PostWrite(*peer, {{*s, 0, *d, 0, src.size()}});
    ASSERT_TRUE(batch.ok());
    ASSERT_TRUE((*a)->Wait(*batch, absl::Now() + absl::Seconds(10)).ok());
  }
  EXPECT_EQ((*a)->NumBatchesForTesting(), 0u);
  EXPECT_EQ(src, dst);
}

}  // namespace
}  // namespace tandem::kvtransfer
