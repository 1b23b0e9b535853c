// The metric families a worker exports on /metrics (registry injected).
//   tandem_worker_requests_total{rpc, outcome}
//   tandem_worker_time_to_first_token_seconds        (decode worker: Decode/Generate)
//   tandem_worker_inter_token_latency_seconds        (decode worker)
//   tandem_worker_prefill_seconds                    (prefill worker)
//   tandem_worker_waiting_requests, tandem_worker_running_requests,
//   tandem_worker_queued_prefill_tokens, tandem_worker_reservations
//   tandem_worker_kv_cache_blocks{state=used|free}, tandem_worker_state_slots{state}
//   tandem_worker_landing_blocks{state=used|free}    (decode worker: engine blocks
//                                                     held as transfer targets / free)
//   tandem_worker_transfer_bytes_total, tandem_worker_transfer_seconds_total,
//   tandem_worker_transfers_total{outcome}
//   tandem_worker_transfer_batches_total             (prefill worker: posted batches)
//   tandem_worker_transfer_restarts_total            (prefill worker: streamed
//     transfers resent whole because the prefill was preempted and recomputed)
//   tandem_worker_exposed_transfer_seconds           (prefill worker: transfer time
//     left after the prefill compute ended, i.e. not overlapped with it)
//   tandem_worker_prefill_tokens_total, tandem_worker_decode_tokens_total
//   tandem_worker_prefill_tokens_per_second, tandem_worker_decode_tokens_per_second
//     (over the interval between two Update() calls)
//   The cache's sizing, set once at start (SetCacheSizing; --kv_cache_memory):
//   tandem_worker_kv_cache_budget_bytes, tandem_worker_kv_cache_bytes{part=mla|kda},
//   tandem_worker_kv_cache_capacity_blocks, tandem_worker_kv_cache_capacity_tokens,
//   tandem_worker_state_slots_capacity, tandem_worker_max_model_len_tokens
//   Device backends (cuda, cuda_sim), also set once at start, one device's bytes
//   (each TP rank's device holds about the same):
//   tandem_worker_gpu_memory_bytes{kind=total|weights|other|activations|kv_cache}
//     (capacity; the weights; the worker's other buffers after loading; the
//     profiling forward's activation peak; the cache's share), and
//   tandem_worker_gpu_memory_utilization (--gpu_memory_utilization; 0 when
//     --kv_cache_memory sized the cache)
//   tandem_worker_kv_transport_info{agent=ucx|libfabric, provider, rails} 1: what
//     carries the KV as opened at start (SetKvTransport; libfabric: fi_info's
//     provider, e.g. "tcp;ofi_rxm", "shm", "efa"; ucx: UCX_TLS or "auto"). The
//     transfer counters above carry no transport label: one agent per worker,
//     so join on the instance.
//   tandem_worker_kv_staged_bytes_total{direction=to_host|to_device|to_peer_device}
//     (to_peer_device: written straight into a peer's device memory, IPC),
//   tandem_worker_kv_direct_peers, tandem_worker_kv_direct_refused_peers_total,
//   tandem_worker_kv_staging_seconds_total,
//   tandem_worker_kv_staging_pages_released_total, tandem_worker_kv_staged_regions:
//     the host staging of a device cache (kvtransfer::HostStagingAgent,
//     --kv_buffer; UpdateKvStaging)
//   tandem_worker_kv_landing_seconds (decode worker): per hand-off, from the
//     moment both its state and its Decode were there to the state ready on the
//     device (queued behind other landings, staged in, checksums verified);
//   tandem_worker_kv_landing_batches_total: landings made ready together (one
//     engine pause for every hand-off queued meanwhile; count / batches is the
//     mean batch)
//   tandem_worker_kv_peer_connections_total{agent=ucx, transports, tcp_only}:
//     connections to peers by the transports UCX chose for each, once its
//     wire-up was done (CountKvPeerConnection, from UcxAgentConfig::
//     on_peer_connected: "sysv,posix,cma" over shared memory, "tcp", "rc_mlx5,
//     ud_mlx5"); tcp_only="true" is issue 19's per-peer fallback to alert on.
//     Keyed by transports rather than by peer: agent ids are random per
//     process, so a peer label would grow with every restart (the peer is in
//     the "KV transfer peer connected" log line).
//   tandem_worker_kv_peer_refused_total{agent=ucx, transports}: of those, the
//     ones refused (TCP only where --kv_require_rdma forbids it): each failed
//     the request that tried (alert TandemKVPeerRefused).
#ifndef TANDEM_WORKER_WORKER_METRICS_H_
#define TANDEM_WORKER_WORKER_METRICS_H_

