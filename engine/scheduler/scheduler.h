// Continuous batching with chunked prefill under a per-step token budget
// (vLLM v1 style; README.md has the policies and the reasons).
//
// A step:  Schedule() → StepPlan → forward pass + sampling (the engine) →
//          CompleteStep(plan, outcomes)
// Schedule():
//   1. running sequences that are decoding, oldest admission first: 1 token
//      each (1 + k with k speculative drafts to verify);
//   2. running sequences still prefilling, oldest first: the next chunk;
//   3. waiting sequences, FCFS, while the budget, a state slot, the running
//      cap and free blocks (above the admission watermark) allow; the head of
//      the queue is never skipped.
//   When a running sequence needs a block and none is free, the most recently
//   admitted running sequence is preempted (recompute): its blocks and slot
//   are freed and it goes back to the FRONT of the waiting queue with all its
//   tokens (prompt + generated) as the new prompt. No admissions happen in a
//   step that preempted. A sequence with a recompute_floor (rows this engine
//   cannot compute again: an image prompt's on a decode worker) is passed
//   over while a newer-or-older one without a floor runs: it would be
//   dropped at readmission, so it is preempted only when nothing else can
//   be.
// Prefix caching (SchedulerConfig::prefix_cache): at admission a sequence with
//   block hashes looks its prompt up (PrefixCache::Lookup, the rule in
//   engine/cache/prefix_cache.h); a hit at p adopts the cached blocks of [0, p)
//   (shared, full, never written) and starts prefill at p with its slot
//   restored from the snapshot (ScheduledSequence::restore_snapshot). Its
//   prefill chunks end at its snapshot positions (SnapshotPositions), where the
//   engine stores the slot (StoreSnapshot, snapshot_at_end); its full prompt
//   blocks enter the cache as they are computed (only prompt tokens: nothing a
//   speculative rollback may undo). Unreferenced cached blocks are evicted (LRU)
//   before anything is preempted or refused.
// Background continuations (SubmitBackground): prefill-only sequences the engine
//   submits when a request finishes, to recompute its prompt + output up to the
//   last chunk multiple the way a prefill does and snapshot the state there
//   (the next chat turn continues from it; the decode state is not bit-identical
//   to it, docs/prefix_caching.md). They run only on spare capacity: admitted
//   after every waiting request, only from a hit at least `min_hit` deep and
//   when all their blocks fit above the watermark; they never sample; under
//   pressure (a block, a slot or the running cap a real request needs) they
//   are dropped, never preempted and requeued; they end themselves once
//   computed.
// Reserve(): a sequence whose state a peer writes in place (the decode worker's
//   reservation) holds its blocks and slot, RESERVED, outside both queues:
//   never scheduled, never preempted, until AdmitReserved() makes it running.
// The scheduler tracks token counts only; the engine owns the token ids.
// Not thread-safe: one engine loop drives it.
#ifndef TANDEM_ENGINE_SCHEDULER_SCHEDULER_H_
#define TANDEM_ENGINE_SCHEDULER_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/cache/block_allocator.h"
#include "engine/cache/block_table.h"
#include "engine/cache/prefix_cache.h"
#include "engine/cache/prefix_events.h"
#include "engine/cache/slot_pool.h"

