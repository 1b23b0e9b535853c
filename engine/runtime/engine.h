// The request loop a worker runs: requests in, tokens out, one forward pass per
// step over everything the scheduler planned.
//
//   AddRequest(id, prompt, params) → Scheduler::Submit
//   Step() = PlanStep → ForwardStep → SampleStep → FinishStep:
//     PlanStep:    Scheduler::Schedule() → StepPlan (decodes first, then prefill
//                  chunks) → drafts (ProposeDrafts) → per sequence (PlanInput):
//                  reset the KDA slot of sequences starting at position 0, place
//                  an imported state, the tokens to feed, KDA snapshot if drafts
//     StartMasks:  structured outputs: one mask-pool task per constrained
//                  sampling row (its next-token mask, or its drafts' walk)
//     ForwardStep: ModelRunner::Forward over all planned sequences (one batch;
//                  layer-progress reports for prefill entries), the mask tasks
//                  running meanwhile → AwaitMasks (structured_mask_timeout)
//     SampleStep:  per sampling sequence: Sampler (seeded per request; rows
//                  without drafts up front in parallel, PresampleRows) or Verify
//                  (drafts; KDA rollback on a partial acceptance) → Emit:
//                  detokenise (IncrementalDetokenizer, when a tokenizer is given)
//                  → StopChecker
//     FinishStep:  Scheduler::CompleteStep (frees finished sequences' blocks and
//                  slot) → length endings flushed → finished requests dropped
//     → RequestOutput per sequence that produced a token or finished
//   Overlapped steps (options.overlap_steps, device backends): a decode step
//     whose rows all sample on the device runs its ForwardStep and sampling on
//     the device thread; the next Step() completes it in the scheduler as if
//     each row had gained one token, plans and launches the step after it (its
//     rows fed those tokens on the device thread), and only then emits the
//     running step's tokens (FinishOverlapped): Step() returns one step late.
//   Abort(id) → Scheduler::Abort (blocks and slot freed at once)
//   ExportState / AddPrefilledRequest: a sequence's complete state as byte ranges
//     and its admission on another engine (the disaggregated hand-off in-process).
//   Reserve / AdmitReserved: blocks and a slot held for state a peer writes in
//     place (the decode worker's reservation), then admitted without a copy.
//
// Speculative decoding (options.speculative): per step the decoding sequences
// get up to k drafts from a speculative::Proposer (n-gram lookup,
// engine/speculative/, or a draft model, draft_model_proposer.h); the target verifies
// [last token, d_1..d_k] in the same batched forward (snapshot of the KDA slot first);
// GreedyVerify / RejectionSample accept a prefix and emit one more token. On a partial
// acceptance the KDA slot is restored and the sequence's accepted tokens are replayed
// by its NEXT forward (the sequence skips drafting for that one step; its rejected MLA
// positions are dropped by the scheduler's block-table truncation).
// docs/ARCHITECTURE.md, "Speculative decoding and hybrid-state rollback", has the
// reasons.
//
// Not thread-safe: one thread owns the engine.
#ifndef TANDEM_ENGINE_RUNTIME_ENGINE_H_
#define TANDEM_ENGINE_RUNTIME_ENGINE_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/splitmix.h"
#include "engine/cache/cache_sizing.h"
#include "engine/cache/host_tier.h"
#include "engine/cache/prefix_events.h"
#include "engine/runtime/device_sampler.h"
#include "engine/runtime/device_thread.h"
#include "engine/runtime/kv_cache.h"
#include "engine/runtime/model_runner.h"
#include "engine/runtime/tp_executor.h"
#include "engine/runtime/weights.h"
#include "engine/sampling/mask_pool.h"
#include "engine/sampling/penalty_state.h"
#include "engine/sampling/sampler.h"
#include "engine/sampling/sampling_params.h"
#include "engine/sampling/stop_checker.h"
#include "engine/sampling/structured_output.h"
#include "engine/scheduler/scheduler.h"
#include "engine/speculative/ngram_proposer.h"
#include "engine/speculative/proposer.h"
#include "engine/tokenizer/incremental_detokenizer.h"
#include "engine/tokenizer/tokenizer.h"
#include "kernels/backend.h"
#include "kernels/cpu/thread_pool.h"

