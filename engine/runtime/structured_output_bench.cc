// structured_output_bench: decode tokens/s of the Engine with and without a
// structured-output constraint, in the same run, on one checkpoint (default the
// tiny one from the runfiles), at each batch size.
//
//   structured_output_bench [--model DIR] [--batches 1,32] [--tokens 64]
//                           [--grammar_json LINE]
//
// For each batch size B: B requests (prompt of --prompt_len tokens) decode
// --tokens tokens each, greedy; unconstrained (ignore_eos, so every request
// makes exactly --tokens) and constrained by a JSON schema of nested objects,
// arrays and strings (the random model rarely finishes it, so most requests run
// to --tokens too: both arms decode the same number of tokens). Only decode
// steps are timed (prefill steps are run first). Reports tokens/s, the
// constrained/plain ratio, the mean step time and the mask time per token
// (Engine::structured_mask_seconds over the masks filled). The constrained arm
// runs three times: on a fresh engine ("cold": every automaton state's first
// visit walks the vocabulary), after an untimed pass of the same schema over
// other prompts ("warm": the compiled grammar's mask cache has those states,
// as in a server that sees the schema again), both with the masks filled on
// --mask_threads threads of the engine's mask pool during the forward (the
// default path), and warm with the masks filled after the forward at sampling
// time ("sync", structured_mask_threads 0). The plain arm also runs after a
// warm-up pass. The JSON line's bN_constrained_* are the warm overlapped arm's.
// Each arm also reports its time outside the forward (step - forward); the
// constrained extra there, over the plain step, is the comparable cost on the
// CPU backend, where the forward itself moves between arms with the machine's
// load (and the mask threads share its cores). --repeats rounds of the four
// arms, interleaved; each arm reports its fastest round. --same_prompts gives
// every request of a batch one prompt (alike outputs: a MoE forward then reads
// fewer experts), a diagnostic for forward-time differences between arms.
// --grammar_json: a JSON line (grammar_bench's) merged into this one's
// "grammar" field. Ends with ONE JSON line {"bench":"grammar",...}.
#include <chrono>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/init.h"
#include "common/status.h"
#include "engine/model/checkpoint.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/weights.h"
#include "engine/tokenizer/tokenizer.h"
#include "kernels/backend_factory.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, model, "",
          "Checkpoint directory (default: the tiny checkpoint)");
ABSL_FLAG(std::string, batches, "1,32", "Batch sizes");
ABSL_FLAG(int32_t, tokens, 64, "Tokens decoded per request");
ABSL_FLAG(int32_t, prompt_len, 32, "Prompt tokens per request");
ABSL_FLAG(std::string, backend, "cpu", "Kernel backend");
ABSL_FLAG(int32_t, repeats, 3,
          "Rounds of the four arms, interleaved; each arm reports its fastest round "
          "(a shared machine's load and the order of the arms move single runs)");
ABSL_FLAG(bool, same_prompts, false,
          "Every request of a batch gets the same prompt (so plain greedy outputs are "
          "alike too; a diagnostic for forward-time differences between arms)");
ABSL_FLAG(int32_t, mask_threads, 2,
          "Mask-pool threads of the overlapped constrained arm (EngineOptions::"
          "structured_mask_threads)");
ABSL_FLAG(std::string, grammar_json, "",
          "A JSON line (grammar_bench's) to carry in the final line's \"grammar\"");

