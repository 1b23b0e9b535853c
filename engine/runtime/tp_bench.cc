// tp_bench: tensor-parallel scaling of the forward pass on this machine.
//
//   tp_bench [--model DIR] [--tp 1,2,4,8] [--batch N] [--prompt_len N]
//            [--decode_steps N] [--repeats N] [--backend cpu]
//            [--threads_per_rank N]
//
// For each TP size the config allows (others are reported as refused, with
// CheckTpSize's reason): a TpExecutor over the checkpoint (ranks = threads, Gloo
// over loopback), --batch sequences prefilled with --prompt_len tokens (one
// forward), then --decode_steps decode steps of --batch tokens. Best of
// --repeats runs (fresh slots each). Reports prefill and decode tokens/s, the
// share of the step time rank 0 spent inside the collectives (ModelRunner's
// CommStats: waiting for the slowest rank included), and the ratio of each
// rate to TP 1 measured in the same run. Ends with ONE JSON line
// {"bench":"tp",...}. Default model: the tiny checkpoint from the runfiles.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/init.h"
#include "common/status.h"
#include "engine/model/checkpoint.h"
#include "engine/runtime/shard_dims.h"
#include "engine/runtime/tp_executor.h"
#include "nlohmann/json.hpp"
#include "parallel/sharding.h"

ABSL_FLAG(std::string, model, "",
          "Checkpoint directory (default: the tiny checkpoint)");
ABSL_FLAG(std::string, tp, "1,2,4,8", "TP sizes (1 is always measured: the baseline)");
ABSL_FLAG(int32_t, batch, 8, "Sequences per step");
ABSL_FLAG(int32_t, prompt_len, 64, "Prompt tokens per sequence (one prefill forward)");
ABSL_FLAG(int32_t, decode_steps, 24, "Decode steps");
ABSL_FLAG(int32_t, repeats, 3, "Runs per TP size (best is reported)");
ABSL_FLAG(std::string, backend, "cpu", "Kernel backend of every rank");
ABSL_FLAG(int32_t, threads_per_rank, 0, "Kernel threads per rank (0: cores / TP)");