namespace tandem::engine {

using SequenceId = int64_t;

// The longest context any configuration may allow (K3: 1M tokens).
inline constexpr int64_t kMaxContextTokens = 1048576;

// Background continuations' counters (Scheduler::background_stats).
struct BackgroundStats {
  int64_t submitted = 0;
  int64_t completed = 0;  // computed to their end
  int64_t skipped = 0;    // dropped before running (no hit deep enough, no room,
                          // queue full, already snapshotted)
  int64_t cancelled = 0;  // dropped while running, for a real request
  int64_t tokens = 0;     // positions computed
};

struct SchedulerConfig {
  int32_t block_size = 16;              // tokens per KV block
  int32_t num_blocks = 0;               // KV blocks in the pool
  int32_t num_slots = 0;                // KDA state slots
  int64_t max_tokens_per_step = 2048;   // token budget of one step
  int32_t max_running = 256;            // running sequences at most
  int64_t max_context_tokens = 131072;  // prompt + output, <= kMaxContextTokens
  int32_t num_speculative_tokens = 0;   // drafts verified per decode step
  int64_t max_prefill_chunk = 0;        // per-sequence chunk cap; 0 = the budget
  // Scored sequences (SequenceRequest::scored_prompt: every prompt row's logits
  // are kept, for prompt logprobs): their prefill tokens in one step, all
  // together, at most this many (bounds the step's logits; a scored sequence
  // that gets none waits for the next step). 0: no limit; else at least
  // prefill_chunk_alignment (a chunk must be able to end on it).
  int64_t max_scored_tokens_per_step = 128;
  // When > 0, a prefill chunk that is not the prompt's last ends at a multiple
  // of this many positions; a sequence that cannot get one this step (budget or
  // blocks left below the next multiple) waits for the next, unless it is the
  // step's only work (progress first: then it runs unaligned). The
  // engine sets the KDA chunk length (64): a prompt split only at multiples of
  // it computes bit-identical state however the steps cut it (see
  // engine/runtime/chunk_alignment_test.cc), so seeded sampling does not depend
  // on load.
  int32_t prefill_chunk_alignment = 0;
  int32_t watermark_blocks = 0;  // blocks admission leaves free
  // Prefix caching: off unless enabled; the snapshot pool and grid as
  // PrefixCacheConfig (block_size and the KDA chunk are taken from above).
  bool enable_prefix_caching = false;
  int32_t num_prefix_snapshots = 0;
  int64_t prefix_snapshot_grid = 0;
  // A decode worker's: also announce the cached blocks of every prompt this
  // engine computes (colocated prefills, background continuations) as
  // blocks_only events, as AdmitReserved always does for landed prompts: a
  // reservation extending them shares them (HeldPrefixTokens).
  bool announce_prompt_blocks = false;
  // Background continuations queued at most (the oldest is dropped past it).
  int32_t max_background = 8;

  absl::Status Validate() const;
};

// Where a decode worker announces a prompt's cached MLA blocks (blocks_only
// prefix events; the router reserves a prompt extending one of them where its
// rows are): multiples of lcm(block_size, 64), ascending, in (0, cached]:
//   - the deepest (cached rounded down): the same prompt again, a chat's next
//     turn;
//   - the branch point (branch rounded down): where the prompt left the chain
//     it shared, so a third prompt sharing only that part (a system prompt)
//     finds it; the deeper announcement names a route hash it does not have;
//   - every `grid` tokens (0: none; the snapshot grid), for prompts that share
//     a long document and diverge somewhere inside it.
// One event each (AnnounceBlocks skips a block announced already), so a
// prompt costs the router 2 + cached / grid index entries at most.
std::vector<int64_t> AnnouncedPositions(int64_t cached_tokens, int64_t branch_tokens,
                                        int32_t block_size, int64_t grid);

struct SequenceRequest {
  SequenceId id = 0;
  int64_t num_prompt_tokens = 0;
  // 0: up to the context limit.
  int64_t max_new_tokens = 0;
  // Chained hashes of the prompt's full blocks (ChainedBlockHashes); empty: the
  // sequence neither uses nor fills the prefix cache.
  std::vector<BlockHash> block_hashes;
  // The prompt's 64-token route hashes (common/route_hash.h RouteBlockHashes:
  // entry i names tokens [0, 64 (i + 1))): the name of each snapshot position
  // in the prefix events. Empty: events carry route_hash 0.
  std::vector<uint64_t> route_hashes;
  // Reserve: the cached blocks of the prompt may be shared (HeldPrefixTokens).
  // False: the reservation allocates every block (the peer writing it may
  // write every row from 0, which must never reach a block other sequences
  // share) and only caches the landed prompt at AdmitReserved.
  bool share_cached_blocks = true;
  // Positions [0, recompute_floor) cannot be recomputed by this engine (image
  // rows of a prompt prefilled elsewhere: no embeddings here). A preempted
  // sequence is readmitted only from a prefix hit at least this deep; without
  // one it is dropped (StepPlan::unrecomputable). 0: everything recomputes.
  int64_t recompute_floor = 0;
  // Every prompt row's logits are wanted (prompt logprobs): the prefill goes at
  // most SchedulerConfig::max_scored_tokens_per_step tokens per step, shared
  // with the step's other scored sequences.
  bool scored_prompt = false;
};

// One sequence's work in a step.
struct ScheduledSequence {
  SequenceId id = 0;
  // Token positions computed this step, [start, end). Positions below the
  // sequence's known token count index its tokens (prompt, then generated);
  // the last num_draft_tokens positions are speculative drafts the engine
  // proposes after its last known token.
  int64_t start = 0;
  int64_t end = 0;
  int32_t num_draft_tokens = 0;
  // Samples a token this step (its prefill completes, or it is decoding).
  bool samples = false;
  SlotId slot = -1;
  // start == 0: the KDA state slot must be reset before computing.
  bool resets_state = false;
  // A prefix-cache hit (start == the hit's p > 0): copy this snapshot into the
  // slot before computing (-1: none).
  SnapshotId restore_snapshot = -1;
  // After this step the slot holds the state at `end`, one of the sequence's
  // snapshot positions: the engine stores it (StoreSnapshot) before the next.
  bool snapshot_at_end = false;

