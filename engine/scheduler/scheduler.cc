#include "engine/scheduler/scheduler.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "absl/container/flat_hash_set.h"
#include "common/status.h"

namespace tandem::engine {

absl::Status SchedulerConfig::Validate() const {
  if (block_size <= 0) return InvalidArgument("block_size must be > 0");
  if (num_blocks <= 0) return InvalidArgument("num_blocks must be > 0");
  if (num_slots <= 0) return InvalidArgument("num_slots must be > 0");
  if (max_tokens_per_step <= 0) {
    return InvalidArgument("max_tokens_per_step must be > 0");
  }
  if (max_running <= 0) return InvalidArgument("max_running must be > 0");
  if (max_context_tokens <= 1 || max_context_tokens > kMaxContextTokens) {
    return InvalidArgument("max_context_tokens must be in [2, ", kMaxContextTokens,
                           "], got ", max_context_tokens);
  }
  if (num_speculative_tokens < 0) {
    return InvalidArgument("num_speculative_tokens must be >= 0");
  }
  if (num_speculative_tokens + 1 > max_tokens_per_step) {
    return InvalidArgument("a decode step of 1 + ", num_speculative_tokens,
                           " tokens exceeds the step budget of ", max_tokens_per_step);
  }
  if (prefill_chunk_alignment < 0) {
    return InvalidArgument("prefill_chunk_alignment must be >= 0");
  }
  if (max_prefill_chunk < 0) {
    return InvalidArgument("max_prefill_chunk must be >= 0");
  }
  // A scored sequence's chunk within the cap must be able to end on the
  // alignment, or it would wait behind other work for ever.
  if (max_scored_tokens_per_step > 0 &&
      max_scored_tokens_per_step < prefill_chunk_alignment) {
    return InvalidArgument(
        "max_scored_tokens_per_step (", max_scored_tokens_per_step,
        ") must be 0 (no limit) or at least prefill_chunk_alignment (",
        prefill_chunk_alignment, ")");
  }
  if (watermark_blocks < 0 || watermark_blocks >= num_blocks) {
    return InvalidArgument("watermark_blocks must be in [0, num_blocks)");
  }
  if (max_background < 0) return InvalidArgument("max_background must be >= 0");
  if (num_prefix_snapshots < 0 || prefix_snapshot_grid < 0) {
    return InvalidArgument(
        "num_prefix_snapshots and prefix_snapshot_grid must be >= 0");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Scheduler>> Scheduler::Create(
    const SchedulerConfig& config) {
  TANDEM_RETURN_IF_ERROR(config.Validate());
  return std::unique_ptr<Scheduler>(new Scheduler(config));
}

Scheduler::Scheduler(const SchedulerConfig& config)
    : config_(config), blocks_(config.num_blocks), slots_(config.num_slots) {
  if (config.enable_prefix_caching) {
    PrefixCacheConfig pc;
    pc.block_size = config.block_size;
    pc.kda_chunk =
        config.prefill_chunk_alignment > 0 ? config.prefill_chunk_alignment : kKdaChunk;
    pc.num_snapshots = config.num_prefix_snapshots;
    pc.snapshot_grid = config.prefix_snapshot_grid;
    prefix_ = std::make_unique<PrefixCache>(pc, &blocks_);
  }
}

Scheduler::Sequence* Scheduler::Find(SequenceId id) {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : it->second.get();
}

const Scheduler::Sequence* Scheduler::Find(SequenceId id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : it->second.get();
}

absl::Status Scheduler::Submit(const SequenceRequest& r) {
  if (aborted_in_flight_.contains(r.id)) {
    return FailedPrecondition("sequence ", r.id,
                              " was aborted during the step in flight; "
                              "resubmit after CompleteStep");
  }
  if (seqs_.contains(r.id)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", r.id, " exists"));
  }
  if (r.num_prompt_tokens <= 0) {
    return InvalidArgument("prompt must have at least one token");
  }
  if (r.max_new_tokens < 0) {
    return InvalidArgument("max_new_tokens must be >= 0, got ", r.max_new_tokens);
  }
  const int64_t context = config_.max_context_tokens;
  if (r.num_prompt_tokens > context) {
    return InvalidArgument("prompt has ", r.num_prompt_tokens,
                           " tokens, more than the context limit of ", context,
                           " tokens");
  }
  if (r.num_prompt_tokens == context) {
    return InvalidArgument("prompt has ", r.num_prompt_tokens,
                           " tokens, which leaves no room to generate within "
                           "the context limit of ",
                           context, " tokens");
  }
  const int64_t capacity =
      static_cast<int64_t>(config_.num_blocks) * config_.block_size;
  if (r.num_prompt_tokens + 1 > capacity) {
    return InvalidArgument("prompt has ", r.num_prompt_tokens,
                           " tokens, more than this worker's KV cache holds (",
                           capacity, " tokens)");
  }
  auto seq = std::make_unique<Sequence>(Sequence{r.id, r.num_prompt_tokens, 0, 0, false,
                                                 SequenceState::kWaiting, -1,
                                                 BlockTable(config_.block_size)});
  int64_t limit = std::min(context, capacity);
  if (r.max_new_tokens > 0) {
    limit = std::min(limit, r.num_prompt_tokens + r.max_new_tokens);
  }
  seq->max_total_tokens = limit;
  seq->num_prompt_tokens = r.num_prompt_tokens;
  seq->recompute_floor = std::max<int64_t>(r.recompute_floor, 0);
  seq->scored_prompt = r.scored_prompt;
  if (prefix_ != nullptr) {
    seq->hashes = r.block_hashes;
    // Only the prompt's full blocks are content (never generated tokens).
    const size_t full = static_cast<size_t>(r.num_prompt_tokens / config_.block_size);
    if (seq->hashes.size() > full) seq->hashes.resize(full);
    seq->route_hashes = r.route_hashes;
  }
  seqs_.emplace(r.id, std::move(seq));
  waiting_.push_back(r.id);
  return absl::OkStatus();
}

absl::Status Scheduler::SubmitBackground(const SequenceRequest& r, int64_t min_hit) {
  if (prefix_ == nullptr) return FailedPrecondition("prefix caching is off");
  if (config_.max_background <= 0) {
    return FailedPrecondition("background continuations are off");
  }
  if (r.num_prompt_tokens % prefix_->config().kda_chunk != 0 ||
      r.num_prompt_tokens % config_.block_size != 0 ||
      static_cast<int64_t>(r.block_hashes.size()) !=
          r.num_prompt_tokens / config_.block_size) {
    return InvalidArgument("a background continuation covers whole chunks and blocks (",
                           r.num_prompt_tokens, " tokens, ", r.block_hashes.size(),
                           " block hashes)");
  }
  TANDEM_RETURN_IF_ERROR(Submit(r));
  waiting_.pop_back();  // Submit queued it last
  Sequence* seq = Find(r.id);
  seq->background = true;
  seq->min_hit = min_hit;
  if (static_cast<int32_t>(background_waiting_.size()) >= config_.max_background) {
    const SequenceId oldest = background_waiting_.front();
    Erase(oldest);
    ++background_stats_.skipped;
  }
  background_waiting_.push_back(r.id);
  ++background_stats_.submitted;
  return absl::OkStatus();
}

bool Scheduler::IsBackground(SequenceId id) const {
  const Sequence* seq = Find(id);
  return seq != nullptr && seq->background;
}

int32_t Scheduler::num_background() const {
  int32_t n = static_cast<int32_t>(background_waiting_.size());
  for (SequenceId id : running_) n += Find(id)->background;
  return n;
}

absl::Status Scheduler::AdmitPrefilled(const SequenceRequest& r,
                                       int64_t num_generated_tokens) {
  // Its whole state is copied in: nothing may be shared with the cache.
  SequenceRequest plain = r;
  plain.block_hashes.clear();
  TANDEM_RETURN_IF_ERROR(Hold(plain, num_generated_tokens, /*growth_headroom=*/0));
  return AdmitReserved(r.id, r.max_new_tokens);
}

absl::Status Scheduler::Reserve(const SequenceRequest& r,
                                int64_t num_generated_tokens) {
  // A reservation cannot be preempted, so it must not take the blocks the
  // running sequences grow into at the next step (one each at most).
  return Hold(r, num_generated_tokens, num_running());
}

absl::Status Scheduler::Hold(const SequenceRequest& r, int64_t num_generated_tokens,
                             int64_t growth_headroom) {
  if (num_generated_tokens < 1) {
    return InvalidArgument("a prefilled sequence has generated >= 1 token");
  }
  TANDEM_RETURN_IF_ERROR(Submit(r));
  Sequence* seq = Find(r.id);
  waiting_.pop_back();  // Submit queued it last
  auto undo = [&](absl::Status s) {
    ReleaseResources(seq);
    seqs_.erase(r.id);
    return s;
  };
  seq->num_tokens = r.num_prompt_tokens + num_generated_tokens;
  if (seq->num_tokens > seq->max_total_tokens) {
    return undo(InvalidArgument("sequence of ", seq->num_tokens,
                                " tokens exceeds its limit of ",
                                seq->max_total_tokens));
  }
  if (num_running() + num_reserved() >= config_.max_running) {
    return undo(ResourceExhausted("running cap of ", config_.max_running,
                                  " sequences reached (", num_reserved(),
                                  " of them reserved)"));
  }
  absl::StatusOr<SlotId> slot = slots_.Acquire();
  if (!slot.ok()) return undo(slot.status());
  seq->slot = *slot;
  const int64_t positions = seq->num_tokens - 1;
  // A decode-side prefix hit: the prompt's leading full blocks this cache
  // holds are shared (full, never written again: the peer writes only the
  // rows after them), so only the rest crosses the wire. MLA blocks alone
  // suffice: the KDA state arrives whole (PrefixCache::MatchBlocks).
  int64_t held = 0;
  if (prefix_ != nullptr && !seq->hashes.empty() && r.share_cached_blocks) {
    const int64_t bs = config_.block_size;
    const std::vector<BlockId> have =
        prefix_->MatchBlocks(seq->hashes, positions / bs, r.num_prompt_tokens);
    if (!have.empty() &&
        seq->table.AdoptShared(have, static_cast<int64_t>(have.size()) * bs, &blocks_)
            .ok()) {
      held = static_cast<int64_t>(have.size()) * bs;
      seq->blocks_cached = static_cast<int64_t>(have.size());
    }
  }
  seq->held_prefix_tokens = held;
  seq->branch_tokens = held;
  const int64_t need = seq->table.BlocksNeededToAppend(positions - held);
  // Like an admission, a reservation leaves the watermark free for the running
  // sequences' growth (SGLang's decode prealloc keeps such headroom too).
  const int64_t kept = config_.watermark_blocks + growth_headroom;
  Reclaim(need + kept);
  if (need > static_cast<int64_t>(blocks_.num_free()) - kept ||
      !seq->table.Append(positions - held, &blocks_).ok()) {
    return undo(ResourceExhausted("need ", need, " KV blocks for ", positions,
                                  " tokens, ", blocks_.num_free(), " free (", kept,
                                  " kept free for the running sequences)"));
  }
  seq->num_computed = seq->num_tokens - 1;
  seq->prefill_done = true;
  seq->state = SequenceState::kReserved;
  reserved_.insert(r.id);
  return absl::OkStatus();
}

absl::Status Scheduler::AdmitReserved(SequenceId id, int64_t max_new_tokens,
                                      int64_t cacheable_tokens) {
  Sequence* seq = Find(id);
  if (seq == nullptr) return NotFound("no sequence ", id);
  if (seq->state != SequenceState::kReserved) {
    return FailedPrecondition("sequence ", id, " is not reserved");
  }
  if (max_new_tokens < 0) {
    return InvalidArgument("max_new_tokens must be >= 0, got ", max_new_tokens);
  }
  if (max_new_tokens > 0) {
    // Counted from the prompt, as Submit counts it.
    const int64_t limit =
        std::min(seq->max_total_tokens, seq->num_prompt_tokens + max_new_tokens);
    if (seq->num_tokens > limit) {
      return InvalidArgument("sequence of ", seq->num_tokens,
                             " tokens exceeds its limit of ", limit);
    }
    seq->max_total_tokens = limit;
  }
  reserved_.erase(id);
  seq->state = SequenceState::kRunning;
  running_.push_back(id);
  // The landed prompt's full blocks (the peer's prefill, verified by the
  // caller's checksums when asked for) join the cache after those it shared,
  // so the next reservation extending this prompt shares them too; only as
  // far as the peer computed them on the chunk grid.
  if (cacheable_tokens >= 0) {
    seq->unaligned_at = std::min(seq->unaligned_at, cacheable_tokens);
  }
  CacheComputedBlocks(seq);
  // Tell the router (prefix_events.h, blocks_only) where the prompt's blocks
  // are now cached here: the next request extending it (a chat's next turn)
  // is best reserved on this worker.
  AnnounceCachedBlocks(*seq);
  return absl::OkStatus();
}

std::vector<int64_t> AnnouncedPositions(int64_t cached_tokens, int64_t branch_tokens,
                                        int32_t block_size, int64_t grid) {
  std::vector<int64_t> out;
  if (block_size <= 0 || cached_tokens <= 0) return out;
  const int64_t a = std::lcm<int64_t>(block_size, kKdaChunk);
  auto add = [&](int64_t p) {
    p = std::min(p, cached_tokens) / a * a;
    if (p > 0) out.push_back(p);
  };
  add(cached_tokens);
  add(branch_tokens);
  if (grid > 0) {
    const int64_t g = (grid + a - 1) / a * a;
    for (int64_t p = g; p < cached_tokens; p += g) add(p);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

void Scheduler::AnnounceCachedBlocks(const Sequence& seq) {
  if (prefix_ == nullptr || seq.hashes.empty()) return;
  const int64_t bs = config_.block_size;
  for (int64_t q : AnnouncedPositions(seq.blocks_cached * bs, seq.branch_tokens, bs,
                                      config_.prefix_snapshot_grid)) {
    const int64_t r = q / kKdaChunk - 1;
    if (q / bs > static_cast<int64_t>(seq.hashes.size()) ||
        r >= static_cast<int64_t>(seq.route_hashes.size())) {
      continue;
    }
    prefix_->AnnounceBlocks(seq.hashes[q / bs - 1], q, seq.route_hashes[r]);
  }
}

int64_t Scheduler::AlignedTokens(SequenceId id) const {
  const Sequence* seq = Find(id);
  return seq == nullptr ? 0 : std::min(seq->num_computed, seq->unaligned_at);
}

int64_t Scheduler::HeldPrefixTokens(SequenceId id) const {
  const Sequence* seq = Find(id);
  return seq == nullptr ? 0 : seq->held_prefix_tokens;
}

void Scheduler::ReleaseResources(Sequence* seq) {
  // Both only fail on bookkeeping bugs, which CheckInvariants reports.
  seq->table.Release(&blocks_).IgnoreError();
  if (seq->slot >= 0) slots_.Release(seq->slot).IgnoreError();
  seq->slot = -1;
}

void Scheduler::Erase(SequenceId id) {
  Sequence* seq = Find(id);
  if (seq == nullptr) return;
  ReleaseResources(seq);
  if (seq->state == SequenceState::kRunning) {
    running_.erase(std::find(running_.begin(), running_.end(), id));
  } else if (seq->state == SequenceState::kReserved) {
    reserved_.erase(id);
  } else if (seq->background) {
    auto it = std::find(background_waiting_.begin(), background_waiting_.end(), id);
    if (it != background_waiting_.end()) background_waiting_.erase(it);
  } else {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), id));
  }
  seqs_.erase(id);
}

void Scheduler::Unplan(SequenceId id, StepPlan* plan, int64_t* budget) {
  for (auto it = plan->sequences.begin(); it != plan->sequences.end(); ++it) {
    if (it->id == id) {
      *budget += it->num_tokens();
      plan->num_scheduled_tokens -= it->num_tokens();
      plan->sequences.erase(it);
      return;
    }
  }
}

bool Scheduler::CancelNewestBackground(StepPlan* plan, int64_t* budget,
                                       SequenceId* cancelled, size_t* index) {
  for (auto it = running_.rbegin(); it != running_.rend(); ++it) {
    const SequenceId id = *it;
    if (!Find(id)->background) continue;
    if (index != nullptr) {
      *index = static_cast<size_t>(std::distance(it, running_.rend())) - 1;
    }
    Unplan(id, plan, budget);
    Erase(id);
    plan->cancelled_background.push_back(id);
    ++background_stats_.cancelled;
    if (cancelled != nullptr) *cancelled = id;
    return true;
  }
  return false;
}

SequenceId Scheduler::PreemptNewest(StepPlan* plan, int64_t* budget, size_t* index) {
  // Background continuations go first, and for good (they are only a bet on
  // the next turn).
  SequenceId bg = 0;
  if (CancelNewestBackground(plan, budget, &bg, index)) return bg;
  // Then the newest sequence that can be recomputed; one with a
  // recompute_floor (rows this engine cannot compute: it would be dropped at
  // readmission) only when every running sequence has one.
  size_t v = running_.size() - 1;
  for (size_t k = running_.size(); k-- > 0;) {
    if (Find(running_[k])->recompute_floor == 0) {
      v = k;
      break;
    }
  }
  const SequenceId id = running_[v];
  running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(v));
  if (index != nullptr) *index = v;
  Sequence* seq = Find(id);
  Unplan(id, plan, budget);
  ReleaseResources(seq);
  seq->num_computed = 0;
  seq->prefill_done = false;
  seq->blocks_cached = 0;
  seq->snapshot_positions.clear();
  seq->unaligned_at = std::numeric_limits<int64_t>::max();
  seq->state = SequenceState::kWaiting;
  waiting_.push_front(id);
  plan->preempted.push_back(id);
  ++num_preemptions_;
  return id;
}

int64_t Scheduler::ChunkLimit(int64_t budget) const {
  return config_.max_prefill_chunk > 0 ? std::min(budget, config_.max_prefill_chunk)
                                       : budget;
}

int64_t Scheduler::ChunkLimit(int64_t budget, const Sequence& seq,
                              int64_t scored_left) const {
  const int64_t limit = ChunkLimit(budget);
  return seq.scored_prompt ? std::min(limit, scored_left) : limit;
}

int64_t Scheduler::AlignChunk(int64_t start, int64_t chunk, int64_t remaining,
                              bool plan_empty) const {
  const int64_t a = config_.prefill_chunk_alignment;
  if (a <= 0 || chunk >= remaining) return chunk;
  const int64_t end = (start + chunk) / a * a;
  if (end > start) return end - start;
  // Less than the alignment left: wait for a later step, unless nothing else
  // runs in this one (then progress beats alignment).
  return plan_empty ? chunk : 0;
}

int64_t Scheduler::CutAtSnapshot(const Sequence& seq, int64_t start, int64_t chunk,
                                 bool* at_snapshot) const {
  *at_snapshot = false;
  for (int64_t p : seq.snapshot_positions) {
    if (p <= start) continue;
    if (start + chunk >= p) {
      chunk = p - start;
      *at_snapshot = p <= seq.unaligned_at;
    }
    break;
  }
  return chunk;
}

void Scheduler::Reclaim(int64_t free_blocks) {
  if (prefix_ != nullptr && blocks_.num_free() < free_blocks) {
    prefix_->Reclaim(free_blocks);
  }
}

SnapshotId Scheduler::AdmitWithPrefix(Sequence* seq, int64_t* matched_blocks) {
  seq->blocks_cached = 0;
  seq->snapshot_positions.clear();
  seq->unaligned_at = std::numeric_limits<int64_t>::max();
  if (prefix_ == nullptr || seq->hashes.empty()) return -1;
  const PrefixHit hit = prefix_->Lookup(seq->hashes, seq->num_tokens, /*record=*/false);
  if (hit.tokens > 0) {
    // Full blocks, never written again: shared without copy-on-write.
    seq->table.AdoptShared(hit.blocks, hit.tokens, &blocks_).IgnoreError();
    seq->num_computed = hit.tokens;
  }
  seq->blocks_cached = hit.tokens / config_.block_size;
  seq->branch_tokens = hit.matched_blocks * config_.block_size;
  if (matched_blocks != nullptr) *matched_blocks = hit.matched_blocks;
  // A background continuation snapshots its end too (it samples nothing).
  for (int64_t p : SnapshotPositions(seq->num_prompt_tokens + (seq->background ? 1 : 0),
                                     hit.tokens, hit.matched_blocks, config_.block_size,
                                     prefix_->config().kda_chunk,
                                     prefix_->config().snapshot_grid)) {
    const int64_t k = p / config_.block_size;
    if (k <= static_cast<int64_t>(seq->hashes.size()) &&
        !prefix_->HasSnapshot(seq->hashes[k - 1])) {
      seq->snapshot_positions.push_back(p);
    }
  }
  return hit.snapshot;
}

void Scheduler::CacheComputedBlocks(Sequence* seq) {
  if (prefix_ == nullptr) return;
  const int64_t bs = config_.block_size;
  const int64_t upto = std::min({static_cast<int64_t>(seq->hashes.size()),
                                 seq->num_computed / bs, seq->unaligned_at / bs,
                                 static_cast<int64_t>(seq->table.blocks().size())});
  for (; seq->blocks_cached < upto; ++seq->blocks_cached) {
    const int64_t i = seq->blocks_cached;
    prefix_->InsertBlock(seq->hashes, i, seq->table.blocks()[i]);
  }
}

absl::StatusOr<SnapshotId> Scheduler::StoreSnapshot(SequenceId id, int64_t position) {
  if (prefix_ == nullptr) return FailedPrecondition("prefix caching is off");
  Sequence* seq = Find(id);
  const int64_t bs = config_.block_size;
  if (seq == nullptr || position <= 0 || position % bs != 0 ||
      position > seq->unaligned_at ||
      position / bs > static_cast<int64_t>(seq->hashes.size()) ||
      position / bs > static_cast<int64_t>(seq->table.blocks().size())) {
    return -1;
  }
  // The blocks before it were computed by the step that just ran.
  const int64_t computed = seq->num_computed;
  seq->num_computed = std::max(computed, position);
  CacheComputedBlocks(seq);
  seq->num_computed = computed;
  const int64_t r = position / kKdaChunk - 1;  // positions are multiples of 64
  const uint64_t route =
      position % kKdaChunk == 0 && r < static_cast<int64_t>(seq->route_hashes.size())
          ? seq->route_hashes[r]
          : 0;
  absl::StatusOr<SnapshotId> s =
      prefix_->StoreSnapshot(seq->hashes[position / bs - 1], position, route);
  if (!s.ok()) return -1;  // exists already, or its blocks are not cached
  return *s;
}

void Scheduler::ResetPrefixCache() {
  if (prefix_ != nullptr) prefix_->Clear();
}

absl::StatusOr<StepPlan> Scheduler::Schedule() {
  if (step_in_flight_) {
    return FailedPrecondition("the previous step was not completed");
  }
  StepPlan plan;
  int64_t budget = config_.max_tokens_per_step;
  const int64_t bs = config_.block_size;
  absl::flat_hash_set<SequenceId> planned;

  auto add = [&](Sequence* seq, int64_t n, int32_t drafts, SnapshotId restore = -1,
                 bool at_snapshot = false) {
    ScheduledSequence e;
    e.id = seq->id;
    e.start = seq->num_computed;
    e.end = seq->num_computed + n;
    e.num_draft_tokens = drafts;
    e.samples = e.end - drafts == seq->num_tokens && !seq->background;
    e.slot = seq->slot;
    e.resets_state = e.start == 0;
    e.restore_snapshot = restore;
    e.snapshot_at_end = at_snapshot;
    // A non-final chunk off the KDA chunk grid (progress beat alignment): the
    // state after it differs in bits from a clean recompute; cache nothing past it.
    const int64_t a = config_.prefill_chunk_alignment;
    if (drafts == 0 && !e.samples && a > 0 && e.end % a != 0) {
      seq->unaligned_at = std::min(seq->unaligned_at, e.end);
    }
    plan.sequences.push_back(e);
    plan.num_scheduled_tokens += n;
    budget -= n;
    planned.insert(seq->id);
  };

  // 1. Decodes, oldest admission first.
  for (size_t i = 0; i < running_.size(); ++i) {
    Sequence* seq = Find(running_[i]);
    if (!seq->prefill_done) continue;
    const int64_t room = seq->max_total_tokens - seq->num_tokens - 1;
    const int32_t drafts = static_cast<int32_t>(
        std::clamp<int64_t>(room, 0, config_.num_speculative_tokens));
    const int64_t need = 1 + drafts;
    if (need > budget) break;
    bool self_preempted = false;
    Reclaim(seq->table.BlocksNeededToAppend(need));
    while (seq->table.BlocksNeededToAppend(need) > blocks_.num_free()) {
      size_t removed = 0;
      if (PreemptNewest(&plan, &budget, &removed) == seq->id) {
        self_preempted = true;
        break;
      }
      if (removed < i) --i;  // an older one went: seq moved down
      // What it held may be cached blocks now (shared with the cache): evict.
      Reclaim(seq->table.BlocksNeededToAppend(need));
    }
    if (self_preempted) {
      // It was the newest recomputable one: only sequences that cannot be
      // recomputed (kept running) may follow it.
      --i;  // running_ shifted down (wraps to ++i == 0 at the front)
      continue;
    }
    seq->table.Append(need, &blocks_).IgnoreError();  // fits: checked above
    add(seq, need, drafts);
  }

  // Prompt tokens of scored sequences this step may still take (all of them
  // together: their logits rows).
  int64_t scored_left = config_.max_scored_tokens_per_step > 0
                            ? config_.max_scored_tokens_per_step
                            : std::numeric_limits<int64_t>::max();
  // 2. Running sequences still prefilling, oldest first.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    Sequence* seq = Find(running_[i]);
    if (seq->prefill_done || planned.contains(seq->id)) continue;
    // A background continuation pauses while a real request waits (the budget
    // is the waiting one's; a slot or blocks it needs cancel the continuation).
    if (seq->background && !waiting_.empty()) continue;
    const int64_t remaining = seq->num_tokens - seq->num_computed;
    const int64_t limit = ChunkLimit(budget, *seq, scored_left);
    if (limit <= 0) continue;  // the step's scored tokens are taken
    const int64_t want = std::min(remaining, limit);
    Reclaim(seq->table.BlocksNeededToAppend(want));
    int64_t fit = 0;
    bool self_preempted = false;
    while (true) {
      const int64_t slack = static_cast<int64_t>(seq->table.blocks().size()) * bs -
                            seq->table.num_tokens();
      fit = slack + static_cast<int64_t>(blocks_.num_free()) * bs;
      if (fit > 0) break;
      if (seq->background) break;  // it never makes others give way
      size_t removed = 0;
      if (PreemptNewest(&plan, &budget, &removed) == seq->id) {
        self_preempted = true;
        break;
      }
      if (removed < i) --i;  // an older one went: seq moved down
      Reclaim(seq->table.BlocksNeededToAppend(want));
    }
    if (self_preempted) {
      --i;  // running_ shifted down; later ones cannot be recomputed
      continue;
    }
    if (seq->background && fit <= 0) {  // no room left for it: dropped
      const SequenceId id = seq->id;
      Erase(id);
      plan.cancelled_background.push_back(id);
      ++background_stats_.cancelled;
      --i;  // running_ shifted down
      continue;
    }
    bool at_snapshot = false;
    const int64_t chunk =
        CutAtSnapshot(*seq, seq->num_computed,
                      AlignChunk(seq->num_computed, std::min({remaining, limit, fit}),
                                 remaining, plan.sequences.empty() && !seq->background),
                      &at_snapshot);
    if (chunk == 0) continue;
    seq->table.Append(chunk, &blocks_).IgnoreError();  // fits: checked above
    if (seq->scored_prompt) scored_left -= chunk;
    add(seq, chunk, 0, -1, at_snapshot);
  }

