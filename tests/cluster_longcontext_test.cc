// Long context through the whole disaggregated cluster (router_main +
// prefill_main + decode_main on localhost, tiny checkpoint, state streamed layer
// by layer over UCX): a 16,000-token prompt gets exactly the greedy tokens of
// the single-process engine, and each worker's peak RSS stays within its cache
// budget plus the mapped weights plus a bound for one step's activations and
// the process itself. The decode reservation, made before the prefill starts,
// outlives it although the prefill takes ten times the router's --lease_ms.
#include <grpcpp/grpcpp.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"
#include "tests/testing/process_cluster.h"

namespace tandem {
namespace {

using testing::MakeRequest;
using testing::Metric;
using testing::ProcessCluster;
using testing::StreamResult;

constexpr int kPromptTokens = 16000;
constexpr int kOutputTokens = 8;
constexpr int64_t kCacheBudget = int64_t{64} << 20;  // --kv_cache_memory=64MiB
// One step's activations (256 tokens: the MLA scores against 16k keys, the MoE
// and vocabulary rows) and the process (gRPC, UCX, allocator arenas).
constexpr int64_t kStepAndProcessBound = int64_t{160} << 20;

// VmHWM (peak resident set) of process `pid`, in bytes; -1 if unreadable.
int64_t PeakRss(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, "VmHWM:")) continue;
    rest = absl::StripAsciiWhitespace(rest);
    absl::ConsumeSuffix(&rest, "kB");
    int64_t kb = 0;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(rest), &kb)) return kb * 1024;
  }
  return -1;
}

int64_t DirectoryBytes(const std::string& dir) {
  int64_t total = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.is_regular_file()) total += static_cast<int64_t>(e.file_size());
  }
  return total;
}

// The same prompt on one engine in this process (no router, no transfer).
std::vector<int32_t> SingleProcessTokens(const tandem::v1::GenerateRequest& req) {
  std::unique_ptr<kernels::Backend> backend = engine::testing::MakeBackend("cpu");
  engine::EngineOptions o;  // the workers' step budget and block size
  o.num_slots = 1;
  o.max_tokens_per_step = 256;
  o.max_context_tokens = kPromptTokens + kOutputTokens + 1;
  auto e = engine::Engine::Create(&engine::testing::TinyWeights(), backend.get(),
                                  nullptr, o);
  EXPECT_TRUE(e.ok()) << e.status();
  std::vector<int32_t> prompt(req.prompt_token_ids().ids().begin(),
                              req.prompt_token_ids().ids().end());
  engine::SamplingParams p;
  p.max_tokens = kOutputTokens;
  p.ignore_eos = true;
  EXPECT_TRUE((*e)->AddRequest(1, prompt, p).ok());
  std::vector<int32_t> out;
  while ((*e)->HasWork()) {
    auto res = (*e)->Step();
    EXPECT_TRUE(res.ok()) << res.status();
    if (!res.ok()) break;
    for (const auto& r : *res)
      out.insert(out.end(), r.new_tokens.begin(), r.new_tokens.end());
  }
  return out;
}

TEST(ClusterLongContextTest, SixteenThousandTokensEqualTheSingleProcessEngine) {
  ProcessCluster c;
  const std::vector<std::string> worker = {"--max_model_len=20000",
                                           "--kv_cache_memory=64MiB"};
  // A 2 s minimum lease: the reservation must outlive the ~20 s prefill (the
  // router asks for the time until the request's deadline).
  ASSERT_EQ(c.Start({"--request_timeout_s=900", "--lease_ms=2000"}, /*decode_slots=*/4,
                    worker, worker),
            "");
  tandem::v1::GenerateRequest req =
      MakeRequest(kPromptTokens, 16, kOutputTokens, /*temperature=*/0.0f);
  req.mutable_stop()->set_ignore_eos(true);
  const absl::Time t0 = absl::Now();
  StreamResult r = c.GenerateWithin(req, absl::Minutes(10));
  const absl::Duration cluster_time = absl::Now() - t0;
  ASSERT_TRUE(r.status.ok()) << r.status.error_message() << c.Logs();
  ASSERT_EQ(r.tokens.size(), static_cast<size_t>(kOutputTokens));
  // Disaggregated: the prompt's state went from the prefill to the decode
  // worker (at least its MLA latent: 16k tokens * 2 layers * 40 BF16 values).
  auto sent = Metric(c.prefill_metrics(), "tandem_worker_transfer_bytes_total", {});
  ASSERT_TRUE(sent.ok()) << sent.status();
  EXPECT_GE(*sent, kPromptTokens * 160.0);

  const std::vector<int32_t> want = SingleProcessTokens(req);
  EXPECT_EQ(r.tokens, want);

  const int64_t weights = DirectoryBytes(testing::kTinyModel);
  const int64_t bound = kCacheBudget + weights + kStepAndProcessBound;
  const int64_t prefill_rss = PeakRss(c.prefill().pid());
  const int64_t decode_rss = PeakRss(c.decode().pid());
  std::cout << "16k-token prompt through the cluster: " << cluster_time
            << "; peak RSS prefill " << (prefill_rss >> 20) << " MiB, decode "
            << (decode_rss >> 20) << " MiB (bound " << (bound >> 20)
            << " MiB: cache budget 64 MiB + weights " << (weights >> 20)
            << " MiB + 160 MiB)\n";
  ASSERT_GT(prefill_rss, 0);
  ASSERT_GT(decode_rss, 0);
  EXPECT_LE(prefill_rss, bound);
  EXPECT_LE(decode_rss, bound);
}

}  // namespace
}  // namespace tandem
