// What a worker process loads at start: the checkpoint (mmapped), its weight
// views, the tokenizer, a kernel backend, and the model id + fingerprint it
// registers with (the router refuses workers whose fingerprint differs).
#ifndef TANDEM_WORKER_WORKER_MODEL_H_
#define TANDEM_WORKER_WORKER_MODEL_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model/checkpoint.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/weights.h"
#include "engine/tokenizer/tokenizer.h"
#include "kernels/backend.h"

namespace tandem::worker {

struct WorkerModel {
  // Declared first, destroyed last: the weights (and a draft's) live in its
  // device's memory.
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<model::Checkpoint> checkpoint;
  std::unique_ptr<engine::ModelWeights> weights;
  std::unique_ptr<tokenizer::Tokenizer> tokenizer;
  std::string backend_name;  // what `backend` was created as (the TP ranks' too)
  std::string model_id;
  std::string fingerprint;
  // The draft model of draft-model speculative decoding (ApplySpeculativeFlags);
  // null otherwise.
  std::unique_ptr<WorkerModel> draft;
  // Device memory the worker holds outside the engine, per TP rank's device
  // (the prefill worker's vision towers: weights and one call's activations
  // each). The device cache budget (--gpu_memory_utilization) is sized after it.
  std::vector<int64_t> extra_device_bytes;
};

// Loads `dir` (config.json, safetensors, tokenizer) with backend `backend_name`.
// With `tp` > 1 the weights are not loaded here: the engine's executor maps each
// rank's shard and places it on that rank's device (TpExecutor::Create), so the
// whole model is never resident in one place (K3: ~1.5 TB); `weights` then holds
// only the config.
absl::StatusOr<std::unique_ptr<WorkerModel>> LoadWorkerModel(
    const std::string& dir, const std::string& backend_name,
    const std::string& served_model_name, int tp = 1);

// An engine over `model` (not owned; must outlive the engine). With
// options.tp.tp_size > 1 the engine runs that many ranks (threads of this
// process) over the model's checkpoint, each with a backend of the model's
// backend name; options.tp_checkpoint and options.tp.backend are filled here.
absl::StatusOr<std::unique_ptr<engine::Engine>> MakeEngine(
    WorkerModel* model, const engine::EngineOptions& options);

// The workers' tensor-parallel flags into `options`: `tp` ranks (>= 1; threads
// of this process) and the failure drill `fail_at` ("" or "R:S": rank R >= 1
// ends its thread instead of running its forward step S, counted from 0, as if
// it had crashed; TpExecutorOptions::fail_rank / fail_rank_at_step).
// INVALID_ARGUMENT for a malformed drill, R outside [1, tp), or tp < 1.
// Speculative decoding from worker flags: `method` none | ngram | draft,
// `num_tokens` drafts verified per step (>= 1 when a method is set), `draft_dir`
// the draft checkpoint (method draft only; same vocabulary as the target). The
// draft model is loaded into model->draft (which must outlive the engine).
// INVALID_ARGUMENT naming the flag for bad values.
absl::Status ApplySpeculativeFlags(const std::string& method, int num_tokens,
                                   const std::string& draft_dir, WorkerModel* model,
                                   engine::EngineOptions* options);

absl::Status ApplyTpFlags(int tp, const std::string& fail_at,
                          engine::EngineOptions* options);

// Every rank's cache of `engine`, rank order (one at TP 1).
std::vector<engine::KvCache*> RankCaches(engine::Engine& engine);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_WORKER_MODEL_H_
