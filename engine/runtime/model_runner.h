// One forward pass of Kimi K3 over a batch of sequences, each bringing its own
// number of new tokens (prefill chunks, single decode tokens, k > 1 tokens for
// speculative verification), on a kernels::Backend.
//
// Batch layout: the new tokens of all sequences are concatenated, sequence after
// sequence, into N rows; every per-token op (projections, norms, residual mixing,
// MoE, lm_head) runs once over the N rows. Per sequence: KDA (causal conv with the
// slot's tails, the recurrence with the slot's state) and the MLA cache write /
// attention (contiguous runs of sequences with the same attention form go in one
// backend call).
//
//   Forward(seqs)
//     → embed → per layer: Mix(attn) → [bank push] → input_layernorm → KDA | MLA
//       → P += a → Mix(mlp) → post_attention_layernorm → dense MLP | LatentMoE
//       → P += f
//     → Mix(output) on the rows that need logits → norm → lm_head → logits
//
// State effects: the KDA slot of every sequence advances by its new tokens, and
// their MLA latents are written at positions start..start+n-1. Callers that may
// roll back (speculation) snapshot the slot first (KvCache::SnapshotSlot).
// Activation memory is O(N * (hidden * (res blocks + a few) + widest projection)):
// callers bound N (the engine's token budget per step).
//
// Memory: every buffer the backend reads or writes is in its Device's memory
// (kernels/device.h): the weights (placed by PlaceModelWeights), the cache
// (KvCacheOptions::device) and the runner's activations (device scratch, grown
// on demand). The host builds the step's index arrays (token ids, cache slots,
// block tables, sequence lengths) and uploads them once per use; only the
// logits come back. On the host device nothing is copied: the arrays and the
// logits are used in place.
//
// Tensor parallelism: with a Communicator of size N (weights and cache of the
// same rank's shard, weights.h / kv_cache.h) every rank runs Forward on the same
// inputs at the same time; the collectives (all of them on the rank's thread):
//   embedding: each rank gathers its vocab rows (zeros elsewhere) → all-reduce
//   KDA / MLA: partial o_proj over the rank's heads → all-reduce
//   dense MLP: partial down over the rank's rows → all-reduce
//   MoE: [routed-expert sum u of the rank's experts | shared-expert partial]
//        → one all-reduce of both (before routed_expert_norm; the replicated
//        latent_up output is not reduced)
//   lm_head: logits of the rank's vocab rows → all-gather → [rows, V]
// Every rank gets the full logits. A collective's error (a peer gone or late
// beyond the communicator's timeout) is returned by Forward. Decode graph steps
// enqueue the collectives in stream order (NCCL on the compute stream; a host
// communicator as host functions on it) and wait once, bounded, at the end of the
// step; eager steps do so with NCCL unless hooks or image rows need the host
// inside the step, and otherwise wait for each. Without a
// communicator (or size 1) nothing is communicated and the arithmetic is the
// unsharded one, unchanged.
#ifndef TANDEM_ENGINE_RUNTIME_MODEL_RUNNER_H_
#define TANDEM_ENGINE_RUNTIME_MODEL_RUNNER_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/runtime/kv_cache.h"
#include "engine/runtime/weights.h"
#include "kernels/backend.h"
#include "kernels/device.h"
#include "parallel/communicator.h"

