#include "worker/worker_metrics.h"

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "metrics/buckets.h"

namespace tandem::worker {
namespace {

using metrics::OrDie;

std::vector<double> LatencyBuckets() {
  return *metrics::ExponentialBuckets(0.0005, 2, 16);  // 0.5 ms .. ~16 s
}

}  // namespace

WorkerMetrics::WorkerMetrics(metrics::Registry* r) {
  requests = OrDie(
      r->AddCounter("tandem_worker_requests_total", "Worker RPCs by rpc and outcome."));
  ttft = &OrDie(r->AddHistogram("tandem_worker_time_to_first_token_seconds",
                                "From Decode/Generate arrival to the first token sent.",
                                LatencyBuckets()))
              ->Add({});
  inter_token = &OrDie(r->AddHistogram("tandem_worker_inter_token_latency_seconds",
                                       "Time between consecutive streamed tokens.",
                                       LatencyBuckets()))
                     ->Add({});
  prefill_seconds =
      &OrDie(r->AddHistogram("tandem_worker_prefill_seconds",
                             "Prefill compute time per request.", LatencyBuckets()))
           ->Add({});
  vision_encode_seconds = OrDie(r->AddHistogram(
      "tandem_worker_vision_encode_seconds",
      "Vision-tower time per request with images (all its images, on the encoder "
      "thread of the prefill worker's tower `tower`: one per TP rank's GPU).",
      LatencyBuckets()));
  vision_queue = &OrDie(r->AddGauge("tandem_worker_vision_queue_requests",
                                    "Requests with images waiting for a vision "
                                    "tower (not counting those being encoded)."))
                      ->Add({});
  waiting = &OrDie(r->AddGauge("tandem_worker_waiting_requests",
                               "Requests waiting for admission in the engine."))
                 ->Add({});
  running = &OrDie(r->AddGauge("tandem_worker_running_requests",
                               "Requests running in the engine."))
                 ->Add({});
  queued_prefill_tokens =
      &OrDie(r->AddGauge("tandem_worker_queued_prefill_tokens",
                         "Prompt tokens added and not yet prefilled."))
           ->Add({});
  reservations = &OrDie(r->AddGauge("tandem_worker_reservations",
                                    "Live KV reservations (decode worker)."))
                      ->Add({});
  kv_blocks = OrDie(r->AddGauge("tandem_worker_kv_cache_blocks",
                                "Engine KV cache blocks by state (used, free)."));
  slots = OrDie(r->AddGauge("tandem_worker_state_slots",
                            "KDA state slots by state (used, free)."));
  landing_blocks = OrDie(r->AddGauge(
      "tandem_worker_landing_blocks",
      "Decode worker KV blocks: used = held as transfer targets (reservations not yet "
      "admitted, quarantined), free = the engine's free blocks."));
  transfer_bytes = &OrDie(r->AddCounter("tandem_worker_transfer_bytes_total",
                                        "KV/state bytes transferred."))
                        ->Add({});
  transfer_seconds = &OrDie(r->AddCounter("tandem_worker_transfer_seconds_total",
                                          "Seconds spent in KV/state transfers."))
                          ->Add({});
  transfers = OrDie(
      r->AddCounter("tandem_worker_transfers_total", "KV/state transfers by outcome."));
  transfer_batches = &OrDie(r->AddCounter("tandem_worker_transfer_batches_total",
                                          "KV/state write batches posted."))
                          ->Add({});
  transfer_restarts =
      &OrDie(r->AddCounter("tandem_worker_transfer_restarts_total",
                           "Streamed transfers resent whole after the prefill was "
                           "preempted and recomputed."))
           ->Add({});
  exposed_transfer_seconds =
      &OrDie(r->AddHistogram("tandem_worker_exposed_transfer_seconds",
                             "Transfer time left after the prefill compute ended "
                             "(first token sampled to the last byte landed).",
                             LatencyBuckets()))
           ->Add({});
  landing_seconds =
      &OrDie(r->AddHistogram("tandem_worker_kv_landing_seconds",
                             "Decode worker: from a hand-off's state and Decode both "
                             "present to the state ready (queued, staged in from host "
                             "memory, checksums verified).",
                             LatencyBuckets()))
           ->Add({});
  landing_batches =
      &OrDie(r->AddCounter("tandem_worker_kv_landing_batches_total",
                           "Decode worker: batches of hand-offs made ready together "
                           "(one engine pause each)."))
           ->Add({});
  prefill_tokens = &OrDie(r->AddCounter("tandem_worker_prefill_tokens_total",
                                        "Prompt tokens computed by the engine."))
                        ->Add({});
  decode_tokens = &OrDie(r->AddCounter("tandem_worker_decode_tokens_total",
                                       "Decode tokens computed by the engine."))
                       ->Add({});
  prefill_tps = &OrDie(r->AddGauge("tandem_worker_prefill_tokens_per_second",
                                   "Prefill throughput over the last interval."))
                     ->Add({});
  decode_tps = &OrDie(r->AddGauge("tandem_worker_decode_tokens_per_second",
                                  "Decode throughput over the last interval."))
                    ->Add({});
  forward_seconds =
      &OrDie(r->AddCounter("tandem_worker_forward_seconds_total",
                           "Time in engine forwards (the device's work)."))
           ->Add({});
  host_gap_seconds =
      &OrDie(r->AddCounter("tandem_worker_host_gap_seconds_total",
                           "Host time between back-to-back forwards (device idle): "
                           "scheduling, sampling, streaming."))
           ->Add({});
  sampled_rows = OrDie(r->AddCounter(
      "tandem_worker_sampled_rows_total",
      "Rows (tokens) sampled, by where: device (the logits never left the GPU) or "
      "host (copied back: a CPU backend, --device_sampling=false, or a step with "
      "speculative drafts)."));
  for (const char* where : {"device", "host"}) sampled_rows->Add({{"where", where}});
  scored_prompt_rows = OrDie(r->AddCounter(
      "tandem_worker_scored_prompt_rows_total",
      "Prompt rows scored for prompt logprobs, by where: device (beside the step's "
      "sampling; only the scores left the GPU) or host (the logits copied back)."));
  for (const char* where : {"device", "host"}) {
    scored_prompt_rows->Add({{"where", where}});
  }
  device_sampling_fallbacks =
      &OrDie(r->AddCounter("tandem_worker_device_sampling_fallbacks_total",
                           "Steps meant for device sampling that sampled on the host "
                           "(device memory for the sampler's inputs ran out)."))
           ->Add({});
  overlapped_steps =
      &OrDie(r->AddCounter("tandem_worker_overlapped_steps_total",
                           "Steps launched on the device thread before the previous "
                           "step's tokens reached the host (--overlap_steps: async "
                           "scheduling). Far below the step count: most steps needed "
                           "the host first (new requests, drafts, constraints, "
                           "penalties)."))
           ->Add({});
  overlap_discarded_rows =
      &OrDie(r->AddCounter("tandem_worker_overlap_discarded_rows_total",
                           "Rows an overlapped step computed for a request that "
                           "had just ended on its previous token (thrown away)."))
           ->Add({});
  graph_steps = OrDie(r->AddCounter(
      "tandem_worker_cuda_graph_steps_total",
      "Forwards by mode: graph (a captured CUDA graph replayed) or eager."));
  graph_captures = &OrDie(r->AddCounter("tandem_worker_cuda_graph_captures_total",
                                        "CUDA graphs captured (recaptures included)."))
                        ->Add({});
  graph_capture_seconds =
      &OrDie(r->AddCounter(
                 "tandem_worker_cuda_graph_capture_seconds_total",
                 "Time capturing CUDA graphs (warm-up, capture, instantiation)."))
           ->Add({});
  graph_padded_rows =
      &OrDie(
           r->AddCounter("tandem_worker_cuda_graph_padded_rows_total",
                         "Rows added to decode batches to fill their graph's bucket."))
           ->Add({});
  graphs_live =
      &OrDie(r->AddGauge("tandem_worker_cuda_graphs", "CUDA graphs held now."))
           ->Add({});
  graph_nodes =
      &OrDie(r->AddGauge("tandem_worker_cuda_graph_nodes",
                         "Nodes (launches, copies, GEMMs) of the graphs held."))
           ->Add({});
  tp_collectives = OrDie(r->AddCounter(
      "tandem_worker_tp_collectives_total",
      "Tensor-parallel collectives of rank 0 by mode: waited (the host waits for "
      "each: steps with hooks or image rows) or stream_ordered (in stream order, "
      "the step waited for once: CUDA-graph decode steps, counted per replay, and "
      "other eager steps)."));
  tp_collective_bytes =
      &OrDie(r->AddCounter("tandem_worker_tp_collective_bytes_total",
                           "Payload rank 0 handed to its collectives."))
           ->Add({});
  tp_collective_wait_seconds = OrDie(r->AddCounter(
      "tandem_worker_tp_collective_wait_seconds_total",
      "Host time rank 0 spent waiting for collectives: in each synchronous one "
      "(wait=\"each\"; includes waiting for the slowest rank) or in a step's one "
      "wait for all of its collectives and kernels (wait=\"step\")."));
  for (const char* wait : {"each", "step"})
    tp_collective_wait_seconds->Add({{"wait", wait}});
  for (const char* mode : {"waited", "stream_ordered"})
    tp_collectives->Add({{"mode", mode}});
  host_gap_fraction =
      &OrDie(r->AddGauge("tandem_worker_host_gap_fraction",
                         "Mean host gap over mean step (gap + forward), since start."))
           ->Add({});
  preemptions =
      &OrDie(
           r->AddCounter("tandem_worker_preemptions_total",
                         "Running sequences preempted for KV room (recomputed later)."))
           ->Add({});
  unrecomputable_requests =
      &OrDie(
           r->AddCounter("tandem_worker_unrecomputable_requests_total",
                         "Preempted requests ended with an error because their "
                         "recompute needs rows this worker cannot compute (image "
                         "rows on a decode worker) and no cached prefix covers them."))
           ->Add({});
  spec_drafted = &OrDie(r->AddCounter("tandem_worker_spec_drafted_tokens_total",
                                      "Speculative drafts verified by the target."))
                      ->Add({});
  spec_accepted = &OrDie(r->AddCounter("tandem_worker_spec_accepted_tokens_total",
                                       "Speculative drafts accepted."))
                       ->Add({});
  spec_verifications =
      &OrDie(r->AddCounter("tandem_worker_spec_verifications_total",
                           "Sequence-steps that verified at least one draft."))
           ->Add({});
  spec_acceptance_rate =
      &OrDie(r->AddGauge("tandem_worker_spec_acceptance_rate",
                         "Accepted / drafted since start (0 before any draft)."))
           ->Add({});
  spec_mean_accepted_length =
      &OrDie(r->AddGauge("tandem_worker_spec_mean_accepted_length",
                         "Mean drafts accepted per verifying step since start."))
           ->Add({});
  prefix_queried_tokens =
      &OrDie(r->AddCounter("tandem_worker_prefix_cache_queried_tokens_total",
                           "Prompt tokens looked up in the prefix cache."))
           ->Add({});
  prefix_hit_tokens =
      &OrDie(
           r->AddCounter("tandem_worker_prefix_cache_hit_tokens_total",
                         "Prompt tokens reused from the prefix cache (not computed)."))
           ->Add({});
  prefix_hit_rate = &OrDie(r->AddGauge("tandem_worker_prefix_cache_hit_rate",
                                       "Hit tokens / queried tokens since start."))
                         ->Add({});
  prefix_snapshots_stored =
      &OrDie(r->AddCounter("tandem_worker_prefix_snapshots_stored_total",
                           "KDA state snapshots stored for prefix caching."))
           ->Add({});
  prefix_snapshots_evicted =
      &OrDie(r->AddCounter("tandem_worker_prefix_snapshots_evicted_total",
                           "KDA state snapshots evicted (LRU, or with their block)."))
           ->Add({});
  prefix_blocks_evicted =
      &OrDie(r->AddCounter("tandem_worker_prefix_cache_blocks_evicted_total",
                           "Cached MLA blocks evicted (LRU, unreferenced only)."))
           ->Add({});
  prefix_snapshot_bytes =
      &OrDie(r->AddGauge("tandem_worker_prefix_snapshot_bytes",
                         "Bytes of KDA state snapshots held (every TP rank)."))
           ->Add({});
  prefix_cached_blocks = &OrDie(r->AddGauge("tandem_worker_prefix_cached_blocks",
                                            "MLA blocks held by the prefix cache."))
                              ->Add({});
  prefix_tier_evictions = OrDie(r->AddCounter(
      "tandem_worker_prefix_cache_evictions_total",
      "Prefix-cache evictions by tier and kind: tier=\"device\" counts every "
      "eviction from the engine's cache (moved to the host tier when it has room), "
      "tier=\"host\" what the host tier's LRU dropped for good; kind=\"block\" "
      "(MLA blocks) or \"snapshot\" (KDA snapshots)."));
  prefix_tier_bytes = OrDie(r->AddGauge(
      "tandem_worker_prefix_cache_bytes",
      "Bytes the prefix cache holds, by tier (device: cached MLA blocks and "
      "snapshots in the engine's cache; host: the host tier), every TP rank."));
  for (const char* tier : {"device", "host"}) {
    prefix_tier_bytes->Add({{"tier", tier}});
    for (const char* kind : {"block", "snapshot"}) {
      prefix_tier_evictions->Add({{"tier", tier}, {"kind", kind}});
    }
  }
  prefix_host_loads = OrDie(r->AddCounter("tandem_worker_prefix_cache_host_loads_total",
                                          "MLA blocks and KDA snapshots loaded back "
                                          "from the host tier for a hit, by kind."));
  for (const char* kind : {"block", "snapshot"})
    prefix_host_loads->Add({{"kind", kind}});
  prefix_host_hits =
      &OrDie(r->AddCounter(
                 "tandem_worker_prefix_cache_host_hits_total",
                 "Prefix-cache lookups whose hit was loaded from the host tier."))
           ->Add({});
  prefix_reserve_queried_tokens =
      &OrDie(r->AddCounter("tandem_worker_prefix_cache_reserve_queried_tokens_total",
                           "Prompt tokens of KV reservations looked up in the "
                           "prefix cache (decode workers)."))
           ->Add({});
  prefix_reserve_hit_tokens =
      &OrDie(r->AddCounter("tandem_worker_prefix_cache_reserve_hit_tokens_total",
                           "Prompt tokens of KV reservations whose MLA rows the "
                           "cache already held, so the prefill worker did not "
                           "send them (decode-side prefix hits)."))
           ->Add({});
  prefix_host_budget_bytes =
      &OrDie(r->AddGauge("tandem_worker_prefix_cache_host_budget_bytes",
                         "The host tier's budget (--prefix_host_memory; 0: off)."))
           ->Add({});
  prefix_continuations = OrDie(r->AddCounter(
      "tandem_worker_prefix_continuations_total",
      "Background prefill continuations of finished generations (their end's KDA "
      "snapshot for the next turn) by result: completed, skipped, cancelled."));
  for (const char* res : {"completed", "skipped", "cancelled"}) {
    prefix_continuations->Add({{"result", res}});
  }
  prefix_continuation_tokens =
      &OrDie(r->AddCounter("tandem_worker_prefix_continuation_tokens_total",
                           "Positions recomputed by generation continuations."))
           ->Add({});
  prefix_generation_snapshots =
      &OrDie(r->AddCounter("tandem_worker_prefix_generation_snapshots_total",
                           "KDA snapshots stored at the end of finished generations."))
           ->Add({});
  cache_budget_bytes =
      &OrDie(
           r->AddGauge("tandem_worker_kv_cache_budget_bytes",
                       "Memory budget of the KV cache and KDA state (--kv_cache_memory "
                       "or --gpu_memory_utilization resolved at start)."))
           ->Add({});
  gpu_memory = OrDie(r->AddGauge(
      "tandem_worker_gpu_memory_bytes",
      "Device backends: one device's memory by kind: total (capacity), weights, other "
      "(the worker's other buffers after loading), activations (the profiling "
      "forward's peak), kv_cache (the cache's share); set at start."));
  gpu_memory_utilization =
      &OrDie(
           r->AddGauge("tandem_worker_gpu_memory_utilization",
                       "Device backends: --gpu_memory_utilization the cache was sized "
                       "by (0: by --kv_cache_memory)."))
           ->Add({});
  cache_bytes = OrDie(r->AddGauge("tandem_worker_kv_cache_bytes",
                                  "Bytes allocated for the cache by part: mla (latent "
                                  "blocks), kda (state slots)."));
  cache_capacity_blocks = &OrDie(r->AddGauge("tandem_worker_kv_cache_capacity_blocks",
                                             "MLA cache blocks the budget bought."))
                               ->Add({});
  cache_capacity_tokens =
      &OrDie(r->AddGauge("tandem_worker_kv_cache_capacity_tokens",
                         "Tokens of MLA cache (blocks * block size)."))
           ->Add({});
  slots_capacity = &OrDie(r->AddGauge("tandem_worker_state_slots_capacity",
                                      "KDA state slots (sequences running at once)."))
                        ->Add({});
  max_model_len =
      &OrDie(r->AddGauge("tandem_worker_max_model_len_tokens",
                         "Longest request (prompt + output) this worker accepts."))
           ->Add({});
  for (const char* part : {"mla", "kda"}) cache_bytes->Add({{"part", part}});
  for (const char* st : {"used", "free"}) {
    kv_blocks->Add({{"state", st}});
    slots->Add({{"state", st}});
    landing_blocks->Add({{"state", st}});
  }
  for (const char* o : {"ok", "error"}) transfers->Add({{"outcome", o}});
  kv_transport_info = OrDie(r->AddGauge(
      "tandem_worker_kv_transport_info",
      "1 for the KV transfer agent this worker opened at start: agent (ucx, "
      "libfabric), provider (libfabric: fi_info's provider, e.g. tcp;ofi_rxm, shm, "
      "efa; ucx: UCX_TLS or auto), rails (endpoints a transfer is striped over)."));
  kv_staged_bytes = OrDie(r->AddCounter(
      "tandem_worker_kv_staged_bytes_total",
      "KV bytes staged through host memory (--kv_buffer=host, or auto on a "
      "transport that cannot register the GPU's memory): direction to_host (the "
      "prefill worker, before each write) or to_device (the decode worker, once the "
      "state landed); to_peer_device: written by the prefill worker straight into "
      "the decode worker's device memory (one host, --kv_device_ipc), no host copy."));
  for (const char* d : {"to_host", "to_device", "to_peer_device"})
    kv_staged_bytes->Add({{"direction", d}});
  kv_staging_seconds = &OrDie(r->AddCounter("tandem_worker_kv_staging_seconds_total",
                                            "Time spent in the host staging copies."))
                            ->Add({});
  kv_staging_pages_released =
      &OrDie(r->AddCounter("tandem_worker_kv_staging_pages_released_total",
                           "Host staging pages given back to the OS once "
                           "their bytes moved."))
           ->Add({});
  kv_staged_regions = &OrDie(r->AddGauge("tandem_worker_kv_staged_regions",
                                         "Cache regions staged through host memory "
                                         "(0: the transfer agent reads and writes "
                                         "the cache where it lives)."))
                           ->Add({});
  kv_direct_peers =
      &OrDie(r->AddGauge("tandem_worker_kv_direct_peers",
                         "Peers whose device memory this worker writes the KV "
                         "into directly (device to device between processes of "
                         "one host: CUDA IPC; --kv_device_ipc)."))
           ->Add({});
  kv_direct_refused_peers =
      &OrDie(r->AddCounter("tandem_worker_kv_direct_refused_peers_total",
                           "Peers that published device memory this worker could "
                           "not map (another host, a GPU it cannot reach): staged "
                           "through host memory instead."))
           ->Add({});
  kv_peer_connections = OrDie(r->AddCounter(
      "tandem_worker_kv_peer_connections_total",
      "KV transfer connections to peers by the transports that carry them, as the "
      "agent chose them per peer (ucx: e.g. sysv,posix,cma over shared memory, tcp, "
      "rc_mlx5); tcp_only=true: every lane is TCP."));
  kv_peer_refused = OrDie(r->AddCounter(
      "tandem_worker_kv_peer_refused_total",
      "KV transfer peers refused (also counted in "
      "tandem_worker_kv_peer_connections_total): connected over TCP only where "
      "--kv_require_rdma forbids it; each refusal fails the request that tried."));
  // The series a TCP-only connection and a refusal count in (every lane tcp),
  // there from the start so that increase() sees the first one.
  kv_peer_connections->Add(
      {{"agent", "ucx"}, {"transports", "tcp"}, {"tcp_only", "true"}});
  kv_peer_refused->Add({{"agent", "ucx"}, {"transports", "tcp"}});
}

void WorkerMetrics::CountKvPeerConnection(const std::string& agent,
                                          const std::string& transports, bool tcp_only,
                                          bool refused) {
  const std::string t = transports.empty() ? "unknown" : transports;
  kv_peer_connections
      ->Add({{"agent", agent},
             {"transports", t},
             {"tcp_only", tcp_only ? "true" : "false"}})
      .Increment();
  if (refused) kv_peer_refused->Add({{"agent", agent}, {"transports", t}}).Increment();
}

void WorkerMetrics::SetKvTransport(const std::string& agent,
                                   const std::string& provider, int rails) {
  kv_transport_info
      ->Add({{"agent", agent}, {"provider", provider}, {"rails", absl::StrCat(rails)}})
      .Set(1);
}

void WorkerMetrics::UpdateKvStaging(const kvtransfer::HostStagingStats& st) {
  absl::MutexLock l(&staging_mu_);
  auto grow = [](metrics::Counter& c, uint64_t now, uint64_t before) {
    if (now > before) c.Increment(static_cast<double>(now - before));
  };
  grow(kv_staged_bytes->Add({{"direction", "to_host"}}), st.bytes_to_host,
       last_staging_.bytes_to_host);
  grow(kv_staged_bytes->Add({{"direction", "to_device"}}), st.bytes_to_device,
       last_staging_.bytes_to_device);
  grow(kv_staged_bytes->Add({{"direction", "to_peer_device"}}), st.bytes_direct,
       last_staging_.bytes_direct);
  grow(*kv_direct_refused_peers, st.direct_refused_peers,
       last_staging_.direct_refused_peers);
  kv_direct_peers->Set(static_cast<double>(st.direct_peers));
  grow(*kv_staging_pages_released, st.pages_released, last_staging_.pages_released);
  if (st.copy_micros > last_staging_.copy_micros) {
    kv_staging_seconds->Increment(
        static_cast<double>(st.copy_micros - last_staging_.copy_micros) * 1e-6);
  }
  kv_staged_regions->Set(static_cast<double>(st.staged_regions));
  last_staging_ = st;
}

void WorkerMetrics::SetCacheSizing(const engine::CacheSizing& sz) {
  cache_budget_bytes->Set(static_cast<double>(sz.budget_bytes));
  cache_bytes->Add({{"part", "mla"}}).Set(static_cast<double>(sz.block_bytes));
  cache_bytes->Add({{"part", "kda"}}).Set(static_cast<double>(sz.slot_bytes));
  cache_capacity_blocks->Set(static_cast<double>(sz.num_blocks));
  cache_capacity_tokens->Set(static_cast<double>(sz.cache_tokens));
  slots_capacity->Set(sz.num_slots);
  max_model_len->Set(static_cast<double>(sz.max_model_len));
  const engine::DeviceMemoryUse& d = sz.device;
  if (d.device.empty()) return;  // a host backend
  const std::pair<const char*, int64_t> kinds[] = {
      {"total", d.total_bytes},
      {"weights", d.weights_bytes},
      {"other", d.in_use_bytes - d.weights_bytes},
      {"activations", d.activation_peak_bytes},
      {"kv_cache", d.num_devices > 0 ? sz.total_bytes() / d.num_devices : 0}};
  for (const auto& [kind, bytes] : kinds) {
    gpu_memory->Add({{"kind", kind}}).Set(static_cast<double>(bytes));
  }
  gpu_memory_utilization->Set(d.utilization);
}

void WorkerMetrics::CountRequest(const char* rpc, const char* outcome) {
  requests->Add({{"rpc", rpc}, {"outcome", outcome}}).Increment();
}

void WorkerMetrics::Update(const EngineLoopStats& s, absl::Time now) {
  waiting->Set(s.waiting);
  running->Set(s.running);
  queued_prefill_tokens->Set(static_cast<double>(s.queued_prefill_tokens));
  kv_blocks->Add({{"state", "free"}}).Set(s.free_blocks);
  kv_blocks->Add({{"state", "used"}}).Set(s.total_blocks - s.free_blocks);
  slots->Add({{"state", "free"}}).Set(s.free_slots);
  slots->Add({{"state", "used"}}).Set(s.total_slots - s.free_slots);
  absl::MutexLock l(&mu_);
  const int64_t dp = s.prefill_tokens - last_prefill_;
  const int64_t dd = s.decode_tokens - last_decode_;
  if (dp > 0) prefill_tokens->Increment(static_cast<double>(dp));
  if (dd > 0) decode_tokens->Increment(static_cast<double>(dd));
  if (last_time_ != absl::InfinitePast()) {
    const double secs = absl::ToDoubleSeconds(now - last_time_);
    if (secs > 0) {
      prefill_tps->Set(dp / secs);
      decode_tps->Set(dd / secs);
    }
  }
  last_time_ = now;
  last_prefill_ = s.prefill_tokens;
  last_decode_ = s.decode_tokens;
  if (s.preemptions > last_preemptions_) {
    preemptions->Increment(static_cast<double>(s.preemptions - last_preemptions_));
  }
  if (s.unrecomputable_drops > last_unrecomputable_) {
    unrecomputable_requests->Increment(
        static_cast<double>(s.unrecomputable_drops - last_unrecomputable_));
  }
  last_preemptions_ = s.preemptions;
  last_unrecomputable_ = s.unrecomputable_drops;
  const engine::SpeculativeStats& sp = s.speculative;
  auto bump = [](metrics::Counter* c, int64_t now_total, int64_t before) {
    if (now_total > before) c->Increment(static_cast<double>(now_total - before));
  };
  bump(spec_drafted, sp.drafted_tokens, last_spec_.drafted_tokens);
  bump(spec_accepted, sp.accepted_tokens, last_spec_.accepted_tokens);
  bump(spec_verifications, sp.verifications, last_spec_.verifications);
  spec_acceptance_rate->Set(sp.acceptance_rate());
  spec_mean_accepted_length->Set(sp.mean_accepted_length());
  last_spec_ = sp;
  const engine::StepTimingStats& tm = s.timing;
  if (tm.forward_seconds > last_timing_.forward_seconds) {
    forward_seconds->Increment(tm.forward_seconds - last_timing_.forward_seconds);
  }
  if (tm.host_gap_seconds > last_timing_.host_gap_seconds) {
    host_gap_seconds->Increment(tm.host_gap_seconds - last_timing_.host_gap_seconds);
  }
  host_gap_fraction->Set(tm.host_gap_fraction());
  bump(&sampled_rows->Add({{"where", "device"}}), tm.device_sampled_rows,
       last_timing_.device_sampled_rows);
  bump(&sampled_rows->Add({{"where", "host"}}), tm.host_sampled_rows,
       last_timing_.host_sampled_rows);
  bump(&scored_prompt_rows->Add({{"where", "device"}}), tm.device_scored_rows,
       last_timing_.device_scored_rows);
  bump(&scored_prompt_rows->Add({{"where", "host"}}), tm.host_scored_rows,
       last_timing_.host_scored_rows);
  bump(device_sampling_fallbacks, tm.device_sampling_fallbacks,
       last_timing_.device_sampling_fallbacks);
  bump(overlapped_steps, tm.overlapped_steps, last_timing_.overlapped_steps);
  bump(overlap_discarded_rows, tm.overlap_discarded_rows,
       last_timing_.overlap_discarded_rows);
  const engine::GraphStats& g = s.graphs;
  const engine::GraphStats& lg = last_graphs_;
  if (g.replays > lg.replays) {
    graph_steps->Add({{"mode", "graph"}})
        .Increment(static_cast<double>(g.replays - lg.replays));
  }
  if (g.eager_steps > lg.eager_steps) {
    graph_steps->Add({{"mode", "eager"}})
        .Increment(static_cast<double>(g.eager_steps - lg.eager_steps));
  }
  if (g.captures > lg.captures) {
    graph_captures->Increment(static_cast<double>(g.captures - lg.captures));
  }
  if (g.capture_seconds > lg.capture_seconds) {
    graph_capture_seconds->Increment(g.capture_seconds - lg.capture_seconds);
  }
  if (g.padded_rows > lg.padded_rows) {
    graph_padded_rows->Increment(static_cast<double>(g.padded_rows - lg.padded_rows));
  }
  graphs_live->Set(static_cast<double>(g.live_graphs));
  graph_nodes->Set(static_cast<double>(g.graph_nodes));
  last_graphs_ = g;
  const engine::CommStats& c = s.comm;
  const engine::CommStats& lc = last_comm_;
  bump(&tp_collectives->Add({{"mode", "waited"}}), c.calls - c.enqueued,
       lc.calls - lc.enqueued);
  bump(&tp_collectives->Add({{"mode", "stream_ordered"}}), c.enqueued, lc.enqueued);
  bump(tp_collective_bytes, c.bytes, lc.bytes);
  if (c.seconds > lc.seconds) {
    tp_collective_wait_seconds->Add({{"wait", "each"}})
        .Increment(c.seconds - lc.seconds);
  }
  if (c.wait_seconds > lc.wait_seconds) {
    tp_collective_wait_seconds->Add({{"wait", "step"}})
        .Increment(c.wait_seconds - lc.wait_seconds);
  }
  last_comm_ = c;
  last_timing_ = tm;
  const engine::PrefixCachingStats& px = s.prefix;
  bump(prefix_queried_tokens, px.queried_tokens, last_prefix_.queried_tokens);
  bump(prefix_hit_tokens, px.hit_tokens, last_prefix_.hit_tokens);
  bump(prefix_snapshots_stored, px.snapshots_stored, last_prefix_.snapshots_stored);
  bump(prefix_snapshots_evicted, px.snapshots_evicted, last_prefix_.snapshots_evicted);
  bump(prefix_blocks_evicted, px.blocks_evicted, last_prefix_.blocks_evicted);
  prefix_hit_rate->Set(px.hit_rate());
  prefix_snapshot_bytes->Set(static_cast<double>(px.snapshot_bytes_held));
  prefix_cached_blocks->Set(static_cast<double>(px.blocks_cached));
  bump(&prefix_tier_evictions->Add({{"tier", "device"}, {"kind", "block"}}),
       px.blocks_evicted, last_prefix_.blocks_evicted);
  bump(&prefix_tier_evictions->Add({{"tier", "device"}, {"kind", "snapshot"}}),
       px.snapshots_evicted, last_prefix_.snapshots_evicted);
  bump(&prefix_tier_evictions->Add({{"tier", "host"}, {"kind", "block"}}),
       px.host_blocks_evicted, last_prefix_.host_blocks_evicted);
  bump(&prefix_tier_evictions->Add({{"tier", "host"}, {"kind", "snapshot"}}),
       px.host_snapshots_evicted, last_prefix_.host_snapshots_evicted);
  prefix_tier_bytes->Add({{"tier", "device"}})
      .Set(static_cast<double>(px.device_bytes_held));
  prefix_tier_bytes->Add({{"tier", "host"}})
      .Set(static_cast<double>(px.host_bytes_held));
  bump(&prefix_host_loads->Add({{"kind", "block"}}), px.blocks_loaded_from_host,
       last_prefix_.blocks_loaded_from_host);
  bump(&prefix_host_loads->Add({{"kind", "snapshot"}}), px.snapshots_loaded_from_host,
       last_prefix_.snapshots_loaded_from_host);
  bump(prefix_host_hits, px.hits_from_host, last_prefix_.hits_from_host);
  bump(prefix_reserve_queried_tokens, px.reserve_queried_tokens,
       last_prefix_.reserve_queried_tokens);
  bump(prefix_reserve_hit_tokens, px.reserve_hit_tokens,
       last_prefix_.reserve_hit_tokens);
  prefix_host_budget_bytes->Set(static_cast<double>(px.host_budget_bytes));
  bump(&prefix_continuations->Add({{"result", "completed"}}),
       px.continuations_completed, last_prefix_.continuations_completed);
  bump(&prefix_continuations->Add({{"result", "skipped"}}), px.continuations_skipped,
       last_prefix_.continuations_skipped);
  bump(&prefix_continuations->Add({{"result", "cancelled"}}),
       px.continuations_cancelled, last_prefix_.continuations_cancelled);
  bump(prefix_continuation_tokens, px.continuation_tokens,
       last_prefix_.continuation_tokens);
  bump(prefix_generation_snapshots, px.generation_snapshots,
       last_prefix_.generation_snapshots);
  last_prefix_ = px;
}

}  // namespace tandem::worker