namespace tandem::engine {

using RequestId = engine::SequenceId;

enum class SpeculativeMethod { kNone, kNgram, kDraft };

struct SpeculativeOptions {
  SpeculativeMethod method = SpeculativeMethod::kNone;
  // Drafts verified per decode step (k >= 1 when a method is set).
  int32_t num_speculative_tokens = 0;
  // kDraft: the draft model (same tokenizer and vocabulary); not owned, must
  // outlive the engine. It runs on the engine's backend with its own cache.
  const ModelWeights* draft_weights = nullptr;
  // kNgram: suffix lengths and search window.
  speculative::NgramOptions ngram;
};

// Plain counters (a worker exports them); per verifying sequence-step.
struct SpeculativeStats {
  int64_t verifications = 0;    // sequence-steps that verified >= 1 draft
  int64_t drafted_tokens = 0;   // drafts verified
  int64_t accepted_tokens = 0;  // drafts accepted
  int64_t emitted_tokens = 0;   // tokens emitted by verifying steps (accepted + 1)
  int64_t rollbacks = 0;        // partial acceptances (KDA slot restored)
  double acceptance_rate() const {
    return drafted_tokens > 0 ? static_cast<double>(accepted_tokens) / drafted_tokens
                              : 0.0;
  }
  // Mean drafts accepted per verifying step (0..k).
  double mean_accepted_length() const {
    return verifications > 0 ? static_cast<double>(accepted_tokens) / verifications
                             : 0.0;
  }
  // Mean tokens a verifying step emits (1..k+1).
  double mean_tokens_per_verification() const {
    return verifications > 0 ? static_cast<double>(emitted_tokens) / verifications
                             : 0.0;
  }
};

// Prefix caching (engine/cache/prefix_cache.h has the rule and the policy):
// prompts' full MLA blocks are cached by content and KDA state snapshots are
// kept in `num_snapshots` extra slots of the cache (beside the running
// sequences' slots, on the cache's device; copies by KvCache::CopySlot). Off
// in the library by default (exact block accounting in tests); the workers'
// --enable_prefix_caching turns it on by default.
struct PrefixCachingOptions {
  bool enabled = false;
  int32_t num_snapshots = 0;      // 0 with enabled: num_slots
  int64_t snapshot_grid = 16384;  // also snapshot every this many tokens (0: off)
  // Prefix events pending for TakePrefixEvents at most (at least the pool's
  // snapshots + 1, a resync's length); past it the queue is replaced by a resync.
  int64_t max_pending_events = 16384;
  // Snapshot the end of a finished generation for the next chat turn: a
  // background prefill continuation recomputes prompt + output up to the last
  // chunk multiple on spare capacity (docs/prefix_caching.md, "Generations").
  bool snapshot_generations = true;
  // The host-memory tier (docs/prefix_caching.md): bytes of host memory that
  // hold blocks and snapshots the device tier evicts, loaded back on a hit;
  // 0: off (evictions drop). The workers' --prefix_host_memory sets it.
  int64_t host_memory_bytes = 0;
  // A decode worker's (decode_main): also announce the cached blocks of the
  // prompts this engine computes itself (colocated prefills, generations'
  // continuations) as blocks_only events, as it does for every landed prompt
  // (SchedulerConfig::announce_prompt_blocks).
  bool announce_blocks = false;
};

// Where a step's time goes (a worker exports it; ./tandem bench engine prints it).
// The forward is the device's work (on a GPU: launches, kernels, the logits copy
// back); everything else a step does (scheduling, block tables, drafts, sampling,
// stop checks, the worker loop's streaming between steps) is host work during
// which the device is idle: the host gap. A step's gap is the time from the end
// of the previous step's forward to the start of its own, counted only when the
// engine had work at the end of the previous step (idle waits for requests are
// not gaps).
struct StepTimingStats {
  int64_t steps = 0;            // steps that ran a forward
  double forward_seconds = 0;   // sum of forward times
  int64_t gaps = 0;             // gaps measured (back-to-back steps)
  double host_gap_seconds = 0;  // sum of gaps
  double max_host_gap_seconds = 0;
  // Rows sampled on the device (their logits never copied back) and on the
  // host; steps that meant to sample on the device and fell back to the host
  // (device memory for the sampler's inputs ran out: the logits were copied).
  int64_t device_sampled_rows = 0;
  int64_t host_sampled_rows = 0;
  // Prompt rows scored (prompt logprobs) on the device (DeviceSampler score
  // rows) and on the host (ScorePrompts).
  int64_t device_scored_rows = 0;
  int64_t host_scored_rows = 0;
  int64_t device_sampling_fallbacks = 0;
  // Overlapped steps (EngineOptions::overlap_steps): steps launched on the
  // device thread before the previous step's tokens reached the host, and rows
  // such a step computed for a request that had just ended (its token thrown
  // away, as in vLLM's async scheduling).
  int64_t overlapped_steps = 0;
  int64_t overlap_discarded_rows = 0;
  // Time in device sampling (inputs up, the kernel, the results back), and
  // of the measured host gaps the part after it: device work follows the
  // forward it samples, so this is what the device idles waiting for the host.
  double device_sampling_seconds = 0;
  double idle_gap_seconds = 0;
  double idle_gap_seconds_per_step() const {
    return gaps > 0 ? idle_gap_seconds / gaps : 0.0;
  }
  // Host gap as a fraction of the step (gap + forward), over the measured gaps.
  double host_gap_fraction() const {
    const double fwd = steps > 0 ? forward_seconds / steps : 0.0;
    const double gap = gaps > 0 ? host_gap_seconds / gaps : 0.0;
    return fwd + gap > 0 ? gap / (fwd + gap) : 0.0;
  }
};

struct PrefixCachingStats {
  int64_t queried_tokens = 0;  // prompt tokens looked up
  int64_t hit_tokens = 0;      // prompt tokens not computed (reused)
  int64_t lookups = 0;
  int64_t hits = 0;
  int64_t snapshots_stored = 0;
  int64_t snapshots_evicted = 0;
  int64_t snapshots_held = 0;
  int64_t snapshot_bytes_held = 0;  // every rank's
  int64_t blocks_cached = 0;
  int64_t blocks_evicted = 0;
  // Generation snapshots (snapshot_generations): continuations queued, run to
  // their end, skipped (no room, the prompt's state gone, already there) or
  // cancelled for real requests; positions they recomputed; snapshots they stored.
  int64_t continuations_submitted = 0;
  int64_t continuations_completed = 0;
  int64_t continuations_skipped = 0;
  int64_t continuations_cancelled = 0;
  int64_t continuation_tokens = 0;
  int64_t generation_snapshots = 0;
  // Tiers: bytes the device tier's blocks and snapshots take (every rank's);
  // the host tier's budget, bytes, blocks and snapshots held; device evictions
  // that moved to the host (blocks_evicted and snapshots_evicted count every
  // device eviction), host-tier evictions (dropped for good), and loads back.
  int64_t device_bytes_held = 0;
  int64_t host_budget_bytes = 0;
  int64_t host_bytes_held = 0;
  int64_t host_blocks_held = 0;
  int64_t host_snapshots_held = 0;
  int64_t host_blocks_evicted = 0;
  int64_t host_snapshots_evicted = 0;
  int64_t blocks_moved_to_host = 0;
  int64_t snapshots_moved_to_host = 0;
  int64_t blocks_loaded_from_host = 0;
  int64_t snapshots_loaded_from_host = 0;
  int64_t hits_from_host = 0;  // lookups whose hit was loaded from the host
  // Reservations with their prompt (Reserve): tokens asked about, and those
  // whose MLA rows were held (shared, not written by the peer).
  int64_t reserve_queried_tokens = 0;
  int64_t reserve_hit_tokens = 0;
  double hit_rate() const {
    return queried_tokens > 0 ? static_cast<double>(hit_tokens) / queried_tokens : 0.0;
  }
};

struct EngineOptions {
  int32_t block_size = 16;
  // KV blocks; 0: enough for num_slots sequences of max_context_tokens.
  int32_t num_blocks = 0;
  int32_t num_slots = 8;              // KDA state slots = concurrent sequences
  int64_t max_tokens_per_step = 256;  // bounds activation memory
  int64_t max_prefill_chunk = 0;      // 0: the step budget
  // Prompt logprobs: the prompt tokens scored requests prefill in one step,
  // all together (their logits rows; SchedulerConfig::max_scored_tokens_per_step;
  // the memory profile counts them). <= 0: no limit.
  int64_t max_scored_tokens_per_step = 128;
  int64_t max_context_tokens = 4096;
  MlaMode mla_mode = MlaMode::kAuto;
  // Decode steps as CUDA graphs where the backend's device supports them
  // (model_runner.h, "CUDA graphs"); true: every step eagerly (--enforce_eager).
  bool enforce_eager = false;
  // Seeds requests that sample without a seed of their own.
  uint64_t seed = 0;
  // Speculative decoding (off by default).
  SpeculativeOptions speculative;
  // Prefix caching (off by default here; on by default in the workers).
  PrefixCachingOptions prefix_caching;
  // Tensor parallelism: tp.tp_size > 1 runs that many ranks (threads of this
  // process, tp_executor.h) over `tp_checkpoint`'s shards, each with its own
  // backend named tp.backend; tp.cache and tp.runner are filled from the options
  // above. tp_size 1 (the default): the caller's weights and backend, exactly the
  // single-rank engine (no threads, no communicator).
  TpExecutorOptions tp;
  const model::Checkpoint* tp_checkpoint = nullptr;  // not owned; outlives the engine
  // Sampling on the device: when the backend samples on its device
  // (Backend::SupportsSampling: cuda, cuda_sim), a step whose sampling rows have
  // no drafts keeps its logits in device memory and samples them there
  // (DeviceSampler; structured-output masks go up with the rows; only the
  // chosen ids and logprobs come back); steps with drafts copy the logits back
  // and sample on the host. false: every step on the host. The same tokens either way
  // (docs/ARCHITECTURE.md, "Sampling on the device").
  bool device_sampling = true;
  // Overlapped steps (async scheduling, as vLLM's async scheduler and SGLang's
  // overlap scheduler): while a decode step's forward and device sampling run
  // on the engine's device thread, the engine's thread plans and launches the
  // next step (each row fed the token the running step is sampling: it is
  // patched into the next step's inputs on the device thread, never waited for
  // on the host) and only then turns the running step's tokens into text, stop
  // checks and outputs. So a Step() returns the previous step's outputs. Taken
  // for steps whose rows are all sampled on the device with nothing the host
  // must know first (no drafts, constraints, penalties, images, layer-progress
  // listener); any other step runs as before, once the one in flight has
  // finished. A request that ended on the step in flight has its row in the
  // next step computed and thrown away. The same tokens either way
  // (docs/ARCHITECTURE.md, "Overlapped steps").
  bool overlap_steps = true;
  // How long a step waits for the overlapped step before it: past it the step
  // fails with DeadlineExceeded (the worker stops taking work).
  absl::Duration overlap_step_timeout = absl::Minutes(5);
  // A step's rows are sampled on this many threads (each row on its own: the
  // results do not depend on it). 0: one per hardware thread; 1: on the engine
  // thread. Full-vocabulary sampling costs 0.2-3 ms per row on a CPU core.
  int32_t sampling_threads = 0;
  // Structured outputs: the masks of a step's constrained rows (and of their
  // drafts) are filled on this many threads of the engine's mask pool
  // (engine/sampling/mask_pool.h) while the step's forward runs, and applied at
  // sampling. 0: filled at sampling time, after the forward, on the sampling
  // threads (the synchronous path; the same tokens either way).
  int32_t structured_mask_threads = 2;
  // How long sampling waits for an overlapped mask: one not started by then is
  // filled at sampling time instead; one still being filled ends its request
  // with kError (DeadlineExceeded in last_structured_error), the others go on.
  absl::Duration structured_mask_timeout = absl::Seconds(10);
  // Where every rank's cache buffers come from (a decode worker's: its transfer
  // agent, so that a peer's puts land in memory it maps); empty: the heap.
  KvCacheAllocator cache_allocator;
  // A device cache in memory another process may map (KvCacheOptions::shareable).
  bool cache_shareable = false;
};

// The step budget (max_tokens_per_step) a worker takes by default on `device`:
// on a GPU, vLLM's defaults for an API server (8192 tokens where the GPU has at
// least 70 GiB, 2048 on a smaller one): a step streams every weight once, so a
// prefill chunk of a few hundred tokens would be bound by the weights' bytes, not
// by the arithmetic (docs/benchmarks.md, "Projection"); on a host-addressable
// device (the CPU, the emulator, where each token costs far more) `host_default`.
int64_t DefaultMaxTokensPerStep(const kernels::Device& device, int64_t host_default);

// The cache sized from a memory budget rather than from counts (a worker's
// --kv_cache_memory, --max_num_seqs, --max_model_len, --num_blocks).
struct CacheMemoryOptions {
  int64_t budget_bytes = 0;         // every TP rank's cache together
  int32_t max_num_seqs = 256;       // running sequences and KDA slots, at most
  int64_t max_model_len = 0;        // 0: the model's max_position_embeddings
  int64_t num_blocks_override = 0;  // > 0: this many MLA blocks, whatever the budget
  // Prefix caching: this share of the budget holds KDA snapshots
  // (options->prefix_caching.num_snapshots is set from it when > 0).
  double prefix_snapshot_fraction = 0.0;
};

// A worker cache's units for `config` at TP `tp`: token_bytes (one token's MLA
// latent over every MLA layer, replicated on every rank, so times tp),
// slot_bytes (one sequence's KDA state, split across the ranks) and
// block_size; the rest of the input at its defaults. SizeCacheFromMemory sizes
// with them; MinCacheBytes of them is what a device budget must leave.
CacheSizingInput WorkerCacheUnits(const model::ModelConfig& config, int tp,
                                  int32_t block_size);

// Sizes `options` (num_slots, num_blocks, max_context_tokens; block_size and
// tp.tp_size as set) for `config` from `memory`: the MLA latent of one token
// ((kv_lora_rank + qk_rope_head_dim) BF16 per MLA layer) is replicated on every
// TP rank, one sequence's KDA state (heads * d_k * d_v fp32 + conv tails per KDA
// layer) is split across them, as KvCache lays them out. The errors of SizeCache.
absl::StatusOr<CacheSizing> SizeCacheFromMemory(const model::ModelConfig& config,
                                                const CacheMemoryOptions& memory,
                                                EngineOptions* options);

// One image of a prompt (image input, VISION.md section 3): the prompt's
// positions [position, position + rows) hold media_placeholder_token_id, and
// layer 0 takes `embeddings` ([rows, hidden_size], the vision tower's output
// for the image, engine/vision/vision_tower.h) there instead of the
// placeholder's embedding. content_hash enters the prefix-cache keys of the
// blocks from `position` on, so prompts that differ only in an image never
// share a hit past it.
struct MediaInput {
  int64_t position = 0;
  int64_t rows = 0;
  uint64_t content_hash = 0;
  std::shared_ptr<const std::vector<float>> embeddings;
};

struct RequestOutput {
  RequestId id = 0;
  std::vector<int32_t> new_tokens;  // this step
  std::string text;                 // streamable text (empty without a tokenizer)
  bool finished = false;
  engine::FinishReason finish_reason = engine::FinishReason::kNone;
  // One per new token when the request asked for logprobs, in the same order.
  std::vector<engine::SampleResult> logprobs;
  // Prompt tokens this engine took from its prefix cache instead of computing
  // them (the last prefill's hit; 0 without a hit or with caching off).
  int64_t cached_prompt_tokens = 0;
  // params.prompt_logprobs >= 0, on the output with the first token: one entry
  // per prompt token after the first (entry i scores prompt token i + 1 under
  // the raw model, engine::ScoreToken).
  std::vector<engine::SampleResult> prompt_logprobs;
};

// Where a running request's state lives in this engine's cache (the KV hand-off
// writes it from here): its block table, KDA slot and cached positions.
struct StateLocation {
  std::vector<int32_t> block_ids;
  int64_t slot = -1;
  int64_t num_cached_tokens = 0;
  // Reserve: the leading positions whose MLA rows this engine already holds
  // (shared cached blocks; the peer must not write them). 0 otherwise.
  int64_t held_prefix_tokens = 0;
  // Locate: the leading positions computed on the 64-token chunk grid (every
  // chunk before them aligned), whose rows a peer may cache as its own
  // (bit-identical to recomputing them); num_cached_tokens when all are.
  int64_t aligned_tokens = 0;
};

// A sequence's state for the hand-off: its tokens and where its bytes are.
struct ExportedState {
  std::vector<int32_t> prompt;
  std::vector<int32_t> generated;
  int64_t num_cached_tokens = 0;   // tokens whose KV/KDA state the ranges hold
  std::vector<StateRange> ranges;  // valid until the sequence advances or ends
  // AdmitReserved: the leading prompt positions the peer computed on the chunk
  // grid (its StateLocation::aligned_tokens), the most this engine caches of
  // the landed prompt; -1: all of it.
  int64_t cacheable_tokens = -1;
};

// One prefill sequence of the step being computed, as the layer-progress
// callback sees it: after layer `layer` returns, that layer's attention state of
// positions [start_pos, end_pos) is in the cache (MLA rows in `block_table`'s
// blocks, the KDA slot after end_pos tokens).
struct LayerProgressEntry {
  RequestId id = 0;
  int64_t start_pos = 0;
  int64_t end_pos = 0;
  absl::Span<const int32_t> block_table;  // valid during the callback only
  int64_t slot = -1;
  // This step computes the last prompt chunk: after it, the layer's state for
  // the whole prompt is final (the request will sample its first token).
  bool completes_prefill = false;
};
// Called on the engine thread during Step(), once per model layer, with the
// step's prefill sequences (requests with no generated token yet); not called
// for steps without one. Decode steps (and speculative drafts, which may be
// rolled back) are never reported.
using LayerProgressCallback =
    std::function<void(int layer, absl::Span<const LayerProgressEntry> entries)>;

class Engine {
 public:
  // weights, backend (and tokenizer, which may be null: no text, no stop
  // strings) are not owned and must outlive the engine. With options.tp.tp_size
  // > 1 weights and backend are not used (may be null): the executor loads the
  // shards from options.tp_checkpoint; a step whose rank fails returns the
  // executor's error (and every later step fails fast, naming the rank).
  static absl::StatusOr<std::unique_ptr<Engine>> Create(
      const ModelWeights* weights, kernels::Backend* backend,
      const tokenizer::Tokenizer* tokenizer, const EngineOptions& options);