  int64_t num_tokens() const { return end - start; }
};

struct StepPlan {
  // Decodes first, then prefill chunks (continuing, then newly admitted).
  std::vector<ScheduledSequence> sequences;
  // Sequences preempted while planning this step (now waiting again); the
  // engine drops their KDA state and keeps their tokens.
  std::vector<SequenceId> preempted;
  // Background continuations dropped while planning (gone: their entries were
  // removed from `sequences`).
  std::vector<SequenceId> cancelled_background;
  // Preempted sequences whose readmission found no prefix hit reaching their
  // recompute_floor: gone (freed, not in `sequences`); the engine ends them
  // with an error rather than recompute rows it cannot.
  std::vector<SequenceId> unrecomputable;
  int64_t num_scheduled_tokens = 0;
};

// What the engine reports for a sequence that sampled in a step.
struct SequenceOutcome {
  SequenceId id = 0;
  // Tokens appended: 1, or accepted drafts + 1 with speculative decoding.
  int32_t num_new_tokens = 1;
  // The sequence ended (stop token/string, max_tokens): free it.
  bool finished = false;
};

// kReserved: holds blocks and a slot for state written in place (Reserve), not
// schedulable until AdmitReserved.
enum class SequenceState { kWaiting, kRunning, kReserved };

class Scheduler {
 public:
  static absl::StatusOr<std::unique_ptr<Scheduler>> Create(
      const SchedulerConfig& config);

  // Queues a new sequence. InvalidArgument when the prompt does not fit the
  // context limit (the message names both numbers) or the KV pool.
  absl::Status Submit(const SequenceRequest& request);

  // Admits a sequence whose prompt was computed elsewhere (disaggregated
  // prefill): it already generated num_generated_tokens (>= 1) and needs KV
  // blocks for all positions but the last token's, plus a slot, now.
  // ResourceExhausted when they are not available. Blocks(id) then tells where
  // the transferred KV goes. Reserve + AdmitReserved in one call.
  absl::Status AdmitPrefilled(const SequenceRequest& request,
                              int64_t num_generated_tokens);

  // Holds, for a sequence whose state a peer will write in place, the KV blocks
  // of all positions but the last token's and a slot: RESERVED. A reserved
  // sequence is never scheduled or preempted; it counts against max_running
  // (so that its admission cannot fail on the cap) and, like an admission,
  // leaves watermark_blocks free, plus one block per running sequence (their
  // growth at the next step: a reservation cannot be preempted to make room).
  // AdmitReserved makes it
  // running (decoding, nothing to prefill); Abort frees it. The errors of
  // AdmitPrefilled; request.max_new_tokens may be 0 (known at admission).
  absl::Status Reserve(const SequenceRequest& request, int64_t num_generated_tokens);
  // RESERVED → running. max_new_tokens (0: up to the context limit) bounds it
  // from now on; InvalidArgument when the sequence already exceeds it (it stays
  // reserved), NotFound / FailedPrecondition when `id` is not reserved.
  // cacheable_tokens (-1: every prompt position) caps the landed prompt's
  // blocks cached (see HeldPrefixTokens).
  absl::Status AdmitReserved(SequenceId id, int64_t max_new_tokens,
                             int64_t cacheable_tokens = -1);
  // The leading positions of `id` computed on the chunk grid (before its
  // first unaligned chunk end, if any): what may be cached as bit-identical
  // to a recompute. 0 for an unknown id.
  int64_t AlignedTokens(SequenceId id) const;
  // With prefix caching and request.block_hashes, Reserve shares the leading
  // full blocks of the prompt this cache holds (MLA rows only: no snapshot is
  // needed, the peer writes the whole KDA state) instead of allocating them:
  // their count x block_size is the reservation's held prefix, which the peer
  // must not write (KvTarget.cached_prefix_tokens); only when
  // request.share_cached_blocks. AdmitReserved then caches the landed
  // prompt's full blocks after them. 0 for an unknown id.
  // AdmitPrefilled never shares (it copies the whole state in).
  int64_t HeldPrefixTokens(SequenceId id) const;

