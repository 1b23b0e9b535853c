// Prefix caching benchmark: a shared-system-prompt workload (every request =
// the same system prompt + its own suffix), run on an engine with the prefix
// cache off and on. One warm-up request, then --requests requests one after
// another; for each, the time from AddRequest to its first token (the prefill,
// TTFT on an idle engine). Prints one JSON line:
//   {"bench":"prefix_cache", system_tokens, suffix_tokens, requests,
//    ttft_ms_p50_off, ttft_ms_p50_on, speedup_p50, prefill_tokens_off/_on,
//    hit_rate, snapshots_stored, snapshots_per_request, snapshot_bytes_held,
//    outputs_equal}
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "common/init.h"
#include "common/status.h"
#include "engine/model/checkpoint.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/test_util.h"
#include "engine/runtime/weights.h"
#include "kernels/backend_factory.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, model, "", "Checkpoint directory (default: the tiny one).");
ABSL_FLAG(int32_t, system_tokens, 2048, "Shared system prompt tokens.");
ABSL_FLAG(int32_t, suffix_tokens, 64, "Each request's own tokens after it.");
ABSL_FLAG(int32_t, requests, 16, "Requests after the warm-up one.");
ABSL_FLAG(int32_t, max_tokens, 4, "Tokens generated per request.");
ABSL_FLAG(std::string, backend, "cpu", "Kernel backend.");

namespace {

using tandem::engine::Engine;
using tandem::engine::EngineOptions;

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "prefix_cache_bench: %s\n", s.ToString().c_str());
  return 1;
}

struct Result {
  std::vector<double> ttft_ms;
  std::vector<std::vector<int32_t>> tokens;
  int64_t prefill_tokens = 0;
  tandem::engine::PrefixCachingStats stats;
};

absl::StatusOr<Result> RunWorkload(const tandem::engine::ModelWeights& w,
                                   tandem::kernels::Backend* backend, bool cache) {
  EngineOptions o;
  o.num_slots = 4;
  o.max_tokens_per_step = 512;
  o.max_context_tokens =
      absl::GetFlag(FLAGS_system_tokens) + absl::GetFlag(FLAGS_suffix_tokens) + 64;
  o.prefix_caching.enabled = cache;
  o.prefix_caching.num_snapshots = 32;
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<Engine> e,
                          Engine::Create(&w, backend, nullptr, o));
  const std::vector<int32_t> sys =
      tandem::engine::testing::MakePrompt(absl::GetFlag(FLAGS_system_tokens), 1);
  Result r;
  for (int i = 0; i <= absl::GetFlag(FLAGS_requests); ++i) {
    std::vector<int32_t> p = sys;
    const std::vector<int32_t> suffix = tandem::engine::testing::MakePrompt(
        absl::GetFlag(FLAGS_suffix_tokens), 100 + i);
    p.insert(p.end(), suffix.begin(), suffix.end());
    tandem::engine::SamplingParams sp;
    sp.max_tokens = absl::GetFlag(FLAGS_max_tokens);
    sp.ignore_eos = true;
    const auto t0 = std::chrono::steady_clock::now();
    TANDEM_RETURN_IF_ERROR(e->AddRequest(i, p, sp));
    std::vector<int32_t> toks;
    bool first = true;
    while (e->HasWork()) {
      TANDEM_ASSIGN_OR_RETURN(auto outs, e->Step());
      for (const auto& out : outs) {
        if (first && !out.new_tokens.empty()) {
          first = false;
          if (i > 0) {  // not the warm-up
            r.ttft_ms.push_back(std::chrono::duration<double, std::milli>(
                                    std::chrono::steady_clock::now() - t0)
                                    .count());
          }
        }
        toks.insert(toks.end(), out.new_tokens.begin(), out.new_tokens.end());
      }
    }
    r.tokens.push_back(toks);
  }
  r.prefill_tokens = e->prefill_tokens();
  r.stats = e->prefix_caching_stats();
  return r;
}

double P50(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  tandem::InitProgram(argc, argv, "prefix_cache_bench",
                      "prefix_cache_bench [--model DIR] [--system_tokens N] "
                      "[--suffix_tokens N] [--requests N]");
  std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty()) {
    dir = std::string(argv[0]) + ".runfiles/tandem/engine/model/tiny_checkpoint";
  }
  auto ckpt = tandem::model::Checkpoint::Open(dir);
  if (!ckpt.ok()) return Fail(ckpt.status());
  auto weights = tandem::engine::LoadModelWeights(**ckpt);
  if (!weights.ok()) return Fail(weights.status());
  auto backend = tandem::kernels::CreateBackend(absl::GetFlag(FLAGS_backend));
  if (!backend.ok()) return Fail(backend.status());
  auto off = RunWorkload(**weights, backend->get(), false);
  if (!off.ok()) return Fail(off.status());
  auto on = RunWorkload(**weights, backend->get(), true);
  if (!on.ok()) return Fail(on.status());
  const double p50_off = P50(off->ttft_ms), p50_on = P50(on->ttft_ms);
  const int n = absl::GetFlag(FLAGS_requests) + 1;
  nlohmann::json j;
  j["bench"] = "prefix_cache";
  j["system_tokens"] = absl::GetFlag(FLAGS_system_tokens);
  j["suffix_tokens"] = absl::GetFlag(FLAGS_suffix_tokens);
  j["requests"] = n;
  j["ttft_ms_p50_off"] = p50_off;
  j["ttft_ms_p50_on"] = p50_on;
  j["speedup_p50"] = p50_on > 0 ? p50_off / p50_on : 0.0;
  j["prefill_tokens_off"] = off->prefill_tokens;
  j["prefill_tokens_on"] = on->prefill_tokens;
  j["hit_rate"] = on->stats.hit_rate();
  j["hits"] = on->stats.hits;
  j["snapshots_stored"] = on->stats.snapshots_stored;
  j["snapshots_per_request"] = static_cast<double>(on->stats.snapshots_stored) / n;
  j["snapshot_bytes_held"] = on->stats.snapshot_bytes_held;
  j["outputs_equal"] = off->tokens == on->tokens;
  std::printf("%s\n", j.dump().c_str());
  return off->tokens == on->tokens ? 0 : 2;
}