namespace {

using tandem::engine::Engine;
using tandem::engine::SamplingParams;

constexpr char kSchema[] =
    R"({"type":"object","properties":{"name":{"type":"string"},)"
    R"("tags":{"type":"array","items":{"type":"string"}},)"
    R"("child":{"type":"object","properties":{"id":{"type":"integer"},)"
    R"("note":{"type":"string"}},"required":["id","note"]}},)"
    R"("required":["name","tags","child"]})";

struct Arm {
  double tokens_per_s = 0;
  double step_ms = 0;
  int64_t tokens = 0;
  double mask_us_per_token = 0;
  double overlapped = 0;  // share of the masks filled during a forward
  double forward_ms = 0;  // of step_ms, the forward (the rest: host work)
};

using RequestBase = tandem::engine::RequestId;

// `batch` requests with ids (and prompts) from `base`.
absl::Status AddBatch(Engine* e, int batch, bool constrained, RequestBase base) {
  for (int i = 0; i < batch; ++i) {
    const int64_t k = base + i;
    const int64_t pk = absl::GetFlag(FLAGS_same_prompts) ? base : k;
    std::vector<int32_t> prompt;
    for (int t = 0; t < absl::GetFlag(FLAGS_prompt_len); ++t) {
      prompt.push_back(1000 + (pk * 7919 + t * 104729) % 90000);
    }
    SamplingParams p;
    p.max_tokens = absl::GetFlag(FLAGS_tokens);
    if (constrained) {
      tandem::engine::StructuredOutputSpec s;
      s.kind = tandem::engine::StructuredOutputSpec::Kind::kJsonSchema;
      s.source = kSchema;
      p.structured = s;
    } else {
      p.ignore_eos = true;
    }
    TANDEM_RETURN_IF_ERROR(e->AddRequest(k, std::move(prompt), p));
  }
  return absl::OkStatus();
}

absl::StatusOr<Arm> Run(const tandem::engine::ModelWeights& w,
                        tandem::kernels::Backend* backend,
                        const tandem::tokenizer::Tokenizer* tok, int batch,
                        bool constrained, int mask_threads, bool warm) {
  tandem::engine::EngineOptions o;
  o.structured_mask_threads = mask_threads;
  o.num_slots = batch;
  o.max_context_tokens =
      absl::GetFlag(FLAGS_prompt_len) + absl::GetFlag(FLAGS_tokens) + 8;
  o.max_tokens_per_step =
      std::max<int64_t>(256, batch * (absl::GetFlag(FLAGS_prompt_len) + 1));
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<Engine> e,
                          Engine::Create(&w, backend, tok, o));
  // warm: the schema was served before on this engine (other prompts, run to
  // their end untimed), so the compiled grammar's mask cache holds the
  // states such outputs visit, as in a server that sees the schema again.
  RequestBase base = 0;
  if (warm) {
    TANDEM_RETURN_IF_ERROR(AddBatch(e.get(), batch, constrained, /*base=*/batch));
    while (e->HasWork()) TANDEM_RETURN_IF_ERROR(e->Step().status());
    base = 2 * batch;
  }
  TANDEM_RETURN_IF_ERROR(AddBatch(e.get(), batch, constrained, base));
  // Prefill (every request's first token) untimed.
  const int64_t prompt_tokens =
      static_cast<int64_t>(batch) * absl::GetFlag(FLAGS_prompt_len);
  const int64_t prefilled0 = e->prefill_tokens();
  while (e->HasWork() && e->prefill_tokens() - prefilled0 < prompt_tokens) {
    TANDEM_RETURN_IF_ERROR(e->Step().status());
  }

  const int64_t masks0 = e->structured_masks();
  const int64_t overlapped0 = e->structured_masks_overlapped();
  const double mask_s0 = e->structured_mask_seconds();
  const double fwd0 = e->step_timing().forward_seconds;
  const int64_t fsteps0 = e->step_timing().steps;
  Arm a;
  int steps = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (e->HasWork()) {
    TANDEM_ASSIGN_OR_RETURN(auto outs, e->Step());
    for (const auto& out : outs) a.tokens += out.new_tokens.size();
    ++steps;
  }
  const double s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  a.tokens_per_s = s > 0 ? a.tokens / s : 0;
  a.step_ms = steps > 0 ? 1e3 * s / steps : 0;
  const int64_t fsteps = e->step_timing().steps - fsteps0;
  if (fsteps > 0)
    a.forward_ms = 1e3 * (e->step_timing().forward_seconds - fwd0) / fsteps;
  const int64_t masks = e->structured_masks() - masks0;
  if (masks > 0) {
    a.mask_us_per_token = 1e6 * (e->structured_mask_seconds() - mask_s0) / masks;
    a.overlapped =
        static_cast<double>(e->structured_masks_overlapped() - overlapped0) / masks;
  }
  if (e->structured_failures() > 0) return e->last_structured_error();
  return a;
}

