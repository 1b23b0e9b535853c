// speculative_bench: decode tokens/s of the Engine with and without speculative
// decoding on a repetitive prompt, and the acceptance rate.
//
//   speculative_bench [--model DIR] [--draft_model DIR] [--k N] [--batch B]
//                     [--tokens N] [--methods none,ngram,draft]
//                     [--repetition_penalty R] [--backend cpu]
//
// Each method runs the same B greedy requests (a short random phrase repeated
// --repeats times, then --tokens generated); decode tokens/s counts the tokens
// generated after every request's first one over the time of those steps. The
// draft model defaults to the target itself (every greedy draft accepted: the
// upper bound of the draft path, paying a full draft model per token); give
// --draft_model engine/speculative/tiny_draft_checkpoint for a model whose
// drafts are rejected (the rollback cost). The random tiny model never repeats
// itself, so n-gram drafts are accepted only with --repetition_penalty < 1
// (which makes it loop over the prompt's tokens). Every method's tokens are
// checked against the plain run. Ends with ONE JSON line {"bench":"speculative",...}.
#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_split.h"
#include "common/init.h"
#include "common/status.h"
#include "engine/model/checkpoint.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/weights.h"
#include "kernels/backend_factory.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, model, "", "Target checkpoint (default: the tiny checkpoint)");
ABSL_FLAG(std::string, draft_model, "", "Draft checkpoint (default: the target)");
ABSL_FLAG(int32_t, k, 4, "Drafts per decode step");
ABSL_FLAG(int32_t, batch, 1, "Concurrent requests");
ABSL_FLAG(int32_t, phrase, 8, "Tokens in the repeated phrase");
ABSL_FLAG(int32_t, repeats, 8, "Repetitions of the phrase in the prompt");
ABSL_FLAG(int32_t, tokens, 64, "Tokens generated per request");
ABSL_FLAG(std::string, methods, "none,ngram,draft", "Methods to run");
ABSL_FLAG(double, repetition_penalty, 1.0, "Sampling repetition penalty (< 1 boosts)");
ABSL_FLAG(std::string, backend, "cpu", "Kernel backend");