  // InvalidArgument for an empty prompt, ids out of range, bad params, a
  // duplicate id, or a prompt that cannot fit.
  // `cache_salt` (the request's tenant, OpenAI `cache_salt` as vLLM): prefix
  // cache entries are shared only between requests with the same salt.
  absl::Status AddRequest(RequestId id, std::vector<int32_t> prompt,
                          const engine::SamplingParams& params,
                          std::string_view cache_salt = {});
  // With images (ascending, non-overlapping MediaInputs over placeholder
  // tokens; InvalidArgument otherwise). Chunked prefill feeds each chunk the
  // rows of the images it covers; decode never needs them. Not with tensor
  // parallelism yet (Unimplemented).
  absl::Status AddRequest(RequestId id, std::vector<int32_t> prompt,
                          const engine::SamplingParams& params,
                          std::string_view cache_salt, std::vector<MediaInput> media);
  // Runs one step; an empty result when there is nothing to do.
  absl::StatusOr<std::vector<RequestOutput>> Step();
  // Cancels a request in any state (a reservation included) and frees its
  // blocks and slot.
  absl::Status Abort(RequestId id);

  // Disaggregation: the state of a running request whose prefill is done.
  absl::StatusOr<ExportedState> ExportState(RequestId id);
  // Admits a request prefilled elsewhere: `state` holds its prompt, the first
  // generated token(s) and the source ranges (num_cached_tokens positions);
  // they are copied into this engine's cache, and decoding continues here.
  absl::Status AddPrefilledRequest(RequestId id, const ExportedState& state,
                                   const engine::SamplingParams& params);
  // As AddPrefilledRequest, and reports what the generated tokens yield for the
  // client (text, logprobs are not known here, finish): when they already end the
  // request (a stop token, a stop string, max_tokens of 1) nothing is admitted
  // and the output is `finished`.
  absl::StatusOr<RequestOutput> AddPrefilledRequestWithOutput(
      RequestId id, const ExportedState& state, const engine::SamplingParams& params);
  // The block table, slot and cached length of a request whose prefill is done
  // (what ExportState describes as byte ranges).
  absl::StatusOr<StateLocation> Locate(RequestId id);

