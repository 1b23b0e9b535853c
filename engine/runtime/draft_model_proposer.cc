#include "engine/runtime/draft_model_proposer.h"

#include <algorithm>
#include <utility>

#include "common/status.h"
#include "engine/sampling/counter_rng.h"
#include "engine/sampling/rejection_sampler.h"

namespace tandem::engine {

DraftModelProposer::DraftModelProposer(const engine::ModelWeights* weights,
                                       const DraftModelOptions& o)
    : weights_(weights),
      options_(o),
      blocks_(static_cast<int32_t>(
          o.num_slots * engine::BlocksForTokens(o.max_context_tokens, o.block_size))),
      slots_(o.num_slots) {}

absl::StatusOr<std::unique_ptr<DraftModelProposer>> DraftModelProposer::Create(
    const engine::ModelWeights* weights, kernels::Backend* backend,
    int64_t target_vocab_size, const DraftModelOptions& options) {
  if (weights == nullptr || backend == nullptr) {
    return InvalidArgument("draft model: weights and backend are required");
  }
  const int64_t V = weights->config.text.vocab_size;
  if (V != target_vocab_size) {
    return InvalidArgument("draft model vocabulary (", V,
                           ") differs from the target's (", target_vocab_size, ")");
  }
  if (options.num_slots <= 0 || options.block_size <= 0 ||
      options.max_context_tokens <= 1) {
    return InvalidArgument("draft model: num_slots, block_size must be > 0 and ",
                           "max_context_tokens > 1");
  }
  DraftModelOptions o = options;
  o.max_context_tokens = std::min<int64_t>(
      o.max_context_tokens, weights->config.text.max_position_embeddings);
  auto p = std::unique_ptr<DraftModelProposer>(new DraftModelProposer(weights, o));
  engine::KvCacheOptions co;
  co.block_size = o.block_size;
  co.num_blocks = p->blocks_.num_blocks();
  co.num_slots = o.num_slots;
  if (backend->device().name() != "host") co.device = &backend->device();
  TANDEM_ASSIGN_OR_RETURN(p->cache_, engine::KvCache::Create(weights->config, co));
  engine::ModelRunnerOptions ro;
  ro.mla_mode = o.mla_mode;
  ro.enforce_eager = o.enforce_eager;
  p->runner_ =
      std::make_unique<engine::ModelRunner>(weights, p->cache_.get(), backend, ro);
  p->sampler_ = std::make_unique<engine::Sampler>(V);
  return p;
}

absl::StatusOr<DraftModelProposer::Seq*> DraftModelProposer::GetOrCreate(int64_t id) {
  auto it = seqs_.find(id);
  if (it != seqs_.end()) return it->second.get();
  TANDEM_ASSIGN_OR_RETURN(engine::SlotId slot, slots_.Acquire());
  auto s = std::make_unique<Seq>(Seq{slot, engine::BlockTable(options_.block_size)});
  absl::Status st = cache_->ResetSlot(slot);
  if (!st.ok()) {
    slots_.Release(slot).IgnoreError();
    return st;
  }
  Seq* raw = s.get();
  seqs_[id] = std::move(s);
  return raw;
}

absl::Status DraftModelProposer::Sync(Seq* s, absl::Span<const int32_t> tokens) {
  const size_t n = std::min(s->cached.size(), tokens.size());
  size_t common = 0;
  while (common < n && s->cached[common] == tokens[common]) ++common;
  if (common == s->cached.size() && common < tokens.size()) return absl::OkStatus();
  if (s->snapshot_len >= 0 && static_cast<size_t>(s->snapshot_len) <= common &&
      static_cast<size_t>(s->snapshot_len) < tokens.size()) {
    TANDEM_RETURN_IF_ERROR(cache_->RestoreSlot(s->slot, s->snapshot));
    s->cached.resize(s->snapshot_len);
    return absl::OkStatus();
  }
  TANDEM_RETURN_IF_ERROR(cache_->ResetSlot(s->slot));
  s->cached.clear();
  s->snapshot_len = -1;
  return absl::OkStatus();
}

absl::Status DraftModelProposer::Propose(
    absl::Span<const speculative::ProposeRequest> requests,
    std::vector<speculative::Proposal>* proposals) {
  const int64_t V = weights_->config.text.vocab_size;
  proposals->assign(requests.size(), speculative::Proposal{});
  struct Work {
    size_t req;
    Seq* seq;
    int32_t k;  // drafts to make
    int64_t len;
    int64_t generated;             // output position of draft 0
    engine::PenaltyState history;  // committed + drafts (with penalties only)
  };
  std::vector<Work> work;
  for (size_t i = 0; i < requests.size(); ++i) {
    const speculative::ProposeRequest& rq = requests[i];
    const int64_t len = static_cast<int64_t>(rq.tokens.size());
    if (rq.max_drafts <= 0 || len == 0) continue;
    // Positions written: up to len + k - 2; the table reserves len + k - 1.
    const int32_t k = static_cast<int32_t>(
        std::min<int64_t>(rq.max_drafts, options_.max_context_tokens - len + 1));
    if (k <= 0) continue;
    absl::StatusOr<Seq*> s = GetOrCreate(rq.id);
    if (!s.ok()) continue;  // no draft slot free: no drafts for it this step
    TANDEM_RETURN_IF_ERROR(Sync(*s, rq.tokens));
    const int64_t need = len + k - 1 - (*s)->table.num_tokens();
    if (need > 0 && !(*s)->table.Append(need, &blocks_).ok()) continue;
    Work w{i, *s, k, len, len - rq.num_prompt_tokens, {}};
    if (rq.params != nullptr && rq.params->HasPenalties() && rq.history != nullptr) {
      w.history = *rq.history;
    }
    work.push_back(std::move(w));
  }
  if (work.empty()) return absl::OkStatus();

  // Picks draft j of `w` from its logits row.
  std::vector<float> q;
  engine::SamplingParams greedy;
  auto choose = [&](Work& w, absl::Span<const float> row, int32_t j) -> absl::Status {
    const speculative::ProposeRequest& rq = requests[w.req];
    const engine::SamplingParams* params = rq.params != nullptr ? rq.params : &greedy;
    const bool penalties = params->HasPenalties() && rq.history != nullptr;
    engine::SampleRequest sr;
    sr.logits = row;
    sr.params = params;
    sr.history = penalties ? &w.history : rq.history;
    const int64_t position = w.generated + j;
    if (position < params->min_tokens) sr.suppressed_tokens = rq.suppressed_tokens;
    sr.position = position;
    speculative::Proposal& out = (*proposals)[w.req];
    int32_t token = 0;
    if (params->IsGreedy()) {
      TANDEM_ASSIGN_OR_RETURN(engine::SampleResult res, sampler_->Sample(sr));
      token = res.token_id;
    } else {
      TANDEM_RETURN_IF_ERROR(sampler_->Distribution(sr, &q));
      token = engine::DrawFromWeights(
          q,
          engine::CounterUniform(*params->seed, position, engine::RngStream::kSample));
      if (token < 0) return Internal("draft distribution has no mass");
      out.probs.insert(out.probs.end(), q.begin(), q.end());
    }
    if (penalties) w.history.AddOutputToken(token);
    out.tokens.push_back(token);
    return absl::OkStatus();
  };

  // Forward 0: the committed tokens the draft has not seen.
  std::vector<engine::SequenceInput> inputs;
  std::vector<float> logits;
  inputs.reserve(work.size());
  for (const Work& w : work) {
    const speculative::ProposeRequest& rq = requests[w.req];
    engine::SequenceInput in;
    const int64_t start = static_cast<int64_t>(w.seq->cached.size());
    in.tokens = rq.tokens.subspan(start);
    in.start_pos = start;
    in.block_table = w.seq->table.blocks();
    in.kda_slot = w.seq->slot;
    in.logits_indices = {static_cast<int32_t>(in.tokens.size()) - 1};
    inputs.push_back(std::move(in));
  }
  TANDEM_RETURN_IF_ERROR(runner_->Forward(inputs, &logits));
  ++forward_passes_;
  int32_t max_k = 0;
  for (size_t i = 0; i < work.size(); ++i) {
    Work& w = work[i];
    Seq* s = w.seq;
    s->cached.assign(requests[w.req].tokens.begin(), requests[w.req].tokens.end());
    TANDEM_ASSIGN_OR_RETURN(s->snapshot, cache_->SnapshotSlot(s->slot));
    s->snapshot_len = w.len;
    s->last_drafts = w.k;
    max_k = std::max(max_k, w.k);
    TANDEM_RETURN_IF_ERROR(choose(w, absl::MakeConstSpan(logits).subspan(i * V, V), 0));
  }
  // Forwards 1..k-1: one new token per sequence still drafting.
  std::vector<size_t> active;
  for (int32_t j = 1; j < max_k; ++j) {
    inputs.clear();
    active.clear();
    for (size_t i = 0; i < work.size(); ++i) {
      Work& w = work[i];
      if (w.k <= j) continue;
      const std::vector<int32_t>& drafts = (*proposals)[w.req].tokens;
      engine::SequenceInput in;
      in.tokens = absl::MakeConstSpan(drafts).subspan(j - 1, 1);
      in.start_pos = w.len + j - 1;
      in.block_table = w.seq->table.blocks();
      in.kda_slot = w.seq->slot;
      in.logits_indices = {0};
      inputs.push_back(std::move(in));
      active.push_back(i);
    }
    TANDEM_RETURN_IF_ERROR(runner_->Forward(inputs, &logits));
    ++forward_passes_;
    for (size_t a = 0; a < active.size(); ++a) {
      Work& w = work[active[a]];
      w.seq->cached.push_back((*proposals)[w.req].tokens[j - 1]);
      TANDEM_RETURN_IF_ERROR(
          choose(w, absl::MakeConstSpan(logits).subspan(a * V, V), j));
    }
  }
  return absl::OkStatus();
}

void DraftModelProposer::OnAccepted(int64_t id, int32_t num_accepted,
                                    int32_t /*next_token*/) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return;
  Seq* s = it->second.get();
  // The draft consumed d_0..d_{k-2}; they stand only if all were accepted.
  if (num_accepted >= s->last_drafts - 1 || s->snapshot_len < 0) return;
  if (!cache_->RestoreSlot(s->slot, s->snapshot).ok()) {
    // Cannot happen for a slot this proposer owns; recompute from scratch.
    cache_->ResetSlot(s->slot).IgnoreError();
    s->cached.clear();
    s->snapshot_len = -1;
    return;
  }
  s->cached.resize(s->snapshot_len);
}

void DraftModelProposer::Release(int64_t id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return;
  Seq* s = it->second.get();
  // Both only fail on bookkeeping bugs; the pools' invariants would show them.
  s->table.Release(&blocks_).IgnoreError();
  slots_.Release(s->slot).IgnoreError();
  seqs_.erase(it);
}

}  // namespace tandem::engine