#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/cache/cache_sizing.h"
#include "kvtransfer/host_staging_agent.h"
#include "metrics/registry.h"
#include "worker/engine_loop.h"

namespace tandem::worker {

class WorkerMetrics {
 public:
  explicit WorkerMetrics(metrics::Registry* registry);

  // Counts one finished RPC.
  void CountRequest(const char* rpc, const char* outcome);
  // Refreshes gauges and rates from the engine loop (call periodically).
  void Update(const EngineLoopStats& s, absl::Time now);
  // The host staging's counters from its running totals (call periodically).
  void UpdateKvStaging(const kvtransfer::HostStagingStats& stats);
  // The cache's sizing gauges (once, at start).
  void SetCacheSizing(const engine::CacheSizing& sizing);
  // tandem_worker_kv_transport_info{agent, provider, rails} = 1 (once, at start;
  // kvtransfer::TransportInfo's fields).
  void SetKvTransport(const std::string& agent, const std::string& provider, int rails);
  // tandem_worker_kv_peer_connections_total{agent, transports, tcp_only} += 1,
  // and tandem_worker_kv_peer_refused_total{agent, transports} += 1 when the
  // connection was refused. Thread-safe (UCX calls it with its agent lock held).
  void CountKvPeerConnection(const std::string& agent, const std::string& transports,
                             bool tcp_only, bool refused = false);

