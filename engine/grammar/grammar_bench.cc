// Grammar engine benchmark: schema compile time over the corpus (p50/p99)
// and token-mask time per token per sequence at batch 1/32/128, on the real
// K3 vocabulary. Each batch runs twice over the same seeded walks: "cold"
// (mask cache entries computed as states are first met) and "warm" (the same
// states again, cache filled). Baseline in the same run: the cost of one
// plain pass over the bitmask (what any masking does at least).
//
// The decode tokens/s with and without a constraint are measured by
// `./tandem bench grammar` (the engine integration), not here.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/init.h"
#include "engine/grammar/grammar.h"
#include "engine/grammar/schema_corpus.h"
#include "engine/tokenizer/tokenizer.h"

ABSL_FLAG(std::string, model, "third_party/kimi_k3_tokenizer", "Tokenizer directory.");
ABSL_FLAG(int, tokens, 64, "Tokens generated per sequence in the mask measurement.");
ABSL_FLAG(std::string, batches, "1,32,128", "Batch sizes (comma separated).");
ABSL_FLAG(uint32_t, seed, 1, "Seed of the random walks.");
ABSL_FLAG(int, precompute_schemas, 1000,
          "Corpus schemas (the first N; the default: all) whose whole mask cache is "
          "precomputed and timed (the worker's compile thread does this while idle); 0 "
          "skips it.");