namespace tandem::engine {

// Which MLA attention form to use.
enum class MlaMode {
  kAuto,      // expanded for q_len > 1 (prefill chunks), absorbed for q_len == 1
  kExpanded,  // always expanded
  kAbsorbed,  // always absorbed
};

// Rows of layer 0's input that replace the token embeddings (image input: the
// vision tower's rows for <|media_pad|> placeholders, VISION.md section 3):
// rows [first, first + rows) of the sequence's new tokens take `data`
// ([rows, hidden_size] fp32, host memory, valid for the Forward call).
struct EmbeddingRows {
  int64_t first = 0;
  int64_t rows = 0;
  const float* data = nullptr;
};

struct SequenceInput {
  absl::Span<const int32_t> tokens;  // the new tokens (>= 1)
  // Embedding overrides within `tokens` (ascending, non-overlapping; such a
  // step always runs eagerly, never as a decode graph).
  std::vector<EmbeddingRows> embedding_rows;
  int64_t start_pos = 0;  // tokens already in the cache / state
  // Block ids covering positions 0 .. start_pos + tokens.size() - 1.
  absl::Span<const int32_t> block_table;
  int64_t kda_slot = 0;
  // Indices into `tokens` whose logits are wanted (ascending).
  std::vector<int32_t> logits_indices;
};

// Debug view of activations: called with [rows, cols] fp32 data.
struct ActivationProbe {
  int layer = -1;          // -1 for the embedding and the output
  absl::string_view name;  // "embed", "attn_in", "attn_out", "mlp_in", "mlp_out",
                           // "final"
  const float* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
};
using ActivationHook = std::function<void(const ActivationProbe&)>;

// Called during Forward, once per model layer (ascending), as soon as that
// layer's attention state for every sequence of the batch is written: the MLA
// latent rows of the new tokens, or the KDA slot after the new tokens. The layer's
// FFN and the later layers run after the hook returns, so a caller can start
// moving the layer's state (layer-by-layer KV streaming) while the forward goes on.
// The hook must not touch the runner or the cache's layout; it runs on the
// forward's thread and should return quickly.
using LayerDoneHook = std::function<void(int layer)>;

// Where Forward leaves the step's logits.
enum class LogitsPlacement {
  kHost,  // in the caller's vector (computed there in place on the host device)
  // In the runner's device buffer (device_logits()), for sampling on the
  // device: no copy back. On the host device this is kHost.
  kDevice,
};

struct ModelRunnerOptions {
  MlaMode mla_mode = MlaMode::kAuto;
  // KDA form: chunked for T > 1 unless this is set (then recurrent always).
  bool kda_recurrent_only = false;
  // CUDA graphs for decode steps (see "CUDA graphs" below) where the backend's
  // device supports them; true runs every step eagerly (vLLM's --enforce_eager).
  bool enforce_eager = false;
  // The largest decode batch served by a graph; 0: the cache's KDA slot count
  // (the most sequences a step can hold). Larger batches run eagerly.
  int64_t max_graph_batch = 0;
};

// CUDA graphs of decode steps, cumulative since the runner was made.
struct GraphStats {
  int64_t captures = 0;        // graphs captured (recaptures included)
  int64_t recaptures = 0;      // of which: a bucket's graph had gone stale
  int64_t replays = 0;         // steps that launched a captured graph
  int64_t eager_steps = 0;     // Forward calls run eagerly
  int64_t padded_rows = 0;     // rows added by padding batches to their bucket
  double capture_seconds = 0;  // warm-up forward + capture + instantiation
  int64_t live_graphs = 0;     // graphs held now
  int64_t graph_nodes = 0;     // their nodes (launches, copies, GEMMs)
  int64_t input_bytes = 0;     // device memory of their fixed input buffers
  // Device memory the captures took beyond the input buffers (free bytes before
  // minus after; graph instantiation on CUDA, 0 on cuda_sim).
  int64_t capture_device_bytes = 0;
  std::string disabled;  // why graphs were turned off (a failed capture), or empty
};

// The batch-size buckets of decode graphs up to max_batch: 1, 2, 4, ..., 64,
// then multiples of 64, and max_batch itself as the last one.
std::vector<int64_t> GraphBuckets(int64_t max_batch);
// The bucket a batch of `batch` sequences is padded to (0: none, batch > max).
int64_t GraphBucket(int64_t batch, int64_t max_batch);
// Graph widths (new tokens per sequence): 1 (decode) .. kMaxGraphWidth
// (speculative verification of up to kMaxGraphWidth - 1 drafts).
inline constexpr int64_t kMaxGraphWidth = 16;
// True when every sequence brings the same number w (1 .. kMaxGraphWidth) of new
// tokens and wants the logits of each, in order: a decode step (w = 1) or a
// verification step of w - 1 drafts. On a device such a step runs the decode
// kernels (KDA recurrent, MLA absorbed), as a graph or eagerly alike.
bool DecodeShaped(absl::Span<const SequenceInput> seqs);

// Time spent in the collectives of Forward (tensor parallelism), cumulative. The
// time of a call includes waiting for the slowest rank to arrive.
struct CommStats {
  int64_t calls = 0;
  int64_t bytes = 0;  // payload handed to the collectives (this rank's view)
  // Time in the synchronous collectives (eager steps; a host communicator's in
  // graph steps too).
  double seconds = 0;
  double all_gather_seconds = 0;  // of which the logits all-gather
  // Of `calls`, enqueued on the stream without a wait (NCCL in graph steps: their
  // time is the device's, inside the step), and the host's one bounded wait per
  // such step for all of them (WaitForStream).
  int64_t enqueued = 0;
  double wait_seconds = 0;
};

// How a decode step runs with respect to CUDA graphs (ModelRunner::PlanGraph):
// as a graph, and if so whether it (re)captures one. Under tensor parallelism
// the executor combines the ranks' plans and hands every rank the same one
// (NCCL: a collective is captured, and replayed, on all ranks or on none).
struct GraphPlan {
  bool use_graph = false;
  bool capture = false;  // capture (or recapture) rather than replay
};

// Device memory reused between calls; grown on demand (contents are not kept
// across growth).
template <typename T>
class DeviceScratch {
 public:
  // A buffer of at least n elements, or null with the error in *status. A
  // reallocation counts one in *moves (graphs captured before it are stale).
  T* Sized(kernels::Device* device, int64_t n, absl::Status* status,
           int64_t* moves = nullptr) {
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T);
    if (buf_.bytes() < bytes || buf_.device() != device) {
      if (moves != nullptr) ++*moves;
      buf_.Reset();
      absl::StatusOr<kernels::DeviceBuffer> b =
          kernels::DeviceBuffer::Allocate(device, bytes + bytes / 4);
      if (!b.ok()) {
        if (status->ok()) *status = b.status();
        return nullptr;
      }
      buf_ = std::move(b).value();
    }
    return buf_.as<T>();
  }
  T* data() const { return buf_.as<T>(); }
  void Release() { buf_.Reset(); }