  // Plans the next step. FailedPrecondition if the previous plan was not
  // completed.
  absl::StatusOr<StepPlan> Schedule();

  // Applies a step's results: every sampling entry of `plan` whose sequence
  // still exists needs an outcome. Returns the sequences the scheduler ended
  // itself because they reached their token limit (context or max_new_tokens)
  // without the engine finishing them.
  absl::StatusOr<std::vector<SequenceId>> CompleteStep(
      const StepPlan& plan, absl::Span<const SequenceOutcome> outcomes);

  // Queues a background continuation (see above): a prefill-only sequence of
  // request.num_prompt_tokens tokens (a multiple of the KDA chunk, with its
  // block hashes) that snapshots its end. It runs from a prefix hit of at least
  // `min_hit` tokens or not at all. FailedPrecondition when caching is off; the
  // errors of Submit.
  absl::Status SubmitBackground(const SequenceRequest& request, int64_t min_hit);
  bool IsBackground(SequenceId id) const;
  const BackgroundStats& background_stats() const { return background_stats_; }
  int32_t num_background() const;

  // Prefix caching: registers the state of sequence `id` at `position` (its
  // plan entry's end, snapshot_at_end) and returns the pool entry the engine
  // copies the slot into now; -1 when a snapshot already exists there or the
  // position is not the sequence's to store. FailedPrecondition when caching is
  // off.
  absl::StatusOr<SnapshotId> StoreSnapshot(SequenceId id, int64_t position);
  // Drops every cached block and snapshot (running sequences keep theirs).
  void ResetPrefixCache();
  // Null when prefix caching is off.
  const PrefixCache* prefix_cache() const { return prefix_.get(); }
  PrefixCache* mutable_prefix_cache() { return prefix_.get(); }
  // The prefix cache's events go to `queue` (not owned; ignored when off).
  void set_prefix_event_queue(PrefixEventQueue* queue) {
    if (prefix_ != nullptr) prefix_->set_event_queue(queue);
  }

  // Cancels a sequence in any state (waiting, running, in the current plan:
  // its results are then ignored) and frees everything it holds.
  absl::Status Abort(SequenceId id);

  // Introspection.
  bool Contains(SequenceId id) const { return seqs_.contains(id); }
  absl::StatusOr<SequenceState> State(SequenceId id) const;
  absl::StatusOr<std::vector<BlockId>> Blocks(SequenceId id) const;
  // Its KDA state slot (-1 while waiting).
  absl::StatusOr<SlotId> Slot(SequenceId id) const;
  // Tokens the sequence may still generate (for the StopChecker).
  absl::StatusOr<int64_t> Room(SequenceId id) const;
  int32_t num_waiting() const { return static_cast<int32_t>(waiting_.size()); }
  int32_t num_running() const { return static_cast<int32_t>(running_.size()); }
  int32_t num_reserved() const { return static_cast<int32_t>(reserved_.size()); }
  // Free blocks, counting cached blocks no sequence holds (evicted on demand).
  int32_t num_free_blocks() const {
    return blocks_.num_free() +
           (prefix_ ? static_cast<int32_t>(prefix_->num_evictable_blocks()) : 0);
  }
  int32_t num_free_slots() const { return slots_.num_free(); }
  int64_t num_preemptions() const { return num_preemptions_; }
  const SchedulerConfig& config() const { return config_; }

  // Pools and per-sequence bookkeeping agree (tests, debug).
  absl::Status CheckInvariants() const;

 private:
  // Reserve with `growth_headroom` blocks kept free beyond the watermark.
  absl::Status Hold(const SequenceRequest& request, int64_t num_generated_tokens,
                    int64_t growth_headroom);
  struct Sequence {
    SequenceId id;
    int64_t num_tokens;  // prompt + generated
    int64_t max_total_tokens;
    int64_t num_computed = 0;
    bool prefill_done = false;  // sampled since its last admission
    SequenceState state = SequenceState::kWaiting;
    SlotId slot = -1;
    BlockTable table;
    int64_t num_prompt_tokens = 0;  // as submitted (max_new_tokens counts from it)
    // Prefix caching.
    std::vector<BlockHash> hashes;       // the prompt's full blocks
    std::vector<uint64_t> route_hashes;  // the prompt's 64-token route hashes
    int64_t blocks_cached = 0;           // hashes[0 .. blocks_cached) handled
    int64_t held_prefix_tokens = 0;      // Reserve: the shared prefix
    // Where the prompt left the cached chain it matched at admission (the
    // shared prefix of a reservation, the matched blocks of a lookup).
    int64_t branch_tokens = 0;
    std::vector<int64_t> snapshot_positions;  // ascending, > the hit
    // A chunk ended off the KDA chunk grid here (progress beat alignment):
    // state after it is not what a clean recompute gives, so nothing after it
    // is cached.
    int64_t unaligned_at = std::numeric_limits<int64_t>::max();
    // A background continuation, and the shallowest hit it runs from.
    bool background = false;
    int64_t min_hit = 0;
    int64_t recompute_floor = 0;  // SequenceRequest::recompute_floor
    bool scored_prompt = false;   // SequenceRequest::scored_prompt
  };