namespace tandem::grammar {
namespace {

using Clock = std::chrono::steady_clock;

double Micros(Clock::duration d) {
  return std::chrono::duration<double, std::micro>(d).count();
}

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(p * (v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

struct MaskStats {
  std::vector<double> per_token_us;  // one mask fill of one sequence
  double step_ms_mean = 0;           // one batch step (all sequences)
};

// `batch` sequences, each over a corpus schema, `tokens` steps.
MaskStats RunBatch(const std::vector<std::shared_ptr<const CompiledGrammar>>& grammars,
                   int batch, int tokens, uint32_t seed) {
  MaskStats st;
  std::vector<std::unique_ptr<GrammarMatcher>> m;
  std::vector<std::mt19937> rng;
  for (int b = 0; b < batch; ++b) {
    m.push_back(std::make_unique<GrammarMatcher>(grammars[b % grammars.size()]));
    rng.emplace_back(seed * 7919 + b);
  }
  const TokenVocabulary& vocab = grammars[0]->vocab();
  std::vector<uint32_t> mask(vocab.bitmask_words());
  std::vector<int32_t> allowed;
  double step_total = 0;
  for (int t = 0; t < tokens; ++t) {
    double step_us = 0;
    for (int b = 0; b < batch; ++b) {
      if (m[b]->IsTerminated()) continue;
      auto t0 = Clock::now();
      m[b]->FillNextTokenBitmask(absl::MakeSpan(mask));
      double us = Micros(Clock::now() - t0);
      st.per_token_us.push_back(us);
      step_us += us;
      allowed.clear();
      for (int32_t w = 0; w < static_cast<int32_t>(mask.size()); ++w) {
        for (uint32_t bits = mask[w]; bits != 0; bits &= bits - 1) {
          allowed.push_back(w * 32 + __builtin_ctz(bits));
        }
      }
      if (allowed.empty()) continue;
      int32_t pick = allowed[rng[b]() % allowed.size()];
      if (m[b]->CanTerminate() && rng[b]() % 4 == 0) pick = vocab.stop_token_ids()[0];
      m[b]->AcceptToken(pick);
    }
    step_total += step_us;
  }
  st.step_ms_mean = step_total / tokens / 1000.0;
  return st;
}

int Main() {
  auto tok = tokenizer::Tokenizer::Load(absl::GetFlag(FLAGS_model));
  if (!tok.ok()) {
    std::fprintf(stderr, "grammar_bench: %s\n", tok.status().ToString().c_str());
    return 2;
  }
  std::vector<int32_t> stops = {tokenizer::kEosId, tokenizer::kEndOfMsgId};
  auto t0 = Clock::now();
  auto vocab = TokenVocabulary::FromTokenizer(**tok, stops);
  if (!vocab.ok()) {
    std::fprintf(stderr, "grammar_bench: %s\n", vocab.status().ToString().c_str());
    return 2;
  }
  const double vocab_ms = Micros(Clock::now() - t0) / 1000;
  std::printf("vocabulary: %d tokens (%zu matchable), built in %.1f ms\n",
              (*vocab)->size(), (*vocab)->sorted_ids().size(), vocab_ms);

  // Compile time over the corpus (no compiler cache).
  CompileLimits no_cache;
  no_cache.cache_capacity = 0;
  GrammarCompiler compiler(*vocab, no_cache);
  std::vector<double> compile_us;
  std::vector<std::shared_ptr<const CompiledGrammar>> grammars;
  int failed = 0;
  for (const CorpusSchema& s : SchemaCorpus()) {
    ConstraintSpec spec;
    spec.kind = ConstraintSpec::Kind::kJsonSchema;
    spec.source = s.schema;
    auto c0 = Clock::now();
    auto g = compiler.Compile(spec);
    compile_us.push_back(Micros(Clock::now() - c0));
    if (!g.ok()) {
      ++failed;
      std::fprintf(stderr, "  %s: %s\n", s.name.c_str(), g.status().ToString().c_str());
      continue;
    }
    grammars.push_back(*g);
  }
  const double c50 = Percentile(compile_us, 0.5) / 1000,
               c99 = Percentile(compile_us, 0.99) / 1000;
  std::printf(
      "compile: %zu schemas (%d failed), p50 %.2f ms, p99 %.2f ms, max %.2f ms\n",
      compile_us.size(), failed, c50, c99, Percentile(compile_us, 1.0) / 1000);

  // Baseline: one pass writing the bitmask (memset) and one reading it.
  std::vector<uint32_t> mask((*vocab)->bitmask_words());
  auto b0 = Clock::now();
  uint64_t sink = 0;
  for (int i = 0; i < 1000; ++i) {
    std::fill(mask.begin(), mask.end(), static_cast<uint32_t>(i));
    sink += mask[i % mask.size()];
  }
  const double baseline_us = Micros(Clock::now() - b0) / 1000;
  std::printf("baseline: one bitmask fill (%zu words) %.2f us (sink %llu)\n",
              mask.size(), baseline_us, static_cast<unsigned long long>(sink % 2));

  std::string json = absl::StrFormat(
      "{\"bench\":\"grammar\",\"vocab\":%d,\"schemas\":%zu,\"compile_failed\":%d,"
      "\"compile_p50_ms\":%.3f,\"compile_p99_ms\":%.3f,\"bitmask_fill_baseline_us\":%."
      "3f",
      (*vocab)->size(), compile_us.size(), failed, c50, c99, baseline_us);
  std::vector<int> batches;
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_batches), ',')) {
    int v;
    if (absl::SimpleAtoi(b, &v) && v > 0) batches.push_back(v);
  }
  const int tokens = absl::GetFlag(FLAGS_tokens);
  for (int batch : batches) {
    // Fresh compiled grammars per batch so that "cold" starts empty.
    std::vector<std::shared_ptr<const CompiledGrammar>> fresh;
    for (int b = 0; b < batch && b < static_cast<int>(SchemaCorpus().size()); ++b) {
      ConstraintSpec spec;
      spec.kind = ConstraintSpec::Kind::kJsonSchema;
      spec.source = SchemaCorpus()[b].schema;
      auto g = compiler.Compile(spec);
      if (g.ok()) fresh.push_back(*g);
    }
    MaskStats cold = RunBatch(fresh, batch, tokens, absl::GetFlag(FLAGS_seed));
    MaskStats warm = RunBatch(fresh, batch, tokens, absl::GetFlag(FLAGS_seed));
    auto mean = [](const std::vector<double>& v) {
      double s = 0;
      for (double x : v) s += x;
      return v.empty() ? 0 : s / v.size();
    };
    int64_t entries = 0;
    for (const auto& g : fresh) entries += g->mask_cache().computed_entries();
    std::printf(
        "batch %3d: mask per token per sequence: warm mean %.1f us p50 %.1f p99 %.1f "
        "(%.1fx the bitmask-fill baseline); cold mean %.1f us p99 %.1f; "
        "batch step warm %.2f ms cold %.2f ms; %lld cache entries\n",
        batch, mean(warm.per_token_us), Percentile(warm.per_token_us, 0.5),
        Percentile(warm.per_token_us, 0.99),
        mean(warm.per_token_us) / std::max(baseline_us, 1e-3), mean(cold.per_token_us),
        Percentile(cold.per_token_us, 0.99), warm.step_ms_mean, cold.step_ms_mean,
        static_cast<long long>(entries));
    absl::StrAppendFormat(
        &json,
        ",\"b%d_mask_warm_mean_us\":%.2f,\"b%d_mask_warm_p99_us\":%.2f,"
        "\"b%d_mask_cold_mean_us\":%.2f,\"b%d_step_warm_ms\":%.3f",
        batch, mean(warm.per_token_us), batch, Percentile(warm.per_token_us, 0.99),
        batch, mean(cold.per_token_us), batch, warm.step_ms_mean);
  }
  // Precompute (CompiledGrammar::PrecomputeMasks) of each of the first N
  // schemas' whole mask cache, fresh compiles, one thread.
  const int n_pre =
      std::min<int>(absl::GetFlag(FLAGS_precompute_schemas), grammars.size());
  if (n_pre > 0) {
    GrammarCompiler fresh(*vocab, no_cache);
    std::vector<double> pre_ms, pre_entries, pre_mb;
    int within = 0;
    for (int i = 0; i < n_pre; ++i) {
      auto g = fresh.Compile(ConstraintSpec{
          ConstraintSpec::Kind::kJsonSchema, SchemaCorpus()[i].schema, {}});
      if (!g.ok()) continue;
      auto p0 = Clock::now();
      (*g)->PrecomputeMasks(absl::InfiniteFuture());
      pre_ms.push_back(Micros(Clock::now() - p0) / 1000);
      pre_entries.push_back((*g)->mask_cache().computed_entries());
      pre_mb.push_back((*g)->mask_cache().entry_bytes() / 1e6);  // MB
      if (pre_ms.back() <= 2000) ++within;
    }
    std::printf(
        "precompute (whole mask cache, first %zu schemas): p50 %.1f ms, p99 %.1f ms, "
        "max %.1f ms; entries p50 %.0f, max %.0f; memory p50 %.3f MB, max %.2f MB; "
        "%d within the worker's 2 s budget\n",
        pre_ms.size(), Percentile(pre_ms, 0.5), Percentile(pre_ms, 0.99),
        Percentile(pre_ms, 1.0), Percentile(pre_entries, 0.5),
        Percentile(pre_entries, 1.0), Percentile(pre_mb, 0.5), Percentile(pre_mb, 1.0),
        within);
    json += absl::StrFormat(
        ",\"precompute_schemas\":%zu,\"precompute_p50_ms\":%.1f,"
        "\"precompute_p99_ms\":%.1f,\"precompute_max_mb\":%.2f,"
        "\"precompute_within_budget\":%d",
        pre_ms.size(), Percentile(pre_ms, 0.5), Percentile(pre_ms, 0.99),
        Percentile(pre_mb, 1.0), within);
  }
  json += "}";
  std::printf("%s\n", json.c_str());
  return failed == 0 ? 0 : 1;
}

}  // namespace
}  // namespace tandem::grammar

int main(int argc, char** argv) {
  tandem::InitProgram(
      argc, argv, "grammar_bench",
      "Grammar engine: compile time and token-mask time on the K3 vocabulary.\n"
      "Usage: grammar_bench [--tokens 64] [--batches 1,32,128]");
  return tandem::grammar::Main();
}
