// What a worker process loads at start: the checkpoint (mmapped), its weight
// views, the tokenizer, a kernel backend, and the model id + fingerprint it
// registers with (the router refuses workers whose fingerprint differs).
#ifndef TANDEM_WORKER_WORKER_MODEL_H_
#define TANDEM_WORKER_WORKER_MODEL_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/model/checkpoint.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/weights.h"
#include "engine/tokenizer/tokenizer.h"
#include "kernels/backend.h"

namespace tandem::worker {

struct WorkerModel {
  std::unique_ptr<model::Checkpoint> checkpoint;
  std::unique_ptr<runtime::ModelWeights> weights;
  std::unique_ptr<tokenizer::Tokenizer> tokenizer;
  std::unique_ptr<kernels::Backend> backend;
  std::string model_id;
  std::string fingerprint;
};

// Loads `dir` (config.json, safetensors, tokenizer) with backend `backend_name`.
absl::StatusOr<std::unique_ptr<WorkerModel>> LoadWorkerModel(
    const std::string& dir, const std::string& backend_name,
    const std::string& served_model_name);

// An engine over `model` (not owned; must outlive the engine).
absl::StatusOr<std::unique_ptr<runtime::Engine>> MakeEngine(
    WorkerModel* model, const runtime::EngineOptions& options);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_WORKER_MODEL_H_
