#include "engine/runtime/model_runner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status.h"

namespace tandem::engine {
namespace {

constexpr float kLoraNormEps = 1e-6f;  // q_a / kv_a layernorms (not rms_norm_eps)
constexpr float kL2NormEps = 1e-6f;
// The largest eager TP step whose collectives go in stream order with one wait
// (Forward): decode and mixed steps, not long prefill chunks.
constexpr int64_t kStreamOrderedRows = 1024;

}  // namespace

ModelRunner::ModelRunner(const ModelWeights* weights, KvCache* cache,
                         kernels::Backend* backend, ModelRunnerOptions options,
                         parallel::Communicator* comm)
    : w_(weights),
      cache_(cache),
      backend_(backend),
      options_(options),
      comm_(comm),
      device_(&backend->device()),
      host_device_(backend->device().name() == "host") {}

template <typename T>
absl::StatusOr<const T*> ModelRunner::Upload(const std::vector<T>& host,
                                             DeviceScratch<T>& dev) {
  if (host_device_) return host.data();
  absl::Status st;
  T* d = dev.Sized(device_, static_cast<int64_t>(host.size()), &st, &scratch_moves_);
  TANDEM_RETURN_IF_ERROR(st);
  if (!host.empty()) {
    TANDEM_RETURN_IF_ERROR(
        device_->CopyToDevice(d, host.data(), host.size() * sizeof(T)));
  }
  return d;
}

// Collectives. A step on fixed buffers (a decode graph's capture, its eager run
// and the replays: GraphStep) enqueues them in stream order, so that they are
// captured with the kernels and the step is waited for once: NCCL on the
// compute stream (WaitCollectives bounds the wait); a host communicator of
// emulated devices (cuda_sim) as a host function on the stream, which runs in
// order, and at each replay of a graph that captured it. An eager step enqueues
// NCCL's the same way (stream_collectives_) where the host has nothing to do
// inside the step; otherwise, and with a host communicator, it waits for each
// (the communicator's bounded wait, synchronous: a host communicator reads the
// data, so the kernels that wrote it must be done first).
// SizeForGraphs's all-padding step communicates nothing (sizing_only_): its
// outputs are discarded, and a rank that sizes while its peers do not must not
// issue collectives they do not.
absl::Status ModelRunner::SyncCollective(const std::function<absl::Status()>& call,
                                         bool gather) {
  // A kernel's error does not skip the collective: the peers are in it, and a
  // rank that skipped one would pair its later ones with their earlier ones.
  absl::Status synced;
  if (!host_device_ && !comm_->takes_device_pointers())
    synced = backend_->Synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s = call();
  if (!synced.ok()) s = synced;
  const double sec =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  comm_stats_.seconds += sec;
  if (gather) comm_stats_.all_gather_seconds += sec;
  return s;
}

absl::Status ModelRunner::Collective(std::function<absl::Status()> sync,
                                     std::function<absl::Status()> enqueue,
                                     int64_t bytes, bool gather) {
  if (sizing_only_) return absl::OkStatus();
  if (fixed_ == nullptr && !stream_collectives_) {
    ++comm_stats_.calls;
    comm_stats_.bytes += bytes;
    return SyncCollective(sync, gather);
  }
  // Counted when they run: now, or (captured) at each replay of the graph.
  if (device_->compute_stream().capturing()) {
    ++captured_collectives_;
    captured_bytes_ += bytes;
  } else {
    ++comm_stats_.calls;
    ++comm_stats_.enqueued;
    comm_stats_.bytes += bytes;
  }
  if (comm_->stream_ordered()) return enqueue();
  // A host function: its error is kept for the end of the step (the first one;
  // once a collective failed the communicator is broken and the later ones fail
  // at once, so a failed step never waits more than one timeout).
  return device_->compute_stream().EnqueueHostFunction(
      [this, sync = std::move(sync), gather] {
        absl::Status s = SyncCollective(sync, gather);
        if (!s.ok() && deferred_comm_.ok()) deferred_comm_ = s;
      });
}

absl::Status ModelRunner::WaitCollectives() {
  absl::Status deferred = std::exchange(deferred_comm_, absl::OkStatus());
  TANDEM_RETURN_IF_ERROR(deferred);
  if (!tp() || !comm_->stream_ordered()) return absl::OkStatus();
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s = comm_->WaitForStream();
  comm_stats_.wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return s;
}

absl::Status ModelRunner::AllReduce(float* data, int64_t n) {
  parallel::Communicator* c = comm_;
  const size_t count = static_cast<size_t>(n);
  return Collective([c, data, count] { return c->AllReduceSum(data, count); },
                    [c, data, count] { return c->EnqueueAllReduceSum(data, count); },
                    n * static_cast<int64_t>(sizeof(float)), /*gather=*/false);
}

absl::Status ModelRunner::AllGather(const float* in, int64_t n_per_rank, float* out) {
  parallel::Communicator* c = comm_;
  const size_t count = static_cast<size_t>(n_per_rank);
  return Collective([c, in, count, out] { return c->AllGather(in, count, out); },
                    [c, in, count, out] { return c->EnqueueAllGather(in, count, out); },
                    n_per_rank * static_cast<int64_t>(sizeof(float)), /*gather=*/true);
}

// Vocabulary-parallel embedding: this rank's rows, zeros for the others (one
// launch, EmbeddingGatherRows), summed over the ranks (each row comes from
// exactly one rank, so the sum is exact).
absl::Status ModelRunner::Embed(int64_t n, float* out) {
  const int64_t H = w_->config.text.hidden_size, V = w_->config.text.vocab_size;
  const int32_t* ids = nullptr;
  if (fixed_ != nullptr) {  // a graph step: the ids are in its input buffer
    ids = fixed_->ids;
  } else {
    TANDEM_ASSIGN_OR_RETURN(ids, Upload(ids_, d_ids_));
  }
  if (!tp()) return backend_->EmbeddingGather(w_->embed, V, H, ids, n, out);
  TANDEM_RETURN_IF_ERROR(backend_->EmbeddingGatherRows(w_->embed, V, w_->vocab_begin,
                                                       w_->vocab_rows, H, ids, n, out));
  return AllReduce(out, n * H);
}

// lm_head over this rank's vocab rows, all-gathered ([rank][row][vocab slice])
// and re-ordered into [row][V] (a strided copy per rank).
absl::Status ModelRunner::LmHead(const float* rows, int64_t num_logits, float* logits) {
  const int64_t H = w_->config.text.hidden_size, V = w_->config.text.vocab_size;
  if (!tp()) {
    return backend_->GemmBf16(rows, H, w_->lm_head, H, logits, V, num_logits, V, H,
                              /*accumulate=*/false);
  }
  const int64_t vr = w_->vocab_rows, N = comm_->size();
  float* local = S(local_logits_, num_logits * vr);
  TANDEM_RETURN_IF_ERROR(backend_->GemmBf16(rows, H, w_->lm_head, H, local, vr,
                                            num_logits, vr, H, /*accumulate=*/false));
  float* all = S(gathered_, N * num_logits * vr);
  TANDEM_RETURN_IF_ERROR(scratch_status_);
  TANDEM_RETURN_IF_ERROR(AllGather(local, num_logits * vr, all));
  const size_t slice = static_cast<size_t>(vr) * sizeof(float);
  for (int64_t r = 0; r < N; ++r) {
    TANDEM_RETURN_IF_ERROR(device_->CopyOnDevice2D(
        logits + r * vr, static_cast<size_t>(V) * sizeof(float),
        all + r * num_logits * vr, slice, slice, static_cast<size_t>(num_logits)));
  }
  return absl::OkStatus();
}

void ModelRunner::Probe(int layer, absl::string_view name, const float* data,
                        int64_t rows, int64_t cols) {
  if (!hook_) return;
  if (!backend_->Synchronize().ok()) return;  // the forward reports the error
  if (!device_->host_addressable()) {
    probe_host_.resize(rows * cols);
    if (!device_->CopyToHost(probe_host_.data(), data, rows * cols * sizeof(float))
             .ok())
      return;
    data = probe_host_.data();
  }
  ActivationProbe p;
  p.layer = layer;
  p.name = name;
  p.data = data;
  p.rows = rows;
  p.cols = cols;
  hook_(p);
}

absl::Status ModelRunner::Validate(absl::Span<const SequenceInput> seqs) const {
  const int64_t bs = cache_->block_size();
  const int64_t max_pos = w_->config.text.max_position_embeddings;
  absl::flat_hash_set<int64_t> slots;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const SequenceInput& q = seqs[s];
    const int64_t t = static_cast<int64_t>(q.tokens.size());
    if (t == 0) return InvalidArgument("forward: sequence ", s, " has no new tokens");
    if (q.start_pos < 0 || q.start_pos + t > max_pos) {
      return InvalidArgument("forward: sequence ", s, " spans positions ", q.start_pos,
                             "..", q.start_pos + t, ", the model allows ", max_pos);
    }
    const int64_t blocks = (q.start_pos + t + bs - 1) / bs;
    if (static_cast<int64_t>(q.block_table.size()) < blocks) {
      return InvalidArgument("forward: sequence ", s, " needs ", blocks,
                             " blocks, its table has ", q.block_table.size());
    }
    for (int64_t b = 0; b < blocks; ++b) {
      if (q.block_table[b] < 0 || q.block_table[b] >= cache_->num_blocks()) {
        return InvalidArgument("forward: sequence ", s, " block id ", q.block_table[b],
                               " not in [0, ", cache_->num_blocks(), ")");
      }
    }
    int64_t override_end = 0;
    for (const EmbeddingRows& e : q.embedding_rows) {
      if (e.data == nullptr || e.rows <= 0 || e.first < override_end ||
          e.first + e.rows > t) {
        return InvalidArgument("forward: sequence ", s, " embedding rows [", e.first,
                               ", ", e.first + e.rows,
                               ") are empty, unordered, overlapping "
                               "or outside its ",
                               t, " new tokens");
      }
      override_end = e.first + e.rows;
    }
    if (q.kda_slot < 0 || q.kda_slot >= cache_->num_slots()) {
      return InvalidArgument("forward: sequence ", s, " KDA slot ", q.kda_slot,
                             " not in [0, ", cache_->num_slots(), ")");
    }
    if (!slots.insert(q.kda_slot).second) {
      return InvalidArgument("forward: KDA slot ", q.kda_slot,
                             " used twice in one batch");
    }
    int32_t prev = -1;
    for (int32_t i : q.logits_indices) {
      if (i <= prev || i >= t) {
        return InvalidArgument("forward: sequence ", s, " logits index ", i,
                               " (must ascend, < ", t, ")");
      }
      prev = i;
    }
  }
  return absl::OkStatus();
}

