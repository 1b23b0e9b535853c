// The KV transfer flags prefill_main and decode_main share reach the agents'
// configuration (--kv_progress_timeout, --kv_require_rdma; issue 19).
#include "worker/worker_flags.h"

#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "common/flag_names.h"
#include "gtest/gtest.h"

namespace tandem::worker {
namespace {

using kvtransfer::UcxRdmaRequirement;

TEST(KvProgressTimeoutTest, Parses) {
  const std::pair<const char*, absl::Duration> ok[] = {
      {"10s", absl::Seconds(10)},        {"500ms", absl::Milliseconds(500)},
      {"1m", absl::Minutes(1)},          {"2.5", absl::Milliseconds(2500)},
      {"3", absl::Seconds(3)},           {" 1s ", absl::Seconds(1)},
      {"inf", absl::InfiniteDuration()}, {"off", absl::InfiniteDuration()},
      {"INF", absl::InfiniteDuration()},
  };
  for (const auto& [spec, want] : ok) {
    auto d = ParseKvProgressTimeout(spec);
    ASSERT_TRUE(d.ok()) << spec << ": " << d.status();
    EXPECT_EQ(*d, want) << spec;
  }
  for (const char* bad : {"", "0", "0s", "-1s", "-2", "ten", "10 s", "nan"}) {
    EXPECT_EQ(ParseKvProgressTimeout(bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(LibfabricRdmaTest, SocketProvidersRefusedOnlyWhenRequired) {
  struct Case {
    const char* provider;
    UcxRdmaRequirement requirement;
    bool refused;
  };
  const Case cases[] = {
      {"tcp;ofi_rxm", UcxRdmaRequirement::kRequired, true},
      {"sockets", UcxRdmaRequirement::kRequired, true},
      {"udp;ofi_rxd", UcxRdmaRequirement::kRequired, true},
      {"efa", UcxRdmaRequirement::kRequired, false},
      {"shm", UcxRdmaRequirement::kRequired, false},
      {"tcp;ofi_rxm", UcxRdmaRequirement::kAuto, false},
      {"tcp;ofi_rxm", UcxRdmaRequirement::kNotRequired, false},
  };
  for (const Case& c : cases) {
    const absl::Status st = CheckLibfabricRdma(c.provider, c.requirement);
    EXPECT_EQ(!st.ok(), c.refused) << c.provider << ": " << st;
    if (c.refused) {
      EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_NE(st.message().find(c.provider), absl::string_view::npos) << st;
    }
  }
}

class AgentConfigFromFlagsTest : public ::testing::Test {
 protected:
  void TearDown() override {
    absl::SetFlag(&FLAGS_kv_progress_timeout, "10s");
    absl::SetFlag(&FLAGS_kv_require_rdma, "auto");
    absl::SetFlag(&FLAGS_kv_transport, "ucx");
  }
};

TEST_F(AgentConfigFromFlagsTest, Defaults) {
  auto c = AgentConfigFromFlags("w");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->transport, kvtransfer::KvTransport::kUcx);
  EXPECT_EQ(c->ucx.progress_timeout, absl::Seconds(10));
  EXPECT_EQ(c->libfabric.progress_timeout, absl::Seconds(10));
  EXPECT_EQ(c->ucx.require_rdma, UcxRdmaRequirement::kAuto);
  EXPECT_EQ(c->ucx.name, "w");
}

// Both spellings of the flags, as prefill_main / decode_main parse them
// (NormalizeFlagNames, then Abseil), reach both agents' options.
TEST_F(AgentConfigFromFlagsTest, HyphenatedAndUnderscoredFlagsReachTheAgents) {
  for (const char* name : {"--kv-progress-timeout", "--kv_progress_timeout"}) {
    const std::vector<std::string> args =
        NormalizeFlagNames({"prefill_main", absl::StrCat(name, "=1500ms"),
                            "--kv-require-rdma=true", "--kv-transport=libfabric:shm"});
    ASSERT_EQ(args.size(), 4u);
    for (size_t i = 1; i < args.size(); ++i) {
      const std::string& a = args[i];
      ASSERT_EQ(a.rfind("--", 0), 0u) << a;
      const size_t eq = a.find('=');
      absl::CommandLineFlag* flag = absl::FindCommandLineFlag(a.substr(2, eq - 2));
      ASSERT_NE(flag, nullptr) << a;
      std::string error;
      ASSERT_TRUE(flag->ParseFrom(a.substr(eq + 1), &error)) << a << ": " << error;
    }
    auto c = AgentConfigFromFlags("w");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->transport, kvtransfer::KvTransport::kLibfabric);
    EXPECT_EQ(c->libfabric.provider, "shm");
    EXPECT_EQ(c->ucx.progress_timeout, absl::Milliseconds(1500)) << name;
    EXPECT_EQ(c->libfabric.progress_timeout, absl::Milliseconds(1500)) << name;
    EXPECT_EQ(c->ucx.require_rdma, UcxRdmaRequirement::kRequired);
    TearDown();
  }
}

TEST_F(AgentConfigFromFlagsTest, OffAndBadValues) {
  absl::SetFlag(&FLAGS_kv_progress_timeout, "inf");
  absl::SetFlag(&FLAGS_kv_require_rdma, "false");
  auto c = AgentConfigFromFlags("w");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->ucx.progress_timeout, absl::InfiniteDuration());
  EXPECT_EQ(c->libfabric.progress_timeout, absl::InfiniteDuration());
  EXPECT_EQ(c->ucx.require_rdma, UcxRdmaRequirement::kNotRequired);

  absl::SetFlag(&FLAGS_kv_progress_timeout, "soon");
  auto bad = AgentConfigFromFlags("w");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--kv_progress_timeout"),
            absl::string_view::npos)
      << bad.status();

  absl::SetFlag(&FLAGS_kv_progress_timeout, "10s");
  absl::SetFlag(&FLAGS_kv_require_rdma, "rdma");
  bad = AgentConfigFromFlags("w");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("--kv_require_rdma"), absl::string_view::npos)
      << bad.status();
}

}  // namespace
}  // namespace tandem::worker