  // Disaggregation, landing in place (the decode worker's reservation): holds
  // this engine's KV blocks for a prompt of num_prompt_tokens positions and a
  // KDA slot for request `id`, whose state a peer then writes straight into
  // them (every rank's cache: the same blocks and slot). The sequence is neither
  // scheduled nor preempted until AdmitReserved; Abort frees it.
  // ResourceExhausted when the memory (or the running cap) is not free,
  // InvalidArgument when the prompt cannot fit, AlreadyExists for a known id.
  //
  // Decode-side prefix hit: given the prompt's token ids (and its tenant's
  // cache_salt) with prefix caching on, the reservation shares the leading
  // full blocks of the prompt this engine's cache holds instead of allocating
  // them (their MLA rows are already here; the KDA state crosses whole, so no
  // snapshot is needed) and reports them as held_prefix_tokens: the peer
  // writes only the rows after them. Only with `share_held_prefix`: the
  // caller's word that the peer honours held_prefix_tokens (a peer that writes
  // every row from 0 would overwrite blocks other sequences share); without
  // it every block is allocated and the landed prompt is only cached at
  // AdmitReserved. `media`: the prompt's images as spans (position, rows,
  // content_hash; no embeddings: MediaInput::embeddings null), ascending and
  // non-overlapping, over placeholder ids where `prompt` is given. Their
  // hashes enter the keys as in AddRequest, so an image prompt shares only
  // with prompts of the same images. Their rows cannot be recomputed here: a
  // preempted request whose readmission would need them (no prefix hit past
  // the last image) ends with FinishReason::kError (unrecomputable_drops()).
  // InvalidArgument when `prompt` is given and its size is not
  // num_prompt_tokens, or for bad spans.
  absl::StatusOr<StateLocation> Reserve(RequestId id, int64_t num_prompt_tokens,
                                        absl::Span<const int32_t> prompt = {},
                                        std::string_view cache_salt = "",
                                        bool share_held_prefix = false,
                                        std::vector<MediaInput> media = {});
  // Admits reserved request `id` whose state is in place: `state` gives its
  // prompt (num_prompt_tokens of them), its first generated token and
  // num_cached_tokens (= the prompt's); its ranges are not used (nothing is
  // copied). Reports what the generated token yields, as
  // AddPrefilledRequestWithOutput: when it already ends the request, the
  // reservation is freed and the output is `finished`. On an error the
  // reservation stays (Abort frees it). With prefix caching and a prompt given
  // to Reserve, the landed prompt's full blocks up to state.cacheable_tokens
  // join this engine's cache.
  absl::StatusOr<RequestOutput> AdmitReserved(RequestId id, const ExportedState& state,
                                              const engine::SamplingParams& params);

