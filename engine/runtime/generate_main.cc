// generate: load a K3 checkpoint, run one prompt through the engine on the CPU,
// stream the text to stdout and report prefill / decode speed on stderr.
//
//   generate --model DIR --prompt TEXT [--max_tokens N] [--temperature T]
//            [--seed S] [--raw] [--json] [--backend cpu|cpu_bf16|cpu_reference|
//                                               cuda|cuda_bf16|cuda_sim|cuda_sim_bf16]
//            [--kv_cache_memory 512MiB|0.2 [--max_model_len N]]
//
// Flags may be hyphenated (--max-tokens 8 is --max_tokens 8). Without --raw the
// prompt is chat-formatted (K3 XTML) as one user message followed by the
// generation prompt; with --raw it is tokenised as plain text. --json prints one
// object instead of streaming, in the schema generate_client prints through a
// router (kJsonSchema below; `./tandem generate --help`).
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/flag_names.h"
#include "common/init.h"
#include "engine/cache/memory_budget.h"
#include "engine/chat/renderer.h"
#include "engine/model/checkpoint.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/weights.h"
#include "engine/sampling/stop_checker.h"
#include "engine/tokenizer/tokenizer.h"
#include "kernels/backend_factory.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, model, "",
          "Checkpoint directory (config.json, safetensors, tokenizer)");
ABSL_FLAG(std::string, prompt, "", "Prompt text");
ABSL_FLAG(int32_t, max_tokens, 64, "Tokens to generate at most");
ABSL_FLAG(double, temperature, 0.0, "Sampling temperature (0: greedy)");
ABSL_FLAG(uint64_t, seed, 0, "Random seed for sampling");
ABSL_FLAG(bool, raw, false, "Tokenise the prompt as plain text (no chat format)");
ABSL_FLAG(bool, json, false, "Print one JSON object instead of streaming text");
ABSL_FLAG(std::string, backend, "cpu",
          "Kernel backend: cpu | cpu_bf16 | cpu_reference | cuda | cuda_bf16 | cuda:N "
          "(a GPU; --config=cuda builds) | cuda_sim | cuda_sim_bf16 (the GPU kernels "
          "on the CPU's SIMT emulator)");
ABSL_FLAG(int32_t, max_tokens_per_step, 0,
          "Prefill chunk budget per step (tokens); 0: by device (8192 on a GPU of at "
          "least 70 GiB, 2048 on a smaller one, 512 on the CPU and the emulator)");
ABSL_FLAG(int32_t, block_size, 16, "MLA cache block size (tokens)");
ABSL_FLAG(bool, enforce_eager, false,
          "No CUDA graphs: decode steps run eagerly (device backends capture one "
          "graph per batch-size bucket by default)");
ABSL_FLAG(bool, device_sampling, true,
          "Sample on the device where the backend can (cuda, cuda_sim); false: copy "
          "the logits back and sample on the host (the same tokens)");
ABSL_FLAG(bool, overlap_steps, true,
          "Overlap the host's work with the device's (async scheduling, device "
          "backends): the next decode step is launched before this one's token is "
          "detokenised; false: every step waits for the one before (the same "
          "tokens)");
ABSL_FLAG(std::string, kv_cache_memory, "",
          "Memory for the KV cache and KDA state, as the workers take it: bytes with a "
          "unit (8GiB, 512MiB) or a fraction of the available memory (0.2); empty: "
          "exactly what this prompt and --max_tokens need");
ABSL_FLAG(int64_t, max_model_len, 0,
          "With --kv_cache_memory: prompt + output tokens at most (0: the model's "
          "max_position_embeddings, lowered to what the cache holds)");