 private:
  kernels::DeviceBuffer buf_;
};

// CUDA graphs (decode). A DecodeShaped step (every sequence w new tokens, w = 1
// for decode or 1 + drafts for speculative verification, all wanting logits), on
// a device with graphs (Device::supports_graphs) and without hooks, runs as a
// graph (under tensor parallelism too: every rank captures its own, with the
// step's collectives in stream order inside it and one bounded wait per step,
// model_runner.cc "Collectives"):
//   b sequences → pad to the bucket B = GraphBucket(b) (padding sequences: token
//   0, KDA slot -1, cache slots -1, context 0: the kernels skip them and give
//   zero rows) → the step's token ids, cache slots, KDA slots, context lengths,
//   query starts and block tables go, in one copy, into the fixed input buffer
//   of graph (B, w, table stride class) → that graph is launched → the first
//   b * w rows of logits are copied back.
// Graphs are captured on first use of a (bucket, width, stride class): the first
// capture (and the first after buffers moved) runs an all-padding step of the
// largest bucket eagerly, so every buffer gets its largest size; then the step
// runs eagerly over the padded batch (its result is the step's) and the same
// forward is captured. Every kernel parameter of the capture is fixed by the
// graph's key: row counts, the MLA table stride (the step's longest table
// rounded up to a power of two: a class), the split-KV plan
// (MlaArgs::split_seqs / split_context); per-step values are read from device
// memory. A graph is stale once a buffer it uses moves (scratch growth here or in
// the backend: workspace_generation) and is then recaptured. DecodeShaped steps
// on a device run the decode kernels (KDA recurrent, MLA absorbed) with the same
// split-KV plan whether graphs are on or off, so both run the same arithmetic.
class ModelRunner {
 public:
  // Not owned: weights, cache, backend (and comm) must outlive the runner.
  // comm: the TP group of this rank (null: TP 1, no collectives); its size and
  // rank must match weights->shard (checked by Forward).
  ModelRunner(const ModelWeights* weights, KvCache* cache, kernels::Backend* backend,
              ModelRunnerOptions options = {}, parallel::Communicator* comm = nullptr);

