#include "worker/worker_model.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
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
  m->backend_name = backend_name;
  return m;
}

absl::StatusOr<std::unique_ptr<runtime::Engine>> MakeEngine(
    WorkerModel* model, const runtime::EngineOptions& options) {
  runtime::EngineOptions o = options;
  if (o.tp.tp_size > 1) {
    o.tp_checkpoint = model->checkpoint.get();
    o.tp.backend = model->backend_name;
  }
  return runtime::Engine::Create(model->weights.get(), model->backend.get(),
                                 model->tokenizer.get(), o);
}

absl::Status ApplyTpFlags(int tp, const std::string& fail_at,
                          runtime::EngineOptions* options) {
  if (tp < 1) return InvalidArgument("--tp must be >= 1, got ", tp);
  options->tp.tp_size = tp;
  if (fail_at.empty()) return absl::OkStatus();
  const std::vector<std::string> parts = absl::StrSplit(fail_at, ':');
  int rank = 0;
  int64_t step = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &rank) ||
      !absl::SimpleAtoi(parts[1], &step) || step < 0) {
    return InvalidArgument("--tp_fail_rank_at_step must be RANK:STEP, got '", fail_at,
                           "'");
  }
  if (rank < 1 || rank >= tp) {
    return InvalidArgument("--tp_fail_rank_at_step: rank ", rank,
                           " must be a rank thread in [1, ", tp, ") (--tp ", tp, ")");
  }
  options->tp.fail_rank = rank;
  options->tp.fail_rank_at_step = step;
  return absl::OkStatus();
}

std::vector<runtime::KvCache*> RankCaches(runtime::Engine& engine) {
  std::vector<runtime::KvCache*> out;
  for (int r = 0; r < engine.executor().tp_size(); ++r) {
    out.push_back(&engine.executor().cache(r));
  }
  return out;
}

}  // namespace tandem::worker