namespace {

using tandem::engine::Engine;
using Clock = std::chrono::steady_clock;

// The --json object; tools/generate_client.cc prints the same keys.
constexpr char kJsonSchema[] =
    "--json prints one object: {\"request_id\": null (a router's id through a\n"
    "router), \"token_ids\": [generated ids], \"text\", \"finish_reason\": \"stop\" |\n"
    "\"length\", \"prompt_tokens\", \"completion_tokens\", \"seed\" (null when\n"
    "greedy), \"ttft_s\", \"total_s\", \"prefill_tokens_per_s\" (prompt tokens /\n"
    "TTFT), \"decode_tokens_per_s\" (tokens after the first / time after the first)}";

const char* FinishReasonName(tandem::engine::FinishReason r) {
  switch (r) {
    case tandem::engine::FinishReason::kStop:
      return "stop";
    case tandem::engine::FinishReason::kLength:
      return "length";
    case tandem::engine::FinishReason::kCancelled:
      return "cancelled";
    case tandem::engine::FinishReason::kError:
      return "error";
    case tandem::engine::FinishReason::kNone:
      break;
  }
  return "";
}

int Fail(const absl::Status& s) {
  std::cerr << "generate: " << s << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  tandem::NormalizeFlagNames(argc, argv);
  tandem::InitProgram(
      argc, argv, "generate",
      absl::StrCat("generate --model DIR --prompt TEXT [--max_tokens N] "
                   "[--temperature T] [--seed S] [--raw] [--json] "
                   "[--backend B]\n"
                   "Flags may be hyphenated (--max-tokens N).\n",
                   kJsonSchema));
  const std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty()) return Fail(absl::InvalidArgumentError("--model is required"));
  auto ckpt = tandem::model::Checkpoint::Open(dir);
  if (!ckpt.ok()) return Fail(ckpt.status());
  auto weights = tandem::engine::LoadModelWeights(**ckpt);
  if (!weights.ok()) return Fail(weights.status());
  auto tok = tandem::tokenizer::Tokenizer::Load(dir);
  if (!tok.ok()) return Fail(tok.status());
  auto backend = tandem::kernels::CreateBackend(absl::GetFlag(FLAGS_backend));
  if (!backend.ok()) return Fail(backend.status());
  weights = tandem::engine::PlaceModelWeights(std::move(weights).value(),
                                              (*backend)->device());
  if (!weights.ok()) return Fail(weights.status());

  std::vector<int> ids;
  if (absl::GetFlag(FLAGS_raw)) {
    auto enc = (*tok)->Encode(absl::GetFlag(FLAGS_prompt));
    if (!enc.ok()) return Fail(enc.status());
    ids = *enc;
  } else {
    tandem::chat::ChatMessage m;
    m.role = tandem::chat::Role::kUser;
    m.content = {absl::GetFlag(FLAGS_prompt)};
    auto segs = tandem::chat::RenderChat({m}, {}, tandem::chat::ChatOptions());
    if (!segs.ok()) return Fail(segs.status());
    auto enc = tandem::chat::EncodeChat(**tok, *segs);
    if (!enc.ok()) return Fail(enc.status());
    ids = *enc;
  }
  if (ids.empty())
    return Fail(absl::InvalidArgumentError("the prompt encodes to no tokens"));

  tandem::engine::EngineOptions eo;
  eo.num_slots = 1;
  eo.block_size = absl::GetFlag(FLAGS_block_size);
  eo.enforce_eager = absl::GetFlag(FLAGS_enforce_eager);
  eo.device_sampling = absl::GetFlag(FLAGS_device_sampling);
  eo.overlap_steps = absl::GetFlag(FLAGS_overlap_steps);
  eo.max_tokens_per_step = absl::GetFlag(FLAGS_max_tokens_per_step);
  if (eo.max_tokens_per_step < 0) {
    return Fail(absl::InvalidArgumentError("--max_tokens_per_step must be >= 0"));
  }
  if (eo.max_tokens_per_step == 0) {
    eo.max_tokens_per_step =
        tandem::engine::DefaultMaxTokensPerStep((*backend)->device(), 512);
  }
  eo.max_context_tokens =
      static_cast<int64_t>(ids.size()) + absl::GetFlag(FLAGS_max_tokens) + 1;
  eo.seed = absl::GetFlag(FLAGS_seed);
  if (const std::string spec = absl::GetFlag(FLAGS_kv_cache_memory); !spec.empty()) {
    auto budget = tandem::engine::ParseMemoryBudget(spec);
    if (!budget.ok()) return Fail(budget.status());
    int64_t available = 0;
    if (budget->is_fraction()) {
      auto a = tandem::engine::ReadMemAvailable("/proc/meminfo");
      if (!a.ok()) return Fail(a.status());
      available = *a;
    }
    tandem::engine::CacheMemoryOptions m;
    auto bytes = tandem::engine::ResolveMemoryBudget(*budget, available);
    if (!bytes.ok()) return Fail(bytes.status());
    m.budget_bytes = *bytes;
    m.max_num_seqs = 1;
    m.max_model_len = absl::GetFlag(FLAGS_max_model_len);
    auto sizing = tandem::engine::SizeCacheFromMemory((*weights)->config, m, &eo);
    if (!sizing.ok()) return Fail(sizing.status());
    std::fprintf(stderr, "kv cache: %s\n", sizing->Summary().c_str());
  } else if (absl::GetFlag(FLAGS_max_model_len) != 0) {
    return Fail(absl::InvalidArgumentError("--max_model_len needs --kv_cache_memory"));
  }
  auto engine = Engine::Create(weights->get(), backend->get(), tok->get(), eo);
  if (!engine.ok()) return Fail(engine.status());