  explicit Scheduler(const SchedulerConfig& config);

  Sequence* Find(SequenceId id);
  const Sequence* Find(SequenceId id) const;
  // Frees blocks and slot; the sequence stays in seqs_.
  void ReleaseResources(Sequence* seq);
  // Preempts the most recently admitted running sequence (undoing its part of
  // `plan`): a background continuation first, then the newest that can be
  // recomputed (recompute_floor 0), the newest of all only when none can.
  // Returns its id; its former index in running_ in *index.
  SequenceId PreemptNewest(StepPlan* plan, int64_t* budget, size_t* index = nullptr);
  // Drops the most recently admitted running background continuation (undoing
  // its part of `plan`; its id in *id, its former index in running_ in
  // *index); false when none runs.
  bool CancelNewestBackground(StepPlan* plan, int64_t* budget, SequenceId* id = nullptr,
                              size_t* index = nullptr);
  // Removes `id`'s entry from `plan`, giving its tokens back to the budget.
  void Unplan(SequenceId id, StepPlan* plan, int64_t* budget);

  void Erase(SequenceId id);
  int64_t ChunkLimit(int64_t budget) const;
  // ChunkLimit for `seq`: a scored sequence also within `scored_left` (the
  // step's scored tokens not yet planned).
  int64_t ChunkLimit(int64_t budget, const Sequence& seq, int64_t scored_left) const;
  // `chunk` tokens from `start`, `remaining` left: shortened to end at a multiple
  // of prefill_chunk_alignment when it is not the last chunk and that keeps >= 1;
  // 0 (wait) when it cannot and the plan already has work, else unchanged.
  int64_t AlignChunk(int64_t start, int64_t chunk, int64_t remaining,
                     bool plan_empty) const;
  // Prefix caching: the chunk from `start` cut at the sequence's next snapshot
  // position; whether it ends there.
  int64_t CutAtSnapshot(const Sequence& seq, int64_t start, int64_t chunk,
                        bool* at_snapshot) const;
  // Evicts unreferenced cached blocks until `free_blocks` are free (if it can).
  void Reclaim(int64_t free_blocks);
  // Admission of a waiting sequence with hashes: the usable hit (adopted into
  // its table, num_computed = p) and its snapshot positions; the snapshot to
  // restore (-1: none).
  SnapshotId AdmitWithPrefix(Sequence* seq, int64_t* matched_blocks = nullptr);
  // Caches the sequence's newly computed full prompt blocks.
  void CacheComputedBlocks(Sequence* seq);
  // Announces (PrefixCache::AnnounceBlocks, blocks_only events) the MLA
  // blocks of the sequence's cached prompt at 64-multiples: the deepest, the
  // branch point and the snapshot grid (AnnouncedPositions).
  void AnnounceCachedBlocks(const Sequence& seq);

  SchedulerConfig config_;
  BlockAllocator blocks_;
  SlotPool slots_;
  absl::flat_hash_map<SequenceId, std::unique_ptr<Sequence>> seqs_;
  std::deque<SequenceId> waiting_;
  std::deque<SequenceId> background_waiting_;  // background continuations, FIFO
  BackgroundStats background_stats_;
  std::vector<SequenceId> running_;  // admission order
  absl::flat_hash_set<SequenceId> reserved_;
  bool step_in_flight_ = false;
  // Aborted while the current step is in flight: their plan entries are
  // ignored, and their ids may not be reused until CompleteStep.
  absl::flat_hash_set<SequenceId> aborted_in_flight_;
  int64_t num_preemptions_ = 0;
  std::unique_ptr<PrefixCache> prefix_;  // null: prefix caching off
  // This plan's restores (id -> snapshot), applied to its entries.
  absl::flat_hash_map<SequenceId, SnapshotId> restores_;
};

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_SCHEDULER_SCHEDULER_H_