  metrics::Family<metrics::Counter>* requests;
  metrics::Histogram* ttft;
  metrics::Histogram* inter_token;
  metrics::Histogram* prefill_seconds;
  // The prefill worker's vision towers: one request's images, on tower `tower`'s
  // encoder thread (tandem_worker_vision_encode_seconds{tower}), and the
  // requests waiting for a tower.
  metrics::Family<metrics::Histogram>* vision_encode_seconds;
  metrics::Gauge* vision_queue;
  metrics::Gauge* waiting;
  metrics::Gauge* running;
  metrics::Gauge* queued_prefill_tokens;
  metrics::Gauge* reservations;
  metrics::Family<metrics::Gauge>* kv_blocks;
  metrics::Family<metrics::Gauge>* slots;
  metrics::Family<metrics::Gauge>* landing_blocks;
  metrics::Counter* transfer_bytes;
  metrics::Counter* transfer_seconds;
  metrics::Family<metrics::Counter>* transfers;
  metrics::Counter* transfer_batches;
  metrics::Counter* transfer_restarts;
  metrics::Histogram* exposed_transfer_seconds;
  metrics::Histogram* landing_seconds;
  metrics::Counter* landing_batches;
  metrics::Counter* prefill_tokens;
  metrics::Counter* decode_tokens;
  metrics::Gauge* prefill_tps;
  metrics::Gauge* decode_tps;
  // Where the engine's steps spend their time (engine::StepTimingStats): forward
  // (the device's work) and host gaps between back-to-back forwards (device idle).
  metrics::Counter* forward_seconds;
  metrics::Counter* host_gap_seconds;
  metrics::Gauge* host_gap_fraction;
  metrics::Family<metrics::Counter>* sampled_rows;        // where: device | host
  metrics::Family<metrics::Counter>* scored_prompt_rows;  // where: device | host
  metrics::Counter* device_sampling_fallbacks;
  metrics::Counter* overlapped_steps;
  metrics::Counter* overlap_discarded_rows;
  // CUDA graphs of decode steps (engine::GraphStats, rank 0): forwards replayed
  // from a graph or run eagerly, captures and their time, rows added by padding
  // to a bucket, graphs held and their nodes.
  metrics::Family<metrics::Counter>* graph_steps;
  metrics::Counter* graph_captures;
  metrics::Counter* graph_capture_seconds;
  metrics::Counter* graph_padded_rows;
  metrics::Gauge* graphs_live;
  metrics::Gauge* graph_nodes;
  // Tensor-parallel collectives (engine::CommStats, rank 0): calls by how the
  // host handled them (waited for one by one, or enqueued in a graph step and
  // waited for once per step), their payload, and the host's time waiting
  // (in each synchronous collective, or in the one wait of a graph step).
  metrics::Family<metrics::Counter>* tp_collectives;
  metrics::Counter* tp_collective_bytes;
  metrics::Family<metrics::Counter>* tp_collective_wait_seconds;
  // Scheduler preemptions (a running sequence freed to make room, recomputed
  // later), and requests ended with an error instead because the recompute
  // would need rows this worker cannot compute (an image prompt's rows on a
  // decode worker, which has no vision tower).
  metrics::Counter* preemptions;
  metrics::Counter* unrecomputable_requests;
  // Speculative decoding (decode workers with --speculative): drafts verified,
  // drafts accepted, verifying sequence-steps, and since start the acceptance
  // rate and mean drafts accepted per verifying step.
  metrics::Counter* spec_drafted;
  metrics::Counter* spec_accepted;
  metrics::Counter* spec_verifications;
  metrics::Gauge* spec_acceptance_rate;
  metrics::Gauge* spec_mean_accepted_length;
  // Prefix caching: prompt tokens looked up and reused (hit rate = their
  // ratio since start), KDA snapshots stored and evicted, what is held.
  metrics::Counter* prefix_queried_tokens;
  metrics::Counter* prefix_hit_tokens;
  metrics::Gauge* prefix_hit_rate;
  metrics::Counter* prefix_snapshots_stored;
  metrics::Counter* prefix_snapshots_evicted;
  metrics::Counter* prefix_blocks_evicted;
  metrics::Gauge* prefix_snapshot_bytes;
  metrics::Gauge* prefix_cached_blocks;
  // The two tiers (docs/prefix_caching.md, "The host-memory tier").
  metrics::Family<metrics::Counter>* prefix_tier_evictions;  // {tier, kind}
  metrics::Family<metrics::Gauge>* prefix_tier_bytes;        // {tier}
  metrics::Family<metrics::Counter>* prefix_host_loads;      // {kind}
  metrics::Counter* prefix_host_hits;
  // Decode-side prefix hits: prompt tokens reserved with their ids, and those
  // whose MLA rows the cache already held (not sent over the wire).
  metrics::Counter* prefix_reserve_queried_tokens;
  metrics::Counter* prefix_reserve_hit_tokens;
  metrics::Gauge* prefix_host_budget_bytes;
  // Generation snapshots: continuations by result (completed, skipped,
  // cancelled), positions they recomputed, snapshots they stored.
  metrics::Family<metrics::Counter>* prefix_continuations;
  metrics::Counter* prefix_continuation_tokens;
  metrics::Counter* prefix_generation_snapshots;
  metrics::Gauge* cache_budget_bytes;
  metrics::Family<metrics::Gauge>* cache_bytes;
  metrics::Gauge* cache_capacity_blocks;
  metrics::Gauge* cache_capacity_tokens;
  metrics::Gauge* slots_capacity;
  metrics::Gauge* max_model_len;
  metrics::Family<metrics::Gauge>* gpu_memory;
  metrics::Gauge* gpu_memory_utilization;
  metrics::Family<metrics::Gauge>* kv_transport_info;
  metrics::Family<metrics::Counter>* kv_staged_bytes;
  metrics::Counter* kv_staging_seconds;
  metrics::Counter* kv_staging_pages_released;
  metrics::Gauge* kv_staged_regions;
  metrics::Gauge* kv_direct_peers;
  metrics::Counter* kv_direct_refused_peers;
  metrics::Family<metrics::Counter>* kv_peer_connections;
  metrics::Family<metrics::Counter>* kv_peer_refused;  // {agent, transports}

 private:
  absl::Mutex mu_;
  absl::Time last_time_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int64_t last_prefill_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_decode_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_preemptions_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_unrecomputable_ ABSL_GUARDED_BY(mu_) = 0;
  engine::SpeculativeStats last_spec_ ABSL_GUARDED_BY(mu_);
  engine::StepTimingStats last_timing_ ABSL_GUARDED_BY(mu_);
  engine::GraphStats last_graphs_ ABSL_GUARDED_BY(mu_);
  engine::CommStats last_comm_ ABSL_GUARDED_BY(mu_);
  absl::Mutex staging_mu_;
  kvtransfer::HostStagingStats last_staging_ ABSL_GUARDED_BY(staging_mu_);
  engine::PrefixCachingStats last_prefix_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_WORKER_METRICS_H_