  // 3. Admissions, FCFS, never in a step that had to preempt. A scored sequence
  // that finds the step's scored tokens taken is passed over (it stays where
  // it is in the queue) rather than holding the requests behind it back.
  size_t head = 0;
  while (plan.preempted.empty() && head < waiting_.size() && budget > 0) {
    if (num_running() + num_reserved() >= config_.max_running ||
        slots_.num_free() == 0) {
      // A background continuation gives its slot to a real request.
      if (CancelNewestBackground(&plan, &budget)) continue;
      break;
    }
    Sequence* seq = Find(waiting_[head]);
    // A prefix hit adopts its cached blocks (taking references, so nothing
    // below evicts them) and starts at p; undone if the head cannot run now.
    const SnapshotId restore = AdmitWithPrefix(seq);
    const int64_t start = seq->num_computed;
    const int64_t remaining = seq->num_tokens - start;
    auto undo = [&] {
      seq->table.Release(&blocks_).IgnoreError();
      seq->num_computed = 0;
    };
    if (start < seq->recompute_floor) {
      // Rows below the floor would be recomputed wrongly (no embeddings for
      // them here): the sequence goes, the engine ends it with an error.
      const SequenceId id = seq->id;
      undo();
      Erase(id);
      plan.unrecomputable.push_back(id);
      continue;
    }
    const int64_t limit = ChunkLimit(budget, *seq, scored_left);
    if (limit <= 0) {  // the step's scored tokens are taken: it waits, others go
      undo();
      ++head;
      continue;
    }
    Reclaim(config_.watermark_blocks + BlocksForTokens(std::min(remaining, limit), bs));
    const int64_t usable =
        static_cast<int64_t>(blocks_.num_free()) - config_.watermark_blocks;
    if (usable <= 0) {
      undo();
      if (CancelNewestBackground(&plan, &budget)) continue;
      break;
    }
    bool at_snapshot = false;
    const int64_t chunk =
        CutAtSnapshot(*seq, start,
                      AlignChunk(start, std::min({remaining, limit, usable * bs}),
                                 remaining, plan.sequences.empty()),
                      &at_snapshot);
    if (chunk == 0) {  // the head waits for a step with room
      undo();
      break;
    }
    if (prefix_ != nullptr && !seq->hashes.empty()) {
      prefix_->RecordLookup(seq->num_tokens, start);
    }
    waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(head));
    seq->slot = *slots_.Acquire();                     // a slot is free: checked above
    seq->table.Append(chunk, &blocks_).IgnoreError();  // fits: checked above
    seq->state = SequenceState::kRunning;
    running_.push_back(seq->id);
    if (seq->scored_prompt) scored_left -= chunk;
    add(seq, chunk, 0, start > 0 ? restore : -1, at_snapshot);
  }

  // 4. Background continuations, on spare capacity only: nothing waiting, no
  // preemption this step, a slot, budget, and all their blocks free above the
  // watermark now (so they never make a real request wait or give way later).
  while (plan.preempted.empty() && waiting_.empty() && !background_waiting_.empty() &&
         budget > 0 && num_running() + num_reserved() < config_.max_running &&
         slots_.num_free() > 0) {
    Sequence* seq = Find(background_waiting_.front());
    const SequenceId id = seq->id;
    auto skip = [&] {
      Erase(id);  // releases any adopted blocks
      ++background_stats_.skipped;
    };
    const int64_t bs_end = seq->num_tokens / bs;  // its end's block count
    if (bs_end < 1 || prefix_->HasSnapshot(seq->hashes[bs_end - 1])) {
      skip();  // already continued (the same conversation twice)
      continue;
    }
    const SnapshotId restore = AdmitWithPrefix(seq);
    const int64_t start = seq->num_computed;
    const int64_t remaining = seq->num_tokens - start;
    if (start < seq->min_hit || seq->snapshot_positions.empty() ||
        seq->snapshot_positions.back() != seq->num_tokens) {
      skip();  // its prompt's state is gone: recomputing it all is not spare work
      continue;
    }
    const int64_t need = seq->table.BlocksNeededToAppend(remaining);
    Reclaim(config_.watermark_blocks + need);
    if (need > static_cast<int64_t>(blocks_.num_free()) - config_.watermark_blocks) {
      skip();
      continue;
    }
    bool at_snapshot = false;
    const int64_t chunk = CutAtSnapshot(
        *seq, start,
        AlignChunk(start, std::min(remaining, ChunkLimit(budget)), remaining, false),
        &at_snapshot);
    if (chunk == 0) {
      if (plan.sequences.empty()) {  // it can never get an aligned chunk: drop it
        skip();
        continue;
      }
      seq->table.Release(&blocks_).IgnoreError();  // waits for a step with budget
      seq->num_computed = 0;
      break;
    }
    background_waiting_.pop_front();
    seq->slot = *slots_.Acquire();                     // a slot is free: checked above
    seq->table.Append(chunk, &blocks_).IgnoreError();  // fits: checked above
    seq->state = SequenceState::kRunning;
    running_.push_back(id);
    add(seq, chunk, 0, start > 0 ? restore : -1, at_snapshot);
  }

  step_in_flight_ = true;
  return plan;
}