  // Runs the batch. `logits` gets one row of vocab_size fp32 per requested index,
  // sequence after sequence, in the order of logits_indices. On error the state of
  // the batch's slots and cache rows is unspecified.
  // With LogitsPlacement::kDevice on a device backend the logits stay in device
  // memory and `logits` is emptied: device_logits() holds them.
  absl::Status Forward(absl::Span<const SequenceInput> seqs, std::vector<float>* logits,
                       LogitsPlacement placement = LogitsPlacement::kHost);
  // The last Forward's logits in device memory, [device_logits_rows(),
  // vocab_size] fp32, when it ran with kDevice on a device backend (else null).
  // Valid until the next Forward; sampling may modify them in place.
  float* device_logits() const { return device_logits_; }
  int64_t device_logits_rows() const { return device_logits_rows_; }
  // Copies them to the host (a step whose sampling falls back to the host).
  absl::Status CopyDeviceLogits(std::vector<float>* logits) const;

  // What this runner would do with `seqs` on its own (no side effects).
  GraphPlan PlanGraph(absl::Span<const SequenceInput> seqs) const;
  // The plan the next Forward follows instead of its own (the TP executor sets
  // the ranks' combined plan before each step: use_graph only where every rank
  // may, capture where any rank must). Consumed by that Forward.
  void set_graph_plan(const GraphPlan& plan) { graph_plan_ = plan; }
  // Before a step that captures (PlanGraph's capture): allocates the graph's
  // input buffer and grows every buffer to the largest bucket's size (an
  // all-padding step that touches no state and communicates nothing). On
  // failure (out of device memory) graphs turn off for this runner
  // (graph_stats().disabled) and the step can still run eagerly: the buffers
  // that did not fit were released. Under tensor parallelism the executor
  // runs it on every rank before the step, so that a rank short of memory
  // fails here, before any collective, and the whole group runs the step
  // eagerly (NCCL: a rank that failed inside the step would leave its peers
  // waiting in a collective). A Forward without an executor's plan calls it
  // itself. OK and a no-op when the buffers are already sized.
  absl::Status PrepareGraph(absl::Span<const SequenceInput> seqs);
  // Destroys the captured graphs (before the communicator their collectives
  // were captured with: NCCL's destroy waits for such graphs to go).
  void ReleaseGraphs();

  void set_activation_hook(ActivationHook hook) { hook_ = std::move(hook); }
  void set_layer_done_hook(LayerDoneHook hook) { layer_done_ = std::move(hook); }
  void set_options(const ModelRunnerOptions& options) { options_ = options; }
  const ModelWeights& weights() const { return *w_; }
  KvCache* cache() { return cache_; }
  kernels::Backend* backend() { return backend_; }
  parallel::Communicator* communicator() { return comm_; }
  const CommStats& comm_stats() const { return comm_stats_; }
  void reset_comm_stats() { comm_stats_ = {}; }
  const GraphStats& graph_stats() const { return graph_stats_; }

