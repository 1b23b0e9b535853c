#include "engine/runtime/engine.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "common/status.h"

namespace tandem::runtime {
namespace {

uint64_t SplitMix(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(
    const ModelWeights* weights, kernels::Backend* backend,
    const tokenizer::Tokenizer* tokenizer, const EngineOptions& options) {
  auto e = std::unique_ptr<Engine>(new Engine());
  e->weights_ = weights;
  e->tokenizer_ = tokenizer;
  e->options_ = options;
  e->seed_state_ = options.seed;
  const int64_t bs = options.block_size;
  engine::SchedulerConfig sc;
  sc.block_size = options.block_size;
  sc.num_slots = options.num_slots;
  sc.num_blocks =
      options.num_blocks > 0
          ? options.num_blocks
          : static_cast<int32_t>(options.num_slots *
                                 ((options.max_context_tokens + bs - 1) / bs));
  sc.max_tokens_per_step = options.max_tokens_per_step;
  sc.max_running = options.num_slots;
  sc.max_context_tokens = std::min<int64_t>(
      options.max_context_tokens, weights->config.text.max_position_embeddings);
  sc.max_prefill_chunk = options.max_prefill_chunk;
  TANDEM_ASSIGN_OR_RETURN(e->scheduler_, engine::Scheduler::Create(sc));
  KvCacheOptions co;
  co.block_size = sc.block_size;
  co.num_blocks = sc.num_blocks;
  co.num_slots = sc.num_slots;
  TANDEM_ASSIGN_OR_RETURN(e->cache_, KvCache::Create(weights->config, co));
  ModelRunnerOptions ro;
  ro.mla_mode = options.mla_mode;
  e->runner_ = std::make_unique<ModelRunner>(weights, e->cache_.get(), backend, ro);
  e->sampler_ = std::make_unique<engine::Sampler>(weights->config.text.vocab_size);
  if (tokenizer != nullptr) {
    e->eos_ids_ = tokenizer->stop_ids();
  } else {
    e->eos_ids_ = {static_cast<int32_t>(weights->config.eos_token_id),
                   static_cast<int32_t>(weights->config.text.eos_token_id)};
    std::sort(e->eos_ids_.begin(), e->eos_ids_.end());
    e->eos_ids_.erase(std::unique(e->eos_ids_.begin(), e->eos_ids_.end()),
                      e->eos_ids_.end());
  }
  return e;
}

absl::StatusOr<Engine::Request*> Engine::NewRequest(
    RequestId id, std::vector<int32_t> prompt, const engine::SamplingParams& params) {
  const int64_t V = weights_->config.text.vocab_size;
  if (requests_.contains(id)) return InvalidArgument("request ", id, " already exists");
  if (prompt.empty()) return InvalidArgument("request ", id, ": empty prompt");
  for (int32_t t : prompt) {
    if (t < 0 || t >= V) {
      return InvalidArgument("request ", id, ": token id ", t, " not in [0, ", V, ")");
    }
  }
  TANDEM_RETURN_IF_ERROR(params.ValidateForVocab(V));
  auto r = std::make_unique<Request>();
  r->id = id;
  r->params = params;
  if (!r->params.IsGreedy() && !r->params.seed.has_value()) {
    r->params.seed = SplitMix(&seed_state_);
  }
  r->prompt = std::move(prompt);
  r->tokens = r->prompt;
  r->history.AddPromptTokens(r->prompt);
  if (tokenizer_ != nullptr) {
    r->detok = std::make_unique<tokenizer::IncrementalDetokenizer>(tokenizer_);
  }
  const int64_t room =
      scheduler_->config().max_context_tokens - static_cast<int64_t>(r->prompt.size());
  r->stop = std::make_unique<engine::StopChecker>(r->params, eos_ids_, room);
  Request* raw = r.get();
  requests_[id] = std::move(r);
  return raw;
}

absl::Status Engine::AddRequest(RequestId id, std::vector<int32_t> prompt,
                                const engine::SamplingParams& params) {
  const int64_t n = prompt.size();
  TANDEM_ASSIGN_OR_RETURN(Request * r, NewRequest(id, std::move(prompt), params));
  engine::SequenceRequest sr;
  sr.id = id;
  sr.num_prompt_tokens = n;
  sr.max_new_tokens = r->params.max_tokens;
  absl::Status s = scheduler_->Submit(sr);
  if (!s.ok()) requests_.erase(id);
  return s;
}

absl::Status Engine::Abort(RequestId id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return NotFound("request ", id, " not found");
  requests_.erase(it);
  return scheduler_->Abort(id);
}

absl::Status Engine::Sample(Request* r, absl::Span<const float> logits,
                            RequestOutput* out) {
  engine::SampleRequest sr;
  sr.logits = logits;
  sr.params = &r->params;
  sr.history = &r->history;
  sr.suppressed_tokens = r->stop->SuppressedTokens();
  sr.position = r->num_generated();
  TANDEM_ASSIGN_OR_RETURN(engine::SampleResult res, sampler_->Sample(sr));
  const int32_t tok = res.token_id;
  if (r->params.logprobs) out->logprobs.push_back(res);
  r->tokens.push_back(tok);
  r->history.AddOutputToken(tok);
  out->new_tokens.push_back(tok);
  std::string delta;
  if (r->detok != nullptr) {
    TANDEM_ASSIGN_OR_RETURN(delta, r->detok->Add(tok));
  }
  engine::StopUpdate up = r->stop->Append(tok, delta);
  out->text += up.text;
  if (up.finish != engine::FinishReason::kNone) {
    out->finished = true;
    out->finish_reason = up.finish;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<RequestOutput>> Engine::Step() {
  std::vector<RequestOutput> outputs;
  if (requests_.empty()) return outputs;
  TANDEM_ASSIGN_OR_RETURN(engine::StepPlan plan, scheduler_->Schedule());
  if (plan.sequences.empty()) {
    TANDEM_RETURN_IF_ERROR(scheduler_->CompleteStep(plan, {}).status());
    return outputs;
  }
  // Inputs. Block tables are copied: the scheduler owns the live ones.
  std::vector<SequenceInput> inputs(plan.sequences.size());
  std::vector<std::vector<int32_t>> tables(plan.sequences.size());
  std::vector<Request*> reqs(plan.sequences.size());
  for (size_t i = 0; i < plan.sequences.size(); ++i) {
    const engine::ScheduledSequence& ss = plan.sequences[i];
    auto it = requests_.find(ss.id);
    if (it == requests_.end()) return Internal("scheduled unknown request ", ss.id);
    Request* r = it->second.get();
    reqs[i] = r;
    r->slot = ss.slot;
    if (ss.resets_state) {
      TANDEM_RETURN_IF_ERROR(cache_->ResetSlot(ss.slot));
      r->pending_import.clear();  // recomputed from its tokens instead
    }
    TANDEM_ASSIGN_OR_RETURN(tables[i], scheduler_->Blocks(ss.id));
    if (!r->pending_import.empty()) {
      TANDEM_ASSIGN_OR_RETURN(
          std::vector<StateRange> dst,
          cache_->ExportSequence(tables[i], r->import_tokens, ss.slot));
      TANDEM_RETURN_IF_ERROR(CopyStateRanges(r->pending_import, dst));
      r->pending_import.clear();
      r->import_bytes.clear();
    }
    if (ss.end > static_cast<int64_t>(r->tokens.size()) || ss.num_draft_tokens != 0) {
      return Internal("request ", ss.id, ": planned positions ", ss.start, "..", ss.end,
                      " beyond its ", r->tokens.size(), " tokens");
    }
    SequenceInput& in = inputs[i];
    in.tokens = absl::MakeConstSpan(r->tokens).subspan(ss.start, ss.end - ss.start);
    in.start_pos = ss.start;
    in.block_table = tables[i];
    in.kda_slot = ss.slot;
    if (ss.samples) in.logits_indices = {static_cast<int32_t>(ss.end - ss.start - 1)};
    if (r->num_generated() > 0 && ss.samples) {
      decode_tokens_ += ss.end - ss.start;
    } else {
      prefill_tokens_ += ss.end - ss.start;
    }
  }
  std::vector<float> logits;
  TANDEM_RETURN_IF_ERROR(runner_->Forward(inputs, &logits));

  const int64_t V = weights_->config.text.vocab_size;
  std::vector<engine::SequenceOutcome> outcomes;
  int64_t row = 0;
  for (size_t i = 0; i < plan.sequences.size(); ++i) {
    const engine::ScheduledSequence& ss = plan.sequences[i];
    if (!ss.samples) continue;
    RequestOutput out;
    out.id = ss.id;
    TANDEM_RETURN_IF_ERROR(
        Sample(reqs[i], absl::MakeConstSpan(logits).subspan(row * V, V), &out));
    ++row;
    engine::SequenceOutcome oc;
    oc.id = ss.id;
    oc.num_new_tokens = 1;
    oc.finished = out.finished;
    outcomes.push_back(oc);
    outputs.push_back(std::move(out));
  }
  TANDEM_ASSIGN_OR_RETURN(std::vector<engine::SequenceId> ended,
                          scheduler_->CompleteStep(plan, outcomes));
  for (engine::SequenceId id : ended) {
    auto it = std::find_if(outputs.begin(), outputs.end(),
                           [&](const RequestOutput& o) { return o.id == id; });
    if (it == outputs.end()) {
      outputs.emplace_back();
      outputs.back().id = id;
      it = outputs.end() - 1;
    }
    if (!it->finished) {
      auto rq = requests_.find(id);
      if (rq != requests_.end())
        it->text += rq->second->stop->Flush(engine::FinishReason::kLength);
      it->finished = true;
      it->finish_reason = engine::FinishReason::kLength;
    }
  }
  for (RequestOutput& out : outputs) {
    if (!out.finished) continue;
    auto rq = requests_.find(out.id);
    if (rq != requests_.end() && rq->second->detok != nullptr &&
        out.finish_reason == engine::FinishReason::kLength) {
      out.text += rq->second->detok->Flush();
    }
    requests_.erase(out.id);
  }
  return outputs;
}

absl::StatusOr<ExportedState> Engine::ExportState(RequestId id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return NotFound("request ", id, " not found");
  Request* r = it->second.get();
  if (r->num_generated() < 1 || r->slot < 0) {
    return FailedPrecondition("request ", id, " has not finished its prefill");
  }
  ExportedState st;
  st.prompt = r->prompt;
  st.generated.assign(r->tokens.begin() + r->prompt.size(), r->tokens.end());
  st.num_cached_tokens = static_cast<int64_t>(r->tokens.size()) - 1;
  TANDEM_ASSIGN_OR_RETURN(std::vector<int32_t> blocks, scheduler_->Blocks(id));
  TANDEM_ASSIGN_OR_RETURN(
      st.ranges, cache_->ExportSequence(blocks, st.num_cached_tokens, r->slot));
  return st;
}

absl::StatusOr<StateLocation> Engine::Locate(RequestId id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return NotFound("request ", id, " not found");
  Request* r = it->second.get();
  if (r->num_generated() < 1 || r->slot < 0) {
    return FailedPrecondition("request ", id, " has not finished its prefill");
  }
  StateLocation loc;
  TANDEM_ASSIGN_OR_RETURN(loc.block_ids, scheduler_->Blocks(id));
  loc.slot = r->slot;
  loc.num_cached_tokens = static_cast<int64_t>(r->tokens.size()) - 1;
  return loc;
}

absl::Status Engine::AddPrefilledRequest(RequestId id, const ExportedState& state,
                                         const engine::SamplingParams& params) {
  return AddPrefilled(id, state, params, nullptr);
}

absl::StatusOr<RequestOutput> Engine::AddPrefilledRequestWithOutput(
    RequestId id, const ExportedState& state, const engine::SamplingParams& params) {
  RequestOutput out;
  out.id = id;
  TANDEM_RETURN_IF_ERROR(AddPrefilled(id, state, params, &out));
  return out;
}

absl::Status Engine::AddPrefilled(RequestId id, const ExportedState& state,
                                  const engine::SamplingParams& params,
                                  RequestOutput* out) {
  if (state.generated.empty() ||
      state.num_cached_tokens !=
          static_cast<int64_t>(state.prompt.size() + state.generated.size()) - 1) {
    return InvalidArgument("request ", id,
                           ": prefilled state needs >= 1 generated token and ",
                           "the state of every token but the last");
  }
  TANDEM_ASSIGN_OR_RETURN(Request * r, NewRequest(id, state.prompt, params));
  for (int32_t t : state.generated) {
    if (t < 0 || t >= weights_->config.text.vocab_size) {
      requests_.erase(id);
      return InvalidArgument("request ", id, ": generated token ", t, " out of range");
    }
    r->tokens.push_back(t);
    r->history.AddOutputToken(t);
    std::string delta;
    if (r->detok != nullptr) {
      auto d = r->detok->Add(t);
      if (d.ok()) delta = *d;
    }
    engine::StopUpdate up = r->stop->Append(t, delta);
    if (out != nullptr && !out->finished) {
      out->new_tokens.push_back(t);
      out->text += up.text;
      if (up.finish != engine::FinishReason::kNone) {
        out->finished = true;
        out->finish_reason = up.finish;
      }
    }
  }
  if (out != nullptr && out->finished) {
    // Nothing left to decode: the request ends here, nothing is admitted.
    if (out->finish_reason == engine::FinishReason::kLength && r->detok != nullptr) {
      out->text += r->detok->Flush();
    }
    requests_.erase(id);
    return absl::OkStatus();
  }
  // Own a copy of the source bytes until the first step places them.
  r->import_tokens = state.num_cached_tokens;
  r->import_bytes.reserve(state.ranges.size());
  for (const StateRange& src : state.ranges) {
    r->import_bytes.emplace_back(reinterpret_cast<const char*>(src.data), src.bytes);
    StateRange own = src;
    own.data = reinterpret_cast<uint8_t*>(r->import_bytes.back().data());
    r->pending_import.push_back(own);
  }
  engine::SequenceRequest sr;
  sr.id = id;
  sr.num_prompt_tokens = state.prompt.size();
  sr.max_new_tokens = r->params.max_tokens;
  absl::Status s = scheduler_->AdmitPrefilled(sr, state.generated.size());
  if (!s.ok()) requests_.erase(id);
  return s;
}

}  // namespace tandem::runtime
