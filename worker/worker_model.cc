#include "worker/worker_model.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "engine/model/served_model.h"
#include "kernels/backend_factory.h"

namespace tandem::worker {

absl::StatusOr<std::unique_ptr<WorkerModel>> LoadWorkerModel(
    const std::string& dir, const std::string& backend_name,
    const std::string& served_model_name, int tp) {
  auto m = std::make_unique<WorkerModel>();
  TANDEM_ASSIGN_OR_RETURN(
      model::ServedModel served,
      model::LoadServedModel(dir, served_model_name, absl::ToUnixSeconds(absl::Now())));
  m->model_id = served.info.id();
  m->fingerprint = served.fingerprint;
  TANDEM_ASSIGN_OR_RETURN(m->checkpoint, model::Checkpoint::Open(dir));
  TANDEM_ASSIGN_OR_RETURN(m->backend, kernels::CreateBackend(backend_name));
  if (tp > 1) {
    // The ranks load their own shards (TpExecutor::Create): the config only.
    m->weights = std::make_unique<engine::ModelWeights>();
    m->weights->config = m->checkpoint->config();
    m->weights->shard = engine::ShardSpec{0, tp};
  } else {
    TANDEM_ASSIGN_OR_RETURN(m->weights, engine::LoadModelWeights(*m->checkpoint));
    // Uploaded once to the backend's device (a no-op on the host).
    TANDEM_ASSIGN_OR_RETURN(
        m->weights,
        engine::PlaceModelWeights(std::move(m->weights), m->backend->device()));
  }
  TANDEM_ASSIGN_OR_RETURN(m->tokenizer, tokenizer::Tokenizer::Load(dir));
  m->backend_name = backend_name;
  return m;
}

absl::StatusOr<std::unique_ptr<engine::Engine>> MakeEngine(
    WorkerModel* model, const engine::EngineOptions& options) {
  engine::EngineOptions o = options;
  if (o.tp.tp_size > 1) {
    o.tp_checkpoint = model->checkpoint.get();
    o.tp.backend = model->backend_name;
  }
  return engine::Engine::Create(model->weights.get(), model->backend.get(),
                                model->tokenizer.get(), o);
}

absl::Status ApplySpeculativeFlags(const std::string& method, int num_tokens,
                                   const std::string& draft_dir, WorkerModel* model,
                                   engine::EngineOptions* options) {
  engine::SpeculativeOptions& so = options->speculative;
  if (method == "none" || method.empty()) {
    if (!draft_dir.empty()) {
      return InvalidArgument("--draft_model needs --speculative=draft");
    }
    so.method = engine::SpeculativeMethod::kNone;
    return absl::OkStatus();
  }
  if (num_tokens < 1 || num_tokens > 16) {
    return InvalidArgument("--num_speculative_tokens must be in [1, 16], got ",
                           num_tokens);
  }
  so.num_speculative_tokens = num_tokens;
  if (method == "ngram") {
    if (!draft_dir.empty()) {
      return InvalidArgument("--draft_model needs --speculative=draft, not ngram");
    }
    so.method = engine::SpeculativeMethod::kNgram;
    return absl::OkStatus();
  }
  if (method != "draft") {
    return InvalidArgument("--speculative must be none, ngram or draft, got '", method,
                           "'");
  }
  if (draft_dir.empty())
    return InvalidArgument("--speculative=draft needs --draft_model");
  TANDEM_ASSIGN_OR_RETURN(model->draft,
                          LoadWorkerModel(draft_dir, model->backend_name, ""));
  // The draft runs on the target's backend (DraftModelProposer): its weights go
  // to that backend's device.
  if (model->backend->device().name() != "host") {
    TANDEM_ASSIGN_OR_RETURN(model->draft->weights,
                            engine::LoadModelWeights(*model->draft->checkpoint));
    TANDEM_ASSIGN_OR_RETURN(model->draft->weights,
                            engine::PlaceModelWeights(std::move(model->draft->weights),
                                                      model->backend->device()));
  }
  if (model->draft->weights->config.text.vocab_size !=
      model->weights->config.text.vocab_size) {
    return InvalidArgument("--draft_model ", draft_dir, " has a vocabulary of ",
                           model->draft->weights->config.text.vocab_size,
                           " tokens, the target ",
                           model->weights->config.text.vocab_size);
  }
  so.method = engine::SpeculativeMethod::kDraft;
  so.draft_weights = model->draft->weights.get();
  return absl::OkStatus();
}

absl::Status ApplyTpFlags(int tp, const std::string& fail_at,
                          engine::EngineOptions* options) {
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

std::vector<engine::KvCache*> RankCaches(engine::Engine& engine) {
  std::vector<engine::KvCache*> out;
  for (int r = 0; r < engine.executor().tp_size(); ++r) {
    out.push_back(&engine.executor().cache(r));
  }
  return out;
}

}  // namespace tandem::worker
