#include "engine/runtime/engine.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/route_hash.h"
#include "common/status.h"
#include "engine/runtime/draft_model_proposer.h"
#include "engine/sampling/rejection_sampler.h"

namespace tandem::engine {

int64_t DefaultMaxTokensPerStep(const kernels::Device& device, int64_t host_default) {
  // A GPU is the device whose memory the host cannot address (the emulator's
  // and the host's it can).
  if (device.host_addressable()) return host_default;
  constexpr int64_t kLargeGpu = int64_t{70} << 30;
  return device.MemoryInfo().total_bytes >= kLargeGpu ? 8192 : 2048;
}

CacheSizingInput WorkerCacheUnits(const model::ModelConfig& config, int tp,
                                  int32_t block_size) {
  CacheSizingInput in;
  in.token_bytes =
      int64_t{std::max(1, tp)} * config.NumMlaLayers() * config.MlaCacheBytesPerToken();
  in.slot_bytes = config.NumKdaLayers() * config.KdaStateBytesPerSequence();
  in.block_size = block_size;
  return in;
}

absl::StatusOr<CacheSizing> SizeCacheFromMemory(const model::ModelConfig& config,
                                                const CacheMemoryOptions& memory,
                                                EngineOptions* options) {
  CacheSizingInput in =
      WorkerCacheUnits(config, options->tp.tp_size, options->block_size);
  in.budget_bytes = memory.budget_bytes;
  in.max_num_seqs = memory.max_num_seqs;
  in.max_model_len = memory.max_model_len;
  in.model_max_len =
      std::min<int64_t>(config.text.max_position_embeddings, kMaxContextTokens);
  in.num_blocks_override = memory.num_blocks_override;
  in.snapshot_fraction =
      options->prefix_caching.enabled ? memory.prefix_snapshot_fraction : 0.0;
  TANDEM_ASSIGN_OR_RETURN(CacheSizing s, SizeCache(in));
  if (options->prefix_caching.enabled && memory.prefix_snapshot_fraction > 0) {
    // The share buys the pool; none fits: no snapshots, so no hits (off).
    options->prefix_caching.num_snapshots = s.num_snapshots;
    if (s.num_snapshots == 0) options->prefix_caching.enabled = false;
  }
  options->num_slots = s.num_slots;
  options->num_blocks = static_cast<int32_t>(s.num_blocks);
  options->max_context_tokens = s.max_model_len;
  return s;
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(
    const ModelWeights* weights, kernels::Backend* backend,
    const tokenizer::Tokenizer* tokenizer, const EngineOptions& options) {
  const bool tp = options.tp.tp_size > 1;
  if (tp && options.tp_checkpoint == nullptr) {
    return InvalidArgument("tensor parallelism (tp.tp_size ", options.tp.tp_size,
                           ") needs EngineOptions::tp_checkpoint");
  }
  if (!tp && (weights == nullptr || backend == nullptr)) {
    return InvalidArgument("engine: weights and backend are required at TP 1");
  }
  const model::ModelConfig& config =
      tp ? options.tp_checkpoint->config() : weights->config;
  auto e = std::unique_ptr<Engine>(new Engine());
  e->weights_ = weights;
  e->tokenizer_ = tokenizer;
  e->options_ = options;
  e->seeds_ = SplitMix64(options.seed);
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
  sc.max_context_tokens = std::min<int64_t>(options.max_context_tokens,
                                            config.text.max_position_embeddings);
  sc.max_prefill_chunk = options.max_prefill_chunk;
  sc.max_scored_tokens_per_step = options.max_scored_tokens_per_step;
  // KdaChunked's chunk: prompts cut only at its multiples compute bit-identical
  // state however the steps split them (chunk_alignment_test).
  sc.prefill_chunk_alignment = 64;
  if (options.prefix_caching.enabled) {
    sc.enable_prefix_caching = true;
    sc.num_prefix_snapshots = options.prefix_caching.num_snapshots > 0
                                  ? options.prefix_caching.num_snapshots
                                  : options.num_slots;
    sc.prefix_snapshot_grid = options.prefix_caching.snapshot_grid;
    sc.announce_prompt_blocks = options.prefix_caching.announce_blocks;
  }
  const SpeculativeOptions& so = options.speculative;
  if (so.method != SpeculativeMethod::kNone) {
    if (so.num_speculative_tokens < 1) {
      return InvalidArgument(
          "speculative decoding needs num_speculative_tokens >= 1, got ",
          so.num_speculative_tokens);
    }
    sc.num_speculative_tokens = so.num_speculative_tokens;
  }
  TANDEM_ASSIGN_OR_RETURN(e->scheduler_, engine::Scheduler::Create(sc));
  if (sc.enable_prefix_caching) {
    e->prefix_events_ = std::make_unique<engine::PrefixEventQueue>(
        std::max<int64_t>(options.prefix_caching.max_pending_events,
                          int64_t{sc.num_prefix_snapshots} + 1));
    e->scheduler_->set_prefix_event_queue(e->prefix_events_.get());
  }
  KvCacheOptions co;
  co.block_size = sc.block_size;
  co.num_blocks = sc.num_blocks;
  // Prefix-cache snapshots live in slots after the running ones, so that they
  // are where the state is (the device, every TP rank) and copied by CopySlot.
  co.num_slots = sc.num_slots + sc.num_prefix_snapshots;
  e->snapshot_base_ = sc.num_slots;
  co.allocator = options.cache_allocator;
  co.shareable = options.cache_shareable;
  ModelRunnerOptions ro;
  ro.mla_mode = options.mla_mode;
  ro.enforce_eager = options.enforce_eager;
  ro.max_graph_batch = sc.num_slots;  // the running sequences (not the snapshots)
  if (tp) {
    // TP N: the executor loads each rank's shard and makes each rank's backend;
    // the engine's own needs (config, vocab; the draft model's backend) use
    // rank 0's, which runs on this thread.
    TpExecutorOptions to = options.tp;
    to.cache = co;
    to.runner = ro;
    TANDEM_ASSIGN_OR_RETURN(e->executor_,
                            TpExecutor::Create(*options.tp_checkpoint, to));
    weights = &e->executor_->weights(0);
    backend = &e->executor_->backend(0);
    e->weights_ = weights;
  } else {
    TANDEM_ASSIGN_OR_RETURN(e->executor_,
                            TpExecutor::CreateLocal(weights, backend, co, ro));
  }
  if (sc.enable_prefix_caching && options.prefix_caching.host_memory_bytes > 0) {
    TANDEM_RETURN_IF_ERROR(e->AttachHostTier(options.prefix_caching.host_memory_bytes));
  }
  e->sampler_ = std::make_unique<engine::Sampler>(weights->config.text.vocab_size);
  if (options.device_sampling && backend->SupportsSampling() &&
      weights->config.text.vocab_size <= kernels::kSamplingMaxVocab) {
    e->device_sampler_ =
        std::make_unique<DeviceSampler>(backend, weights->config.text.vocab_size);
    if (options.overlap_steps) {
      if (options.overlap_step_timeout <= absl::ZeroDuration()) {
        return InvalidArgument("overlap_step_timeout must be > 0, got ",
                               absl::FormatDuration(options.overlap_step_timeout));
      }
      e->device_sampler2_ =
          std::make_unique<DeviceSampler>(backend, weights->config.text.vocab_size);
      e->device_thread_ = std::make_unique<DeviceThread>();
    }
  }
  {
    int threads = options.sampling_threads;
    if (threads <= 0) threads = static_cast<int>(std::thread::hardware_concurrency());
    if (threads > 1) {
      e->sample_pool_ = std::make_unique<kernels::ThreadPool>(threads);
      for (int t = 0; t < e->sample_pool_->size(); ++t) {
        e->row_samplers_.push_back(
            std::make_unique<engine::Sampler>(weights->config.text.vocab_size));
      }
    }
  }
  switch (so.method) {
    case SpeculativeMethod::kNone:
      break;
    case SpeculativeMethod::kNgram: {
      TANDEM_ASSIGN_OR_RETURN(e->proposer_,
                              speculative::NgramProposer::Create(so.ngram));
      break;
    }
    case SpeculativeMethod::kDraft: {
      if (so.draft_weights == nullptr) {
        return InvalidArgument("speculative method 'draft' needs draft_weights");
      }
      DraftModelOptions dopt;
      dopt.num_slots = sc.num_slots;
      dopt.block_size = sc.block_size;
      // The draft's cache holds the sequences the target's holds: each slot up
      // to its share of the target's blocks (a memory-sized target may hold
      // far fewer than num_slots full contexts); longer ones get no drafts.
      dopt.max_context_tokens =
          std::min<int64_t>(sc.max_context_tokens + so.num_speculative_tokens,
                            std::max<int64_t>(2, static_cast<int64_t>(sc.num_blocks) *
                                                     bs / sc.num_slots));
      dopt.mla_mode = options.mla_mode;
      dopt.enforce_eager = options.enforce_eager;
      TANDEM_ASSIGN_OR_RETURN(e->proposer_, DraftModelProposer::Create(
                                                so.draft_weights, backend,
                                                weights->config.text.vocab_size, dopt));
      break;
    }
  }
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
  TANDEM_RETURN_IF_ERROR(device_error_);  // a stopped engine takes no work
  const int64_t V = weights_->config.text.vocab_size;
  if (requests_.contains(id)) return InvalidArgument("request ", id, " already exists");
  if (id < 0) {  // negative ids are the engine's own (prefix-cache continuations)
    return InvalidArgument("request id ", id, " is negative");
  }
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
  EnsureSeed(&r->params, &seeds_);
  r->prompt = std::move(prompt);
  r->tokens = r->prompt;
  r->history.AddPromptTokens(r->prompt);
  if (tokenizer_ != nullptr) {
    r->detok = std::make_unique<tokenizer::IncrementalDetokenizer>(tokenizer_);
  }
  const int64_t room =
      scheduler_->config().max_context_tokens - static_cast<int64_t>(r->prompt.size());
  r->stop = std::make_unique<engine::StopChecker>(r->params, eos_ids_, room);
  if (r->params.structured.has_value())
    TANDEM_RETURN_IF_ERROR(AttachConstraint(r.get()));
  if (r->params.prompt_logprobs >= 0) {
    r->scoring_prompt = true;
    r->prompt_scores.resize(r->prompt.size() - 1);
  }
  Request* raw = r.get();
  requests_[id] = std::move(r);
  return raw;
}

absl::Status Engine::AddRequest(RequestId id, std::vector<int32_t> prompt,
                                const engine::SamplingParams& params,
                                std::string_view cache_salt) {
  return AddRequest(id, std::move(prompt), params, cache_salt, {});
}

namespace {
// The end of the last image's rows (0 without images).
int64_t MediaEnd(absl::Span<const MediaInput> media) {
  return media.empty() ? 0 : media.back().position + media.back().rows;
}
}  // namespace

void Engine::SetPrefixKeys(absl::Span<const int32_t> prompt,
                           std::string_view cache_salt,
                           absl::Span<const MediaInput> media,
                           engine::SequenceRequest* sr) const {
  std::vector<engine::MediaHash> media_hashes;
  std::vector<RouteMedia> route_media;  // the router's, from its ImageInputs
  for (const MediaInput& m : media) {
    media_hashes.push_back({m.position, m.content_hash});
    route_media.push_back({.position = m.position, .hash = m.content_hash});
  }
  sr->block_hashes =
      engine::ChainedBlockHashes(prompt, options_.block_size, cache_salt, media_hashes);
  sr->route_hashes = RouteBlockHashes(prompt, cache_salt, route_media);
}

absl::Status Engine::CheckMedia(int64_t num_prompt_tokens,
                                absl::Span<const int32_t> prompt,
                                absl::Span<const MediaInput> media,
                                bool embeddings) const {
  const int64_t H = weights_->config.text.hidden_size;
  const int32_t pad = static_cast<int32_t>(weights_->config.media_placeholder_token_id);
  int64_t end = 0;
  for (size_t i = 0; i < media.size(); ++i) {
    const MediaInput& m = media[i];
    if (m.rows <= 0 || m.position < end || m.position + m.rows > num_prompt_tokens) {
      return InvalidArgument("image ", i, ": rows [", m.position, ", ",
                             m.position + m.rows,
                             ") are empty, overlap the previous "
                             "image or lie outside the ",
                             num_prompt_tokens, "-token prompt");
    }
    if (embeddings && (m.embeddings == nullptr ||
                       static_cast<int64_t>(m.embeddings->size()) != m.rows * H)) {
      return InvalidArgument("image ", i, ": ", m.rows, " rows need ", m.rows * H,
                             " embedding values, got ",
                             m.embeddings == nullptr ? 0 : m.embeddings->size());
    }
    for (int64_t p = m.position; p < m.position + m.rows && !prompt.empty(); ++p) {
      if (prompt[p] != pad) {
        return InvalidArgument("image ", i, ": prompt position ", p, " holds token ",
                               prompt[p], ", not the placeholder ", pad);
      }
    }
    end = m.position + m.rows;
  }
  return absl::OkStatus();
}

absl::Status Engine::AddRequest(RequestId id, std::vector<int32_t> prompt,
                                const engine::SamplingParams& params,
                                std::string_view cache_salt,
                                std::vector<MediaInput> media) {
  const int64_t n = prompt.size();
  if (!media.empty()) {
    // Under TP every rank runs the same step inputs (TpExecutor): each writes
    // the image rows over its all-reduced embeddings, so the rows need no
    // sharding.
    TANDEM_RETURN_IF_ERROR(CheckMedia(n, prompt, media, /*embeddings=*/true));
  }
  TANDEM_ASSIGN_OR_RETURN(Request * r, NewRequest(id, std::move(prompt), params));
  r->media = std::move(media);
  engine::SequenceRequest sr;
  sr.id = id;
  sr.num_prompt_tokens = n;
  sr.max_new_tokens = r->params.max_tokens;
  // Prompt logprobs need every prompt row computed: no prefix-cache hit (and,
  // keyless, nothing cached from it); their logits rows bound the chunks.
  sr.scored_prompt = r->scoring_prompt;
  // The tenant, also for a scored request's continuation at its end.
  r->cache_salt = std::string(cache_salt);
  if (options_.prefix_caching.enabled && !r->scoring_prompt) {
    SetPrefixKeys(r->prompt, cache_salt, r->media, &sr);
  }
  absl::Status s = scheduler_->Submit(sr);
  if (!s.ok()) requests_.erase(id);
  return s;
}

absl::Status Engine::Abort(RequestId id) {
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second->background) {  // continuations are ours
    if (reserved_.erase(id) > 0) return scheduler_->Abort(id);  // a reservation
    return NotFound("request ", id, " not found");
  }
  requests_.erase(it);
  if (proposer_ != nullptr) proposer_->Release(id);
  return scheduler_->Abort(id);
}

absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>>
Engine::CompileConstraint(const engine::StructuredOutputSpec& spec) const {
  if (tokenizer_ == nullptr) {
    return absl::FailedPreconditionError(
        "structured output needs the model's tokenizer (this engine has none)");
  }
  grammar::GrammarCompiler* compiler = nullptr;
  {
    absl::MutexLock lock(&grammar_mu_);
    if (grammar_compiler_ == nullptr) {
      TANDEM_ASSIGN_OR_RETURN(grammar_vocab_, grammar::TokenVocabulary::FromTokenizer(
                                                  *tokenizer_, eos_ids_));
      grammar_compiler_ = std::make_unique<grammar::GrammarCompiler>(
          grammar_vocab_, grammar::CompileLimits{});
    }
    compiler = grammar_compiler_.get();  // lives as long as the engine
  }
  return compiler->Compile(GrammarSpecOf(spec));  // thread-safe, outside the lock
}

absl::Status Engine::AttachConstraint(Request* r) {
  const int64_t V = weights_->config.text.vocab_size;
  std::shared_ptr<const grammar::CompiledGrammar> g = r->params.structured->compiled;
  if (g == nullptr) {
    TANDEM_ASSIGN_OR_RETURN(g, CompileConstraint(*r->params.structured));
    ++structured_compiled_at_admission_;
  } else {
    ++structured_precompiled_;
  }
  std::shared_ptr<const grammar::TokenVocabulary> vocab;
  {
    absl::MutexLock lock(&grammar_mu_);
    vocab = grammar_vocab_;
  }
  if (vocab == nullptr || &g->vocab() != vocab.get()) {
    return absl::InvalidArgumentError(
        "structured output: the request's grammar was compiled by another engine");
  }
  r->params.structured->compiled = nullptr;  // the constraint holds it
  // Verification rolls the constraint back over at most k drafts.
  const int rollback = std::max(options_.speculative.num_speculative_tokens, 0) + 1;
  TANDEM_ASSIGN_OR_RETURN(r->constraint, engine::OutputConstraint::Create(
                                             std::move(g), *r->params.structured,
                                             eos_ids_, vocab->size(), V, rollback));
  r->mask.assign(r->constraint->mask_words(), 0u);
  if (mask_pool_ == nullptr && options_.structured_mask_threads > 0) {
    mask_pool_ = std::make_unique<engine::MaskPool>(options_.structured_mask_threads);
  }
  return absl::OkStatus();
}

void Engine::EndWithConstraintError(const absl::Status& status, RequestOutput* out) {
  ++structured_failures_;
  last_structured_error_ = status;
  out->finished = true;
  out->finish_reason = engine::FinishReason::kError;
}

void Engine::FillMask(Request* r) {
  const absl::Time t0 = absl::Now();
  r->constraint->FillNextTokenBitmask(absl::MakeSpan(r->mask));
  structured_mask_ns_ += absl::ToInt64Nanoseconds(absl::Now() - t0);
  ++structured_masks_;
}

namespace {

// The masks of verification rows 0..m for `drafts` (row j after drafts[0, j))
// into `rows`, and the drafts the constraint allows: the walk stops at the
// first draft it forbids (rows then has usable + 1 entries). The constraint is
// left as it was (rolled back). Counts each mask's fill time into *ns.
absl::Status WalkDraftMasks(engine::OutputConstraint& c,
                            absl::Span<const int32_t> drafts,
                            std::vector<std::vector<uint32_t>>* rows, int64_t* usable,
                            int64_t* ns) {
  const int64_t m = static_cast<int64_t>(drafts.size());
  rows->resize(m + 1);
  int advanced = 0;
  int64_t j = 0;
  for (; j <= m; ++j) {
    std::vector<uint32_t>& row = (*rows)[j];
    row.assign(c.mask_words(), 0u);
    const absl::Time t0 = absl::Now();
    c.FillNextTokenBitmask(absl::MakeSpan(row));
    *ns += absl::ToInt64Nanoseconds(absl::Now() - t0);
    if (j == m) break;
    const int32_t d = drafts[j];
    if (((row[d >> 5] >> (d & 31)) & 1u) == 0 || !c.Accept(d).ok()) break;
    ++advanced;
  }
  *usable = std::min(j, m);  // drafts j.. break the grammar
  rows->resize(*usable + 1);
  return c.Rollback(advanced);
}

}  // namespace

absl::StatusOr<engine::SampleResult> Engine::SampleNext(
    engine::Sampler* sampler, Request* r, absl::Span<const float> logits) {
  engine::SampleRequest sr;
  sr.logits = logits;
  sr.params = &r->params;
  sr.history = &r->history;
  sr.suppressed_tokens = r->stop->SuppressedTokens();
  sr.position = r->num_generated();
  if (r->constraint != nullptr) {
    TANDEM_RETURN_IF_ERROR(r->mask_error);
    sr.allowed_bitmask = TakeReadyMask(r);
    if (sr.allowed_bitmask.empty()) {
      FillMask(r);
      sr.allowed_bitmask = r->mask;
    }
  }
  return sampler->Sample(sr);
}

absl::Span<const uint32_t> Engine::TakeReadyMask(Request* r) {
  if (!r->mask_ready) return {};
  r->mask_ready = false;
  return r->prepared->rows[0];
}

absl::Status Engine::Emit(Request* r, int32_t tok, const engine::SampleResult* res,
                          RequestOutput* out) {
  if (r->params.logprobs && res != nullptr) out->logprobs.push_back(*res);
  if (r->constraint != nullptr) TANDEM_RETURN_IF_ERROR(r->constraint->Accept(tok));
  r->tokens.push_back(tok);
  r->history.AddOutputToken(tok);
  out->new_tokens.push_back(tok);
  out->cached_prompt_tokens = r->hit_tokens;
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

// One step's batch as it moves through the phases: the plan, each planned
// sequence's request, drafts, forward input (block tables are copies: the
// scheduler owns the live ones) and KDA snapshot, then the outcomes the
// scheduler is told.
struct Engine::StepBatch {
  engine::StepPlan plan;
  std::vector<Request*> reqs;                     // indexed like plan.sequences
  std::vector<speculative::Proposal> proposals;   // empty where no drafts
  std::vector<SequenceInput> inputs;              // what the forward computes
  std::vector<std::vector<int32_t>> tables;       // inputs' block tables
  std::vector<std::vector<int32_t>> fed;          // inputs' tokens when not a prefix
  std::vector<KdaSnapshot> snapshots;             // taken before verifying drafts
  std::vector<engine::SequenceOutcome> outcomes;  // one per sampling sequence
  // Structured outputs, the overlapped path: the rows (indices into
  // plan.sequences) whose masks the mask pool fills during the forward.
  std::vector<size_t> mask_rows;
  std::shared_ptr<engine::MaskPool::Batch> mask_batch;
  // Prompt logprobs: the leading logits rows of entry i that score its prompt
  // (positions inputs[i].start_pos ..), before its sampled rows.
  std::vector<int32_t> scored_rows;
  // The forward leaves the logits on the device, to be sampled there.
  bool logits_on_device = false;
  // An overlapped step: its job on the device thread, and the sequences the
  // scheduler ended at the length limit when it completed the step ahead of
  // its tokens.
  std::shared_ptr<DeviceJob> job;
  std::vector<engine::SequenceId> ended;
};

// What an overlapped step's job reads and writes on the device thread. The
// host fills the inputs before submitting it and reads the outputs only after
// DeviceThread::Wait; nothing here points into a Request (the host changes
// those meanwhile).
struct Engine::DeviceJob {
  StepBatch* batch =
      nullptr;  // its inputs, fed and tables (the batch outlives the job)
  DeviceSampler* sampler = nullptr;  // packed on the host
  // The step before, whose sampled tokens feed this one: (row of batch->fed,
  // index into prev->results). Reset once read.
  std::shared_ptr<DeviceJob> prev;
  std::vector<std::pair<size_t, size_t>> pending;
  std::shared_ptr<DeviceThread::Job> handle;
  // Outputs.
  absl::Status status;
  std::vector<absl::StatusOr<engine::SampleResult>> results;  // one per sampling row
  StepTimingStats timing;     // the forward and the gap before it
  std::vector<float> logits;  // (empty: the logits stay on the device)
};

Engine::~Engine() {
  device_thread_.reset();  // runs what was submitted; nothing it uses is gone yet
}

void Engine::StartMasks(StepBatch* batch) {
  batch->mask_rows.clear();
  batch->mask_batch.reset();
  if (mask_pool_ == nullptr) return;
  std::vector<std::function<void()>> tasks;
  for (size_t i = 0; i < batch->plan.sequences.size(); ++i) {
    Request* r = batch->reqs[i];
    if (r->constraint == nullptr) continue;
    r->mask_ready = false;
    if (!batch->plan.sequences[i].samples) continue;
    // A PreparedMasks still held by a task given up on is left to it.
    if (r->prepared == nullptr || r->prepared.use_count() > 1) {
      r->prepared = std::make_shared<PreparedMasks>();
    }
    r->prepared->ns = 0;
    r->prepared->status = absl::OkStatus();
    // The constraint's state is final for this step: sampling (after the
    // forward) is the next thing that changes it.
    tasks.push_back(
        [c = r->constraint, p = r->prepared, drafts = batch->proposals[i].tokens]() {
          p->status = WalkDraftMasks(*c, drafts, &p->rows, &p->usable_drafts, &p->ns);
        });
    batch->mask_rows.push_back(i);
  }
  if (!tasks.empty()) batch->mask_batch = mask_pool_->Start(std::move(tasks));
}

void Engine::AwaitMasks(StepBatch* batch) {
  if (batch->mask_batch == nullptr) return;
  const std::vector<engine::MaskPool::TaskState> states = mask_pool_->Wait(
      batch->mask_batch.get(), absl::Now() + options_.structured_mask_timeout);
  for (size_t k = 0; k < batch->mask_rows.size(); ++k) {
    Request* r = batch->reqs[batch->mask_rows[k]];
    switch (states[k]) {
      case engine::MaskPool::TaskState::kDone:
        r->mask_ready = true;
        structured_mask_ns_ += r->prepared->ns;
        structured_masks_ += static_cast<int64_t>(r->prepared->rows.size());
        structured_masks_overlapped_ += static_cast<int64_t>(r->prepared->rows.size());
        break;
      case engine::MaskPool::TaskState::kRunning:
        // Still filling: its constraint is the task's until it ends.
        r->mask_error = absl::DeadlineExceededError(
            absl::StrCat("structured output: request ", r->id, "'s mask was not ready ",
                         absl::FormatDuration(options_.structured_mask_timeout),
                         " after the step's forward"));
        break;
      default:  // never started: filled at sampling time instead
        break;
    }
  }
  batch->mask_batch.reset();
}

absl::StatusOr<std::vector<RequestOutput>> Engine::Step() {
  std::vector<RequestOutput> outputs;
  TANDEM_RETURN_IF_ERROR(device_error_);
  if (!HasWork()) return outputs;
  // A TP group whose rank failed cannot run steps: fail fast, naming the rank.
  // (While a step is in flight its job reports that.)
  if (inflight_ == nullptr) TANDEM_RETURN_IF_ERROR(executor_->health());
  if (inflight_ != nullptr) {
    TANDEM_RETURN_IF_ERROR(StepOverlapped(&outputs));
  } else {
    std::unique_ptr<StepBatch> batch = std::move(planned_);
    if (batch != nullptr) {
      // Scheduled by the last Step() while a step ran: the rows of requests
      // that ended since are dropped; the inputs come from the tokens now known.
      size_t w = 0;
      for (size_t i = 0; i < batch->plan.sequences.size(); ++i) {
        if (!requests_.contains(batch->plan.sequences[i].id)) continue;
        batch->plan.sequences[w] = batch->plan.sequences[i];
        batch->reqs[w] = batch->reqs[i];
        ++w;
      }
      batch->plan.sequences.resize(w);
      batch->reqs.resize(w);
      if (w > 0) TANDEM_RETURN_IF_ERROR(PlanInputs(batch.get()));
    } else {
      batch = std::make_unique<StepBatch>();
      TANDEM_RETURN_IF_ERROR(PlanStep(batch.get()));
      EndUnrecomputable(batch->plan, &outputs);
    }
    if (batch->plan.sequences.empty()) {  // nothing fits now: close the empty step
      TANDEM_RETURN_IF_ERROR(scheduler_->CompleteStep(batch->plan, {}).status());
      return outputs;
    }
    if (Overlappable(*batch) && LaunchOverlapped(&batch, nullptr).ok()) {
      // The pipeline starts: the step after this one is launched before this
      // one's tokens are emitted.
      TANDEM_RETURN_IF_ERROR(StepOverlapped(&outputs));
    } else {
      TANDEM_RETURN_IF_ERROR(RunStep(batch.get(), &outputs));
    }
  }
  // The next forward's wait counts as a host gap only if it follows at once.
  if (!HasWork()) last_forward_end_.reset();
  return outputs;
}

absl::Status Engine::RunStep(StepBatch* batch, std::vector<RequestOutput>* outputs) {
  // The constrained rows' masks are filled while the forward runs; they are
  // waited for before anything else (a failed forward included).
  StartMasks(batch);
  batch->logits_on_device = SamplesOnDevice(*batch);
  const absl::Status forward = ForwardStep(*batch, &timing_, &logits_);
  AwaitMasks(batch);
  TANDEM_RETURN_IF_ERROR(forward);
  TANDEM_RETURN_IF_ERROR(StoreSnapshots(*batch));
  graph_stats_ = executor_->runner(0).graph_stats();
  comm_stats_ = executor_->comm_stats();
  TANDEM_RETURN_IF_ERROR(SampleStep(batch, outputs));
  return FinishStep(*batch, outputs);
}

bool Engine::Overlappable(const StepBatch& batch) const {
  if (device_thread_ == nullptr || proposer_ != nullptr || layer_progress_)
    return false;
  if (batch.plan.sequences.empty()) return false;
  for (size_t i = 0; i < batch.plan.sequences.size(); ++i) {
    const engine::ScheduledSequence& ss = batch.plan.sequences[i];
    const Request* r = batch.reqs[i];
    if (!ss.samples || ss.num_draft_tokens > 0 || ss.snapshot_at_end) return false;
    if (r->constraint != nullptr || r->background) return false;
    // Prompt logprobs: handed out with the first token (SampleStep), which
    // this step's successor would already be computing.
    if (r->scoring_prompt) return false;
    if (i < batch.inputs.size() && !batch.inputs[i].embedding_rows.empty())
      return false;
  }
  return true;
}

bool Engine::FollowsOverlapped(const StepBatch& next, const StepBatch& prev) const {
  if (next.plan.sequences.empty() || prev.job == nullptr) return false;
  if (device_thread_ == nullptr || proposer_ != nullptr || layer_progress_)
    return false;
  absl::flat_hash_set<engine::SequenceId> fed;  // prev's sampling rows
  for (const engine::ScheduledSequence& ss : prev.plan.sequences) {
    if (ss.samples) fed.insert(ss.id);
  }
  for (size_t i = 0; i < next.plan.sequences.size(); ++i) {
    const engine::ScheduledSequence& ss = next.plan.sequences[i];
    const Request* r = next.reqs[i];
    // Exactly the one token prev is sampling, at its position.
    if (!ss.samples || ss.num_draft_tokens > 0 || ss.snapshot_at_end ||
        ss.resets_state || ss.restore_snapshot >= 0 || ss.end != ss.start + 1 ||
        !fed.contains(ss.id) || ss.start != static_cast<int64_t>(r->tokens.size())) {
      return false;
    }
    // Nothing the host must know prev's token for before sampling this row
    // (penalty history, the grammar's state) or must place first.
    if (r->constraint != nullptr || r->params.HasPenalties() ||
        !r->pending_import.empty() || r->replay_from >= 0 || r->background) {
      return false;
    }
    // Not right after its first token: a caller may take a request's state
    // once its first token is out (the disaggregated hand-off, ExportState,
    // Locate), which a step in flight would have moved on.
    if (r->num_generated() < 1) return false;
  }
  return true;
}

absl::Status Engine::LaunchOverlapped(std::unique_ptr<StepBatch>* batch,
                                      const StepBatch* prev) {
  StepBatch* b = batch->get();
  const size_t n = b->plan.sequences.size();
  // The sampler's rows first: a row it cannot take leaves the batch as it was
  // (the caller runs it synchronously).
  std::vector<DeviceSampler::Row> rows(n);
  for (size_t i = 0; i < n; ++i) {
    Request* r = b->reqs[i];
    // After prev the row samples the output token after prev's.
    const int64_t position = r->num_generated() + (prev != nullptr ? 1 : 0);
    rows[i].params = &r->params;
    rows[i].history = &r->history;
    rows[i].position = position;
    // min_tokens: the stop ids stay masked while fewer were generated.
    if (position < r->params.min_tokens)
      rows[i].suppressed_tokens = r->stop->SuppressedTokens();
  }
  DeviceSampler* sampler =
      next_sampler_ == 0 ? device_sampler_.get() : device_sampler2_.get();
  if (absl::Status st = sampler->Pack(rows); !st.ok()) {
    ++timing_.device_sampling_fallbacks;
    return st;
  }
  auto job = std::make_shared<DeviceJob>();
  job->batch = b;
  job->sampler = sampler;
  if (prev != nullptr) {
    // Each row is fed the token prev is sampling for it: a placeholder here,
    // patched on the device thread from prev's results before the forward.
    absl::flat_hash_map<engine::SequenceId, size_t> result_of;
    size_t k = 0;
    for (const engine::ScheduledSequence& ss : prev->plan.sequences) {
      if (ss.samples) result_of[ss.id] = k++;
    }
    b->proposals.assign(n, {});
    b->inputs.assign(n, {});
    b->tables.assign(n, {});
    b->fed.assign(n, {});
    b->snapshots.assign(n, {});
    b->scored_rows.assign(n, 0);
    for (size_t i = 0; i < n; ++i) {
      const engine::ScheduledSequence& ss = b->plan.sequences[i];
      Request* r = b->reqs[i];
      r->slot = ss.slot;
      TANDEM_ASSIGN_OR_RETURN(b->tables[i], scheduler_->Blocks(ss.id));
      b->fed[i].assign(1, 0);
      SequenceInput& in = b->inputs[i];
      in.tokens = b->fed[i];
      in.start_pos = ss.start;
      in.block_table = b->tables[i];
      in.kda_slot = ss.slot;
      in.logits_indices = {0};
      job->pending.emplace_back(i, result_of.at(ss.id));
    }
    decode_tokens_ += static_cast<int64_t>(n);
    job->prev = prev->job;
  } else {
    // The job reads its tokens while the host appends to the requests': copies.
    for (size_t i = 0; i < n; ++i) {
      SequenceInput& in = b->inputs[i];
      if (in.tokens.data() == b->fed[i].data()) continue;
      b->fed[i].assign(in.tokens.begin(), in.tokens.end());
      in.tokens = b->fed[i];
    }
  }
  b->logits_on_device = true;
  b->job = job;
  next_sampler_ ^= 1;
  ++timing_.overlapped_steps;
  inflight_ = std::move(*batch);
  job->handle = device_thread_->Submit([this, job] { RunDeviceJob(job.get()); });
  return absl::OkStatus();
}

void Engine::RunDeviceJob(DeviceJob* job) {
  StepBatch& b = *job->batch;
  if (job->prev != nullptr) {
    const DeviceJob& prev = *job->prev;
    for (const auto& [i, k] : job->pending) {
      if (!prev.status.ok() || k >= prev.results.size()) {
        job->status = FailedPrecondition(
            "overlapped step: the step before it brought no tokens: ",
            prev.status.message());
        job->prev.reset();
        return;
      }
      // A row whose sampling failed fails that step at the host; its next row
      // is never used.
      b.fed[i][0] = prev.results[k].ok() ? prev.results[k]->token_id : 0;
    }
    job->prev.reset();
  }
  job->status = executor_->backend(0).device().MakeCurrent();
  if (job->status.ok()) job->status = ForwardStep(b, &job->timing, &job->logits);
  const absl::Time t0 = absl::Now();
  if (job->status.ok()) job->status = job->sampler->Upload();
  if (!job->status.ok()) return;
  ModelRunner& runner = executor_->runner(0);
  const int64_t rows = static_cast<int64_t>(
      job->pending.empty() ? b.plan.sequences.size() : job->pending.size());
  if (runner.device_logits() == nullptr || runner.device_logits_rows() != rows) {
    job->status =
        Internal("overlapped step: the forward left ", runner.device_logits_rows(),
                 " rows of logits on the device for ", rows, " sampling rows");
    return;
  }
  job->status = job->sampler->Run(runner.device_logits(), &job->results);
  last_sampling_seconds_ = absl::ToDoubleSeconds(absl::Now() - t0);
  job->timing.device_sampling_seconds = last_sampling_seconds_;
}

absl::Status Engine::StepOverlapped(std::vector<RequestOutput>* outputs) {
  std::unique_ptr<StepBatch> prev = std::move(inflight_);
  // The prefix cache's host tier copies blocks on the device inside the
  // scheduler's calls: with one, the step in flight finishes first (the next
  // one still launches before this one's tokens are emitted).
  if (host_tier_ != nullptr) {
    if (absl::Status w = WaitJob(*prev); !w.ok()) {
      return FailOverlap(w, std::move(prev), nullptr);
    }
  }
  // 1. The scheduler completes the running step as if each row had gained one
  //    token and gone on (the length limit it ends itself); the real endings
  //    are known after its tokens come back (FinishOverlapped).
  std::vector<engine::SequenceOutcome> optimistic;
  for (const engine::ScheduledSequence& ss : prev->plan.sequences) {
    if (!ss.samples || !requests_.contains(ss.id)) continue;  // aborted meanwhile
    engine::SequenceOutcome oc;
    oc.id = ss.id;
    oc.num_new_tokens = 1;
    optimistic.push_back(oc);
  }
  absl::StatusOr<std::vector<engine::SequenceId>> ended =
      scheduler_->CompleteStep(prev->plan, optimistic);
  if (!ended.ok()) return FailOverlap(ended.status(), std::move(prev), nullptr);
  prev->ended = *std::move(ended);
  ReapBackground();
  // 2. The next step: launched now when its rows only continue prev's.
  auto next = std::make_unique<StepBatch>();
  absl::Status planned = ScheduleStep(next.get());
  if (planned.ok()) {
    EndUnrecomputable(next->plan, outputs);
    if (FollowsOverlapped(*next, *prev)) {
      // (A row the device sampler cannot take: next stays here, run below.)
      LaunchOverlapped(&next, prev.get()).IgnoreError();
    }
  }
  // 3. The running step's tokens: emitted, stop-checked, ended.
  const absl::Status finished = FinishOverlapped(prev.get(), outputs);
  if (!planned.ok() || !finished.ok()) {
    return FailOverlap(planned.ok() ? finished : planned, std::move(prev),
                       std::move(next));
  }
  if (next == nullptr) return absl::OkStatus();  // launched
  // 4. Otherwise the next step runs in the next Step() (one step's outputs per
  //    call), its inputs planned from the tokens just emitted.
  if (next->plan.sequences.empty())
    return scheduler_->CompleteStep(next->plan, {}).status();
  planned_ = std::move(next);
  return absl::OkStatus();
}

absl::Status Engine::FinishOverlapped(StepBatch* prev,
                                      std::vector<RequestOutput>* outputs) {
  DeviceJob& job = *prev->job;
  TANDEM_RETURN_IF_ERROR(WaitJob(*prev));
  graph_stats_ = executor_->runner(0).graph_stats();
  comm_stats_ = executor_->comm_stats();
  timing_.steps += job.timing.steps;
  timing_.forward_seconds += job.timing.forward_seconds;
  timing_.gaps += job.timing.gaps;
  timing_.host_gap_seconds += job.timing.host_gap_seconds;
  timing_.max_host_gap_seconds =
      std::max(timing_.max_host_gap_seconds, job.timing.max_host_gap_seconds);
  timing_.device_sampling_seconds += job.timing.device_sampling_seconds;
  timing_.idle_gap_seconds += job.timing.idle_gap_seconds;
  TANDEM_RETURN_IF_ERROR(job.status);
  timing_.device_sampled_rows += static_cast<int64_t>(job.results.size());
  const absl::flat_hash_set<engine::SequenceId> at_length(prev->ended.begin(),
                                                          prev->ended.end());
  absl::flat_hash_set<engine::SequenceId> launched;  // rows of the step launched after
  if (inflight_ != nullptr) {
    for (const engine::ScheduledSequence& ss : inflight_->plan.sequences) {
      launched.insert(ss.id);
    }
  }
  size_t k = 0;
  for (const engine::ScheduledSequence& ss : prev->plan.sequences) {
    if (!ss.samples) continue;
    const size_t row = k++;
    auto it = requests_.find(ss.id);
    if (it == requests_.end()) continue;  // aborted while in flight
    Request* r = it->second.get();
    if (row >= job.results.size()) {
      return Internal("overlapped step: ", job.results.size(), " results for ", row + 1,
                      " sampling rows");
    }
    const absl::StatusOr<engine::SampleResult>& res = job.results[row];
    // As the synchronous path: a row's sampling error fails the step.
    TANDEM_RETURN_IF_ERROR(res.status());
    RequestOutput out;
    out.id = ss.id;
    TANDEM_RETURN_IF_ERROR(Emit(r, res->token_id, &*res, &out));
    if (!out.finished && at_length.contains(ss.id)) {
      out.text += r->stop->Flush(engine::FinishReason::kLength);
      out.finished = true;
      out.finish_reason = engine::FinishReason::kLength;
    }
    if (out.finished) {
      if (r->detok != nullptr && out.finish_reason == engine::FinishReason::kLength) {
        out.text += r->detok->Flush();
      }
      ContinueFinished(*r);
      if (!at_length.contains(ss.id) && scheduler_->Contains(ss.id)) {
        // Ended by its token (EOS, a stop string): the scheduler still runs it,
        // in the step launched after (its row there is thrown away) or queued.
        timing_.overlap_discarded_rows += launched.contains(ss.id);
        scheduler_->Abort(ss.id).IgnoreError();
      }
      requests_.erase(it);
    }
    outputs->push_back(std::move(out));
  }
  return absl::OkStatus();
}

absl::Status Engine::WaitDevice() {
  TANDEM_RETURN_IF_ERROR(device_error_);
  if (inflight_ == nullptr) return absl::OkStatus();
  if (absl::Status w = WaitJob(*inflight_); !w.ok()) {
    return FailOverlap(w, nullptr, nullptr);
  }
  return absl::OkStatus();
}

absl::Status Engine::WaitJob(const StepBatch& batch) {
  if (batch.job == nullptr) return absl::OkStatus();
  absl::Status w = DeviceThread::Wait(*batch.job->handle,
                                      absl::Now() + options_.overlap_step_timeout);
  if (!w.ok()) {
    return absl::DeadlineExceededError(
        absl::StrCat("an overlapped step ran past overlap_step_timeout (",
                     absl::FormatDuration(options_.overlap_step_timeout), ")"));
  }
  return absl::OkStatus();
}

absl::Status Engine::FailOverlap(const absl::Status& st, std::unique_ptr<StepBatch> a,
                                 std::unique_ptr<StepBatch> b) {
  for (std::unique_ptr<StepBatch>* p : {&a, &b, &inflight_, &planned_}) {
    if (*p != nullptr) abandoned_.push_back(std::move(*p));
  }
  if (device_error_.ok()) {
    device_error_ = absl::Status(
        st.code(),
        absl::StrCat("engine stopped after an overlapped step failed: ", st.message()));
    TLOG(ERROR, "engine stopped: an overlapped step failed").Kv("status", st);
  }
  return device_error_;
}

void Engine::set_layer_progress_callback(LayerProgressCallback cb) {
  // The device thread reads it during a step (ForwardStep).
  if (absl::Status w = WaitDevice(); !w.ok()) {
    TLOG(ERROR, "layer progress callback not set: a step is still running")
        .Kv("status", w);
    return;
  }
  layer_progress_ = std::move(cb);
  InstallLayerDoneHook();
}

void Engine::EndUnrecomputable(const engine::StepPlan& plan,
                               std::vector<RequestOutput>* outputs) {
  for (engine::SequenceId id : plan.unrecomputable) {
    auto it = requests_.find(id);
    if (it == requests_.end()) continue;
    RequestOutput out;
    out.id = id;
    out.finished = true;
    out.finish_reason = engine::FinishReason::kError;
    outputs->push_back(std::move(out));
    ++unrecomputable_drops_;
    if (proposer_ != nullptr) proposer_->Release(id);
    requests_.erase(it);
  }
}

absl::Status Engine::PlanStep(StepBatch* batch) {
  TANDEM_RETURN_IF_ERROR(ScheduleStep(batch));
  if (batch->plan.sequences.empty()) return absl::OkStatus();
  return PlanInputs(batch);
}

absl::Status Engine::ScheduleStep(StepBatch* batch) {
  TANDEM_ASSIGN_OR_RETURN(batch->plan, scheduler_->Schedule());
  ReapBackground();  // continuations the scheduler skipped or cancelled
  const engine::StepPlan& plan = batch->plan;
  // Preempted sequences recompute from position 0: their draft state and any
  // pending replay go.
  for (engine::SequenceId id : plan.preempted) {
    if (proposer_ != nullptr) proposer_->Release(id);
    auto it = requests_.find(id);
    if (it != requests_.end()) it->second->replay_from = -1;
  }
  if (plan.sequences.empty()) return absl::OkStatus();
  const size_t n = plan.sequences.size();
  batch->reqs.resize(n);
  for (size_t i = 0; i < n; ++i) {
    auto it = requests_.find(plan.sequences[i].id);
    if (it == requests_.end()) {
      return Internal("scheduled unknown request ", plan.sequences[i].id);
    }
    batch->reqs[i] = it->second.get();
    if (plan.sequences[i].resets_state || plan.sequences[i].restore_snapshot >= 0) {
      batch->reqs[i]->replay_from = -1;
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::PlanInputs(StepBatch* batch) {
  const engine::StepPlan& plan = batch->plan;
  const size_t n = plan.sequences.size();
  // Speculation: drafts, the tokens each entry feeds, KDA snapshots to roll back to.
  batch->proposals.assign(n, {});
  if (proposer_ != nullptr) {
    TANDEM_RETURN_IF_ERROR(ProposeDrafts(plan, batch->reqs, &batch->proposals));
  }
  batch->inputs.assign(n, {});
  batch->tables.assign(n, {});
  batch->fed.assign(n, {});
  batch->snapshots.assign(n, {});
  batch->scored_rows.assign(n, 0);
  for (size_t i = 0; i < n; ++i) TANDEM_RETURN_IF_ERROR(PlanInput(i, batch));
  return absl::OkStatus();
}

absl::Status Engine::PlanInput(size_t i, StepBatch* batch) {
  const engine::ScheduledSequence& ss = batch->plan.sequences[i];
  Request* r = batch->reqs[i];
  r->slot = ss.slot;
  if (ss.resets_state) {
    TANDEM_RETURN_IF_ERROR(executor_->ResetSlot(ss.slot));
    r->pending_import.clear();  // recomputed from its tokens instead
    r->hit_tokens = 0;
  } else if (ss.restore_snapshot >= 0) {
    // A prefix-cache hit at ss.start: the KDA state after exactly those tokens
    // (the rule: a snapshot at p), its MLA rows in the adopted blocks.
    TANDEM_RETURN_IF_ERROR(
        executor_->CopySlot(snapshot_base_ + ss.restore_snapshot, ss.slot));
    r->pending_import.clear();
    r->hit_tokens = ss.start;
  }
  std::vector<int32_t>& table = batch->tables[i];
  TANDEM_ASSIGN_OR_RETURN(table, scheduler_->Blocks(ss.id));
  if (!r->pending_import.empty()) {
    TANDEM_ASSIGN_OR_RETURN(
        std::vector<StateRange> dst,
        executor_->ExportSequence(table, r->import_tokens, ss.slot));
    TANDEM_RETURN_IF_ERROR(CopyStateRanges(r->pending_import, dst));
    r->pending_import.clear();
    r->import_bytes.clear();
  }
  const int64_t known_end = ss.end - ss.num_draft_tokens;
  const std::vector<int32_t>& drafts = batch->proposals[i].tokens;
  if (known_end > static_cast<int64_t>(r->tokens.size()) ||
      static_cast<int32_t>(drafts.size()) > ss.num_draft_tokens) {
    return Internal("request ", ss.id, ": planned positions ", ss.start, "..", ss.end,
                    " beyond its ", r->tokens.size(), " tokens and ", drafts.size(),
                    " drafts");
  }
  // A rolled-back sequence replays its accepted tokens from replay_from.
  const int64_t from = r->replay_from >= 0 ? r->replay_from : ss.start;
  SequenceInput& in = batch->inputs[i];
  if (drafts.empty() && from == ss.start) {
    in.tokens = absl::MakeConstSpan(r->tokens).subspan(ss.start, known_end - ss.start);
  } else {
    std::vector<int32_t>& fed = batch->fed[i];
    fed.assign(r->tokens.begin() + from, r->tokens.begin() + known_end);
    fed.insert(fed.end(), drafts.begin(), drafts.end());
    in.tokens = fed;
  }
  in.start_pos = from;
  in.block_table = table;
  in.kda_slot = ss.slot;
  // Image rows inside this chunk's positions [from, from + fed).
  in.embedding_rows.clear();
  const int64_t fed_end = from + static_cast<int64_t>(in.tokens.size());
  for (const MediaInput& m : r->media) {
    const int64_t b = std::max(from, m.position);
    const int64_t e = std::min(fed_end, m.position + m.rows);
    if (b >= e) continue;
    if (m.embeddings == nullptr) {  // the scheduler's recompute_floor keeps this out
      return Internal("request ", ss.id, ": positions ", b, "..", e,
                      " are image rows without embeddings on this engine");
    }
    in.embedding_rows.push_back(
        {b - from, e - b,
         m.embeddings->data() + (b - m.position) * weights_->config.text.hidden_size});
  }
  // Prompt logprobs: every row that predicts a prompt token (they come first:
  // logits indices ascend, and the sampled row predicts the first output).
  if (r->scoring_prompt && drafts.empty()) {
    const int64_t k =
        std::clamp<int64_t>(static_cast<int64_t>(r->prompt.size()) - 1 - from, 0,
                            static_cast<int64_t>(in.tokens.size()));
    for (int32_t j = 0; j < k; ++j) in.logits_indices.push_back(j);
    batch->scored_rows[i] = static_cast<int32_t>(k);
  }
  if (ss.samples) {
    // The last known token's row, then one per draft.
    const int32_t t = static_cast<int32_t>(in.tokens.size());
    const int32_t m = static_cast<int32_t>(drafts.size());
    for (int32_t j = t - 1 - m; j < t; ++j) in.logits_indices.push_back(j);
  }
  if (!drafts.empty()) {
    TANDEM_ASSIGN_OR_RETURN(batch->snapshots[i], executor_->SnapshotSlot(ss.slot));
  }
  if (r->num_generated() > 0 && ss.samples) {
    decode_tokens_ += in.tokens.size();
  } else {
    prefill_tokens_ += in.tokens.size();
  }
  return absl::OkStatus();
}

void Engine::InstallLayerDoneHook() {
  // The runner is the device thread's while a step is in flight.
  if (absl::Status w = WaitDevice(); !w.ok()) {
    TLOG(ERROR, "layer progress hook not changed: a step is still running")
        .Kv("status", w);
    return;
  }
  if (!layer_progress_) {
    executor_->runner(0).set_layer_done_hook(nullptr);
    return;
  }
  // Rank 0's runner (the caller's thread). With TP, rank 0 reports a layer after
  // that layer's attention all-reduce, which every rank enters only after writing
  // its own KDA heads / MLA rows: the layer's state is final on every rank.
  Engine* self = this;
  executor_->runner(0).set_layer_done_hook([self](int layer) {
    if (self->layer_progress_ && !self->progress_.empty()) {
      // Listeners read the layer's state (the KV hand-off streams it): on a
      // device it must have been computed, not just enqueued. A device error is
      // left to the forward to report.
      if (!self->executor_->backend(0).Synchronize().ok()) return;
      self->layer_progress_(layer, self->progress_);
    }
  });
}

absl::Status Engine::ForwardStep(const StepBatch& batch, StepTimingStats* timing,
                                 std::vector<float>* logits) {
  // The prefill entries the layer-progress callback reports during the forward.
  progress_.clear();
  if (layer_progress_) {
    for (size_t i = 0; i < batch.plan.sequences.size(); ++i) {
      if (batch.reqs[i]->num_generated() > 0) continue;
      const SequenceInput& in = batch.inputs[i];
      LayerProgressEntry pe;
      pe.id = batch.plan.sequences[i].id;
      pe.start_pos = in.start_pos;
      // A prefix hit's first chunk: positions [0, p) were already in the
      // cache (shared blocks, restored slot), so after this layer the state of
      // [0, end) is: reported from 0, as a first chunk.
      if (batch.reqs[i]->hit_tokens > 0 && in.start_pos == batch.reqs[i]->hit_tokens) {
        pe.start_pos = 0;
      }
      pe.end_pos = in.start_pos + static_cast<int64_t>(in.tokens.size());
      pe.block_table = batch.tables[i];
      pe.slot = in.kda_slot;
      pe.completes_prefill = batch.plan.sequences[i].samples;
      progress_.push_back(pe);
    }
  }
  const absl::Time start = absl::Now();
  if (last_forward_end_.has_value()) {
    const double gap = absl::ToDoubleSeconds(start - *last_forward_end_);
    ++timing->gaps;
    timing->host_gap_seconds += gap;
    timing->max_host_gap_seconds = std::max(timing->max_host_gap_seconds, gap);
    timing->idle_gap_seconds += std::max(0.0, gap - last_sampling_seconds_);
  }
  last_sampling_seconds_ = 0;
  const absl::Status forward = executor_->Forward(
      batch.inputs, logits,
      batch.logits_on_device ? LogitsPlacement::kDevice : LogitsPlacement::kHost);
  const absl::Time end = absl::Now();
  ++timing->steps;
  timing->forward_seconds += absl::ToDoubleSeconds(end - start);
  last_forward_end_ = end;
  progress_.clear();
  return forward;
}

// Generation snapshots. The state token-by-token decode reaches is not the one
// chunked prefill computes for the same tokens (tests/prefix:
// generation_snapshot_test), and the MLA rows of later layers inherit the
// difference, so neither the decode slot nor the decode-written blocks may be
// cached: a hit must continue bit-identically to a cache-off recompute. Instead
// a finished request's tokens (prompt + verified output) up to the last
// multiple of lcm(64, block size) are queued as a background continuation:
// the scheduler runs it on spare capacity from the prompt's own snapshot,
// chunked like a prefill, caches its blocks (hashes chained after the
// prompt's) and snapshots its end; under pressure it is dropped.
void Engine::ContinueFinished(const Request& r) {
  const engine::PrefixCache* pc = scheduler_->prefix_cache();
  if (pc == nullptr || !options_.prefix_caching.snapshot_generations || r.background) {
    return;
  }
  const int64_t a = std::lcm<int64_t>(options_.block_size, pc->config().kda_chunk);
  const int64_t q = static_cast<int64_t>(r.tokens.size()) / a * a;
  // The prompt's own deepest snapshot (its last full chunk): the continuation
  // starts there, and is worth running only past it.
  const int64_t p0 = (static_cast<int64_t>(r.prompt.size()) - 1) / a * a;
  if (q <= p0) return;
  // Images: their hashes key the continuation's blocks as they keyed the
  // prompt's (the next turn carries the same images at the same positions).
  // Rows of an image this engine has no embeddings for (a decode worker gets
  // only the spans) cannot be recomputed: past p0 there is nothing to run.
  int64_t floor = 0;
  for (const MediaInput& m : r.media) {
    if (m.embeddings == nullptr) floor = std::max(floor, m.position + m.rows);
  }
  if (floor > p0) return;
  auto bg = std::make_unique<Request>();
  bg->id = next_background_id_--;
  bg->background = true;
  bg->prompt.assign(r.tokens.begin(), r.tokens.begin() + q);
  bg->tokens = bg->prompt;
  bg->cache_salt = r.cache_salt;
  bg->media = r.media;  // shared embeddings, rows below q
  engine::SequenceRequest sr;
  sr.id = bg->id;
  sr.num_prompt_tokens = q;
  sr.max_new_tokens = 1;
  sr.recompute_floor = floor;
  SetPrefixKeys(bg->prompt, bg->cache_salt, bg->media, &sr);
  // From at least the prompt's snapshot (else its whole prompt would be recomputed).
  if (!scheduler_->SubmitBackground(sr, p0).ok()) return;  // e.g. at the context limit
  background_.insert(bg->id);
  requests_[bg->id] = std::move(bg);
}

void Engine::ReapBackground() {
  for (auto it = background_.begin(); it != background_.end();) {
    auto cur = it++;
    if (!scheduler_->Contains(*cur)) {
      requests_.erase(*cur);
      background_.erase(cur);
    }
  }
}

absl::Status Engine::StoreSnapshots(const StepBatch& batch) {
  for (const engine::ScheduledSequence& ss : batch.plan.sequences) {
    if (!ss.snapshot_at_end || ss.num_draft_tokens > 0) continue;
    TANDEM_ASSIGN_OR_RETURN(const engine::SnapshotId snap,
                            scheduler_->StoreSnapshot(ss.id, ss.end));
    if (snap < 0) continue;  // one exists there already
    TANDEM_RETURN_IF_ERROR(executor_->CopySlot(ss.slot, snapshot_base_ + snap));
    generation_snapshots_ += background_.contains(ss.id);
  }
  return absl::OkStatus();
}

// The prefix cache's host tier: evicted blocks and snapshots move to a budgeted
// host pool and come back on a hit, every TP rank copying its own cache (its own
// KDA heads; its own replica of the MLA rows), rank after rank in the bytes.
absl::Status Engine::AttachHostTier(int64_t budget_bytes) {
  engine::PrefixCache* pc = scheduler_->mutable_prefix_cache();
  if (pc == nullptr) return FailedPrecondition("host tier without a prefix cache");
  host_tier_ = std::make_unique<engine::HostTier>(budget_bytes);
  TpExecutor* ex = executor_.get();
  const int64_t base = snapshot_base_;
  engine::PrefixTierCopier c;
  c.save_block = [ex](engine::BlockId id, std::vector<uint8_t>* out) -> absl::Status {
    size_t n = 0;
    for (int r = 0; r < ex->tp_size(); ++r) n += ex->cache(r).block_bytes();
    out->resize(n);
    size_t off = 0;
    for (int r = 0; r < ex->tp_size(); ++r) {
      TANDEM_RETURN_IF_ERROR(ex->cache(r).CopyBlockToHost(id, out->data() + off));
      off += ex->cache(r).block_bytes();
    }
    return absl::OkStatus();
  };
  c.load_block = [ex](engine::BlockId id,
                      absl::Span<const uint8_t> in) -> absl::Status {
    size_t off = 0;
    for (int r = 0; r < ex->tp_size(); ++r) {
      if (off + ex->cache(r).block_bytes() > in.size()) {
        return Internal("host tier: block bytes too short for rank ", r);
      }
      TANDEM_RETURN_IF_ERROR(ex->cache(r).CopyBlockFromHost(id, in.data() + off));
      off += ex->cache(r).block_bytes();
    }
    return absl::OkStatus();
  };
  c.save_snapshot = [ex, base](engine::SnapshotId s,
                               std::vector<uint8_t>* out) -> absl::Status {
    size_t n = 0;
    for (int r = 0; r < ex->tp_size(); ++r) n += ex->cache(r).kda_bytes_per_slot();
    out->resize(n);
    size_t off = 0;
    for (int r = 0; r < ex->tp_size(); ++r) {
      TANDEM_RETURN_IF_ERROR(ex->cache(r).CopySlotToHost(base + s, out->data() + off));
      off += ex->cache(r).kda_bytes_per_slot();
    }
    return absl::OkStatus();
  };
  c.load_snapshot = [ex, base](engine::SnapshotId s,
                               absl::Span<const uint8_t> in) -> absl::Status {
    size_t off = 0;
    for (int r = 0; r < ex->tp_size(); ++r) {
      if (off + ex->cache(r).kda_bytes_per_slot() > in.size()) {
        return Internal("host tier: snapshot bytes too short for rank ", r);
      }
      TANDEM_RETURN_IF_ERROR(ex->cache(r).CopySlotFromHost(base + s, in.data() + off));
      off += ex->cache(r).kda_bytes_per_slot();
    }
    return absl::OkStatus();
  };
  pc->set_host_tier(host_tier_.get(), std::move(c));
  return absl::OkStatus();
}

PrefixCachingStats Engine::prefix_caching_stats() const {
  PrefixCachingStats out;
  const engine::PrefixCache* pc = scheduler_->prefix_cache();
  if (pc == nullptr) return out;
  const engine::PrefixCacheStats& s = pc->stats();
  out.queried_tokens = s.queried_tokens;
  out.hit_tokens = s.hit_tokens;
  out.lookups = s.lookups;
  out.hits = s.hits;
  out.snapshots_stored = s.snapshots_stored;
  out.snapshots_evicted = s.snapshots_evicted;
  out.snapshots_held = pc->num_snapshots();
  out.blocks_cached = pc->num_cached_blocks();
  out.blocks_evicted = s.blocks_evicted;
  const engine::BackgroundStats& b = scheduler_->background_stats();
  out.continuations_submitted = b.submitted;
  out.continuations_completed = b.completed;
  out.continuations_skipped = b.skipped;
  out.continuations_cancelled = b.cancelled;
  out.continuation_tokens = b.tokens;
  out.generation_snapshots = generation_snapshots_;
  int64_t slot_bytes = 0;
  for (int r = 0; r < executor_->tp_size(); ++r) {
    slot_bytes += static_cast<int64_t>(executor_->cache(r).kda_bytes_per_slot());
  }
  out.snapshot_bytes_held = out.snapshots_held * slot_bytes;
  int64_t block_bytes = 0;
  for (int r = 0; r < executor_->tp_size(); ++r) {
    block_bytes += static_cast<int64_t>(executor_->cache(r).block_bytes());
  }
  out.device_bytes_held = out.snapshot_bytes_held + out.blocks_cached * block_bytes;
  out.blocks_moved_to_host = s.blocks_moved_to_host;
  out.snapshots_moved_to_host = s.snapshots_moved_to_host;
  out.blocks_loaded_from_host = s.blocks_loaded_from_host;
  out.snapshots_loaded_from_host = s.snapshots_loaded_from_host;
  out.hits_from_host = s.hits_from_host;
  out.reserve_queried_tokens = s.reserve_queried_tokens;
  out.reserve_hit_tokens = s.reserve_hit_tokens;
  if (const engine::HostTier* h = pc->host_tier(); h != nullptr) {
    out.host_budget_bytes = h->budget_bytes();
    out.host_bytes_held = h->bytes_held();
    out.host_blocks_held = h->num_blocks();
    out.host_snapshots_held = h->num_snapshots();
    out.host_blocks_evicted = h->stats().blocks_evicted;
    out.host_snapshots_evicted = h->stats().snapshots_evicted;
  }
  return out;
}

std::vector<std::optional<absl::StatusOr<engine::SampleResult>>> Engine::PresampleRows(
    const StepBatch& batch) {
  const int64_t V = weights_->config.text.vocab_size;
  // Rows without drafts are sampled up front, in parallel: a row reads only its
  // request's parameters, history and position, which nothing changes before
  // its Emit in SampleStep, so the results are those of sampling them one by one.
  std::vector<std::optional<absl::StatusOr<engine::SampleResult>>> presampled(
      batch.plan.sequences.size());
  if (sample_pool_ == nullptr) return presampled;
  std::vector<std::pair<size_t, int64_t>> plain;  // (sequence, logits row)
  const std::vector<int64_t> starts = LogitsRowStarts(batch);
  for (size_t i = 0; i < batch.plan.sequences.size(); ++i) {
    if (batch.plan.sequences[i].samples && batch.proposals[i].tokens.empty()) {
      plain.emplace_back(i, starts[i] + batch.scored_rows[i]);
    }
  }
  if (plain.size() > 1) {
    sample_pool_->ParallelFor(
        static_cast<int64_t>(plain.size()), [&](int64_t b, int64_t e, int participant) {
          engine::Sampler& sampler = *row_samplers_[participant];
          for (int64_t k = b; k < e; ++k) {
            const auto [i, prow] = plain[k];
            presampled[i] =
                SampleNext(&sampler, batch.reqs[i],
                           absl::MakeConstSpan(logits_).subspan(prow * V, V));
          }
        });
  }
  return presampled;
}

std::vector<int64_t> Engine::LogitsRowStarts(const StepBatch& batch) {
  const size_t n = batch.plan.sequences.size();
  std::vector<int64_t> starts(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    int64_t rows = batch.scored_rows.empty() ? 0 : batch.scored_rows[i];
    if (batch.plan.sequences[i].samples) {
      rows += 1 + static_cast<int64_t>(batch.proposals[i].tokens.size());
    }
    starts[i + 1] = starts[i] + rows;
  }
  return starts;
}

namespace {

// A prompt row that cannot be scored ends its own request (at its first token),
// not the step; the first error a request gets is the one it reports. `position`
// is the scored row's index (the token at position + 1 is the one scored).
template <typename Req>
void NotePromptScoreError(Req* r, int64_t position, const absl::Status& st) {
  if (!r->prompt_score_error.ok()) return;
  r->prompt_score_error = absl::Status(
      st.code(),
      absl::StrCat("prompt logprobs at position ", position + 1, ": ", st.message()));
}

}  // namespace

absl::Status Engine::ScorePrompts(const StepBatch& batch) {
  const int64_t V = weights_->config.text.vocab_size;
  struct Row {
    Request* r;
    int64_t logits_row;
    int64_t position;  // scores the prompt token at position + 1
  };
  std::vector<Row> rows;
  const std::vector<int64_t> starts = LogitsRowStarts(batch);
  for (size_t i = 0; i < batch.plan.sequences.size(); ++i) {
    for (int32_t j = 0; j < batch.scored_rows[i]; ++j) {
      rows.push_back({batch.reqs[i], starts[i] + j, batch.inputs[i].start_pos + j});
    }
  }
  if (rows.empty()) return absl::OkStatus();
  timing_.host_scored_rows += static_cast<int64_t>(rows.size());
  const int64_t row = starts.back();
  if (static_cast<int64_t>(logits_.size()) < row * V) {
    return Internal("prompt logprobs: the forward left ", logits_.size() / V,
                    " logits rows, the step needs ", row);
  }
  std::vector<absl::Status> status(rows.size());
  auto score = [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const Row& w = rows[k];
      absl::StatusOr<engine::SampleResult> res =
          engine::ScoreToken(absl::MakeConstSpan(logits_).subspan(w.logits_row * V, V),
                             w.r->prompt[w.position + 1], w.r->params.prompt_logprobs);
      if (res.ok()) {
        w.r->prompt_scores[w.position] = *std::move(res);
      } else {
        status[k] = res.status();
      }
    }
  };
  if (sample_pool_ != nullptr && rows.size() > 1) {
    sample_pool_->ParallelFor(static_cast<int64_t>(rows.size()),
                              [&](int64_t b, int64_t e, int) { score(b, e); });
  } else {
    score(0, static_cast<int64_t>(rows.size()));
  }
  // A row that cannot be scored ends its own request, not the step.
  for (size_t k = 0; k < rows.size(); ++k) {
    if (!status[k].ok()) NotePromptScoreError(rows[k].r, rows[k].position, status[k]);
  }
  return absl::OkStatus();
}

bool Engine::SamplesOnDevice(const StepBatch& batch) const {
  if (device_sampler_ == nullptr) return false;
  bool any = false;
  for (size_t i = 0; i < batch.plan.sequences.size(); ++i) {
    // Prompt logprobs are scored there too (DeviceSampler::Row::score_token).
    if (batch.scored_rows[i] > 0) any = true;
    if (!batch.plan.sequences[i].samples) continue;
    if (!batch.proposals[i].tokens.empty()) return false;
    any = true;
  }
  return any;
}

absl::StatusOr<bool> Engine::SampleRowsOnDevice(
    const StepBatch& batch,
    std::vector<std::optional<absl::StatusOr<engine::SampleResult>>>* presampled) {
  ModelRunner& runner = executor_->runner(0);
  std::vector<DeviceSampler::Row> rows;
  // rows[k] is sequence seq[k]'s sampled row, or (scored[k] >= 0) its prompt
  // row scoring the token at position scored[k] + 1 (LogitsRowStarts' order:
  // a sequence's scored rows, then its sampled row).
  std::vector<size_t> seq;
  std::vector<int64_t> scored;
  std::vector<absl::Status> mask_errors;
  std::vector<std::pair<size_t, Request*>>
      to_fill;  // (row, request) without a mask yet
  for (size_t i = 0; i < batch.plan.sequences.size(); ++i) {
    for (int32_t j = 0; j < batch.scored_rows[i]; ++j) {
      Request* r = batch.reqs[i];
      const int64_t position = batch.inputs[i].start_pos + j;
      DeviceSampler::Row row;
      row.score_token = r->prompt[position + 1];
      row.score_top = r->params.prompt_logprobs;
      rows.push_back(row);
      seq.push_back(i);
      scored.push_back(position);
      mask_errors.emplace_back();
    }
    if (!batch.plan.sequences[i].samples) continue;
    Request* r = batch.reqs[i];
    DeviceSampler::Row row;
    row.params = &r->params;
    row.history = &r->history;
    row.suppressed_tokens = r->stop->SuppressedTokens();
    row.position = r->num_generated();
    // Structured output, as SampleNext: the mask filled during the forward, or
    // now. A row whose mask failed is sampled unmasked and gets its error.
    absl::Status mask_error;
    if (r->constraint != nullptr) {
      mask_error = r->mask_error;
      if (mask_error.ok()) {
        row.allowed_bitmask = TakeReadyMask(r);
        if (row.allowed_bitmask.empty()) to_fill.emplace_back(rows.size(), r);
      }
    }
    rows.push_back(row);
    seq.push_back(i);
    scored.push_back(-1);
    mask_errors.push_back(std::move(mask_error));
  }
  // Masks not filled during the forward: now, in parallel on the sampling pool
  // as the host path fills them (each touches only its own request).
  if (sample_pool_ != nullptr && to_fill.size() > 1) {
    sample_pool_->ParallelFor(static_cast<int64_t>(to_fill.size()),
                              [&](int64_t b, int64_t e, int) {
                                for (int64_t k = b; k < e; ++k)
                                  FillMask(to_fill[k].second);
                              });
  } else {
    for (const auto& [k, r] : to_fill) FillMask(r);
  }
  for (const auto& [k, r] : to_fill) rows[k].allowed_bitmask = r->mask;
  if (runner.device_logits() == nullptr ||
      runner.device_logits_rows() != static_cast<int64_t>(rows.size())) {
    return Internal("device sampling: the forward left ", runner.device_logits_rows(),
                    " rows of logits on the device for ", rows.size(),
                    " sampling and scored rows");
  }
  const absl::Time t0 = absl::Now();
  if (absl::Status st = device_sampler_->Prepare(rows); !st.ok()) {
    // The logits are untouched: sample them on the host this step.
    ++timing_.device_sampling_fallbacks;
    const int64_t n = timing_.device_sampling_fallbacks;
    if (n == 1 || n % 1000 == 0) {
      TLOG(WARNING, "device sampling: a step samples on the host instead")
          .Kv("rows", static_cast<int64_t>(rows.size()))
          .Kv("fallbacks", n)
          .Kv("error", st);
    }
    TANDEM_RETURN_IF_ERROR(runner.CopyDeviceLogits(&logits_));
    return false;
  }
  TANDEM_RETURN_IF_ERROR(
      device_sampler_->Run(runner.device_logits(), &device_results_));
  last_sampling_seconds_ = absl::ToDoubleSeconds(absl::Now() - t0);
  timing_.device_sampling_seconds += last_sampling_seconds_;
  int64_t sampled_rows = 0;
  for (size_t k = 0; k < seq.size(); ++k) {
    if (scored[k] >= 0) {
      // As ScorePrompts: a row that cannot be scored ends its own request.
      Request* r = batch.reqs[seq[k]];
      absl::StatusOr<engine::SampleResult>& res = device_results_[k];
      if (res.ok()) {
        r->prompt_scores[scored[k]] = *std::move(res);
      } else {
        NotePromptScoreError(r, scored[k], res.status());
      }
      continue;
    }
    ++sampled_rows;
    (*presampled)[seq[k]] = mask_errors[k].ok()
                                ? std::move(device_results_[k])
                                : absl::StatusOr<engine::SampleResult>(mask_errors[k]);
  }
  timing_.device_sampled_rows += sampled_rows;
  timing_.device_scored_rows += static_cast<int64_t>(rows.size()) - sampled_rows;
  return true;
}

absl::Status Engine::SampleStep(StepBatch* batch, std::vector<RequestOutput>* outputs) {
  const int64_t V = weights_->config.text.vocab_size;
  std::vector<std::optional<absl::StatusOr<engine::SampleResult>>> presampled;
  bool on_device = false;
  if (batch->logits_on_device) {
    presampled.resize(batch->plan.sequences.size());
    TANDEM_ASSIGN_OR_RETURN(on_device, SampleRowsOnDevice(*batch, &presampled));
  }
  if (!on_device) {
    presampled = PresampleRows(*batch);
    for (const engine::ScheduledSequence& ss : batch->plan.sequences) {
      if (ss.samples) ++timing_.host_sampled_rows;
    }
  }
  const absl::Span<const float> logits = logits_;
  if (!on_device) TANDEM_RETURN_IF_ERROR(ScorePrompts(*batch));
  const std::vector<int64_t> starts = LogitsRowStarts(*batch);
  for (size_t i = 0; i < batch->plan.sequences.size(); ++i) {
    const engine::ScheduledSequence& ss = batch->plan.sequences[i];
    if (!ss.samples) continue;
    const int64_t row = starts[i] + batch->scored_rows[i];  // its sampled rows
    RequestOutput out;
    out.id = ss.id;
    Request* r = batch->reqs[i];
    const speculative::Proposal& prop = batch->proposals[i];
    const int64_t m = static_cast<int64_t>(prop.tokens.size());
    r->replay_from = -1;  // this forward brought the KDA slot up to date
    if (!r->prompt_score_error.ok()) {
      TLOG(WARNING, "request ended: its prompt could not be scored")
          .Kv("request_id", ss.id)
          .Kv("error", r->prompt_score_error);
      out.finished = true;
      out.finish_reason = engine::FinishReason::kError;
    } else if (m == 0) {
      if (!presampled[i].has_value()) {  // not sampled up front (one row, one thread)
        presampled[i] = SampleNext(sampler_.get(), r, logits.subspan(row * V, V));
      }
      absl::StatusOr<engine::SampleResult> res = *std::move(presampled[i]);
      absl::Status st = res.ok() ? Emit(r, res->token_id, &*res, &out) : res.status();
      if (!st.ok()) {
        // A constrained request that cannot go on (its mask left no token)
        // ends alone, with an error; any other failure fails the step.
        if (r->constraint == nullptr) return st;
        EndWithConstraintError(st, &out);
      }
    } else {
      absl::StatusOr<int32_t> verified =
          Verify(r, logits.subspan(row * V, (m + 1) * V), prop, &out);
      if (!verified.ok() && r->constraint != nullptr) {
        EndWithConstraintError(verified.status(), &out);
        verified = 0;
      }
      TANDEM_ASSIGN_OR_RETURN(const int32_t accepted, std::move(verified));
      ++spec_stats_.verifications;
      spec_stats_.drafted_tokens += m;
      spec_stats_.accepted_tokens += accepted;
      spec_stats_.emitted_tokens += out.new_tokens.size();
      if (accepted < m && !out.finished) {
        // Hybrid-state rollback: the slot saw rejected drafts. Back to the state
        // before this forward; the next forward replays [start, accepted..].
        TANDEM_RETURN_IF_ERROR(executor_->RestoreSlot(ss.slot, batch->snapshots[i]));
        r->replay_from = batch->inputs[i].start_pos;
        ++spec_stats_.rollbacks;
      }
      proposer_->OnAccepted(ss.id, accepted, r->tokens.back());
    }
    if (r->scoring_prompt && !out.new_tokens.empty()) {
      // The first token is out: the prompt's scores go with it.
      out.prompt_logprobs = std::move(r->prompt_scores);
      r->prompt_scores.clear();
      r->scoring_prompt = false;
    }
    engine::SequenceOutcome oc;
    oc.id = ss.id;
    oc.num_new_tokens = static_cast<int32_t>(out.new_tokens.size());
    oc.finished = out.finished;
    batch->outcomes.push_back(oc);
    outputs->push_back(std::move(out));
  }
  return absl::OkStatus();
}

absl::Status Engine::FinishStep(const StepBatch& batch,
                                std::vector<RequestOutput>* outputs) {
  // The scheduler advances the sequences and frees the blocks and slot of those
  // that ended; an ending the outputs did not see is the length limit.
  TANDEM_ASSIGN_OR_RETURN(std::vector<engine::SequenceId> ended,
                          scheduler_->CompleteStep(batch.plan, batch.outcomes));
  ReapBackground();  // continuations computed to their end
  for (engine::SequenceId id : ended) {
    auto it = std::find_if(outputs->begin(), outputs->end(),
                           [&](const RequestOutput& o) { return o.id == id; });
    if (it == outputs->end()) {
      outputs->emplace_back();
      outputs->back().id = id;
      it = outputs->end() - 1;
    }
    if (!it->finished) {
      auto rq = requests_.find(id);
      if (rq != requests_.end())
        it->text += rq->second->stop->Flush(engine::FinishReason::kLength);
      it->finished = true;
      it->finish_reason = engine::FinishReason::kLength;
    }
  }
  for (RequestOutput& out : *outputs) {
    if (!out.finished) continue;
    auto rq = requests_.find(out.id);
    if (rq != requests_.end() && rq->second->detok != nullptr &&
        out.finish_reason == engine::FinishReason::kLength) {
      out.text += rq->second->detok->Flush();
    }
    if (rq != requests_.end()) ContinueFinished(*rq->second);
    requests_.erase(out.id);
    if (proposer_ != nullptr) proposer_->Release(out.id);
  }
  return absl::OkStatus();
}

absl::StatusOr<Engine::Request*> Engine::SettledState(RequestId id) {
  if (inflight_ != nullptr) {
    for (const engine::ScheduledSequence& ss : inflight_->plan.sequences) {
      if (ss.id == id) {
        // Its state already holds the next position's token, which the host
        // has not seen yet.
        return FailedPrecondition("request ", id,
                                  " has an overlapped step in flight; its state is "
                                  "taken between steps (overlap_steps off)");
      }
    }
  }
  TANDEM_RETURN_IF_ERROR(WaitDevice());
  auto it = requests_.find(id);
  if (it == requests_.end()) return NotFound("request ", id, " not found");
  Request* r = it->second.get();
  if (r->num_generated() < 1 || r->slot < 0) {
    return FailedPrecondition("request ", id, " has not finished its prefill");
  }
  TANDEM_RETURN_IF_ERROR(CatchUp(r));
  return r;
}

absl::StatusOr<ExportedState> Engine::ExportState(RequestId id) {
  TANDEM_ASSIGN_OR_RETURN(Request * r, SettledState(id));
  ExportedState st;
  st.prompt = r->prompt;
  st.generated.assign(r->tokens.begin() + r->prompt.size(), r->tokens.end());
  st.num_cached_tokens = static_cast<int64_t>(r->tokens.size()) - 1;
  TANDEM_ASSIGN_OR_RETURN(std::vector<int32_t> blocks, scheduler_->Blocks(id));
  TANDEM_ASSIGN_OR_RETURN(
      st.ranges, executor_->ExportSequence(blocks, st.num_cached_tokens, r->slot));
  return st;
}

absl::StatusOr<StateLocation> Engine::Locate(RequestId id) {
  TANDEM_ASSIGN_OR_RETURN(Request * r, SettledState(id));
  StateLocation loc;
  TANDEM_ASSIGN_OR_RETURN(loc.block_ids, scheduler_->Blocks(id));
  loc.slot = r->slot;
  loc.num_cached_tokens = static_cast<int64_t>(r->tokens.size()) - 1;
  loc.aligned_tokens = std::min(loc.num_cached_tokens, scheduler_->AlignedTokens(id));
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

absl::StatusOr<Engine::Request*> Engine::NewPrefilledRequest(
    RequestId id, const ExportedState& state, const engine::SamplingParams& params,
    RequestOutput* out) {
  if (state.generated.empty() ||
      state.num_cached_tokens !=
          static_cast<int64_t>(state.prompt.size() + state.generated.size()) - 1) {
    return InvalidArgument("request ", id,
                           ": prefilled state needs >= 1 generated token and ",
                           "the state of every token but the last");
  }
  TANDEM_ASSIGN_OR_RETURN(Request * r, NewRequest(id, state.prompt, params));
  // The peer computed the prompt (and its logprobs, which travel beside it).
  r->scoring_prompt = false;
  std::vector<engine::SampleResult>().swap(r->prompt_scores);
  for (int32_t t : state.generated) {
    if (t < 0 || t >= weights_->config.text.vocab_size) {
      requests_.erase(id);
      return InvalidArgument("request ", id, ": generated token ", t, " out of range");
    }
    if (r->constraint != nullptr) {
      // The hand-off replays the tokens generated elsewhere: the matcher state
      // is rebuilt exactly (a token the constraint forbids is refused).
      if (absl::Status c = r->constraint->Accept(t); !c.ok()) {
        requests_.erase(id);
        return InvalidArgument("request ", id, ": generated token ", t,
                               " breaks its structured output: ", c.message());
      }
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
    return nullptr;
  }
  return r;
}

absl::Status Engine::AddPrefilled(RequestId id, const ExportedState& state,
                                  const engine::SamplingParams& params,
                                  RequestOutput* out) {
  TANDEM_RETURN_IF_ERROR(WaitDevice());  // the copies below use a device
  TANDEM_ASSIGN_OR_RETURN(Request * r, NewPrefilledRequest(id, state, params, out));
  if (r == nullptr) return absl::OkStatus();  // ended by its generated tokens
  // Own a copy of the source bytes until the first step places them.
  r->import_tokens = state.num_cached_tokens;
  r->import_bytes.reserve(state.ranges.size());
  for (const StateRange& src : state.ranges) {
    // The source may be another engine's device cache: copied by its device.
    r->import_bytes.emplace_back(src.bytes, '\0');
    if (absl::Status c = CopyRangeToHost(src, r->import_bytes.back().data()); !c.ok()) {
      requests_.erase(id);
      return c;
    }
    StateRange own = src;
    own.device = nullptr;  // host bytes now
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

absl::StatusOr<StateLocation> Engine::Reserve(RequestId id, int64_t num_prompt_tokens,
                                              absl::Span<const int32_t> prompt,
                                              std::string_view cache_salt,
                                              bool share_held_prefix,
                                              std::vector<MediaInput> media) {
  // The slot and blocks it hands the peer may be a just-ended request's, which
  // the step in flight still writes.
  TANDEM_RETURN_IF_ERROR(WaitDevice());
  if (requests_.contains(id) || reserved_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("request ", id, " already exists"));
  }
  if (!prompt.empty() && static_cast<int64_t>(prompt.size()) != num_prompt_tokens) {
    return InvalidArgument("request ", id, ": ", prompt.size(),
                           " prompt token ids for a reservation of ", num_prompt_tokens,
                           " tokens");
  }
  if (absl::Status m =
          CheckMedia(num_prompt_tokens, prompt, media, /*embeddings=*/false);
      !m.ok()) {
    return InvalidArgument("request ", id, ": ", m.message());
  }
  engine::SequenceRequest sr;
  sr.id = id;
  sr.num_prompt_tokens = num_prompt_tokens;
  if (!prompt.empty() && scheduler_->prefix_cache() != nullptr) {
    // The images' hashes mixed in as the prefill worker mixes them, so a hit
    // never crosses a different image. (The route hashes name the positions
    // in the events, should a recompute after preemption snapshot them.)
    SetPrefixKeys(prompt, cache_salt, media, &sr);
  }
  // Image rows have no embeddings here: they come only from the peer or from
  // the cache, never from a recompute.
  sr.recompute_floor = MediaEnd(media);
  sr.share_cached_blocks = share_held_prefix;
  TANDEM_RETURN_IF_ERROR(scheduler_->Reserve(sr, /*num_generated_tokens=*/1));
  reserved_[id] = Reservation{num_prompt_tokens, std::move(media)};
  StateLocation loc;
  TANDEM_ASSIGN_OR_RETURN(loc.block_ids, scheduler_->Blocks(id));
  TANDEM_ASSIGN_OR_RETURN(loc.slot, scheduler_->Slot(id));
  loc.num_cached_tokens = num_prompt_tokens;
  loc.held_prefix_tokens = scheduler_->HeldPrefixTokens(id);
  return loc;
}

absl::StatusOr<RequestOutput> Engine::AdmitReserved(
    RequestId id, const ExportedState& state, const engine::SamplingParams& params) {
  TANDEM_RETURN_IF_ERROR(WaitDevice());
  auto it = reserved_.find(id);
  if (it == reserved_.end()) return NotFound("request ", id, " has no reservation");
  if (static_cast<int64_t>(state.prompt.size()) != it->second.num_prompt_tokens ||
      state.generated.size() != 1) {
    return InvalidArgument("request ", id, " reserved a prompt of ",
                           it->second.num_prompt_tokens,
                           " tokens and its first generated token; got ",
                           state.prompt.size(), " and ", state.generated.size());
  }
  // The image spans the reservation named must lie over placeholders of the
  // prompt that landed.
  if (absl::Status m = CheckMedia(it->second.num_prompt_tokens, state.prompt,
                                  it->second.media, /*embeddings=*/false);
      !m.ok()) {
    return InvalidArgument("request ", id, ": ", m.message());
  }
  RequestOutput out;
  out.id = id;
  TANDEM_ASSIGN_OR_RETURN(Request * r, NewPrefilledRequest(id, state, params, &out));
  if (r == nullptr) {  // ended by its first token: the reservation goes
    reserved_.erase(id);
    TANDEM_RETURN_IF_ERROR(scheduler_->Abort(id));
    return out;
  }
  r->media = std::move(it->second.media);  // spans only: no embeddings here
  if (absl::Status s =
          scheduler_->AdmitReserved(id, r->params.max_tokens, state.cacheable_tokens);
      !s.ok()) {
    requests_.erase(id);
    return s;
  }
  reserved_.erase(id);
  return out;
}

absl::Status Engine::ProposeDrafts(const engine::StepPlan& plan,
                                   absl::Span<Request* const> reqs,
                                   std::vector<speculative::Proposal>* proposals) {
  std::vector<speculative::ProposeRequest> batch;
  std::vector<size_t> where;
  for (size_t i = 0; i < plan.sequences.size(); ++i) {
    const engine::ScheduledSequence& ss = plan.sequences[i];
    Request* r = reqs[i];
    // Drafts for decoding sequences whose KDA slot is current. Random sampling
    // with logprobs is not verified speculatively (RejectionSample reports no
    // logprobs), so it decodes one token per step.
    if (!ss.samples || ss.num_draft_tokens <= 0 || r->replay_from >= 0 ||
        r->num_generated() < 1 ||
        ss.start + 1 != static_cast<int64_t>(r->tokens.size()) ||
        (!r->params.IsGreedy() && r->params.logprobs)) {
      continue;
    }
    speculative::ProposeRequest pr;
    pr.id = ss.id;
    pr.tokens = r->tokens;
    pr.num_prompt_tokens = static_cast<int64_t>(r->prompt.size());
    pr.max_drafts = ss.num_draft_tokens;
    pr.params = &r->params;
    pr.history = &r->history;
    pr.suppressed_tokens = r->stop->SuppressedTokens();
    batch.push_back(pr);
    where.push_back(i);
  }
  if (batch.empty()) return absl::OkStatus();
  std::vector<speculative::Proposal> got;
  TANDEM_RETURN_IF_ERROR(proposer_->Propose(batch, &got));
  if (got.size() != batch.size()) {
    return Internal("proposer '", proposer_->name(), "' returned ", got.size(),
                    " proposals for ", batch.size(), " sequences");
  }
  const int64_t V = weights_->config.text.vocab_size;
  for (size_t b = 0; b < batch.size(); ++b) {
    speculative::Proposal& p = got[b];
    if (static_cast<int32_t>(p.tokens.size()) > batch[b].max_drafts ||
        (!p.probs.empty() && static_cast<int64_t>(p.probs.size()) !=
                                 static_cast<int64_t>(p.tokens.size()) * V)) {
      return Internal("proposer '", proposer_->name(), "': bad proposal for request ",
                      batch[b].id);
    }
    for (int32_t t : p.tokens) {
      if (t < 0 || t >= V) {
        return Internal("proposer '", proposer_->name(), "' drafted token ", t);
      }
    }
    (*proposals)[where[b]] = std::move(p);
  }
  return absl::OkStatus();
}

absl::StatusOr<int32_t> Engine::Verify(Request* r, absl::Span<const float> logits,
                                       const speculative::Proposal& proposal,
                                       RequestOutput* out) {
  const int64_t V = weights_->config.text.vocab_size;
  std::vector<int32_t> drafts = proposal.tokens;
  int64_t m = static_cast<int64_t>(drafts.size());
  const int64_t g = r->num_generated();  // output position of row 0
  // Structured output: row j is sampled under the constraint's mask after the
  // drafts before it. A draft the constraint forbids is rejected with every
  // draft after it (the verification is cut there); the constraint walks the
  // drafts to make each row's mask and is rolled back before Emit replays the
  // accepted ones.
  // (The overlapped path walked the drafts during the forward.)
  std::vector<std::vector<uint32_t>> local;
  const std::vector<std::vector<uint32_t>>* rows = &local;
  if (r->constraint != nullptr) {
    TANDEM_RETURN_IF_ERROR(r->mask_error);
    int64_t usable = 0;
    if (r->mask_ready) {
      r->mask_ready = false;
      TANDEM_RETURN_IF_ERROR(r->prepared->status);
      rows = &r->prepared->rows;
      usable = r->prepared->usable_drafts;
    } else {
      int64_t ns = 0;
      TANDEM_RETURN_IF_ERROR(
          WalkDraftMasks(*r->constraint, drafts, &local, &usable, &ns));
      structured_mask_ns_ += ns;
      structured_masks_ += static_cast<int64_t>(local.size());
    }
    m = usable;
    drafts.resize(m);
  }
  const std::vector<std::vector<uint32_t>>& masks = *rows;
  const bool greedy = r->params.IsGreedy();
  const bool penalties = r->params.HasPenalties();
  // Row j is the target's distribution for output position g + j, after the
  // drafts before it: they join the penalty history (and leave it again).
  std::vector<engine::SampleResult> argmax;  // greedy
  std::vector<float> target, row_probs;      // random: (m + 1) rows
  absl::Status status;
  int64_t added = 0;
  for (int64_t j = 0; j <= m && status.ok(); ++j) {
    if (j > 0 && penalties) {
      r->history.AddOutputToken(drafts[j - 1]);
      ++added;
    }
    engine::SampleRequest sr;
    sr.logits = logits.subspan(j * V, V);
    sr.params = &r->params;
    sr.history = &r->history;
    if (g + j < r->params.min_tokens)
      sr.suppressed_tokens = r->stop->SuppressedTokens();
    sr.position = g + j;
    if (!masks.empty()) sr.allowed_bitmask = masks[j];
    if (greedy) {
      absl::StatusOr<engine::SampleResult> res = sampler_->Sample(sr);
      status = res.status();
      if (res.ok()) argmax.push_back(*std::move(res));
    } else {
      status = sampler_->Distribution(sr, &row_probs);
      target.insert(target.end(), row_probs.begin(), row_probs.end());
    }
  }
  for (; added > 0; --added) r->history.RemoveOutputToken(drafts[added - 1]);
  TANDEM_RETURN_IF_ERROR(status);

  engine::SpecVerifyResult v;
  if (greedy) {
    std::vector<int32_t> ids;
    for (const engine::SampleResult& res : argmax) ids.push_back(res.token_id);
    TANDEM_ASSIGN_OR_RETURN(v, engine::GreedyVerify(ids, drafts));
  } else {
    std::vector<float> onehot;
    absl::Span<const float> q = proposal.probs;
    if (!q.empty()) q = q.subspan(0, m * V);  // cut with the drafts
    if (q.empty()) {  // deterministic drafts: q is one-hot at each draft
      onehot.assign(m * V, 0.0f);
      for (int64_t j = 0; j < m; ++j) onehot[j * V + drafts[j]] = 1.0f;
      q = onehot;
    }
    TANDEM_ASSIGN_OR_RETURN(
        v, engine::RejectionSample(target, q, drafts, V, *r->params.seed, g));
  }
  for (int32_t j = 0; j < v.num_accepted && !out->finished; ++j) {
    TANDEM_RETURN_IF_ERROR(Emit(r, drafts[j], greedy ? &argmax[j] : nullptr, out));
  }
  if (!out->finished) {
    TANDEM_RETURN_IF_ERROR(
        Emit(r, v.next_token, greedy ? &argmax[v.num_accepted] : nullptr, out));
  }
  return v.num_accepted;
}

absl::Status Engine::CatchUp(Request* r) {
  if (r->replay_from < 0) return absl::OkStatus();
  TANDEM_ASSIGN_OR_RETURN(std::vector<int32_t> blocks, scheduler_->Blocks(r->id));
  SequenceInput in;
  const int64_t cached = static_cast<int64_t>(r->tokens.size()) - 1;
  in.tokens =
      absl::MakeConstSpan(r->tokens).subspan(r->replay_from, cached - r->replay_from);
  in.start_pos = r->replay_from;
  in.block_table = blocks;
  in.kda_slot = r->slot;
  std::vector<float> logits;
  TANDEM_RETURN_IF_ERROR(executor_->Forward({&in, 1}, &logits));
  r->replay_from = -1;
  return absl::OkStatus();
}

}  // namespace tandem::engine