absl::StatusOr<std::vector<SequenceId>> Scheduler::CompleteStep(
    const StepPlan& plan, absl::Span<const SequenceOutcome> outcomes) {
  if (!step_in_flight_) return FailedPrecondition("no step in flight");
  absl::flat_hash_map<SequenceId, const SequenceOutcome*> by_id;
  for (const SequenceOutcome& o : outcomes) by_id[o.id] = &o;
  // Validate everything before changing anything.
  for (const ScheduledSequence& e : plan.sequences) {
    if (!e.samples || aborted_in_flight_.contains(e.id)) continue;
    if (Find(e.id) == nullptr) {
      return InvalidArgument("plan names unknown sequence ", e.id);
    }
    auto it = by_id.find(e.id);
    if (it == by_id.end()) {
      return InvalidArgument("no outcome for sequence ", e.id,
                             ", which sampled this step");
    }
    const int32_t n = it->second->num_new_tokens;
    if (n < 1 || n > e.num_draft_tokens + 1) {
      return InvalidArgument("sequence ", e.id, " reported ", n, " new tokens; 1..",
                             e.num_draft_tokens + 1, " allowed");
    }
  }
  for (const SequenceOutcome& o : outcomes) {
    bool found = false;
    for (const ScheduledSequence& e : plan.sequences) {
      found |= e.id == o.id && e.samples;
    }
    if (!found) {
      return InvalidArgument("outcome for sequence ", o.id,
                             ", which did not sample this step");
    }
  }
  step_in_flight_ = false;
  aborted_in_flight_.clear();
  std::vector<SequenceId> ended;
  for (const ScheduledSequence& e : plan.sequences) {
    Sequence* seq = Find(e.id);
    if (seq == nullptr) continue;  // aborted while in flight (or ended above)
    if (!e.samples) {
      seq->num_computed = e.end;
      CacheComputedBlocks(seq);
      if (seq->background) {
        background_stats_.tokens += e.num_tokens();
        if (seq->num_computed >= seq->num_tokens) {  // computed and snapshotted
          ++background_stats_.completed;
          if (config_.announce_prompt_blocks) AnnounceCachedBlocks(*seq);
          Erase(e.id);
        }
      }
      continue;
    }
    const SequenceOutcome& o = *by_id[e.id];
    seq->num_computed = e.end - e.num_draft_tokens + (o.num_new_tokens - 1);
    seq->num_tokens += o.num_new_tokens;
    const bool prompt_done = !seq->prefill_done;
    seq->prefill_done = true;
    // Drop the positions of rejected drafts.
    seq->table.Truncate(seq->num_computed, &blocks_).IgnoreError();
    CacheComputedBlocks(seq);
    // Its prompt just completed (every full block cached now).
    if (prompt_done && config_.announce_prompt_blocks) AnnounceCachedBlocks(*seq);
    if (o.finished) {
      Erase(e.id);
    } else if (seq->num_tokens >= seq->max_total_tokens) {
      ended.push_back(e.id);
      Erase(e.id);
    }
  }
  return ended;
}