  // Requests to step, or an overlapped or planned step the next Step() finishes.
  bool HasWork() const {
    return device_error_.ok() &&
           (!requests_.empty() || inflight_ != nullptr || planned_ != nullptr);
  }
  int32_t num_free_blocks() const { return scheduler_->num_free_blocks(); }
  int32_t num_free_slots() const { return scheduler_->num_free_slots(); }
  const engine::Scheduler& scheduler() const { return *scheduler_; }
  // Rank 0's cache and runner (the only ones at TP 1).
  KvCache& cache() { return executor_->cache(0); }
  ModelRunner& runner() { return executor_->runner(0); }
  TpExecutor& executor() { return *executor_; }
  // Layer-by-layer progress of prefill chunks (see LayerProgressCallback); the
  // KV hand-off streams each layer's state while the forward continues.
  // Installs the runner's layer hook only while a callback is set: a runner with
  // a hook runs every step eagerly (no CUDA graphs, model_runner.h).
  void set_layer_progress_callback(LayerProgressCallback cb);
  // Overlapped steps: waits (within overlap_step_timeout) until no step runs
  // on the device thread, for callers that use the engine's devices between
  // steps (checksums of the cache on the device). OK at once when none runs.
  absl::Status Quiesce() { return WaitDevice(); }
  // The executor's health, or the error that stopped the engine (an
  // overlapped step that failed or overran overlap_step_timeout: the engine
  // then takes no more work, and HasWork() is false).
  absl::Status health() const {
    return device_error_.ok() ? executor_->health() : device_error_;
  }
  // Rank 0's CUDA-graph counters as of the last step that finished (the
  // runner's own are the device thread's while a step is in flight).
  const GraphStats& graph_stats() const { return graph_stats_; }
  // Rank 0's tensor-parallel collectives as of the last step that finished
  // (zero at TP 1).
  const CommStats& comm_stats() const { return comm_stats_; }
  // Tokens computed by forward passes so far (prefill, decode).
  int64_t prefill_tokens() const { return prefill_tokens_; }
  int64_t decode_tokens() const { return decode_tokens_; }
  // Prefix caching: counters (zero when off), and dropping every cached block
  // and snapshot (running requests keep theirs).
  PrefixCachingStats prefix_caching_stats() const;
  void ResetPrefixCache() { scheduler_->ResetPrefixCache(); }
  // Prefix-cache events since the last call (engine/cache/prefix_events.h:
  // usable hit positions stored, removed, cleared), oldest first; drains them.
  // Thread-safe: the worker's heartbeat thread may call it while the engine
  // thread steps. Empty when prefix caching is off.
  std::vector<engine::PrefixEvent> TakePrefixEvents() {
    return prefix_events_ != nullptr ? prefix_events_->Take()
                                     : std::vector<engine::PrefixEvent>{};
  }
  // Times the event queue overflowed and was replaced by a resync.
  int64_t prefix_event_overflows() const {
    return prefix_events_ != nullptr ? prefix_events_->overflows() : 0;
  }
  // Forward time and host gaps between steps (StepTimingStats).
  const StepTimingStats& step_timing() const { return timing_; }
  // Structured outputs: masks computed and the time spent on them (summed over
  // the sampling threads).
  int64_t structured_masks() const { return structured_masks_.load(); }
  double structured_mask_seconds() const { return structured_mask_ns_.load() * 1e-9; }
  // Of those, the masks filled on the mask pool during a forward (the rest
  // were filled at sampling time).
  int64_t structured_masks_overlapped() const { return structured_masks_overlapped_; }
  // Compiles a structured-output spec with this engine's grammar compiler
  // (cached by spec), for StructuredOutputSpec::compiled. Thread-safe: the
  // worker's EngineLoop calls it off the engine thread, so a slow compile
  // (a large schema: tens to hundreds of ms) delays only its own request.
  absl::StatusOr<std::shared_ptr<const grammar::CompiledGrammar>> CompileConstraint(
      const engine::StructuredOutputSpec& spec) const ABSL_LOCKS_EXCLUDED(grammar_mu_);
  // Constrained requests admitted with their grammar compiled ahead (by
  // CompileConstraint) and compiled at admission on the engine thread.
  int64_t structured_precompiled() const { return structured_precompiled_; }
  int64_t structured_compiled_at_admission() const {
    return structured_compiled_at_admission_;
  }
  // Constrained requests ended with kError, and the last such error.
  int64_t structured_failures() const { return structured_failures_; }
  const absl::Status& last_structured_error() const { return last_structured_error_; }
  // Requests ended with kError because a preemption left them needing rows
  // this engine cannot recompute (image rows of a prefilled prompt, Reserve).
  int64_t unrecomputable_drops() const { return unrecomputable_drops_; }
  // Speculative decoding: counters, and the proposer (null when off).
  const SpeculativeStats& speculative_stats() const { return spec_stats_; }
  speculative::Proposer* proposer() { return proposer_.get(); }