absl::Status ModelRunner::CopyDeviceLogits(std::vector<float>* logits) const {
  if (device_logits_ == nullptr) {
    return FailedPrecondition("the last forward left no logits in device memory");
  }
  const int64_t cells = device_logits_rows_ * w_->config.text.vocab_size;
  logits->resize(cells);
  return device_->CopyToHost(logits->data(), device_logits_, cells * sizeof(float));
}

absl::Status ModelRunner::FinishLogits(float* dev_logits, int64_t rows,
                                       std::vector<float>* logits,
                                       LogitsPlacement placement) {
  TANDEM_RETURN_IF_ERROR(backend_->Synchronize());  // a kernel's recorded error first
  if (placement == LogitsPlacement::kDevice) {
    logits->clear();
    device_logits_ = dev_logits;
    device_logits_rows_ = rows;
    return absl::OkStatus();
  }
  return device_->CopyToHost(logits->data(), dev_logits,
                             rows * w_->config.text.vocab_size * sizeof(float));
}

absl::Status ModelRunner::Forward(absl::Span<const SequenceInput> seqs,
                                  std::vector<float>* logits,
                                  LogitsPlacement placement) {
  absl::Status st = ForwardStep(seqs, logits, placement);
  if (comm_ != nullptr && comm_->abort_pending()) {
    // A collective failed and the communicator's abort waits for us: NCCL's
    // abort waits for every graph that captured its collectives, so they go
    // first (this rank's own graph would otherwise hang the abort for ever).
    ReleaseGraphs();
    comm_->AbortNow();
  }
  return st;
}

absl::Status ModelRunner::ForwardStep(absl::Span<const SequenceInput> seqs,
                                      std::vector<float>* logits,
                                      LogitsPlacement placement) {
  device_logits_ = nullptr;
  device_logits_rows_ = 0;
  // This step's graph plan (set_graph_plan), consumed whatever the step does.
  const std::optional<GraphPlan> plan = std::exchange(graph_plan_, std::nullopt);
  if (host_device_) placement = LogitsPlacement::kHost;
  TANDEM_RETURN_IF_ERROR(Validate(seqs));
  const int tp_size = comm_ != nullptr ? comm_->size() : 1;
  const int tp_rank = comm_ != nullptr ? comm_->rank() : 0;
  if (w_->shard.size != tp_size || w_->shard.rank != tp_rank ||
      cache_->tp_rank() != tp_rank) {
    return FailedPrecondition("forward: weights of TP shard {", w_->shard.rank, ", ",
                              w_->shard.size, "} and cache of rank ", cache_->tp_rank(),
                              " do not match communicator rank ", tp_rank, " of ",
                              tp_size);
  }
  if (tp() && !device_->host_addressable() && !comm_->takes_device_pointers()) {
    return FailedPrecondition("forward: tensor parallelism on ", device_->name(),
                              " needs a device communicator (NCCL), got a host one");
  }
  if (tp() && host_device_ && comm_->takes_device_pointers()) {
    return FailedPrecondition(
        "forward: a device communicator (NCCL) cannot join "
        "ranks on the host backend ",
        backend_->name());
  }
  if (w_->device != nullptr ? w_->device != device_ : !host_device_) {
    return FailedPrecondition(
        "forward: the weights are on ",
        w_->device != nullptr ? w_->device->name() : absl::string_view("host"),
        ", the backend runs on ", device_->name(), " (PlaceModelWeights)");
  }
  scratch_status_ = absl::OkStatus();
  const int64_t V = w_->config.text.vocab_size;

  int64_t n = 0;
  int64_t num_logits = 0;
  for (const SequenceInput& q : seqs) {
    n += q.tokens.size();
    num_logits += q.logits_indices.size();
  }
  if (placement == LogitsPlacement::kHost) {
    logits->assign(num_logits * V, 0.0f);
  } else {
    logits->clear();
  }
  if (n == 0) return absl::OkStatus();
  // A decode or verification step on a device runs the decode kernels (KDA
  // recurrent, MLA absorbed, the bucket's split-KV plan), graph or not.
  decode_kernels_ = !host_device_ && DecodeShaped(seqs);
  const bool overrides =
      std::any_of(seqs.begin(), seqs.end(),
                  [](const SequenceInput& q) { return !q.embedding_rows.empty(); });
  // Under TP the executor decides for every rank (set_graph_plan): NCCL needs
  // the same steps captured, and replayed, on all ranks.
  bool graph = plan.has_value() ? plan->use_graph : !overrides && GraphEligible(seqs);
  // On its own (no executor's plan) the runner sizes a capture's buffers here:
  // short of memory, this step (and the later ones) runs eagerly.
  if (graph && !plan.has_value() && PlanGraph(seqs).capture &&
      !PrepareGraph(seqs).ok()) {
    graph = false;
  }
  if (graph)
    return GraphStep(seqs, logits, placement, plan.has_value() && plan->capture);
  ++graph_stats_.eager_steps;

  row_start_.resize(seqs.size() + 1);
  n = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    row_start_[s] = n;
    n += seqs[s].tokens.size();
  }
  row_start_[seqs.size()] = n;
  ids_.resize(n);
  for (size_t s = 0; s < seqs.size(); ++s) {
    std::copy(seqs[s].tokens.begin(), seqs[s].tokens.end(),
              ids_.begin() + row_start_[s]);
  }
  TANDEM_ASSIGN_OR_RETURN(const float* const* bank_table, PrepareActivations(n));
  if (host_device_) {
    TANDEM_RETURN_IF_ERROR(Enqueue(seqs, bank_table, num_logits,
                                   num_logits == 0 ? nullptr : logits->data()));
    return backend_->Synchronize();
  }
  float* dev_logits = nullptr;
  if (num_logits > 0) {
    dev_logits = S(logits_, num_logits * V);
    TANDEM_RETURN_IF_ERROR(scratch_status_);
  }
  // Collectives in stream order with one bounded wait (NCCL; on the emulator the
  // host communicator's calls as host functions, which run at once there),
  // unless the host must act inside the step: hooks (a probe copies activations
  // back; the layer hook may wait for the device) and image rows (host copies
  // after the embedding's all-reduce).
  // Only steps of up to kStreamOrderedRows rows: the one wait's deadline (the
  // communicator timeout) then covers the whole step's device work, which a
  // long prefill chunk should not have to fit in; its collectives are waited
  // for one by one (each covering one layer's work), which it amortises.
  stream_collectives_ = tp() &&
                        (comm_->stream_ordered() || device_->host_addressable()) &&
                        !hook_ && !layer_done_ && !overrides && n <= kStreamOrderedRows;
  absl::Status st = Enqueue(seqs, bank_table, num_logits, dev_logits);
  stream_collectives_ = false;
  const absl::Status waited = WaitCollectives();
  TANDEM_RETURN_IF_ERROR(st);
  TANDEM_RETURN_IF_ERROR(waited);
  if (num_logits == 0) return backend_->Synchronize();
  return FinishLogits(dev_logits, num_logits, logits, placement);
}