absl::Status Scheduler::Abort(SequenceId id) {
  if (Find(id) == nullptr) return NotFound("no sequence ", id);
  if (step_in_flight_) aborted_in_flight_.insert(id);
  Erase(id);
  return absl::OkStatus();
}

absl::StatusOr<SequenceState> Scheduler::State(SequenceId id) const {
  const Sequence* seq = Find(id);
  if (seq == nullptr) return NotFound("no sequence ", id);
  return seq->state;
}

absl::StatusOr<std::vector<BlockId>> Scheduler::Blocks(SequenceId id) const {
  const Sequence* seq = Find(id);
  if (seq == nullptr) return NotFound("no sequence ", id);
  return seq->table.blocks();
}

absl::StatusOr<SlotId> Scheduler::Slot(SequenceId id) const {
  const Sequence* seq = Find(id);
  if (seq == nullptr) return NotFound("no sequence ", id);
  return seq->slot;
}

absl::StatusOr<int64_t> Scheduler::Room(SequenceId id) const {
  const Sequence* seq = Find(id);
  if (seq == nullptr) return NotFound("no sequence ", id);
  return seq->max_total_tokens - seq->num_tokens;
}

absl::Status Scheduler::CheckInvariants() const {
  TANDEM_RETURN_IF_ERROR(blocks_.CheckInvariants());
  TANDEM_RETURN_IF_ERROR(slots_.CheckInvariants());
  if (running_.size() + waiting_.size() + background_waiting_.size() +
          reserved_.size() !=
      seqs_.size()) {
    return Internal(running_.size(), " running + ", waiting_.size(), " waiting + ",
                    background_waiting_.size(), " background waiting + ",
                    reserved_.size(), " reserved != ", seqs_.size(), " sequences");
  }
  // Holders of each block: sequences, and the prefix cache's one reference. A
  // block is in two sequences only with prefix caching (an adopted hit; it may
  // have left the cache since, by ResetPrefixCache).
  absl::flat_hash_map<BlockId, int32_t> holders;
  auto hold = [&](SequenceId id, const BlockTable& t) -> absl::Status {
    for (BlockId b : t.blocks()) {
      if (++holders[b] > 1 && prefix_ == nullptr) {
        return Internal("block ", b, " is in two sequences");
      }
    }
    return absl::OkStatus();
  };
  for (SequenceId id : running_) {
    const Sequence* seq = Find(id);
    if (seq == nullptr || seq->state != SequenceState::kRunning) {
      return Internal("running list holds sequence ", id, " not running");
    }
    if (!slots_.in_use(seq->slot)) {
      return Internal("running sequence ", id, " has no slot");
    }
    if (!step_in_flight_ && seq->table.num_tokens() != seq->num_computed) {
      return Internal("sequence ", id, " reserves ", seq->table.num_tokens(),
                      " positions but computed ", seq->num_computed);
    }
    if (seq->num_computed > seq->num_tokens ||
        seq->num_tokens > seq->max_total_tokens) {
      return Internal("sequence ", id, " counts out of range");
    }
    TANDEM_RETURN_IF_ERROR(hold(id, seq->table));
  }
  for (SequenceId id : reserved_) {
    const Sequence* seq = Find(id);
    if (seq == nullptr || seq->state != SequenceState::kReserved) {
      return Internal("reserved set holds sequence ", id, " not reserved");
    }
    if (!slots_.in_use(seq->slot)) {
      return Internal("reserved sequence ", id, " has no slot");
    }
    if (seq->table.num_tokens() != seq->num_computed ||
        seq->num_computed != seq->num_tokens - 1) {
      return Internal("reserved sequence ", id, " holds ", seq->table.num_tokens(),
                      " positions for ", seq->num_tokens, " tokens");
    }
    TANDEM_RETURN_IF_ERROR(hold(id, seq->table));
  }
  for (SequenceId id : background_waiting_) {
    const Sequence* seq = Find(id);
    if (seq == nullptr || seq->state != SequenceState::kWaiting || !seq->background ||
        seq->slot >= 0 || !seq->table.blocks().empty()) {
      return Internal("background queue holds sequence ", id, " wrongly");
    }
  }
  for (SequenceId id : waiting_) {
    const Sequence* seq = Find(id);
    if (seq == nullptr || seq->state != SequenceState::kWaiting || seq->background) {
      return Internal("waiting list holds sequence ", id, " not waiting");
    }
    if (seq->slot >= 0 || !seq->table.blocks().empty() || seq->num_computed != 0) {
      return Internal("waiting sequence ", id, " holds resources");
    }
  }
  int64_t used = 0;
  for (const auto& [b, n] : holders) {
    const int32_t want = n + (prefix_ != nullptr && prefix_->Holds(b) ? 1 : 0);
    if (blocks_.ref_count(b) != want) {
      return Internal("block ", b, " has ", blocks_.ref_count(b), " references, ", want,
                      " holders");
    }
    ++used;
  }
  if (prefix_ != nullptr) {
    TANDEM_RETURN_IF_ERROR(prefix_->CheckInvariants());
    used += prefix_->num_cached_blocks();
    for (const auto& [b, n] : holders) used -= prefix_->Holds(b) ? 1 : 0;
  }
  if (used != blocks_.num_used()) {
    return Internal("sequences and the prefix cache hold ", used,
                    " blocks, allocator has ", blocks_.num_used(), " in use");
  }
  if (static_cast<int32_t>(running_.size() + reserved_.size()) != slots_.num_used()) {
    return Internal(running_.size(), " running and ", reserved_.size(),
                    " reserved but ", slots_.num_used(), " slots in use");
  }
  return absl::OkStatus();
}

}  // namespace tandem::engine
