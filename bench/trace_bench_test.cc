// trace_bench end to end on a tiny generated trace: --generate writes a valid trace,
// the replay spawns a cluster per configuration from the runfiles (two prefill
// workers, one decode worker), every request completes, and the JSON line's figures
// are sane: hit rates in [0, 1] and at most the ideal's neighbourhood, the cache-off
// run hits nothing and stores no snapshot, the token counts add up.
#include <sys/wait.h>

#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/subprocess.h"

namespace tandem {
namespace {

std::string Tmp(const std::string& name) {
  return std::string(std::getenv("TEST_TMPDIR")) + "/" + name;
}

// Runs trace_bench with `args`; its exit status and output.
std::pair<int, std::string> RunBench(const std::vector<std::string>& args,
                                     const std::string& log) {
  std::vector<std::string> argv = {testing::RunfilePath("bench/trace_bench")};
  argv.insert(argv.end(), args.begin(), args.end());
  auto proc = testing::Subprocess::Start(argv, log);
  EXPECT_TRUE(proc.ok()) << proc.status();
  if (!proc.ok()) return {-1, ""};
  auto status = proc->Wait(absl::Seconds(200));
  const std::string out = proc->ReadLog();
  EXPECT_TRUE(status.ok()) << out;
  if (!status.ok() || !WIFEXITED(*status)) return {-1, out};
  return {WEXITSTATUS(*status), out};
}

nlohmann::json LastLine(const std::string& out) {
  const std::string body = out.substr(0, out.find_last_not_of('\n') + 1);
  return nlohmann::json::parse(body.substr(body.rfind('\n') + 1), nullptr,
                               /*allow_exceptions=*/false);
}

TEST(TraceBenchTest, GeneratesAndReplaysATinyTrace) {
  const std::string trace = Tmp("chat.jsonl");
  auto [rc, out] = RunBench({"--generate=multiturn", "--out=" + trace, "--requests=8",
                             "--seed=3", "--sessions-per-s=4", "--think-ms=300"},
                            Tmp("gen.log"));
  ASSERT_EQ(rc, 0) << out;
  {
    std::ifstream f(trace);
    std::string line;
    int lines = 0;
    while (std::getline(f, line)) ++lines;
    EXPECT_EQ(lines, 8);
  }
  const std::string root = testing::RunfilePath("");
  std::tie(rc, out) =
      RunBench({"--trace=" + trace, "--bin_dir=" + root,
                "--model=" + testing::RunfilePath("engine/model/tiny_checkpoint"),
                "--length-scale=0.125", "--time-scale=0.5", "--max-output-tokens=4",
                "--configs=cache_aware,round_robin,cache_off", "--max-num-seqs=4",
                "--max-model-len=1024", "--kv-cache-memory=64MiB", "--timeout-s=60"},
               Tmp("replay.log"));
  ASSERT_EQ(rc, 0) << out;
  const nlohmann::json j = LastLine(out);
  ASSERT_TRUE(j.is_object()) << out;
  EXPECT_EQ(j["bench"], "trace");
  EXPECT_EQ(j["requests"].get<int>(), 8);
  EXPECT_EQ(j["prefill_workers"].get<int>(), 2);
  const double ideal = j["ideal_hit_rate"].get<double>();
  EXPECT_GT(ideal, 0) << out;  // later turns extend earlier ones
  EXPECT_LT(ideal, 1);
  const int64_t prompt_tokens = j["prompt_tokens"].get<int64_t>();
  for (const char* config : {"cache_aware", "round_robin", "cache_off"}) {
    SCOPED_TRACE(config);
    const nlohmann::json& c = j["configs"][config];
    ASSERT_TRUE(c.is_object()) << out;
    EXPECT_EQ(c["completed"].get<int>(), 8);
    EXPECT_EQ(c["failed"].get<int>(), 0);
    const double hit_rate = c["hit_rate"].get<double>();
    EXPECT_GE(hit_rate, 0);
    EXPECT_LE(hit_rate, 1);
    // Per-worker figures add up to the totals; hits never exceed what was queried.
    double hits = 0, queried = 0, computed = 0, snapshots = 0;
    int prefill_workers = 0;
    for (const auto& [id, w] : c["workers"].items()) {
      EXPECT_LE(w["hit_tokens"].get<double>(), w["queried_tokens"].get<double>()) << id;
      computed += w["prefill_tokens_computed"].get<double>();
      snapshots += w["snapshots_stored"].get<double>();
      if (id.rfind("prefill-", 0) == 0) {
        ++prefill_workers;
        hits += w["hit_tokens"].get<double>();
        queried += w["queried_tokens"].get<double>();
      }
    }
    EXPECT_EQ(prefill_workers, 2);
    EXPECT_EQ(hits, c["hit_tokens"].get<double>());
    EXPECT_EQ(queried, c["queried_tokens"].get<double>());
    EXPECT_EQ(computed, c["prefill_tokens_computed"].get<double>());
    EXPECT_EQ(snapshots, c["snapshots_stored"].get<double>());
    // Every prompt token is either computed or a hit (a preempted request may be
    // computed again: at least, not exactly).
    EXPECT_GE(computed + hits, prompt_tokens);
    // The router made one prefill choice per request (the readiness probe's is
    // before the run).
    double choices = 0;
    for (const auto& [reason, n] : c["router_choices"].items())
      choices += n.get<double>();
    EXPECT_EQ(choices, 8) << c["router_choices"].dump();
    EXPECT_GE(c["load_spread"].get<double>(), 1);
    EXPECT_LE(c["load_spread"].get<double>(), 2);  // at most all on one of two
    EXPECT_GT(c["ttft"]["p50_ms"].get<double>(), 0);
    EXPECT_LE(c["ttft"]["p50_ms"].get<double>(), c["ttft"]["p99_ms"].get<double>());
    EXPECT_LE(c["tpot"]["p50_ms"].get<double>(), c["tpot"]["p99_ms"].get<double>());
    if (std::string(config) == "cache_off") {
      EXPECT_EQ(c["prefix_caching"], false);
      EXPECT_EQ(c["hit_tokens"].get<double>(), 0);
      EXPECT_EQ(hit_rate, 0);
      EXPECT_EQ(c["snapshots_stored"].get<double>(), 0);
      EXPECT_GE(computed, prompt_tokens);
    } else {
      EXPECT_EQ(c["prefix_caching"], true);
      EXPECT_EQ(queried, prompt_tokens);  // one lookup per request
      // No cache beats one infinite cache on the same grid.
      EXPECT_LE(hit_rate, ideal + 1e-9);
      EXPECT_GT(c["snapshots_stored"].get<double>(), 0);
    }
  }
  EXPECT_TRUE(j["targets"].contains("ttft_p50_speedup"));
}

TEST(TraceBenchTest, ABadTraceLineIsAClearError) {
  const std::string trace = Tmp("bad.jsonl");
  {
    std::ofstream f(trace);
    f << R"({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]})"
      << "\n"
      << R"({"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": [1]})"
      << "\n";
  }
  auto [rc, out] = RunBench({"--trace=" + trace}, Tmp("bad.log"));
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("bad.jsonl: line 2: input_length 600 needs 2 hash_ids"),
            std::string::npos)
      << out;
  std::tie(rc, out) =
      RunBench({"--generate=chat", "--out=" + Tmp("x.jsonl")}, Tmp("g.log"));
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("unknown trace kind 'chat'"), std::string::npos) << out;
}

}  // namespace
}  // namespace tandem