absl::StatusOr<const float* const*> ModelRunner::PrepareActivations(int64_t n) {
  const int64_t H = w_->config.text.hidden_size;
  const int num_bufs = w_->config.NumResBlocks() + 1;
  if (static_cast<int>(res_.size()) < num_bufs) res_.resize(num_bufs);
  bank_host_.clear();
  for (auto& r : res_) bank_host_.push_back(S(r, n * H));
  S(h_, n * H);
  S(xn_, n * H);
  S(attn_out_, n * H);
  S(ffn_out_, n * H);
  TANDEM_RETURN_IF_ERROR(scratch_status_);
  // The residual bank is always a prefix of res_: one pointer table in device
  // memory serves every layer.
  return Upload(bank_host_, d_bank_);
}

absl::Status ModelRunner::Enqueue(absl::Span<const SequenceInput> seqs,
                                  const float* const* bank_table, int64_t num_logits,
                                  float* logits_out) {
  const model::TextConfig& t = w_->config.text;
  const int64_t H = t.hidden_size;
  const float eps = static_cast<float>(t.rms_norm_eps);
  kernels::Backend& be = *backend_;
  const int64_t n = row_start_.back();
  float* h = h_.data();
  float* xn = xn_.data();
  float* attn_out = attn_out_.data();
  float* ffn_out = ffn_out_.data();

  // An eager step's MLA index arrays, before the first collective (no host copy
  // after one: a pageable upload may wait for the stream).
  if (fixed_ == nullptr) TANDEM_RETURN_IF_ERROR(PlanStep(seqs));
  TANDEM_RETURN_IF_ERROR(Embed(n, res_[0].data()));
  // Image rows replace their placeholders' embeddings (layer 0's initial P).
  for (size_t s = 0; s < seqs.size(); ++s) {
    for (const EmbeddingRows& e : seqs[s].embedding_rows) {
      TANDEM_RETURN_IF_ERROR(
          device_->CopyToDevice(res_[0].data() + (row_start_[s] + e.first) * H, e.data,
                                static_cast<size_t>(e.rows * H) * sizeof(float)));
    }
  }
  Probe(-1, "embed", res_[0].data(), n, H);

  std::vector<const float*> bank;  // host view: its size and entries
  int cur = 0;                     // index of the running P in res_
  bool p_valid = true;             // false right after a block boundary (P = none)
  for (const LayerWeights& lw : w_->layers) {
    const int l = lw.spec.index;
    // Attention-residual mix for the attention input.
    const float* hin = res_[cur].data();
    if (!bank.empty()) {
      TANDEM_RETURN_IF_ERROR(be.AttnResMix(bank_table, bank.size(), res_[cur].data(),
                                           lw.attn_res_proj.data(),
                                           lw.attn_res_norm.data(), eps, n, H, h));
      hin = h;
    }
    Probe(l, "attn_in", hin, n, H);
    if (lw.spec.starts_res_block) {
      bank.push_back(res_[cur].data());
      cur = static_cast<int>(bank.size());
      p_valid = false;
    }
    TANDEM_RETURN_IF_ERROR(be.RmsNorm(hin, H, lw.input_norm.data(), xn, H, n, H, eps));
    if (lw.spec.attention == model::AttentionKind::kKda) {
      TANDEM_RETURN_IF_ERROR(KdaLayer(lw, seqs, xn, attn_out));
    } else {
      TANDEM_RETURN_IF_ERROR(MlaLayer(lw, seqs, xn, attn_out));
    }
    Probe(l, "attn_out", attn_out, n, H);
    if (layer_done_) layer_done_(l);
    float* p = res_[cur].data();
    if (!p_valid) {
      TANDEM_RETURN_IF_ERROR(device_->CopyOnDevice(p, attn_out, n * H * sizeof(float)));
      p_valid = true;
    } else {
      TANDEM_RETURN_IF_ERROR(be.AddInPlace(p, attn_out, n * H));
    }
    TANDEM_RETURN_IF_ERROR(be.AttnResMix(bank_table, bank.size(), p,
                                         lw.mlp_res_proj.data(), lw.mlp_res_norm.data(),
                                         eps, n, H, h));
    Probe(l, "mlp_in", h, n, H);
    TANDEM_RETURN_IF_ERROR(
        be.RmsNorm(h, H, lw.post_attention_norm.data(), xn, H, n, H, eps));
    TANDEM_RETURN_IF_ERROR(Ffn(lw, xn, ffn_out));
    Probe(l, "mlp_out", ffn_out, n, H);
    TANDEM_RETURN_IF_ERROR(be.AddInPlace(p, ffn_out, n * H));
    Probe(l, "residual", p, n, H);
  }

  // Output mix over all rows (cheap), then norm + lm_head on the requested rows.
  TANDEM_RETURN_IF_ERROR(be.AttnResMix(bank_table, bank.size(), res_[cur].data(),
                                       w_->output_res_proj.data(),
                                       w_->output_res_norm.data(), eps, n, H, h));
  if (num_logits == 0) return absl::OkStatus();
  float* rows = S(out_rows_, num_logits * H);
  TANDEM_RETURN_IF_ERROR(scratch_status_);
  if (fixed_ != nullptr) {
    // A graph step: every row wants its logits (GraphEligible), in row order.
    TANDEM_RETURN_IF_ERROR(
        be.RmsNorm(h, H, w_->final_norm.data(), rows, H, num_logits, H, eps));
  } else {
    // The rows that want logits, gathered in one batch of copies (a mixed
    // step's decode rows number up to the batch).
    logit_rows_.clear();
    for (size_t s = 0; s < seqs.size(); ++s) {
      for (int32_t i : seqs[s].logits_indices) {
        const int64_t r = static_cast<int64_t>(logit_rows_.size());
        logit_rows_.push_back({rows + r * H, h + (row_start_[s] + i) * H,
                               static_cast<size_t>(H) * sizeof(float)});
      }
    }
    TANDEM_RETURN_IF_ERROR(
        device_->CopyBatchAsync(kernels::CopyKind::kDeviceToDevice, logit_rows_));
    TANDEM_RETURN_IF_ERROR(
        be.RmsNorm(rows, H, w_->final_norm.data(), rows, H, num_logits, H, eps));
  }
  Probe(-1, "final", rows, num_logits, H);
  return LmHead(rows, num_logits, logits_out);
}