 private:
  void InstallLayerDoneHook();
  // Masks a mask-pool task fills for one constrained row during the forward:
  // row j is the mask after drafts[0, j) (one row without drafts); the walk
  // stops at the first draft the constraint forbids (usable_drafts). Shared
  // with the task, so a task the engine stopped waiting for ends on its own.
  struct PreparedMasks {
    std::vector<std::vector<uint32_t>> rows;
    int64_t usable_drafts = 0;
    absl::Status status;  // the walk's (a rollback failure)
    int64_t ns = 0;       // time spent filling
  };
  struct Request {
    RequestId id = 0;
    std::vector<int32_t> prompt;
    std::vector<int32_t> tokens;  // prompt + generated
    engine::SamplingParams params;
    engine::PenaltyState history;
    std::unique_ptr<engine::StopChecker> stop;
    std::unique_ptr<tokenizer::IncrementalDetokenizer> detok;
    int64_t slot = -1;  // the KDA slot of its last scheduled step
    // A prefilled state waiting to be copied in at the first step.
    std::vector<StateRange> pending_import;
    std::vector<std::string> import_bytes;  // owns pending_import's bytes
    int64_t import_tokens = 0;
    // Speculation rolled the KDA slot back to the state after tokens[0 ..
    // replay_from): the next forward feeds from there (-1: the slot is current).
    int64_t replay_from = -1;
    // Prefix caching: the prompt's chained block hashes (held by the
    // scheduler) and the hit its current admission started from.
    int64_t hit_tokens = 0;
    std::string cache_salt;  // its tenant (the continuation's hashes use it)
    // Image input: rows that replace placeholder embeddings (held until the
    // request goes; PlanInput slices them per chunk).
    std::vector<MediaInput> media;
    // A background continuation (Scheduler::SubmitBackground): never samples,
    // never reported; the engine's own (negative id).
    bool background = false;
    // Structured output (params.structured): the constraint and the mask of
    // the next token (filled just before sampling: the synchronous path).
    // Shared with this step's mask task (the overlapped path).
    std::shared_ptr<engine::OutputConstraint> constraint;
    std::vector<uint32_t> mask;
    // The overlapped path: the masks this step's task filled during the
    // forward (valid when mask_ready), or why it is missing (mask_error).
    std::shared_ptr<PreparedMasks> prepared;
    bool mask_ready = false;
    absl::Status mask_error;
    // params.prompt_logprobs >= 0 and the prompt computed here: its scores
    // (entry p for prompt token p + 1), filled chunk by chunk (a recompute
    // writes the same entries again) and handed out with the first token.
    bool scoring_prompt = false;
    std::vector<engine::SampleResult> prompt_scores;
    // A prompt row that could not be scored (NaN or +inf logits): the request
    // ends with an error at its first token, alone.
    absl::Status prompt_score_error;
    int64_t num_generated() const { return tokens.size() - prompt.size(); }
  };

  // The batch one Step() moves through its phases (engine.cc).
  struct StepBatch;

  Engine() = default;

 public:
  ~Engine();