int Fail(const absl::Status& s) {
  std::cerr << "structured_output_bench: " << s << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  tandem::InitProgram(
      argc, argv, "structured_output_bench",
      "structured_output_bench [--model DIR] [--batches 1,32] [--tokens N]");
  std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty())
    dir = std::string(argv[0]) + ".runfiles/tandem/engine/model/tiny_checkpoint";
  auto ckpt = tandem::model::Checkpoint::Open(dir);
  if (!ckpt.ok()) return Fail(ckpt.status());
  auto tok = tandem::tokenizer::Tokenizer::Load(dir);
  if (!tok.ok()) return Fail(tok.status());
  auto backend = tandem::kernels::CreateBackend(absl::GetFlag(FLAGS_backend));
  if (!backend.ok()) return Fail(backend.status());
  auto weights = tandem::engine::LoadModelWeights(**ckpt);
  if (!weights.ok()) return Fail(weights.status());
  weights =
      tandem::engine::PlaceModelWeights(*std::move(weights), (*backend)->device());
  if (!weights.ok()) return Fail(weights.status());
  nlohmann::json line = {{"bench", "grammar"},
                         {"model", dir},
                         {"mask_threads", absl::GetFlag(FLAGS_mask_threads)},
                         {"repeats", absl::GetFlag(FLAGS_repeats)}};
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_batches), ',')) {
    int batch = 0;
    if (!absl::SimpleAtoi(b, &batch) || batch < 1) {
      return Fail(
          absl::InvalidArgumentError(absl::StrCat("bad batch '", std::string(b), "'")));
    }
    const int mt = absl::GetFlag(FLAGS_mask_threads);
    // Plain (after a warm-up pass too, so both sides ran as long), then
    // constrained: cold (a fresh engine), warm, and warm with the masks filled
    // after the forward (sync); `repeats` rounds of the four.
    const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
    std::optional<Arm> plain, cold, warm, sync;
    auto keep_fastest = [](std::optional<Arm>* best, const Arm& a) {
      if (!best->has_value() || a.step_ms < (*best)->step_ms) *best = a;
    };
    for (int round = 0; round < repeats; ++round) {
      auto p = Run(**weights, backend->get(), tok->get(), batch, false, mt, true);
      if (!p.ok()) return Fail(p.status());
      keep_fastest(&plain, *p);
      auto c = Run(**weights, backend->get(), tok->get(), batch, true, mt, false);
      if (!c.ok()) return Fail(c.status());
      keep_fastest(&cold, *c);
      auto w = Run(**weights, backend->get(), tok->get(), batch, true, mt, true);
      if (!w.ok()) return Fail(w.status());
      keep_fastest(&warm, *w);
      auto y = Run(**weights, backend->get(), tok->get(), batch, true, 0, true);
      if (!y.ok()) return Fail(y.status());
      keep_fastest(&sync, *y);
    }
    auto over = [&](const Arm& a) {
      return plain->tokens_per_s > 0 ? a.tokens_per_s / plain->tokens_per_s : 0;
    };
    std::printf(
        "batch %3d: plain %7.1f tok/s (%6.2f ms/step, forward %.2f) | constrained, "
        "cold "
        "cache: %7.1f tok/s (%6.2f ms/step, forward %.2f, mask %.1f us/token) %.3f of "
        "plain | warm: %7.1f tok/s (%6.2f ms/step, forward %.2f, mask %.1f us/token, "
        "%.0f%% overlapped) %.3f of plain | warm, sync masks: %7.1f tok/s (%6.2f "
        "ms/step, "
        "forward %.2f) %.3f of plain\n",
        batch, plain->tokens_per_s, plain->step_ms, plain->forward_ms,
        cold->tokens_per_s, cold->step_ms, cold->forward_ms, cold->mask_us_per_token,
        over(*cold), warm->tokens_per_s, warm->step_ms, warm->forward_ms,
        warm->mask_us_per_token, 100 * warm->overlapped, over(*warm),
        sync->tokens_per_s, sync->step_ms, sync->forward_ms, over(*sync));
    // The step's time outside the forward (scheduling, sampling with the
    // mask applied, the matchers' advance; a mask filled during the forward
    // is inside it). On a GPU backend this is the host's share of a step; on
    // the CPU backend the forward itself moves between arms (the machine's
    // load; the mask threads share the cores), so the extra outside the
    // forward is the comparable cost of the constraint.
    auto outside = [](const Arm& a) { return a.step_ms - a.forward_ms; };
    const double extra =
        plain->step_ms > 0 ? (outside(*warm) - outside(*plain)) / plain->step_ms : 0;
    const double mask_ms_per_step =
        warm->mask_us_per_token * batch / 1e3;  // one mask per sequence and step
    std::printf(
        "batch %3d: outside the forward: plain %.2f ms/step, constrained warm %.2f "
        "(overlapped), %.2f (sync); extra %.3f of the plain step; masks %.2f ms per "
        "step beside a %.2f ms forward\n",
        batch, outside(*plain), outside(*warm), outside(*sync), extra, mask_ms_per_step,
        warm->forward_ms);
    const std::string k = absl::StrCat("b", batch);
    line[k + "_plain_outside_forward_ms"] = outside(*plain);
    line[k + "_constrained_outside_forward_ms"] = outside(*warm);
    line[k + "_sync_outside_forward_ms"] = outside(*sync);
    line[k + "_constrained_outside_extra_over_plain_step"] = extra;
    line[k + "_mask_ms_per_step"] = mask_ms_per_step;
    line[k + "_plain_tok_s"] = plain->tokens_per_s;
    line[k + "_plain_step_ms"] = plain->step_ms;
    line[k + "_plain_forward_ms"] = plain->forward_ms;
    line[k + "_constrained_forward_ms"] = warm->forward_ms;
    line[k + "_sync_step_ms"] = sync->step_ms;
    line[k + "_cold_step_ms"] = cold->step_ms;
    line[k + "_constrained_tok_s"] = warm->tokens_per_s;
    line[k + "_constrained_step_ms"] = warm->step_ms;
    line[k + "_constrained_over_plain"] = over(*warm);
    line[k + "_mask_us_per_token"] = warm->mask_us_per_token;
    line[k + "_overlapped_share"] = warm->overlapped;
    line[k + "_constrained_tokens"] = warm->tokens;
    line[k + "_cold_tok_s"] = cold->tokens_per_s;
    line[k + "_cold_over_plain"] = over(*cold);
    line[k + "_cold_mask_us_per_token"] = cold->mask_us_per_token;
    line[k + "_sync_tok_s"] = sync->tokens_per_s;
    line[k + "_sync_over_plain"] = over(*sync);
  }
  const std::string g = absl::GetFlag(FLAGS_grammar_json);
  if (!g.empty()) {
    nlohmann::json gj = nlohmann::json::parse(g, nullptr, false);
    line["grammar"] = gj.is_discarded() ? nlohmann::json(g) : gj;
  }
  std::cout << line.dump() << std::endl;
  return 0;
}