// ---- CUDA graphs ------------------------------------------------------------------

std::vector<int64_t> GraphBuckets(int64_t max_batch) {
  // Powers of two to 64, then steps of 64: a decode step reads every weight once
  // whatever its batch, so a padded row costs only its activations (attention
  // and KDA skip padding sequences), while the count of graphs stays small
  // (11 up to 256 sequences: capture time and graph memory).
  std::vector<int64_t> out;
  for (int64_t b = 1; b < max_batch; b = b < 64 ? 2 * b : b + 64) out.push_back(b);
  if (max_batch >= 1) out.push_back(max_batch);
  return out;
}

int64_t GraphBucket(int64_t batch, int64_t max_batch) {
  if (batch < 1 || batch > max_batch) return 0;
  int64_t b = 1;
  while (b < batch) b = b < 64 ? 2 * b : b + 64;
  return std::min(b, max_batch);
}

int64_t ModelRunner::MaxGraphBatch() const {
  return options_.max_graph_batch > 0 ? options_.max_graph_batch : cache_->num_slots();
}

// Table strides come in powers of two (capped at the cache's block count), so a
// bucket needs a new graph only when its longest sequence doubles.
int64_t ModelRunner::StrideClass(int64_t blocks) const {
  int64_t c = 1;
  while (c < blocks) c *= 2;
  return std::max(std::min(c, cache_->num_blocks()), blocks);
}

bool ModelRunner::GraphEligible(absl::Span<const SequenceInput> seqs) const {
  if (options_.enforce_eager || !graph_stats_.disabled.empty()) return false;
  if (host_device_ || !device_->supports_graphs() || hook_ || layer_done_) {
    return false;
  }
  if (options_.mla_mode == MlaMode::kExpanded) return false;
  if (GraphBucket(static_cast<int64_t>(seqs.size()), MaxGraphBatch()) == 0)
    return false;
  return DecodeShaped(seqs);
}

bool DecodeShaped(absl::Span<const SequenceInput> seqs) {
  if (seqs.empty()) return false;
  const size_t w = seqs[0].tokens.size();
  if (w < 1 || w > static_cast<size_t>(kMaxGraphWidth)) return false;
  for (const SequenceInput& q : seqs) {
    if (q.tokens.size() != w || q.logits_indices.size() != w) return false;
    for (size_t j = 0; j < w; ++j) {
      if (q.logits_indices[j] != static_cast<int32_t>(j)) return false;
    }
  }
  return true;
}

void ModelRunner::UpdateGraphStats() {
  graph_stats_.live_graphs = 0;
  graph_stats_.graph_nodes = 0;
  graph_stats_.input_bytes = 0;
  for (const auto& [key, g] : graphs_) {
    graph_stats_.input_bytes += static_cast<int64_t>(g->inputs.bytes());
    if (g->graph == nullptr) continue;
    ++graph_stats_.live_graphs;
    graph_stats_.graph_nodes += g->graph->num_nodes();
  }
}

absl::StatusOr<ModelRunner::DecodeGraph*> ModelRunner::GraphFor(int64_t B, int64_t w,
                                                                int64_t stride) {
  std::unique_ptr<DecodeGraph>& slot = graphs_[{B, w, stride}];
  if (slot == nullptr) {
    auto g = std::make_unique<DecodeGraph>();
    g->bucket = B;
    g->width = w;
    g->stride = stride;
    const int64_t words = 2 * B * w + 3 * B + 1 + B * stride;
    absl::StatusOr<kernels::DeviceBuffer> inputs =
        kernels::DeviceBuffer::Allocate(device_, words * 4);
    if (!inputs.ok()) {
      graphs_.erase({B, w, stride});
      return inputs.status();
    }
    g->inputs = std::move(inputs).value();
    int32_t* p = g->inputs.as<int32_t>();
    g->ids = p;
    g->cache_slots = p + B * w;
    g->kda_slots = p + 2 * B * w;
    g->seq_lens = g->kda_slots + B;
    g->query_start = g->seq_lens + B;
    g->tables = g->query_start + B + 1;
    slot = std::move(g);
    UpdateGraphStats();
  }
  return slot.get();
}

int32_t* ModelRunner::PaddingInputs(const DecodeGraph& g, std::vector<int32_t>* out) {
  const int64_t B = g.bucket, w = g.width;
  out->assign(2 * B * w + 3 * B + 1 + B * g.stride, 0);
  int32_t* h = out->data();
  std::fill(h + B * w, h + 2 * B * w + B, -1);  // cache slots, KDA slots
  int32_t* qs = h + 2 * B * w + 2 * B;
  for (int64_t i = 0; i <= B; ++i) qs[i] = static_cast<int32_t>(i * w);
  return h;
}

absl::Status ModelRunner::SizeForGraphs(int64_t w, int64_t stride) {
  const int64_t B = MaxGraphBatch();
  TANDEM_ASSIGN_OR_RETURN(DecodeGraph * g, GraphFor(B, w, stride));
  std::vector<int32_t> host;
  PaddingInputs(*g, &host);
  TANDEM_RETURN_IF_ERROR(device_->CopyToDevice(g->inputs.data(), host.data(),
                                               host.size() * sizeof(int32_t)));
  row_start_.resize(B + 1);
  for (int64_t i = 0; i <= B; ++i) row_start_[i] = i * w;
  const std::vector<SequenceInput> none(B);
  TANDEM_ASSIGN_OR_RETURN(const float* const* bank_table, PrepareActivations(B * w));
  float* dev_logits = S(logits_, B * w * w_->config.text.vocab_size);
  TANDEM_RETURN_IF_ERROR(scratch_status_);
  fixed_ = g;
  sizing_only_ = true;  // buffers only: the outputs are discarded
  absl::Status st = Enqueue(none, bank_table, B * w, dev_logits);
  sizing_only_ = false;
  fixed_ = nullptr;
  return st;
}

absl::Status ModelRunner::PrepareGraph(absl::Span<const SequenceInput> seqs) {
  if (!graph_stats_.disabled.empty()) {
    return FailedPrecondition("CUDA graphs are off: ", graph_stats_.disabled);
  }
  const auto [B, w, stride] = GraphKey(seqs);
  absl::Status st = GraphFor(B, w, stride).status();
  if (st.ok() && (sized_generation_ != Generation() || sized_width_ < w)) {
    // Buffers sized for the largest bucket first, so that capturing a larger
    // bucket later does not move the buffers of the graphs already captured.
    const int64_t width = std::max(w, sized_width_);
    st = SizeForGraphs(width, stride);
    if (st.ok()) {
      sized_generation_ = Generation();
      sized_width_ = width;
    }
  }
  if (st.ok()) return st;
  // Eager steps from now on, on buffers of their own size: what the largest
  // bucket grew is released (a scratch growth that failed freed its buffer).
  ReleaseScratch();
  ReleaseGraphs();
  scratch_status_ = absl::OkStatus();
  graph_stats_.disabled = absl::StrCat("the buffers of bucket ", MaxGraphBatch(),
                                       " (width ", w, ") did not fit: ", st.message());
  TLOG(WARNING,
       "CUDA graphs off: the largest bucket's buffers did not fit; decode steps run "
       "eagerly")
      .Kv("bucket", MaxGraphBatch())
      .Kv("width", w)
      .Kv("error", st);
  return st;
}

