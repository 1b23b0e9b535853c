// UcxAgent-specific checks (the shared behaviour is in agent_conformance_test).
#include "kvtransfer/ucx_agent.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kvtransfer/descriptor.h"

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

TEST(UcxTransportsTest, DescribesEachLane) {
  const char* info =
      "#                 lane[0]:  8:posix/memory.0 md[4]           -> "
      "md[4]/posix/sysdev[255] am am_bw#0\n"
      "#                 lane[1]:  3:cma/memory.0 md[2]             -> "
      "md[2]/cma/sysdev[255] rma_bw#0\n"
      "#                 lane[2]:  3:sysv/memory.0 md[2]           -> "
      "md[2]/sysv/sysdev[255]\n"
      "#                 lane[0]:  1:tcp/lo.0 md[0]                -> "
      "md[0]/tcp/sysdev[255] am am_bw#0 keepalive wireup\n";
  EXPECT_EQ(DescribeUcxLanes(info),
            "posix/memory.0 (am am_bw); cma/memory.0 (rma_bw); sysv/memory.0; "
            "tcp/lo.0 (am am_bw keepalive wireup)");
  EXPECT_EQ(DescribeUcxLanes("#  lane[0]: garbage\n"), "");
  EXPECT_EQ(DescribeUcxLanes(""), "");
}

TEST(UcxTransportsTest, TcpOnly) {
  const std::pair<const char*, bool> cases[] = {
      {"tcp", true},         {"tcp,tcp", true},          {"posix,cma", false},
      {"tcp,cma", false},    {"rc_mlx5,ud_mlx5", false}, {"", false},
      {"tcp_sockcm", false},
  };
  for (const auto& [t, want] : cases) EXPECT_EQ(UcxTransportsAreTcpOnly(t), want) << t;
}

// The transports UCX chose per peer reach on_peer_connected once the wire-up is
// done: TCP only with peer-failure detection on one host (UCX 1.13 keeps shared
// memory out then), shared memory without it.
TEST(UcxAgentTest, PeerTransportsAreReportedPerConnection) {
  for (bool detection : {true, false}) {
    std::vector<UcxPeerTransport> seen;
    UcxAgentConfig config;
    config.peer_failure_detection = detection;
    config.on_peer_connected = [&seen](const UcxPeerTransport& t) {
      seen.push_back(t);
    };
    auto a = UcxAgent::Create(config);
    config.on_peer_connected = nullptr;
    auto b = UcxAgent::Create(config);
    ASSERT_TRUE(a.ok() && b.ok());
    std::vector<uint8_t> mem(4096, 1);
    ASSERT_TRUE((*b)->RegisterMemory(mem.data(), mem.size()).ok());
    const std::string descriptor = *(*b)->LocalDescriptor();
    auto peer = (*a)->Connect(descriptor);
    ASSERT_TRUE(peer.ok()) << peer.status();
    ASSERT_EQ(seen.size(), 1u);
    const UcxPeerTransport& t = seen[0];
    EXPECT_EQ(t.transports, (*a)->Transport(*peer));
    EXPECT_FALSE(t.lanes.empty());
    EXPECT_NE(t.lanes.find(t.transports.substr(0, t.transports.find(','))),
              std::string::npos)
        << t.lanes;
    EXPECT_EQ(t.tcp_only, detection) << t.transports << ": " << t.lanes;
    if (detection) {
      EXPECT_EQ(t.transports, "tcp");
      EXPECT_NE(t.lanes.find("keepalive"), std::string::npos) << t.lanes;
    }
    ASSERT_TRUE((*a)->Connect(descriptor).ok());
    EXPECT_EQ(seen.size(), 2u);  // every connection
  }
}