 private:
  absl::StatusOr<Request*> NewRequest(RequestId id, std::vector<int32_t> prompt,
                                      const engine::SamplingParams& params);
  // Step()'s phases, in order. PlanStep: schedule, drafts, each sequence's input
  // (PlanInput: entry i). ForwardStep: the batched forward into logits_.
  // SampleStep: sample or verify each sampling sequence (PresampleRows: the rows
  // without drafts, in parallel), appending outputs and the scheduler's outcomes.
  // FinishStep: the scheduler completes the step; finished requests go.
  absl::Status PlanStep(StepBatch* batch);
  // Where each entry's rows start in the step's logits (the runner's order:
  // entry after entry, each its scored prompt rows, then its sampled row and
  // one per draft); entry n is the step's row count.
  static std::vector<int64_t> LogitsRowStarts(const StepBatch& batch);
  // Prompt logprobs: scores the step's prompt rows (StepBatch::scored_rows)
  // from the host logits into their requests (the host backends, and a device
  // step whose sampler could not be prepared; SampleRowsOnDevice scores them
  // otherwise).
  absl::Status ScorePrompts(const StepBatch& batch);
  absl::Status PlanInput(size_t i, StepBatch* batch);
  absl::Status ForwardStep(const StepBatch& batch, StepTimingStats* timing,
                           std::vector<float>* logits);
  // Prefix caching: the slots of entries that ended at a snapshot position are
  // copied into the snapshot pool (before sampling: verification may roll back
  // a decoding slot, never a prefill's).
  absl::Status StoreSnapshots(const StepBatch& batch);
  std::vector<std::optional<absl::StatusOr<engine::SampleResult>>> PresampleRows(
      const StepBatch& batch);
  // Whether the step's logits may stay on the device: a device sampler, at
  // least one sampling or scored prompt row, and no row with drafts
  // (verification runs on the host).
  bool SamplesOnDevice(const StepBatch& batch) const;
  // Samples every row of a SamplesOnDevice step on the device into
  // *presampled, and scores its prompt rows into their requests; false (nothing
  // sampled) when the sampler's inputs could not be prepared: the logits are then
  // copied to logits_ for the host.
  absl::StatusOr<bool> SampleRowsOnDevice(
      const StepBatch& batch,
      std::vector<std::optional<absl::StatusOr<engine::SampleResult>>>* presampled);
  absl::Status SampleStep(StepBatch* batch, std::vector<RequestOutput>* outputs);
  // Overlapped steps (EngineOptions::overlap_steps). The job a launched step
  // runs on device_thread_; whether a planned step may run there (and, after
  // `prev`, with its rows fed prev's tokens); launching it; the steady state
  // (plan and launch the next step, then finish the one in flight); finishing
  // the step in flight; waiting for the device thread before anything else
  // touches the ranks (every public call that does).
  struct DeviceJob;
  bool Overlappable(const StepBatch& batch) const;
  bool FollowsOverlapped(const StepBatch& next, const StepBatch& prev) const;
  // On success *batch moves to inflight_; on an error it stays with the caller.
  absl::Status LaunchOverlapped(std::unique_ptr<StepBatch>* batch,
                                const StepBatch* prev);
  void RunDeviceJob(DeviceJob* job);
  absl::Status StepOverlapped(std::vector<RequestOutput>* outputs);
  absl::Status FinishOverlapped(StepBatch* prev, std::vector<RequestOutput>* outputs);
  absl::Status WaitDevice();
  absl::Status WaitJob(const StepBatch& batch);
  // Stops the engine after an overlapped step's failure (device_error_),
  // keeping alive every batch a job may still read.
  absl::Status FailOverlap(const absl::Status& st, std::unique_ptr<StepBatch> a,
                           std::unique_ptr<StepBatch> b);
  // The synchronous rest of a planned, non-empty step (forward, sampling,
  // the scheduler's completion).
  absl::Status RunStep(StepBatch* batch, std::vector<RequestOutput>* outputs);
  // Schedules the next step and looks up its requests (PlanStep's first half);
  // PlanInputs does the rest (drafts, inputs).
  absl::Status ScheduleStep(StepBatch* batch);
  absl::Status PlanInputs(StepBatch* batch);
  absl::Status FinishStep(const StepBatch& batch, std::vector<RequestOutput>* outputs);
  // Samples `r`'s next token from its `logits` row with `sampler` (scratch of
  // the calling thread); reads only `r`'s parameters, history and position,
  // and with a constraint fills r's mask first (nothing else of r changes).
  absl::StatusOr<engine::SampleResult> SampleNext(engine::Sampler* sampler, Request* r,
                                                  absl::Span<const float> logits);
  // Structured output: the constraint of a new request (the grammar compiled
  // on first use of the vocabulary; cached by the compiler).
  absl::Status AttachConstraint(Request* r);
  // Image spans over a prompt of num_prompt_tokens (`prompt`, when not empty,
  // holds the placeholder id there); with `embeddings`, each span's rows.
  absl::Status CheckMedia(int64_t num_prompt_tokens, absl::Span<const int32_t> prompt,
                          absl::Span<const MediaInput> media, bool embeddings) const;
  // The prompt's prefix-cache keys (block and route hashes, images mixed in).
  void SetPrefixKeys(absl::Span<const int32_t> prompt, std::string_view cache_salt,
                     absl::Span<const MediaInput> media,
                     engine::SequenceRequest* sr) const;
  // Ends the sequences the scheduler dropped (StepPlan::unrecomputable).
  void EndUnrecomputable(const engine::StepPlan& plan,
                         std::vector<RequestOutput>* outputs);
  // Fills r->mask from its constraint (timed).
  void FillMask(Request* r);
  // The plain row's mask the mask pool filled during the forward (taken: the
  // next step needs a new one), or empty when it must be filled now.
  absl::Span<const uint32_t> TakeReadyMask(Request* r);
  // The overlapped path: starts a mask-pool task per constrained sampling row
  // of `batch` (before the forward), and waits for them (after it, within
  // options.structured_mask_timeout), marking each row ready or failed.
  void StartMasks(StepBatch* batch);
  void AwaitMasks(StepBatch* batch);
  // Ends a constrained request whose step failed: finished, kError (the
  // engine goes on with the others).
  void EndWithConstraintError(const absl::Status& status, RequestOutput* out);
  // Appends one token to the request and its output (detokenise, stop check);
  // `res` (may be null) supplies the logprobs.
  absl::Status Emit(Request* r, int32_t token, const engine::SampleResult* res,
                    RequestOutput* out);
  // Speculative decoding: drafts for the plan's decoding entries (indexed like
  // plan.sequences; empty where none).
  absl::Status ProposeDrafts(const engine::StepPlan& plan,
                             absl::Span<Request* const> reqs,
                             std::vector<speculative::Proposal>* proposals);
  // Verifies `proposal` against the target's m + 1 logits rows and emits the
  // accepted drafts and the next token; returns the drafts accepted.
  absl::StatusOr<int32_t> Verify(Request* r, absl::Span<const float> logits,
                                 const speculative::Proposal& proposal,
                                 RequestOutput* out);
  // Replays a rolled-back request's accepted tokens now (before its state is
  // exported or located).
  absl::Status CatchUp(Request* r);
  // The request whose state ExportState / Locate describe: prefilled, no
  // overlapped step in flight over it, the device idle, the host caught up.
  absl::StatusOr<Request*> SettledState(RequestId id);
  // Shared by the AddPrefilledRequest variants; `out` null: the generated tokens'
  // stop results are ignored (the request is always admitted).
  absl::Status AddPrefilled(RequestId id, const ExportedState& state,
                            const engine::SamplingParams& params, RequestOutput* out);
  // The request of a prefilled `state` (its generated tokens appended, stop
  // checks run; `out`, when given, gets what they yield). Null when they already
  // end it (out->finished): nothing is kept.
  absl::StatusOr<Request*> NewPrefilledRequest(RequestId id, const ExportedState& state,
                                               const engine::SamplingParams& params,
                                               RequestOutput* out);