  tandem::engine::SamplingParams params;
  params.temperature = static_cast<float>(absl::GetFlag(FLAGS_temperature));
  params.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  params.seed = absl::GetFlag(FLAGS_seed);
  std::vector<int32_t> prompt(ids.begin(), ids.end());
  if (absl::Status s = (*engine)->AddRequest(1, prompt, params); !s.ok())
    return Fail(s);  // a prompt longer than the cache holds: INVALID_ARGUMENT

  const bool json = absl::GetFlag(FLAGS_json);
  std::vector<int32_t> out_ids;
  std::string text;
  std::string finish_reason;
  const auto t0 = Clock::now();
  Clock::time_point t_first;
  bool have_first = false;
  while ((*engine)->HasWork()) {
    auto res = (*engine)->Step();
    if (!res.ok()) return Fail(res.status());
    for (const auto& o : *res) {
      out_ids.insert(out_ids.end(), o.new_tokens.begin(), o.new_tokens.end());
      text += o.text;
      if (o.finished) finish_reason = FinishReasonName(o.finish_reason);
      if (!json && !o.text.empty()) {
        std::fwrite(o.text.data(), 1, o.text.size(), stdout);
        std::fflush(stdout);
      }
      if (!have_first && !o.new_tokens.empty()) {
        have_first = true;
        t_first = Clock::now();
      }
    }
  }
  const auto t1 = Clock::now();
  const double prefill_s =
      std::chrono::duration<double>((have_first ? t_first : t1) - t0).count();
  const double decode_s =
      have_first ? std::chrono::duration<double>(t1 - t_first).count() : 0;
  const double prefill_tps = prefill_s > 0 ? prompt.size() / prefill_s : 0;
  const int64_t decoded =
      out_ids.empty() ? 0 : static_cast<int64_t>(out_ids.size()) - 1;
  const double decode_tps = decode_s > 0 ? decoded / decode_s : 0;
  if (json) {
    const double total_s = std::chrono::duration<double>(t1 - t0).count();
    nlohmann::ordered_json j = {{"request_id", nullptr},
                                {"token_ids", out_ids},
                                {"text", text},
                                {"finish_reason", finish_reason},
                                {"prompt_tokens", prompt.size()},
                                {"completion_tokens", out_ids.size()},
                                {"seed", nullptr},
                                {"ttft_s", prefill_s},
                                {"total_s", total_s},
                                {"prefill_tokens_per_s", prefill_tps},
                                {"decode_tokens_per_s", decode_tps}};
    // Greedy decoding draws nothing: no seed, as through a router.
    if (params.temperature > 0) j["seed"] = absl::GetFlag(FLAGS_seed);
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
              << "\n";
  } else {
    std::cout << "\n";
  }
  std::cout.flush();  // the text line ends before the speeds on stderr
  std::fprintf(
      stderr,
      "prefill: %zu tokens, %.1f tokens/s; decode: %lld tokens, %.1f tokens/s\n",
      prompt.size(), prefill_tps, static_cast<long long>(decoded), decode_tps);
  if ((*backend)->device().supports_graphs()) {
    const tandem::engine::GraphStats& g = (*engine)->runner().graph_stats();
    std::fprintf(
        stderr,
        "cuda graphs: %s; %lld captured (%.2f s, %lld nodes, %lld input "
        "bytes, %lld device bytes), %lld replayed steps, %lld eager steps\n",
        eo.enforce_eager     ? "off (--enforce_eager)"
        : g.disabled.empty() ? "on"
                             : g.disabled.c_str(),
        static_cast<long long>(g.captures), g.capture_seconds,
        static_cast<long long>(g.graph_nodes), static_cast<long long>(g.input_bytes),
        static_cast<long long>(g.capture_device_bytes),
        static_cast<long long>(g.replays), static_cast<long long>(g.eager_steps));
    const tandem::engine::StepTimingStats& t = (*engine)->step_timing();
    std::fprintf(stderr, "sampling: %lld rows on the device, %lld on the host%s\n",
                 static_cast<long long>(t.device_sampled_rows),
                 static_cast<long long>(t.host_sampled_rows),
                 eo.device_sampling ? "" : " (--device_sampling=false)");
    std::fprintf(
        stderr, "overlapped steps: %lld of %lld%s; host gap %.3f ms per step\n",
        static_cast<long long>(t.overlapped_steps), static_cast<long long>(t.steps),
        eo.overlap_steps ? "" : " (--overlap_steps=false)",
        t.gaps > 0 ? 1e3 * t.host_gap_seconds / t.gaps : 0.0);
  }
  return 0;
}