namespace {

using Clock = std::chrono::steady_clock;
using tandem::engine::SequenceInput;
using tandem::engine::TpExecutor;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

int Fail(const absl::Status& s) {
  std::cerr << "tp_bench: " << s << "\n";
  return 1;
}

struct Figures {
  double prefill_tps = 0, decode_tps = 0;
  double prefill_comm_share = 0, decode_comm_share = 0;
  double decode_step_ms = 0;
  double decode_gather_share = 0;  // of the step: the logits all-gather
  int64_t collectives_per_decode_step = 0;
};

// One prefill + decode run on fresh slots.
absl::StatusOr<Figures> RunOnce(TpExecutor* ex, int B, int prompt_len, int steps) {
  const int64_t V = ex->weights(0).config.text.vocab_size;
  const int64_t bs = ex->cache(0).block_size();
  const int64_t blocks_per_seq = (prompt_len + steps + 1 + bs - 1) / bs;
  std::vector<std::vector<int32_t>> prompts(B), tables(B);
  for (int s = 0; s < B; ++s) {
    TANDEM_RETURN_IF_ERROR(ex->ResetSlot(s));
    for (int i = 0; i < prompt_len; ++i)
      prompts[s].push_back((s * 7919 + i * 104729) % 100000);
    for (int64_t b = 0; b < blocks_per_seq; ++b)
      tables[s].push_back(s * blocks_per_seq + b);
  }
  auto argmax = [&](const std::vector<float>& logits, int s) {
    return static_cast<int32_t>(
        std::max_element(logits.begin() + s * V, logits.begin() + (s + 1) * V) -
        (logits.begin() + s * V));
  };
  Figures f;
  std::vector<float> logits;
  std::vector<int32_t> next(B);
  {
    std::vector<SequenceInput> in(B);
    for (int s = 0; s < B; ++s) {
      in[s].tokens = prompts[s];
      in[s].block_table = tables[s];
      in[s].kda_slot = s;
      in[s].logits_indices = {prompt_len - 1};
    }
    ex->reset_comm_stats();
    const auto t0 = Clock::now();
    TANDEM_RETURN_IF_ERROR(ex->Forward(in, &logits));
    const double sec = Seconds(t0, Clock::now());
    f.prefill_tps = B * prompt_len / sec;
    f.prefill_comm_share = ex->comm_stats().seconds / sec;
    for (int s = 0; s < B; ++s) next[s] = argmax(logits, s);
  }
  ex->reset_comm_stats();
  const auto t1 = Clock::now();
  for (int step = 0; step < steps; ++step) {
    std::vector<SequenceInput> in(B);
    for (int s = 0; s < B; ++s) {
      in[s].tokens = {&next[s], 1};
      in[s].start_pos = prompt_len + step;
      in[s].block_table = tables[s];
      in[s].kda_slot = s;
      in[s].logits_indices = {0};
    }
    TANDEM_RETURN_IF_ERROR(ex->Forward(in, &logits));
    for (int s = 0; s < B; ++s) next[s] = argmax(logits, s);
  }
  const double sec = Seconds(t1, Clock::now());
  f.decode_tps = static_cast<double>(B) * steps / sec;
  f.decode_step_ms = 1e3 * sec / std::max(1, steps);
  f.decode_comm_share = ex->comm_stats().seconds / sec;
  f.decode_gather_share = ex->comm_stats().all_gather_seconds / sec;
  f.collectives_per_decode_step = ex->comm_stats().calls / std::max(1, steps);
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  tandem::InitProgram(argc, argv, "tp_bench",
                      "tp_bench [--model DIR] [--tp 1,2,4,8] [--batch N] "
                      "[--prompt_len N] [--decode_steps N]");
  std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty())
    dir = std::string(argv[0]) + ".runfiles/tandem/engine/model/tiny_checkpoint";
  auto ckpt = tandem::model::Checkpoint::Open(dir);
  if (!ckpt.ok()) return Fail(ckpt.status());
  std::vector<int> sizes = {1};
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_tp), ',')) {
    int n;
    if (!absl::SimpleAtoi(s, &n) || n < 1) {
      return Fail(absl::InvalidArgumentError("--tp: bad entry"));
    }
    if (std::find(sizes.begin(), sizes.end(), n) == sizes.end()) sizes.push_back(n);
  }
  const int B = std::max(1, absl::GetFlag(FLAGS_batch));
  const int prompt_len = std::max(1, absl::GetFlag(FLAGS_prompt_len));
  const int steps = std::max(1, absl::GetFlag(FLAGS_decode_steps));
  const int repeats = std::max(1, absl::GetFlag(FLAGS_repeats));
  const int64_t block_size = 16;
  std::fprintf(stderr,
               "model %s, backend %s, %u hardware threads, batch %d, prompt %d, "
               "%d decode steps, best of %d\n",
               dir.c_str(), absl::GetFlag(FLAGS_backend).c_str(),
               std::thread::hardware_concurrency(), B, prompt_len, steps, repeats);

  nlohmann::json results = nlohmann::json::array();
  nlohmann::json refused = nlohmann::json::array();
  Figures base;
  for (int tp : sizes) {
    absl::Status ok = tandem::parallel::CheckTpSize(
        tandem::engine::ShardDimsOf((*ckpt)->config()), tp);
    if (!ok.ok()) {
      std::fprintf(stderr, "TP %d: refused: %s\n", tp,
                   std::string(ok.message()).c_str());
      refused.push_back({{"tp", tp}, {"reason", std::string(ok.message())}});
      continue;
    }
    tandem::engine::TpExecutorOptions o;
    o.tp_size = tp;
    o.backend = absl::GetFlag(FLAGS_backend);
    o.threads_per_rank = absl::GetFlag(FLAGS_threads_per_rank);
    o.cache.block_size = block_size;
    o.cache.num_blocks = B * ((prompt_len + steps + 1 + block_size - 1) / block_size);
    o.cache.num_slots = B;
    auto ex = TpExecutor::Create(**ckpt, o);
    if (!ex.ok()) return Fail(ex.status());
    Figures best;
    for (int r = 0; r < repeats; ++r) {
      auto f = RunOnce(ex->get(), B, prompt_len, steps);
      if (!f.ok()) return Fail(f.status());
      if (f->prefill_tps > best.prefill_tps) {
        best.prefill_tps = f->prefill_tps;
        best.prefill_comm_share = f->prefill_comm_share;
      }
      if (f->decode_tps > best.decode_tps) {
        best.decode_tps = f->decode_tps;
        best.decode_step_ms = f->decode_step_ms;
        best.decode_comm_share = f->decode_comm_share;
        best.decode_gather_share = f->decode_gather_share;
        best.collectives_per_decode_step = f->collectives_per_decode_step;
      }
    }
    if (tp == 1) base = best;
    const double pr = best.prefill_tps / base.prefill_tps;
    const double dr = best.decode_tps / base.decode_tps;
    std::fprintf(stderr,
                 "TP %d: prefill %9.1f tok/s (x%.2f vs TP 1, comm %4.1f%%), decode "
                 "%8.1f tok/s (x%.2f, step %.2f ms, comm %4.1f%% of which logits "
                 "all-gather %4.1f%%, %lld collectives)\n",
                 tp, best.prefill_tps, pr, 100 * best.prefill_comm_share,
                 best.decode_tps, dr, best.decode_step_ms, 100 * best.decode_comm_share,
                 100 * best.decode_gather_share,
                 static_cast<long long>(best.collectives_per_decode_step));
    nlohmann::json j;
    j["tp"] = tp;
    j["prefill_tokens_per_s"] = best.prefill_tps;
    j["decode_tokens_per_s"] = best.decode_tps;
    j["decode_step_ms"] = best.decode_step_ms;
    j["prefill_comm_share"] = best.prefill_comm_share;
    j["decode_comm_share"] = best.decode_comm_share;
    j["decode_logits_all_gather_share"] = best.decode_gather_share;
    j["collectives_per_decode_step"] = best.collectives_per_decode_step;
    j["prefill_ratio_vs_tp1"] = pr;
    j["decode_ratio_vs_tp1"] = dr;
    results.push_back(j);
  }
  nlohmann::json out;
  out["bench"] = "tp";
  out["model"] = dir;
  out["backend"] = absl::GetFlag(FLAGS_backend);
  out["hardware_threads"] = std::thread::hardware_concurrency();
  out["batch"] = B;
  out["prompt_len"] = prompt_len;
  out["decode_steps"] = steps;
  out["results"] = results;
  out["refused"] = refused;
  std::cout << out.dump() << "\n";
  return 0;
}