  const ModelWeights* weights_ = nullptr;            // not owned
  const tokenizer::Tokenizer* tokenizer_ = nullptr;  // not owned; may be null
  EngineOptions options_;
  std::unique_ptr<engine::Scheduler> scheduler_;
  std::unique_ptr<TpExecutor> executor_;  // the ranks' caches and runners
  std::unique_ptr<engine::Sampler> sampler_;
  // Parallel row sampling: the pool (null: sampling_threads 1) and a Sampler
  // (scratch) per pool participant.
  std::unique_ptr<kernels::ThreadPool> sample_pool_;
  std::vector<std::unique_ptr<engine::Sampler>> row_samplers_;
  std::vector<float> logits_;  // the step's logits, reused (no per-step allocation)
  // Sampling on the device: null where the backend cannot, or device_sampling
  // is off.
  std::unique_ptr<DeviceSampler> device_sampler_;
  std::vector<absl::StatusOr<engine::SampleResult>> device_results_;
  absl::flat_hash_map<RequestId, std::unique_ptr<Request>> requests_;
  // Reserved ids (Reserve) → their prompt's tokens; in the scheduler, not in
  // requests_ until AdmitReserved.
  struct Reservation {
    int64_t num_prompt_tokens = 0;
    std::vector<MediaInput> media;  // spans only (Reserve)
  };
  absl::flat_hash_map<RequestId, Reservation> reserved_;
  std::vector<int32_t> eos_ids_;
  // Structured outputs: the tokenizer's vocabulary and the compiler (created
  // on the first constrained request).
  // The grammar vocabulary and compiler, made on first use by any thread.
  mutable absl::Mutex grammar_mu_;
  mutable std::shared_ptr<const grammar::TokenVocabulary> grammar_vocab_
      ABSL_GUARDED_BY(grammar_mu_);
  mutable std::unique_ptr<grammar::GrammarCompiler> grammar_compiler_
      ABSL_GUARDED_BY(grammar_mu_);
  int64_t structured_precompiled_ = 0;
  int64_t structured_compiled_at_admission_ = 0;
  std::atomic<int64_t> structured_masks_{0};
  std::atomic<int64_t> structured_mask_ns_{0};
  int64_t structured_failures_ = 0;
  int64_t unrecomputable_drops_ = 0;
  int64_t structured_masks_overlapped_ = 0;
  absl::Status last_structured_error_;
  // The overlapped masks' threads (null: structured_mask_threads 0, or no
  // constrained request yet). Declared after everything its tasks could
  // reach; the tasks own what they touch (PreparedMasks, the constraint).
  std::unique_ptr<engine::MaskPool> mask_pool_;
  SplitMix64 seeds_;  // seeds for sampling requests that bring none
  int64_t prefill_tokens_ = 0;
  int64_t decode_tokens_ = 0;
  std::unique_ptr<speculative::Proposer> proposer_;  // null: speculation off
  SpeculativeStats spec_stats_;
  StepTimingStats timing_;
  // End of the last forward, when the engine still had work after that step.
  std::optional<absl::Time> last_forward_end_;
  // Device sampling after that forward (its seconds: part of the next gap).
  double last_sampling_seconds_ = 0;
  LayerProgressCallback layer_progress_;
  int64_t snapshot_base_ = 0;  // KDA slot of snapshot 0 (after the running slots)
  // Generation snapshots: the finished request's continuation (queued in the
  // scheduler as a background sequence), the next id (negative), the ones alive.
  void ContinueFinished(const Request& r);
  void ReapBackground();
  RequestId next_background_id_ = -1;
  absl::flat_hash_set<RequestId> background_;
  int64_t generation_snapshots_ = 0;
  // Prefix-cache events (null: caching off); the scheduler's cache pushes.
  std::unique_ptr<engine::PrefixEventQueue> prefix_events_;
  // The prefix cache's host tier (null: off); the scheduler's cache points here.
  std::unique_ptr<engine::HostTier> host_tier_;
  absl::Status AttachHostTier(int64_t budget_bytes);
  std::vector<LayerProgressEntry> progress_;  // the current step's prefill entries
  // Overlapped steps: the step whose job was launched and whose outputs the
  // next Step() returns (null: none), the second device sampler (launched
  // steps alternate between the two: one is packed while the other runs), and
  // the device thread (last: it is joined before anything its jobs use goes).
  std::unique_ptr<StepBatch> inflight_;
  // A step the scheduler planned while the overlapped one ran but that could
  // not follow it: the next Step() runs it (its rows are already scheduled).
  std::unique_ptr<StepBatch> planned_;
  std::unique_ptr<DeviceSampler> device_sampler2_;
  int next_sampler_ = 0;
  // Set when an overlapped step failed: every later call returns it. The
  // batches its device thread may still read are kept until it is joined.
  absl::Status device_error_;
  std::vector<std::unique_ptr<StepBatch>> abandoned_;
  GraphStats graph_stats_;
  CommStats comm_stats_;
  std::unique_ptr<DeviceThread> device_thread_;
};

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_RUNTIME_ENGINE_H_
