// Validates our exposition with the reference implementation's own checker:
// `promtool check metrics` (Debian package `prometheus`) parses the text with
// Prometheus's parser and lints it (counters end in _total, base units, help
// present...). The test fails, rather than skips, when promtool is missing.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "metrics/buckets.h"
#include "metrics/registry.h"
#include "metrics/text_format.h"

namespace tandem::metrics {
namespace {

struct PromtoolResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

std::string FindPromtool() {
  for (const char* path : {"/usr/bin/promtool", "/usr/local/bin/promtool"}) {
    if (access(path, X_OK) == 0) return path;
  }
  return "";
}

// Runs `promtool check metrics` with `text` on its stdin.
PromtoolResult CheckMetrics(const std::string& text) {
  const std::string promtool = FindPromtool();
  if (promtool.empty()) {
    ADD_FAILURE() << "promtool not found (/usr/bin/promtool): run `./tandem setup` to "
                     "install the Debian package `prometheus`";
    return {};
  }
  const char* tmpdir = std::getenv("TEST_TMPDIR");
  const std::string input = absl::StrCat(
      tmpdir != nullptr ? tmpdir : "/tmp", "/promtool_input_", getpid(), "_",
      ::testing::UnitTest::GetInstance()->current_test_info()->name());
  {
    std::ofstream out(input, std::ios::binary);
    out << text;
  }
  const std::string command =
      absl::StrCat(promtool, " check metrics < '", input, "' 2>&1");
  PromtoolResult result;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) {
    ADD_FAILURE() << "popen failed: " << command;
    return result;
  }
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) result.output.append(buf, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::remove(input.c_str());
  return result;
}

TEST(PromtoolTest, EveryTypeAndTrickyLabelsPassWithZeroProblems) {
  Registry registry;
  auto* requests = *registry.AddCounter(
      "tandem_requests_total", "Requests received, by route.\nSecond \\ line.");
  auto* tokens =
      *registry.AddCounter("tandem_generated_tokens_total", "Tokens generated.");
  auto* kv_bytes = *registry.AddGauge("tandem_kv_cache_used_bytes", "KV cache in use.");
  auto* queue = *registry.AddGauge("tandem_queue_depth_requests", "Requests waiting.");
  auto* ttft =
      *registry.AddHistogram("tandem_time_to_first_token_seconds",
                             "Time to first token.", *ExponentialBuckets(0.001, 2, 16));
  auto* batch = *registry.AddHistogram("tandem_batch_size_requests", "Batch sizes.",
                                       *LinearBuckets(1, 8, 8));

  requests->Add({{"route", "prefill"}, {"code", "200"}}).Increment(12);
  requests->Add({{"route", "quote\" backslash\\ newline\n end"}, {"code", "500"}})
      .Increment();
  requests
      ->Add({{"route", "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80"},
             {"code", ""}})
      .Increment(0.5);
  tokens->Add({}).Increment(1e12);
  kv_bytes->Add({{"pool", "gpu"}}).Set(3.5e10);
  kv_bytes->Add({{"pool", "host"}}).Set(0);
  queue->Add({}).Set(-1);
  queue->Add({{"shard", "nan"}}).Set(std::nan(""));
  Histogram& h = ttft->Add({{"model", "kimi-k3"}, {"le_like", "{}=,"}});
  for (double v : {0.0005, 0.001, 0.0123, 0.5, 1.7, 100.0}) h.Observe(v);
  batch->Add({}).Observe(33);

  const std::string text = SerializeText(registry.Collect());
  PromtoolResult result = CheckMetrics(text);
  EXPECT_EQ(result.exit_code, 0) << result.output << "\n--- input ---\n" << text;
  EXPECT_EQ(result.output, "") << "promtool reported problems:\n" << result.output;
}

TEST(PromtoolTest, CheckIsLiveCounterWithoutTotalIsReported) {
  Registry registry;
  auto* bad = *registry.AddCounter("tandem_requests", "Requests, badly named.");
  bad->Add({}).Increment();
  PromtoolResult result = CheckMetrics(SerializeText(registry.Collect()));
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_NE(
      result.output.find("tandem_requests counter metrics should have \"_total\""),
      std::string::npos)
      << result.output;
}

TEST(PromtoolTest, CheckIsLiveSyntaxErrorIsReported) {
  PromtoolResult result = CheckMetrics("tandem_x_total{a=\"1} 1\n");
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("parsing error"), std::string::npos) << result.output;
}

}  // namespace
}  // namespace tandem::metrics