TEST(UcxRdmaRequirementTest, Parses) {
  EXPECT_EQ(*ParseUcxRdmaRequirement("auto"), UcxRdmaRequirement::kAuto);
  EXPECT_EQ(*ParseUcxRdmaRequirement("true"), UcxRdmaRequirement::kRequired);
  EXPECT_EQ(*ParseUcxRdmaRequirement(" True"), UcxRdmaRequirement::kRequired);
  EXPECT_EQ(*ParseUcxRdmaRequirement("1"), UcxRdmaRequirement::kRequired);
  EXPECT_EQ(*ParseUcxRdmaRequirement("false"), UcxRdmaRequirement::kNotRequired);
  EXPECT_EQ(*ParseUcxRdmaRequirement("no"), UcxRdmaRequirement::kNotRequired);
  for (const char* bad : {"", "rdma", "2", "tcp"}) {
    EXPECT_EQ(ParseUcxRdmaRequirement(bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

// Which peers may carry KV: only a TCP-only peer is ever refused; auto refuses
// it where this host opened RDMA, true always, false never.
TEST(UcxRdmaRequirementTest, DecidesPerPeer) {
  const UcxRdmaRequirement kAuto = UcxRdmaRequirement::kAuto;
  const UcxRdmaRequirement kReq = UcxRdmaRequirement::kRequired;
  const UcxRdmaRequirement kNot = UcxRdmaRequirement::kNotRequired;
  const std::vector<std::string> no_rdma = {"tcp/eth0", "tcp/lo", "sysv/memory",
                                            "posix/memory", "cma/memory"};
  const std::vector<std::string> rdma = {"tcp/eth0", "rc_mlx5/mlx5_0:1",
                                         "ud_mlx5/mlx5_0:1", "sysv/memory"};
  struct Case {
    const char* transports;
    UcxRdmaRequirement requirement;
    const std::vector<std::string>* resources;
    bool refused;
  };
  const Case cases[] = {
      // One host over shared memory: fine under every setting.
      {"sysv,posix,cma", kAuto, &no_rdma, false},
      {"sysv,posix,cma", kReq, &no_rdma, false},
      {"sysv,posix,cma", kReq, &rdma, false},
      // RDMA lanes (with a tcp one beside them): fine.
      {"rc_mlx5,ud_mlx5", kReq, &rdma, false},
      {"tcp,rc_mlx5", kAuto, &rdma, false},
      // TCP only on a host without RDMA (CI, laptops, ./tandem up --kv-tcp,
      // UCX_TLS=tcp): auto lets it run, true refuses.
      {"tcp", kAuto, &no_rdma, false},
      {"tcp", kNot, &no_rdma, false},
      {"tcp", kReq, &no_rdma, true},
      // TCP only where this host has RDMA: the silent fallback.
      {"tcp", kAuto, &rdma, true},
      {"tcp", kReq, &rdma, true},
      {"tcp", kNot, &rdma, false},
      // Nothing parsed (ucp_ep_print_info unreadable): not judged TCP only.
      {"", kReq, &rdma, false},
  };
  for (const Case& c : cases) {
    UcxPeerTransport t;
    t.peer_agent_id = 0xabc123;
    t.transports = c.transports;
    t.lanes = "tcp/eth0.0 (am am_bw rma_bw keepalive wireup)";
    t.tcp_only = UcxTransportsAreTcpOnly(t.transports);
    const absl::Status st = CheckUcxPeerTransport(t, c.requirement, *c.resources);
    const std::string where =
        absl::StrCat(c.transports, " requirement ", static_cast<int>(c.requirement),
                     " rdma ", c.resources == &rdma);
    if (!c.refused) {
      EXPECT_TRUE(st.ok()) << where << ": " << st;
      continue;
    }
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << where;
    // Names the peer, its lanes, and the way out.
    EXPECT_NE(st.message().find("abc123"), absl::string_view::npos) << st;
    EXPECT_NE(st.message().find("tcp/eth0.0"), absl::string_view::npos) << st;
    EXPECT_NE(st.message().find("--kv_require_rdma=false"), absl::string_view::npos)
        << st;
    if (c.requirement == kAuto) {
      EXPECT_NE(st.message().find("rc_mlx5/mlx5_0:1"), absl::string_view::npos) << st;
    }
  }
}

// A real connection UCX makes over TCP only (peer-failure detection on one host
// keeps shared memory out) is refused with --kv_require_rdma=true: Connect fails
// naming the peer, the connection is still reported (counted), none is kept; the
// same agents connect with the requirement off.
TEST(UcxAgentTest, TcpOnlyPeerRefusedWhenRdmaRequired) {
  std::vector<UcxPeerTransport> seen;
  UcxAgentConfig config;
  config.peer_failure_detection = true;
  config.require_rdma = UcxRdmaRequirement::kRequired;
  config.on_peer_connected = [&seen](const UcxPeerTransport& t) { seen.push_back(t); };
  auto a = UcxAgent::Create(config);
  UcxAgentConfig plain;
  auto b = UcxAgent::Create(plain);
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<uint8_t> mem(4096, 1);
  ASSERT_TRUE((*b)->RegisterMemory(mem.data(), mem.size()).ok());
  const std::string descriptor = *(*b)->LocalDescriptor();
  auto peer = (*a)->Connect(descriptor);
  ASSERT_FALSE(peer.ok());
  EXPECT_EQ(peer.status().code(), absl::StatusCode::kFailedPrecondition)
      << peer.status();
  EXPECT_NE(peer.status().message().find("TCP only"), absl::string_view::npos)
      << peer.status();
  EXPECT_NE(peer.status().message().find(
                absl::StrCat(absl::Hex(ParseDescriptor(descriptor)->agent_id))),
            absl::string_view::npos)
      << peer.status();
  ASSERT_EQ(seen.size(), 1u);  // reported once, as refused
  EXPECT_TRUE(seen[0].tcp_only) << seen[0].transports;
  EXPECT_TRUE(seen[0].refused);
  EXPECT_EQ((*a)->NumPeers(), 0u);
  // Shared memory (detection off) passes the same requirement.
  config.peer_failure_detection = false;
  auto c = UcxAgent::Create(config);
  ASSERT_TRUE(c.ok());
  auto shm_peer = (*c)->Connect(descriptor);
  ASSERT_TRUE(shm_peer.ok()) << shm_peer.status();
  EXPECT_FALSE(UcxTransportsAreTcpOnly((*c)->Transport(*shm_peer)));
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_FALSE(seen[1].tcp_only);
  EXPECT_FALSE(seen[1].refused);
  // And with the requirement off, TCP only connects.
  config.peer_failure_detection = true;
  config.require_rdma = UcxRdmaRequirement::kNotRequired;
  auto d = UcxAgent::Create(config);
  ASSERT_TRUE(d.ok());
  auto tcp_peer = (*d)->Connect(descriptor);
  ASSERT_TRUE(tcp_peer.ok()) << tcp_peer.status();
  EXPECT_EQ((*d)->Transport(*tcp_peer), "tcp");
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_TRUE(seen[2].tcp_only);
  EXPECT_FALSE(seen[2].refused);  // allowed: counted, not refused
}

TEST(UcxAgentTest, RejectsBadConfig) {
  UcxAgentConfig bad;
  bad.max_inflight_ops = 0;
  EXPECT_EQ(UcxAgent::Create(bad).status().code(), absl::StatusCode::kInvalidArgument);
  UcxAgentConfig no_bytes;
  no_bytes.max_op_bytes = 0;
  EXPECT_EQ(UcxAgent::Create(no_bytes).status().code(),
            absl::StatusCode::kInvalidArgument);
  UcxAgentConfig garbled;
  garbled.ucx_options = {{"RNDV_THRESH", "not-a-size"}};
  auto agent = UcxAgent::Create(garbled);
  ASSERT_FALSE(agent.ok());
  EXPECT_NE(agent.status().message().find("RNDV_THRESH"), std::string::npos)
      << agent.status();
}

// CUDA device memory needs a UCX built with CUDA. Without one (this UCX 1.13
// has no cuda transports) registering it fails at once with a message that
// says what is missing, and nothing is registered; with one the registration
// needs a real GPU buffer, which the GPU check does.
TEST(UcxAgentTest, CudaMemoryNeedsAUcxBuiltWithCuda) {
  auto a = UcxAgent::Create({});
  ASSERT_TRUE(a.ok()) << a.status();
  if ((*a)->cuda_memory_supported()) GTEST_SKIP() << "this UCX moves CUDA memory";
  std::vector<uint8_t> mem(4096);
  auto r = (*a)->RegisterMemory(mem.data(), mem.size(), MemoryKind::Cuda(0));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("cuda:0"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("cuda_copy"), std::string::npos) << r.status();
  EXPECT_EQ((*a)->NumRegisteredRegions(), 0u);
  // Host memory still registers.
  EXPECT_TRUE((*a)->RegisterMemory(mem.data(), mem.size(), MemoryKind::Host()).ok());
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

// Segments longer than max_op_bytes go out in pieces, posted by the progress
// thread (inline_post_bytes 0), through a small window; both into plain memory and
// into UCX-allocated memory (the direct-copy path over shared memory), with and
// without the bandwidth protocols.
TEST(UcxAgentTest, LongSegmentsArePostedInPiecesAndArriveExactly) {
  for (const bool allocate : {false, true}) {
    for (const bool bandwidth : {false, true}) {
      SCOPED_TRACE(testing::Message()
                   << "allocate " << allocate << " bandwidth " << bandwidth);
      UcxAgentConfig config;
      config.peer_failure_detection = false;  // shared memory on one host
      config.max_op_bytes = 4097;
      config.inline_post_bytes = 0;
      config.max_inflight_ops = 3;
      config.bandwidth_protocols = bandwidth;
      auto a = UcxAgent::Create(config);
      auto b = UcxAgent::Create(config);
      ASSERT_TRUE(a.ok() && b.ok());
      const size_t n = (1 << 20) + 5;
      std::vector<uint8_t> src(n), back(n, 0), plain(n, 0);
      for (size_t i = 0; i < n; ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
      uint8_t* dst = plain.data();
      RegionId d = 0;
      if (allocate) {
        auto alloc = (*b)->AllocateMemory(n);
        ASSERT_TRUE(alloc.ok()) << alloc.status();
        dst = static_cast<uint8_t*>(alloc->base);
        d = alloc->region;
      } else {
        auto r = (*b)->RegisterMemory(plain.data(), n);
        ASSERT_TRUE(r.ok());
        d = *r;
      }
      auto s = (*a)->RegisterMemory(src.data(), n);
      auto k = (*a)->RegisterMemory(back.data(), n);
      auto peer = (*a)->Connect(*(*b)->LocalDescriptor());
      ASSERT_TRUE(s.ok() && k.ok() && peer.ok());
      // Three segments, swapped halves, odd lengths.
      const uint64_t h = n / 2;
      auto batch = (*a)->PostWrite(
          *peer,
          {{*s, 0, d, h, n - h}, {*s, n - h, d, 1, h - 1}, {*s, n - 1, d, 0, 1}});
      ASSERT_TRUE(batch.ok()) << batch.status();
      ASSERT_TRUE((*a)->Wait(*batch, absl::Now() + absl::Seconds(20)).ok());
      EXPECT_TRUE(std::equal(src.begin(), src.begin() + (n - h), dst + h));
      EXPECT_TRUE(std::equal(src.begin() + (n - h), src.end() - 1, dst + 1));
      EXPECT_EQ(dst[0], src[n - 1]);
      batch = (*a)->PostRead(*peer, {{*k, 0, d, 0, n}});
      ASSERT_TRUE(batch.ok()) << batch.status();
      ASSERT_TRUE((*a)->Wait(*batch, absl::Now() + absl::Seconds(20)).ok());
      EXPECT_TRUE(std::equal(back.begin(), back.end(), dst));
    }
  }
}

}  // namespace
}  // namespace tandem::kvtransfer