namespace tandem::worker {
namespace {

// Host-staged shadows: pages go back only when the shadows are large against
// the host's available memory, and never where an RDMA NIC may pin them.
TEST(StagingPageReleaseTest, LargeShadowsReleaseUnlessRdma) {
  constexpr int64_t kGiB = int64_t{1} << 30;
  struct Case {
    uint64_t shadow;
    int64_t available;
    bool rdma;
    bool release;
  } cases[] = {
      {1 * kGiB, 64 * kGiB, false, false},   // small: kept resident
      {16 * kGiB, 64 * kGiB, false, false},  // a quarter: still kept
      {16 * kGiB + 1, 64 * kGiB, false, true},
      {100 * kGiB, 64 * kGiB, false, true},
      {100 * kGiB, 64 * kGiB, true, false},  // pinned by the NIC: never
      {1 * kGiB, 0, false, true},            // unknown memory: bounded
      {1 * kGiB, -1, true, false},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(StagingPageRelease(c.shadow, c.available, c.rdma), c.release)
        << c.shadow << " of " << c.available << " rdma " << c.rdma;
  }
}

TEST(StagingPageReleaseTest, RdmaDevicesAreEntriesOfTheSysfsClass) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/ib";
  std::filesystem::create_directories(dir);
  EXPECT_FALSE(HostHasRdmaDevices(dir));
  std::filesystem::create_directories(dir + "/mlx5_0");
  EXPECT_TRUE(HostHasRdmaDevices(dir));
  EXPECT_FALSE(HostHasRdmaDevices(dir + "/missing"));
}

}  // namespace
}  // namespace tandem::worker