void ModelRunner::ReleaseScratch() {
  for (auto& r : res_) r.Release();
  for (DeviceScratch<float>* b :
       {&h_,      &xn_,       &attn_out_, &ffn_out_, &t0_,           &t1_,      &t2_,
        &t3_,     &t4_,       &t5_,       &t6_,      &t7_,           &gates_,   &betas_,
        &topk_w_, &out_rows_, &logits_,   &moe_red_, &local_logits_, &gathered_}) {
    b->Release();
  }
  d_ids_.Release();
  d_step_index_.Release();
  d_expert_ids_.Release();
  d_bank_.Release();
  ++scratch_moves_;
  device_logits_ = nullptr;
  device_logits_rows_ = 0;
  sized_width_ = 0;
  sized_generation_ = -1;
}

absl::StatusOr<float*> ModelRunner::EagerFixedStep(
    DecodeGraph& g, absl::Span<const SequenceInput> padded,
    const float* const** bank_table) {
  const int64_t B = g.bucket, w = g.width;
  TANDEM_ASSIGN_OR_RETURN(*bank_table, PrepareActivations(B * w));
  float* dev_logits = S(logits_, B * w * w_->config.text.vocab_size);
  TANDEM_RETURN_IF_ERROR(scratch_status_);
  fixed_ = &g;
  absl::Status st = Enqueue(padded, *bank_table, B * w, dev_logits);
  fixed_ = nullptr;
  if (!st.ok()) {
    (void)WaitCollectives();  // what was enqueued of it, bounded
    return st;
  }
  return dev_logits;
}

std::tuple<int64_t, int64_t, int64_t> ModelRunner::GraphKey(
    absl::Span<const SequenceInput> seqs) const {
  const int64_t bs = cache_->block_size();
  const int64_t w = static_cast<int64_t>(seqs[0].tokens.size());  // GraphEligible
  int64_t longest = 1;
  for (const SequenceInput& q : seqs) {
    longest = std::max<int64_t>(longest, (q.start_pos + w + bs - 1) / bs);
  }
  return {GraphBucket(static_cast<int64_t>(seqs.size()), MaxGraphBatch()), w,
          StrideClass(longest)};
}

GraphPlan ModelRunner::PlanGraph(absl::Span<const SequenceInput> seqs) const {
  GraphPlan plan;
  const bool overrides =
      std::any_of(seqs.begin(), seqs.end(),
                  [](const SequenceInput& q) { return !q.embedding_rows.empty(); });
  plan.use_graph = !seqs.empty() && !overrides && GraphEligible(seqs);
  if (!plan.use_graph) return plan;
  auto it = graphs_.find(GraphKey(seqs));
  plan.capture = it == graphs_.end() || it->second->graph == nullptr ||
                 it->second->generation != Generation();
  return plan;
}

void ModelRunner::ReleaseGraphs() {
  graphs_.clear();
  UpdateGraphStats();
}