 private:
  // One captured decode graph and its fixed input buffer (int32):
  //   ids [B * w] | cache slots [B * w] | KDA slots [B] | seq_lens [B] |
  //   query_start [B + 1] | block tables [B * stride]
  struct DecodeGraph {
    int64_t bucket = 0, width = 0, stride = 0;
    std::unique_ptr<kernels::Graph> graph;
    int64_t generation = -1;  // Generation() when captured
    kernels::DeviceBuffer inputs;
    int32_t *ids = nullptr, *cache_slots = nullptr, *kda_slots = nullptr,
            *seq_lens = nullptr, *query_start = nullptr, *tables = nullptr;
    int64_t collectives = 0, collective_bytes = 0;  // captured, run per replay
  };
  // (bucket, width, table stride class) of a graph step over `seqs`.
  std::tuple<int64_t, int64_t, int64_t> GraphKey(
      absl::Span<const SequenceInput> seqs) const;
  bool GraphEligible(absl::Span<const SequenceInput> seqs) const;
  absl::Status GraphStep(absl::Span<const SequenceInput> seqs,
                         std::vector<float>* logits, LogitsPlacement placement,
                         bool force_capture);
  // The end of a device step: the kernels' errors, then the logits copied back
  // (kHost) or left where they are (kDevice).
  absl::Status FinishLogits(float* dev_logits, int64_t rows, std::vector<float>* logits,
                            LogitsPlacement placement);
  // The device work of a forward over row_start_.back() rows: no host copies
  // when fixed_ is set (the inputs are in fixed_'s buffer), so it can be captured.
  absl::Status Enqueue(absl::Span<const SequenceInput> seqs,
                       const float* const* bank_table, int64_t num_logits,
                       float* logits_out);
  // Sizes the activation buffers for n rows; uploads the residual bank table.
  absl::StatusOr<const float* const*> PrepareActivations(int64_t n);
  // The padded step of g's shape on its fixed buffers (sized by PrepareGraph),
  // eagerly, its inputs uploaded: the step's device logits, and the bank table a
  // capture of it uses.
  absl::StatusOr<float*> EagerFixedStep(DecodeGraph& g,
                                        absl::Span<const SequenceInput> padded,
                                        const float* const** bank_table);
  absl::StatusOr<DecodeGraph*> GraphFor(int64_t bucket, int64_t width, int64_t stride);
  // *out filled with the inputs of an all-padding step of g's shape; its data.
  int32_t* PaddingInputs(const DecodeGraph& g, std::vector<int32_t>* out);
  // An all-padding step of the largest bucket, eagerly: every buffer a graph
  // step uses gets its largest size.
  absl::Status SizeForGraphs(int64_t width, int64_t stride);
  // Forward's step; Forward then aborts a communicator whose abort is pending
  // (Communicator, "Deferred abort") once the graphs are gone.
  absl::Status ForwardStep(absl::Span<const SequenceInput> seqs,
                           std::vector<float>* logits, LogitsPlacement placement);
  // Frees the scratch above (a step regrows what it needs); graphs go stale.
  void ReleaseScratch();
  int64_t MaxGraphBatch() const;
  int64_t StrideClass(int64_t blocks) const;
  int64_t Generation() const {
    return scratch_moves_ + backend_->workspace_generation();
  }
  void UpdateGraphStats();

  absl::Status Validate(absl::Span<const SequenceInput> seqs) const;
  absl::Status KdaLayer(const LayerWeights& lw, absl::Span<const SequenceInput> seqs,
                        const float* xn, float* out);
  absl::Status PlanStep(absl::Span<const SequenceInput> seqs);
  absl::Status MlaLayer(const LayerWeights& lw, absl::Span<const SequenceInput> seqs,
                        const float* xn, float* out);
  absl::Status Ffn(const LayerWeights& lw, const float* xn, float* out);
  absl::Status DenseMlp(const DenseMlpWeights& m, const float* x, float* out,
                        bool accumulate);
  bool tp() const { return comm_ != nullptr && comm_->size() > 1; }
  // Collectives (counted in comm_stats_): synchronous in eager steps, in stream
  // order on fixed buffers (model_runner.cc, "Collectives").
  absl::Status SyncCollective(const std::function<absl::Status()>& call, bool gather);
  absl::Status Collective(std::function<absl::Status()> sync,
                          std::function<absl::Status()> enqueue, int64_t bytes,
                          bool gather);
  // The end of a step whose collectives were enqueued: their first deferred
  // error, then (NCCL) the bounded wait for the stream.
  absl::Status WaitCollectives();
  absl::Status AllReduce(float* data, int64_t n);
  absl::Status AllGather(const float* in, int64_t n_per_rank, float* out);
  absl::Status Embed(int64_t n, float* out);
  absl::Status LmHead(const float* rows, int64_t num_logits, float* logits);
  void Probe(int layer, absl::string_view name, const float* data, int64_t rows,
             int64_t cols);
  // Scratch of the backend's device (errors collect in scratch_status_).
  float* S(DeviceScratch<float>& buf, int64_t n) {
    return buf.Sized(device_, n, &scratch_status_, &scratch_moves_);
  }
  // `host` in device memory: itself on the host device, else an upload into `dev`.
  template <typename T>
  absl::StatusOr<const T*> Upload(const std::vector<T>& host, DeviceScratch<T>& dev);

