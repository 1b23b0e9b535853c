#include "worker/worker_model.h"

#include "absl/time/clock.h"
#include "common/status.h"
#include "kernels/backend_factory.h"
#include "router/model_info.h"

namespace tandem::worker {

absl::StatusOr<std::unique_ptr<WorkerModel>> LoadWorkerModel(
    const std::string& dir, const std::string& backend_name,
    const std::string& served_model_name) {
  auto m = std::make_unique<WorkerModel>();
  TANDEM_ASSIGN_OR_RETURN(router::ServedModel served,
                          router::LoadServedModel(dir, served_model_name,
                                                  absl::ToUnixSeconds(absl::Now())));
  m->model_id = served.info.id();
  m->fingerprint = served.fingerprint;
  TANDEM_ASSIGN_OR_RETURN(m->checkpoint, model::Checkpoint::Open(dir));
  TANDEM_ASSIGN_OR_RETURN(m->weights, runtime::LoadModelWeights(*m->checkpoint));
  TANDEM_ASSIGN_OR_RETURN(m->tokenizer, tokenizer::Tokenizer::Load(dir));
  TANDEM_ASSIGN_OR_RETURN(m->backend, kernels::CreateBackend(backend_name));
  return m;
}

absl::StatusOr<std::unique_ptr<runtime::Engine>> MakeEngine(
    WorkerModel* model, const runtime::EngineOptions& options) {
  return runtime::Engine::Create(model->weights.get(), model->backend.get(),
                                 model->tokenizer.get(), options);
}

}  // namespace tandem::worker
