// serving_bench end to end with a tiny load: it spawns both clusters from the
// runfiles, every request completes, each cluster served them on the intended
// path, the statistics are consistent, and the last line is the JSON summary.
// Workers with two sequences at once make disaggregated requests wait in the
// router's queue, which is reported apart from TTFT; --sampling_mix gives requests
// different sampling settings.
#include <sys/wait.h>

#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/subprocess.h"

namespace tandem {
namespace {

TEST(ServingBenchTest, SpawnsBothClustersAndReportsConsistentFigures) {
  const std::string root = testing::RunfilePath("");
  const std::string log = std::string(std::getenv("TEST_TMPDIR")) + "/bench.log";
  auto proc = testing::Subprocess::Start(
      {testing::RunfilePath("bench/serving_bench"), "--bin_dir=" + root,
       "--model=" + testing::RunfilePath("engine/model/tiny_checkpoint"),
       "--num_prompts=6", "--request_rate=0", "--input_len_min=4", "--input_len_max=40",
       "--output_len_min=3", "--output_len_max=6", "--overhead_prompts=2",
       "--max-num-seqs=2", "--max_model_len=256", "--slo_ttft_ms=1e9",
       "--slo_tpot_ms=1e9",
       "--sampling-mix=greedy,t=0.8:top_p=0.9,t=1:top_k=20:rep=1.1"},
      log);
  ASSERT_TRUE(proc.ok()) << proc.status();
  auto status = proc->Wait(absl::Seconds(120));
  const std::string out = proc->ReadLog();
  ASSERT_TRUE(status.ok()) << out;
  ASSERT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << out;
  // The last line is the JSON summary.
  std::string body = out.substr(0, out.find_last_not_of('\n') + 1);
  const std::string last = body.substr(body.rfind('\n') + 1);
  nlohmann::json j = nlohmann::json::parse(last, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(j.is_object()) << out;
  EXPECT_EQ(j["bench"], "serving");
  for (const char* mode : {"disaggregated", "colocated"}) {
    SCOPED_TRACE(mode);
    const nlohmann::json& r = j[mode];
    EXPECT_EQ(r["completed"].get<int>(), 6);
    EXPECT_EQ(r["failed"].get<int>(), 0);
    // Infinite SLOs: every request counts towards goodput.
    EXPECT_EQ(r["good_requests"].get<int>(), 6);
    EXPECT_GE(r["output_tokens"].get<int>(), 6 * 3);
    EXPECT_LE(r["output_tokens"].get<int>(), 6 * 6);
    EXPECT_GT(r["ttft"]["p50_ms"].get<double>(), 0);
    EXPECT_LE(r["ttft"]["p50_ms"].get<double>(), r["ttft"]["p99_ms"].get<double>());
    EXPECT_LE(r["ttft"]["p99_ms"].get<double>(), r["e2e"]["p99_ms"].get<double>());
    EXPECT_GT(r["output_throughput"].get<double>(), 0);
    EXPECT_EQ(r["refused"].get<int>(), 0);
    // The router's queue time, a histogram delta (the readiness probe's wait is
    // not among them).
    const nlohmann::json& q = r["queue"];
    ASSERT_TRUE(q.is_object()) << out;
    EXPECT_LE(q["waits"].get<double>(), 12);  // a woken request may wait again
    if (std::string(mode) == "disaggregated") {
      // Six requests on two decode sequences: some waited for a reservation at
      // the router. (Colocated, the decode worker admits them all and they wait
      // in its engine, not in the router's queue.)
      EXPECT_GE(q["waits"].get<double>(), 1);
      EXPECT_GT(q["total_s"].get<double>(), 0);
    }
    EXPECT_LE(q["p50_ms"].get<double>(), q["p99_ms"].get<double>());
    // Each request waited within its own end-to-end time.
    EXPECT_LE(q["total_s"].get<double>() * 1000, 6 * r["e2e"]["mean_ms"].get<double>());
  }
  int mixed = 0;
  for (const auto& [name, n] : j["sampling_mix"].items()) mixed += n.get<int>();
  EXPECT_EQ(mixed, 6);
  EXPECT_GE(j["sampling_mix"].size(), 2u) << j["sampling_mix"];
  // Six requests plus the readiness probe, each on its cluster's path.
  EXPECT_EQ(j["disaggregated"]["router_paths"]["disaggregated"].get<double>(), 7);
  EXPECT_EQ(j["disaggregated"]["router_paths"]["colocated"].get<double>(), 0);
  EXPECT_EQ(j["colocated"]["router_paths"]["colocated"].get<double>(), 7);
  EXPECT_EQ(j["colocated"]["router_paths"]["disaggregated"].get<double>(), 0);
  EXPECT_EQ(j["router_overhead"]["pairs"].get<int>(), 2);
}

}  // namespace
}  // namespace tandem