absl::Status ModelRunner::GraphStep(absl::Span<const SequenceInput> seqs,
                                    std::vector<float>* logits,
                                    LogitsPlacement placement, bool force_capture) {
  const int64_t bs = cache_->block_size();
  const int64_t b = static_cast<int64_t>(seqs.size());
  const auto [B, w, stride] = GraphKey(seqs);
  // A capture's buffers (done already where the executor prepared every rank).
  {
    auto it = graphs_.find({B, w, stride});
    if (force_capture || it == graphs_.end() || it->second->graph == nullptr ||
        it->second->generation != Generation()) {
      TANDEM_RETURN_IF_ERROR(PrepareGraph(seqs));
    }
  }
  TANDEM_ASSIGN_OR_RETURN(DecodeGraph * gp, GraphFor(B, w, stride));
  DecodeGraph& g = *gp;

  // The step's inputs, padded to the bucket (padding: token 0, no cache slot, no
  // KDA slot, context 0, a zero table row), in one upload.
  int32_t* h = PaddingInputs(g, &graph_host_);
  int32_t* kda = h + 2 * B * w;
  for (int64_t i = 0; i < b; ++i) {
    const SequenceInput& q = seqs[i];
    for (int64_t j = 0; j < w; ++j) {
      const int64_t pos = q.start_pos + j;
      h[i * w + j] = q.tokens[j];
      h[B * w + i * w + j] =
          static_cast<int32_t>(q.block_table[pos / bs] * bs + pos % bs);
    }
    kda[i] = static_cast<int32_t>(q.kda_slot);
    kda[B + i] = static_cast<int32_t>(q.start_pos + w);
    const int64_t used = (q.start_pos + w + bs - 1) / bs;
    std::copy(q.block_table.begin(), q.block_table.begin() + used,
              kda + 3 * B + 1 + i * stride);
  }
  TANDEM_RETURN_IF_ERROR(
      device_->CopyToDevice(g.inputs.data(), h, graph_host_.size() * sizeof(int32_t)));
  graph_stats_.padded_rows += (B - b) * w;

  row_start_.resize(B + 1);
  for (int64_t i = 0; i <= B; ++i) row_start_[i] = i * w;
  // The padded batch's sequence list: real sequences, then copies of the first
  // (only their count and q_len are read on the fixed path).
  std::vector<SequenceInput> padded(seqs.begin(), seqs.end());
  padded.resize(B, seqs[0]);

  kernels::Stream& stream = device_->compute_stream();
  float* dev_logits = nullptr;
  if (!force_capture && g.graph != nullptr && g.generation == Generation()) {
    dev_logits = logits_.data();
    absl::Status launched = g.graph->Launch(stream);
    // Its collectives, as captured (they ran now, in the graph).
    comm_stats_.calls += g.collectives;
    comm_stats_.enqueued += g.collectives;
    comm_stats_.bytes += g.collective_bytes;
    if (!launched.ok()) {
      (void)WaitCollectives();  // what did run of it, bounded
      return launched;
    }
    ++graph_stats_.replays;
  } else {
    // First use (or stale): the padded step eagerly (it sizes every buffer and is
    // this step's result), then the same forward captured.
    const auto t0 = std::chrono::steady_clock::now();
    const bool recapture = g.graph != nullptr;
    g.graph.reset();
    const float* const* bank_table = nullptr;
    TANDEM_ASSIGN_OR_RETURN(dev_logits, EagerFixedStep(g, padded, &bank_table));
    const int64_t free_before = device_->MemoryInfo().free_bytes;
    const int64_t generation = Generation();
    absl::StatusOr<std::unique_ptr<kernels::Graph>> graph;
    absl::Status st = stream.BeginCapture();
    if (st.ok()) {
      captured_collectives_ = captured_bytes_ = 0;
      fixed_ = &g;
      st = Enqueue(padded, bank_table, B * w, dev_logits);
      fixed_ = nullptr;
      graph = stream.EndCapture();
      if (st.ok()) st = graph.status();
      g.collectives = captured_collectives_;
      g.collective_bytes = captured_bytes_;
    }
    if (st.ok() && Generation() != generation) {
      st = absl::InternalError("a buffer moved during the capture");
    }
    if (!st.ok()) {
      // The eager result stands; later steps run eagerly.
      graph_stats_.disabled =
          absl::StrCat("capture of bucket ", B, " failed: ", st.message());
      TLOG(WARNING, "CUDA graphs off: a capture failed; decode steps run eagerly")
          .Kv("bucket", B)
          .Kv("error", st);
    } else {
      g.graph = std::move(graph).value();
      g.generation = generation;
      ++graph_stats_.captures;
      if (recapture) ++graph_stats_.recaptures;
      graph_stats_.capture_device_bytes +=
          std::max<int64_t>(0, free_before - device_->MemoryInfo().free_bytes);
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    graph_stats_.capture_seconds += seconds;
    UpdateGraphStats();
    if (g.graph != nullptr) {
      TLOG(INFO, recapture ? "CUDA graph recaptured (its buffers had moved)"
                           : "CUDA graph captured")
          .Kv("bucket", B)
          .Kv("width", w)
          .Kv("table_stride", stride)
          .Kv("nodes", g.graph->num_nodes())
          .Kv("seconds", seconds)
          .Kv("graphs", graph_stats_.live_graphs)
          .Kv("input_bytes", graph_stats_.input_bytes)
          .Kv("capture_device_bytes", graph_stats_.capture_device_bytes);
    }
  }
  // One bounded wait for the step's collectives, before any unbounded one.
  TANDEM_RETURN_IF_ERROR(WaitCollectives());
  return FinishLogits(dev_logits, b * w, logits, placement);
}

absl::Status ModelRunner::KdaLayer(const LayerWeights& lw,
                                   absl::Span<const SequenceInput> seqs,
                                   const float* xn, float* out) {
  const model::ModelConfig& c = w_->config;
  const auto& la = c.text.linear_attn_config;
  const KdaWeights& kw = lw.kda;
  // This rank's heads (all of them at TP 1) and their channels.
  const int64_t nh = kw.heads, d = la.head_dim, K = la.short_conv_kernel_size;
  const int64_t H = c.text.hidden_size, P = nh * d;
  const int64_t n = row_start_[seqs.size()];
  kernels::Backend& be = *backend_;

  float* q_raw = S(t0_, n * P);
  float* k_raw = S(t1_, n * P);
  float* v_raw = S(t2_, n * P);
  float* q_c = S(t3_, n * P);
  float* k_c = S(t4_, n * P);
  float* v_c = S(t5_, n * P);
  float* fa = S(t6_, n * d);
  float* braw = S(t7_, n * nh);
  float* g = S(gates_, n * P);
  float* beta = S(betas_, n * nh);
  TANDEM_RETURN_IF_ERROR(scratch_status_);
  TANDEM_RETURN_IF_ERROR(be.GemmBf16(xn, H, kw.q_proj, H, q_raw, P, n, P, H, false));
  TANDEM_RETURN_IF_ERROR(be.GemmBf16(xn, H, kw.k_proj, H, k_raw, P, n, P, H, false));
  TANDEM_RETURN_IF_ERROR(be.GemmBf16(xn, H, kw.v_proj, H, v_raw, P, n, P, H, false));
  // A graph step: one launch per conv over the bucket, the slots on the device
  // (the pool's slots are slot_stride floats apart).
  const int64_t slot_stride =
      cache_->kda_recurrent(1, lw.kda_index) - cache_->kda_recurrent(0, lw.kda_index);
  if (fixed_ != nullptr) {
    const int64_t B = fixed_->bucket, T = n / B;
    for (int which = 0; which < 3; ++which) {
      const float* raw = which == 0 ? q_raw : which == 1 ? k_raw : v_raw;
      const float* wconv = which == 0 ? kw.q_conv : which == 1 ? kw.k_conv : kw.v_conv;
      float* conv = which == 0 ? q_c : which == 1 ? k_c : v_c;
      TANDEM_RETURN_IF_ERROR(be.CausalConv1dSiluSlots(
          raw, P, wconv, K, cache_->kda_conv(0, lw.kda_index, which), slot_stride,
          fixed_->kda_slots, B, conv, P, T, P));
    }
  }
  for (size_t r = 0; fixed_ == nullptr && r < kda_runs_.size(); ++r) {
    const KdaRun& run = kda_runs_[r];
    const int64_t r0 = run.first_row, T = run.tokens;
    for (int which = 0; which < 3; ++which) {
      const float* raw = (which == 0 ? q_raw : which == 1 ? k_raw : v_raw) + r0 * P;
      const float* wconv = which == 0 ? kw.q_conv : which == 1 ? kw.k_conv : kw.v_conv;
      float* conv = (which == 0 ? q_c : which == 1 ? k_c : v_c) + r0 * P;
      if (run.num_seqs == 1) {
        const int64_t slot = seqs[run.first_seq].kda_slot;
        TANDEM_RETURN_IF_ERROR(be.CausalConv1dSilu(
            raw, P, wconv, K, cache_->kda_conv(slot, lw.kda_index, which), conv, P, T,
            P));
      } else {
        TANDEM_RETURN_IF_ERROR(be.CausalConv1dSiluSlots(
            raw, P, wconv, K, cache_->kda_conv(0, lw.kda_index, which), slot_stride,
            run.slots, run.num_seqs, conv, P, T, P));
      }
    }
  }
  // Normalised q (scaled) and k go back into the raw buffers.
  TANDEM_RETURN_IF_ERROR(be.L2NormHeads(q_c, P, q_raw, P, n, nh, d, kL2NormEps,
                                        1.0f / std::sqrt(static_cast<float>(d))));
  TANDEM_RETURN_IF_ERROR(be.L2NormHeads(k_c, P, k_raw, P, n, nh, d, kL2NormEps, 1.0f));
  // Gates.
  float* graw = q_c;  // q_c is free now
  TANDEM_RETURN_IF_ERROR(be.GemmBf16(xn, H, kw.f_a_proj, H, fa, d, n, d, H, false));
  TANDEM_RETURN_IF_ERROR(be.GemmBf16(fa, d, kw.f_b_proj, d, graw, P, n, P, d, false));
  TANDEM_RETURN_IF_ERROR(be.GemmBf16(xn, H, kw.b_proj, H, braw, nh, n, nh, H, false));
  TANDEM_RETURN_IF_ERROR(be.KdaGates(graw, P, kw.a_log, kw.dt_bias, braw, nh,
                                     static_cast<float>(la.gate_lower_bound), n, nh, d,
                                     g, beta));
  // Recurrence per sequence (a graph step: one launch, slots on the device).
  float* o = k_c;  // k_c is free now
  if (fixed_ != nullptr) {
    kernels::KdaArgs a;
    a.tokens = n / fixed_->bucket;
    a.heads = nh;
    a.head_dim_k = d;
    a.head_dim_v = d;
    a.q = q_raw;
    a.k = k_raw;
    a.ld_qk = P;
    a.v = v_c;
    a.ld_v = P;
    a.g = g;
    a.beta = beta;
    a.state = cache_->kda_recurrent(0, lw.kda_index);
    a.out = o;
    a.ld_out = P;
    TANDEM_RETURN_IF_ERROR(
        be.KdaRecurrentSlots(a, fixed_->bucket, fixed_->kda_slots, slot_stride));
  }
  for (size_t r = 0; fixed_ == nullptr && r < kda_runs_.size(); ++r) {
    const KdaRun& run = kda_runs_[r];
    const bool chunked =
        run.tokens > 1 && !options_.kda_recurrent_only && !decode_kernels_;
    if (run.num_seqs > 1 && !chunked) {  // one launch for the run
      kernels::KdaArgs a;
      a.tokens = run.tokens;
      a.heads = nh;
      a.head_dim_k = d;
      a.head_dim_v = d;
      a.q = q_raw + run.first_row * P;
      a.k = k_raw + run.first_row * P;
      a.ld_qk = P;
      a.v = v_c + run.first_row * P;
      a.ld_v = P;
      a.g = g + run.first_row * P;
      a.beta = beta + run.first_row * nh;
      a.state = cache_->kda_recurrent(0, lw.kda_index);
      a.out = o + run.first_row * P;
      a.ld_out = P;
      TANDEM_RETURN_IF_ERROR(
          be.KdaRecurrentSlots(a, run.num_seqs, run.slots, slot_stride));
      continue;
    }
    for (int64_t s = run.first_seq; s < run.first_seq + run.num_seqs; ++s) {
      const int64_t r0 = row_start_[s], T = seqs[s].tokens.size();
      kernels::KdaArgs a;
      a.tokens = T;
      a.heads = nh;
      a.head_dim_k = d;
      a.head_dim_v = d;
      a.q = q_raw + r0 * P;
      a.k = k_raw + r0 * P;
      a.ld_qk = P;
      a.v = v_c + r0 * P;
      a.ld_v = P;
      a.g = g + r0 * P;
      a.beta = beta + r0 * nh;
      a.state = cache_->kda_recurrent(seqs[s].kda_slot, lw.kda_index);
      a.out = o + r0 * P;
      a.ld_out = P;
      if (chunked) {
        TANDEM_RETURN_IF_ERROR(be.KdaChunked(a));
      } else {
        TANDEM_RETURN_IF_ERROR(be.KdaRecurrent(a));
      }
    }
  }
  // Output gate and projection.
  float* gate = v_raw;  // free now
  TANDEM_RETURN_IF_ERROR(be.GemmBf16(xn, H, kw.g_proj, H, gate, P, n, P, H, false));
  TANDEM_RETURN_IF_ERROR(be.KdaOutputGate(o, P, kw.o_norm, gate, P, o, P, n, nh, d,
                                          static_cast<float>(c.text.rms_norm_eps)));
  TANDEM_RETURN_IF_ERROR(
      be.GemmBf16(o, P, kw.o_proj, kw.o_proj_ld, out, H, n, H, P, false));
  return tp() ? AllReduce(out, n * H) : absl::OkStatus();
}

// An eager step's index arrays depend only on the batch: built and uploaded
// (one copy) before its first layer, read by every layer.
absl::Status ModelRunner::PlanStep(absl::Span<const SequenceInput> seqs) {
  const int64_t bs = cache_->block_size();
  const int64_t n = row_start_[seqs.size()];
  auto absorbed_for = [&](const SequenceInput& sq) {
    switch (options_.mla_mode) {
      case MlaMode::kExpanded:
        return false;
      case MlaMode::kAbsorbed:
        return true;
      case MlaMode::kAuto:
        break;
    }
    return sq.tokens.size() == 1 || decode_kernels_;
  };
  // [cache slots of the n rows | per run: seq_lens | query_start | tables]
  step_index_.assign(n, 0);
  for (size_t s = 0; s < seqs.size(); ++s) {
    const SequenceInput& sq = seqs[s];
    for (size_t i = 0; i < sq.tokens.size(); ++i) {
      const int64_t pos = sq.start_pos + i;
      step_index_[row_start_[s] + i] =
          static_cast<int32_t>(sq.block_table[pos / bs] * bs + pos % bs);
    }
  }
  // Runs of consecutive sequences sharing the attention form, one call each.
  mla_runs_.clear();
  std::vector<size_t> offsets;  // of each run's arrays in step_index_
  size_t s0 = 0;
  while (s0 < seqs.size()) {
    MlaRun run;
    run.absorbed = absorbed_for(seqs[s0]);
    size_t s1 = s0 + 1;
    while (s1 < seqs.size() && absorbed_for(seqs[s1]) == run.absorbed) ++s1;
    const int64_t num = s1 - s0;
    int64_t stride = 1;
    for (size_t s = s0; s < s1; ++s) {
      stride = std::max<int64_t>(stride, seqs[s].block_table.size());
    }
    run.num_seqs = num;
    run.stride = stride;
    run.first_row = row_start_[s0];
    run.num_tokens = row_start_[s1] - row_start_[s0];
    const size_t at = step_index_.size();
    offsets.push_back(at);
    step_index_.resize(at + num + (num + 1) + num * stride, 0);
    int32_t* seq_lens = step_index_.data() + at;
    int32_t* query_start = seq_lens + num;
    int32_t* tables = query_start + num + 1;
    int64_t longest = 1;
    for (size_t s = s0; s < s1; ++s) {
      const int64_t j = s - s0;
      seq_lens[j] = static_cast<int32_t>(seqs[s].start_pos + seqs[s].tokens.size());
      query_start[j + 1] = static_cast<int32_t>(row_start_[s + 1] - row_start_[s0]);
      std::copy(seqs[s].block_table.begin(), seqs[s].block_table.end(),
                tables + j * stride);
      longest = std::max<int64_t>(longest, (seq_lens[j] + bs - 1) / bs);
      run.max_context = std::max<int64_t>(run.max_context, seq_lens[j]);
    }
    // A decode run plans its split-KV decomposition as the graph of its bucket
    // would (same arithmetic with graphs on and off).
    const int64_t bucket = GraphBucket(num, MaxGraphBatch());
    if (decode_kernels_ && run.absorbed && bucket > 0) {
      run.split_seqs = bucket;
      run.split_context = StrideClass(longest) * bs;
    }
    mla_runs_.push_back(run);
    s0 = s1;
  }
  // KDA: runs of consecutive sequences with the same number of new tokens (a
  // decode step's, a mixed step's decode rows) go through the batched ops, the
  // slots on the device; a sequence on its own keeps the single-sequence ops.
  kda_runs_.clear();
  const size_t kda_at = step_index_.size();
  for (const SequenceInput& q : seqs) {
    step_index_.push_back(static_cast<int32_t>(q.kda_slot));
  }
  for (size_t k0 = 0; k0 < seqs.size();) {
    size_t k1 = k0 + 1;
    while (k1 < seqs.size() && seqs[k1].tokens.size() == seqs[k0].tokens.size()) ++k1;
    KdaRun run;
    run.first_seq = static_cast<int64_t>(k0);
    run.num_seqs = static_cast<int64_t>(k1 - k0);
    run.tokens = static_cast<int64_t>(seqs[k0].tokens.size());
    run.first_row = row_start_[k0];
    kda_runs_.push_back(run);
    k0 = k1;
  }
  TANDEM_ASSIGN_OR_RETURN(const int32_t* d, Upload(step_index_, d_step_index_));
  for (KdaRun& run : kda_runs_) run.slots = d + kda_at + run.first_seq;
  mla_slots_ = d;
  for (size_t r = 0; r < mla_runs_.size(); ++r) {
    MlaRun& run = mla_runs_[r];
    run.seq_lens = d + offsets[r];
    run.query_start = run.seq_lens + run.num_seqs;
    run.tables = run.query_start + run.num_seqs + 1;
  }
  return absl::OkStatus();
}

absl::Status ModelRunner::MlaLayer(const LayerWeights& lw,
                                   absl::Span<const SequenceInput> seqs,
                                   const float* xn, float* out) {
  const model::ModelConfig& c = w_->config;
  const model::TextConfig& t = c.text;
  const int64_t H = t.hidden_size, nh = lw.mla.heads;  // this rank's heads
  const int64_t ql = t.q_lora_rank, lora = t.kv_lora_rank, rope = t.qk_rope_head_dim;
  const int64_t qd = c.QHeadDim(), W = lora + rope, vd = t.v_head_dim;
  const int64_t n = row_start_[seqs.size()];
  const int64_t bs = cache_->block_size();
  const MlaWeights& mw = lw.mla;
  kernels::Backend& be = *backend_;

  float* qa = S(t0_, n * ql);
  float* q = S(t1_, n * nh * qd);
  float* kv = S(t2_, n * W);
  float* att = S(t3_, n * nh * vd);
  float* gate = S(t4_, n * nh * vd);
  TANDEM_RETURN_IF_ERROR(scratch_status_);
  TANDEM_RETURN_IF_ERROR(be.GemmBf16(xn, H, mw.q_a_proj, H, qa, ql, n, ql, H, false));
  TANDEM_RETURN_IF_ERROR(
      be.RmsNorm(qa, ql, mw.q_a_norm.data(), qa, ql, n, ql, kLoraNormEps));
  TANDEM_RETURN_IF_ERROR(
      be.GemmBf16(qa, ql, mw.q_b_proj, ql, q, nh * qd, n, nh * qd, ql, false));
  TANDEM_RETURN_IF_ERROR(be.GemmBf16(xn, H, mw.kv_a_proj, H, kv, W, n, W, H, false));
  TANDEM_RETURN_IF_ERROR(
      be.RmsNorm(kv, W, mw.kv_a_norm.data(), kv, W, n, lora, kLoraNormEps));

  // Cache write.
  uint16_t* cache = cache_->mla_layer(lw.mla_index);
  const int32_t* slots = fixed_ != nullptr ? fixed_->cache_slots : mla_slots_;
  TANDEM_RETURN_IF_ERROR(
      be.PagedCacheWrite(kv, W, slots, n, W, cache, cache_->num_blocks() * bs));

  // Attention: one call per run of sequences sharing the form (PlanStep), or one
  // absorbed call over a graph step's bucket.
  kernels::MlaArgs base;
  base.heads = nh;
  base.nope_dim = t.qk_nope_head_dim;
  base.rope_dim = rope;
  base.v_dim = vd;
  base.kv_lora_rank = lora;
  base.scale = 1.0f / std::sqrt(static_cast<float>(qd));
  base.kv_cache = cache;
  base.num_blocks = cache_->num_blocks();
  base.block_size = bs;
  base.kv_b_proj = mw.kv_b_proj;
  base.ld_q = nh * qd;
  base.ld_out = nh * vd;
  if (fixed_ != nullptr) {  // a graph step: one absorbed call over the bucket
    kernels::MlaArgs a = base;
    a.num_seqs = fixed_->bucket;
    a.num_tokens = n;
    a.seq_lens = fixed_->seq_lens;
    a.query_start = fixed_->query_start;
    a.block_tables = fixed_->tables;
    a.block_table_stride = fixed_->stride;
    a.q = q;
    a.out = att;
    a.split_seqs = fixed_->bucket;
    a.split_context = fixed_->stride * bs;
    TANDEM_RETURN_IF_ERROR(be.MlaAttentionAbsorbed(a));
  }
  for (size_t r = 0; fixed_ == nullptr && r < mla_runs_.size(); ++r) {
    const MlaRun& run = mla_runs_[r];
    const bool absorbed = run.absorbed;
    kernels::MlaArgs a = base;
    a.num_seqs = run.num_seqs;
    a.num_tokens = run.num_tokens;
    a.seq_lens = run.seq_lens;
    a.query_start = run.query_start;
    a.block_tables = run.tables;
    a.block_table_stride = run.stride;
    a.q = q + run.first_row * nh * qd;
    a.out = att + run.first_row * nh * vd;
    a.split_seqs = run.split_seqs;
    a.split_context = run.split_context;
    a.max_context = run.max_context;
    if (absorbed) {
      TANDEM_RETURN_IF_ERROR(be.MlaAttentionAbsorbed(a));
    } else {
      TANDEM_RETURN_IF_ERROR(be.MlaAttentionExpanded(a));
    }
  }
  TANDEM_RETURN_IF_ERROR(
      be.GemmBf16(xn, H, mw.g_proj, H, gate, nh * vd, n, nh * vd, H, false));
  TANDEM_RETURN_IF_ERROR(
      be.MulSigmoid(att, nh * vd, gate, nh * vd, att, nh * vd, n, nh * vd));
  TANDEM_RETURN_IF_ERROR(
      be.GemmBf16(att, nh * vd, mw.o_proj, mw.o_proj_ld, out, H, n, H, nh * vd, false));
  return tp() ? AllReduce(out, n * H) : absl::OkStatus();
}

absl::Status ModelRunner::DenseMlp(const DenseMlpWeights& m, const float* x, float* out,
                                   bool accumulate) {
  const model::TextConfig& t = w_->config.text;
  const int64_t H = t.hidden_size, I = m.inter;
  const int64_t n = row_start_.back();
  kernels::Backend& be = *backend_;
  float* g = S(t5_, n * I);
  float* u = S(t6_, n * I);
  float* act = S(t7_, n * I);
  TANDEM_RETURN_IF_ERROR(scratch_status_);
  TANDEM_RETURN_IF_ERROR(be.GemmBf16(x, H, m.gate, H, g, I, n, I, H, false));
  TANDEM_RETURN_IF_ERROR(be.GemmBf16(x, H, m.up, H, u, I, n, I, H, false));
  TANDEM_RETURN_IF_ERROR(be.SituGlu(g, I, u, I, act, I, n, I,
                                    static_cast<float>(t.activation_situ_beta),
                                    static_cast<float>(t.activation_situ_linear_beta)));
  return be.GemmBf16(act, I, m.down, m.down_ld, out, H, n, H, I, accumulate);
}

absl::Status ModelRunner::Ffn(const LayerWeights& lw, const float* xn, float* out) {
  if (lw.spec.ffn == model::FfnKind::kDense) {
    TANDEM_RETURN_IF_ERROR(DenseMlp(lw.dense, xn, out, false));
    return tp() ? AllReduce(out, row_start_.back() * w_->config.text.hidden_size)
                : absl::OkStatus();
  }
  const model::TextConfig& t = w_->config.text;
  const int64_t H = t.hidden_size, L = t.routed_expert_hidden_size;
  const int64_t E = t.num_experts, k = t.num_experts_per_token;
  const int64_t n = row_start_.back();
  const MoeWeights& m = lw.moe;
  kernels::Backend& be = *backend_;
  float* wts = S(topk_w_, n * k);
  absl::Status st;
  int32_t* expert_ids = d_expert_ids_.Sized(device_, n * k, &st, &scratch_moves_);
  TANDEM_RETURN_IF_ERROR(st);
  float* z = S(t0_, n * L);
  // TP: u and the shared-expert partial side by side, reduced in one call.
  float* u = tp() ? S(moe_red_, n * (L + H)) : S(t1_, n * L);
  TANDEM_RETURN_IF_ERROR(scratch_status_);
  TANDEM_RETURN_IF_ERROR(
      be.RouterTopK(xn, H, m.router, m.router_bias, n, H, E, k, t.moe_renormalize,
                    static_cast<float>(t.routed_scaling_factor), expert_ids, wts));
  float* shared = u + n * L;  // TP only
  TANDEM_RETURN_IF_ERROR(be.GemmBf16(xn, H, m.latent_down, H, z, L, n, L, H, false));
  kernels::MoeArgs a;
  a.tokens = n;
  a.hidden = L;
  a.inter = t.moe_intermediate_size;
  a.top_k = k;
  a.num_experts = E;
  a.experts = m.expert_table();
  a.z = z;
  a.ld_z = L;
  a.ids = expert_ids;
  a.weights = wts;
  a.situ_beta = static_cast<float>(t.activation_situ_beta);
  a.situ_linear_beta = static_cast<float>(t.activation_situ_linear_beta);
  a.out = u;
  a.ld_out = L;
  TANDEM_RETURN_IF_ERROR(be.MoeMxfp4(a));
  if (tp()) {
    TANDEM_RETURN_IF_ERROR(DenseMlp(m.shared, xn, shared, /*accumulate=*/false));
    TANDEM_RETURN_IF_ERROR(AllReduce(u, n * (L + H)));
  }
  if (t.latent_moe_use_norm) {
    TANDEM_RETURN_IF_ERROR(be.RmsNorm(u, L, m.latent_norm.data(), u, L, n, L,
                                      static_cast<float>(t.rms_norm_eps)));
  }
  TANDEM_RETURN_IF_ERROR(be.GemmBf16(u, L, m.latent_up, L, out, H, n, H, L, false));
  if (tp()) return be.AddInPlace(out, shared, n * H);
  return DenseMlp(m.shared, xn, out, /*accumulate=*/true);
}

}  // namespace tandem::engine