  const ModelWeights* w_;      // not owned
  KvCache* cache_;             // not owned
  kernels::Backend* backend_;  // not owned
  ModelRunnerOptions options_;
  parallel::Communicator* comm_;  // not owned; may be null
  CommStats comm_stats_;
  ActivationHook hook_;
  LayerDoneHook layer_done_;

  kernels::Device* device_;         // the backend's
  bool host_device_;                // device_ is the host: no uploads, logits in place
  float* device_logits_ = nullptr;  // the last kDevice Forward's (device_logits())
  int64_t device_logits_rows_ = 0;
  absl::Status scratch_status_;

  // Host-side step data.
  std::vector<int64_t> row_start_;  // per sequence, first row
  std::vector<int32_t> ids_;
  // An eager step's index arrays (PlanStep). MLA: per run of sequences sharing the
  // attention form, its part of the one upload (device pointers).
  struct MlaRun {
    bool absorbed = false;
    int64_t num_seqs = 0, num_tokens = 0, first_row = 0, stride = 1;
    int64_t split_seqs = 0, split_context = 0;  // MlaArgs' (0: the call's own)
    int64_t max_context = 0;                    // MlaArgs': the longest seq_len
    const int32_t *seq_lens = nullptr, *query_start = nullptr, *tables = nullptr;
  };
  std::vector<MlaRun> mla_runs_;
  // Runs of consecutive sequences with the same number of new tokens (KDA: the
  // batched conv and recurrence over a run), their KDA slots on the device.
  struct KdaRun {
    int64_t first_seq = 0, num_seqs = 0, tokens = 0, first_row = 0;
    const int32_t* slots = nullptr;
  };
  std::vector<KdaRun> kda_runs_;
  // [cache slots | per MLA run: lens, starts, tables | KDA slot per sequence]
  std::vector<int32_t> step_index_;
  const int32_t* mla_slots_ = nullptr;
  std::vector<const float*> bank_host_;
  std::vector<kernels::CopyPiece> logit_rows_;  // an eager step's rows for lm_head
  std::vector<float> probe_host_;
  // Device scratch reused between calls (grows to the largest N).
  std::vector<DeviceScratch<float>> res_;  // bank entries + the running P
  DeviceScratch<float> h_, xn_, attn_out_, ffn_out_;
  DeviceScratch<float> t0_, t1_, t2_, t3_, t4_, t5_, t6_, t7_;  // per-op temporaries
  DeviceScratch<float> gates_, betas_, topk_w_, out_rows_, logits_;
  DeviceScratch<float> moe_red_, local_logits_, gathered_;  // TP only
  DeviceScratch<int32_t> d_ids_, d_step_index_, d_expert_ids_;
  DeviceScratch<const float*> d_bank_;

  // CUDA graphs (decode).
  int64_t scratch_moves_ = 0;      // reallocations of the scratch above
  int64_t sized_width_ = 0;        // the width SizeForGraphs sized for
  bool decode_kernels_ = false;    // this step runs the decode kernels (DecodeShaped)
  int64_t sized_generation_ = -1;  // Generation() after the last SizeForGraphs
  const DecodeGraph* fixed_ = nullptr;  // while a graph's forward is enqueued
  bool sizing_only_ = false;            // SizeForGraphs: no collectives
  bool stream_collectives_ = false;     // an eager step's NCCL calls in stream order
  absl::Status deferred_comm_;          // a host-function collective's first error
  int64_t captured_collectives_ = 0, captured_bytes_ = 0;  // by the capture running
  std::optional<GraphPlan> graph_plan_;  // set_graph_plan, for the next Forward
  // (bucket, width, stride) -> graph
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::unique_ptr<DecodeGraph>> graphs_;
  std::vector<int32_t> graph_host_;  // a graph step's inputs, staged
  GraphStats graph_stats_;
};

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_RUNTIME_MODEL_RUNNER_H_