namespace {

using Clock = std::chrono::steady_clock;
using tandem::engine::Engine;
using tandem::engine::EngineOptions;
using tandem::engine::SpeculativeMethod;

int Fail(const absl::Status& s) {
  std::cerr << "speculative_bench: " << s << "\n";
  return 1;
}

std::vector<int32_t> Prompt(int b, int phrase, int repeats) {
  std::vector<int32_t> p;
  std::vector<int32_t> words;
  uint64_t x = 0x9E3779B97F4A7C15ull * (b + 1);
  for (int i = 0; i < phrase; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    words.push_back(static_cast<int32_t>(x % 100000));
  }
  for (int r = 0; r < repeats; ++r) p.insert(p.end(), words.begin(), words.end());
  return p;
}

struct RunResult {
  std::map<int64_t, std::vector<int32_t>> tokens;
  double decode_seconds = 0;
  int64_t decode_tokens = 0;
  int64_t steps = 0;
  tandem::engine::SpeculativeStats stats;
};

absl::StatusOr<RunResult> Run(const tandem::engine::ModelWeights* w,
                              tandem::kernels::Backend* backend,
                              const EngineOptions& options) {
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<Engine> e,
                          Engine::Create(w, backend, nullptr, options));
  const int B = absl::GetFlag(FLAGS_batch);
  tandem::engine::SamplingParams p;
  p.max_tokens = absl::GetFlag(FLAGS_tokens);
  p.ignore_eos = true;
  p.repetition_penalty = static_cast<float>(absl::GetFlag(FLAGS_repetition_penalty));
  for (int b = 0; b < B; ++b) {
    TANDEM_RETURN_IF_ERROR(e->AddRequest(
        b, Prompt(b, absl::GetFlag(FLAGS_phrase), absl::GetFlag(FLAGS_repeats)), p));
  }
  RunResult r;
  // Prefill: until every request has its first token.
  while (static_cast<int>(r.tokens.size()) < B) {
    TANDEM_ASSIGN_OR_RETURN(auto outs, e->Step());
    for (const auto& o : outs) {
      auto& v = r.tokens[o.id];
      v.insert(v.end(), o.new_tokens.begin(), o.new_tokens.end());
    }
  }
  const auto t0 = Clock::now();
  while (e->HasWork()) {
    TANDEM_ASSIGN_OR_RETURN(auto outs, e->Step());
    ++r.steps;
    for (const auto& o : outs) {
      auto& v = r.tokens[o.id];
      v.insert(v.end(), o.new_tokens.begin(), o.new_tokens.end());
      r.decode_tokens += o.new_tokens.size();
    }
  }
  r.decode_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  r.stats = e->speculative_stats();
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  tandem::InitProgram(argc, argv, "speculative_bench",
                      "speculative_bench [--model DIR] [--draft_model DIR] [--k N] "
                      "[--batch B] [--tokens N] [--methods none,ngram,draft]");
  std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty()) {
    dir = std::string(argv[0]) + ".runfiles/tandem/engine/model/tiny_checkpoint";
  }
  auto ckpt = tandem::model::Checkpoint::Open(dir);
  if (!ckpt.ok()) return Fail(ckpt.status());
  auto weights = tandem::engine::LoadModelWeights(**ckpt);
  if (!weights.ok()) return Fail(weights.status());
  const tandem::engine::ModelWeights* draft = weights->get();
  std::unique_ptr<tandem::model::Checkpoint> draft_ckpt;
  std::unique_ptr<tandem::engine::ModelWeights> draft_weights;
  const std::string draft_dir = absl::GetFlag(FLAGS_draft_model);
  if (!draft_dir.empty()) {
    auto c = tandem::model::Checkpoint::Open(draft_dir);
    if (!c.ok()) return Fail(c.status());
    draft_ckpt = std::move(c).value();
    auto dw = tandem::engine::LoadModelWeights(*draft_ckpt);
    if (!dw.ok()) return Fail(dw.status());
    draft_weights = std::move(dw).value();
    draft = draft_weights.get();
  }
  auto backend = tandem::kernels::CreateBackend(absl::GetFlag(FLAGS_backend));
  if (!backend.ok()) return Fail(backend.status());

  const int32_t k = absl::GetFlag(FLAGS_k);
  const int B = absl::GetFlag(FLAGS_batch);
  EngineOptions base;
  base.num_slots = B;
  base.max_context_tokens = absl::GetFlag(FLAGS_phrase) * absl::GetFlag(FLAGS_repeats) +
                            absl::GetFlag(FLAGS_tokens) + k + 16;
  base.max_tokens_per_step = std::max<int64_t>(256, B * (k + 1));

  nlohmann::json results = nlohmann::json::array();
  std::map<int64_t, std::vector<int32_t>> plain_tokens;
  double plain_tps = 0;
  // The plain run always goes first: the reference tokens and speed.
  std::vector<std::string> methods = {"none"};
  for (absl::string_view m : absl::StrSplit(absl::GetFlag(FLAGS_methods), ',')) {
    if (m != "none") methods.emplace_back(m);
  }
  for (const std::string& m : methods) {
    EngineOptions o = base;
    if (m == "ngram") {
      o.speculative.method = SpeculativeMethod::kNgram;
    } else if (m == "draft") {
      o.speculative.method = SpeculativeMethod::kDraft;
      o.speculative.draft_weights = draft;
    } else if (m != "none") {
      return Fail(absl::InvalidArgumentError("--methods: unknown method " + m));
    }
    if (m != "none") o.speculative.num_speculative_tokens = k;
    auto r = Run(weights->get(), backend->get(), o);
    if (!r.ok()) return Fail(r.status());
    const double tps = r->decode_tokens / r->decode_seconds;
    if (m == "none") {
      plain_tokens = r->tokens;
      plain_tps = tps;
    }
    const bool identical = r->tokens == plain_tokens;
    std::fprintf(stderr,
                 "%-6s decode %8.1f tok/s (x%.2f)  steps %4ld  acceptance %.3f  "
                 "accepted/verify %.2f  tokens/verify %.2f  rollbacks %ld  %s\n",
                 m.c_str(), tps, tps / plain_tps, static_cast<long>(r->steps),
                 r->stats.acceptance_rate(), r->stats.mean_accepted_length(),
                 r->stats.mean_tokens_per_verification(),
                 static_cast<long>(r->stats.rollbacks),
                 identical ? "identical to plain" : "DIFFERENT FROM PLAIN");
    results.push_back({{"method", m},
                       {"decode_tokens_per_s", tps},
                       {"speedup", tps / plain_tps},
                       {"decode_steps", r->steps},
                       {"drafted", r->stats.drafted_tokens},
                       {"accepted", r->stats.accepted_tokens},
                       {"acceptance_rate", r->stats.acceptance_rate()},
                       {"mean_accepted_length", r->stats.mean_accepted_length()},
                       {"rollbacks", r->stats.rollbacks},
                       {"identical_to_plain", identical}});
  }
  nlohmann::json out = {{"bench", "speculative"},
                        {"model", dir},
                        {"draft_model", draft_dir.empty() ? dir : draft_dir},
                        {"k", k},
                        {"batch", B},
                        {"tokens", absl::GetFlag(FLAGS_tokens)},
                        {"repetition_penalty", absl::GetFlag(FLAGS_repetition_penalty)},
                        {"results", results}};
  std::printf("%s\n", out.dump().c_str());
  return 0;
}
