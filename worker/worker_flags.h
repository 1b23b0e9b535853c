// The flags prefill_main and decode_main share (the model, the server, the
// engine and its tensor parallelism, the UCX agent), defined once so the two
// workers cannot drift apart. Role-specific flags (--worker_id's default,
// leases and quarantine, speculation, streaming) stay in each main.
#ifndef TANDEM_WORKER_WORKER_FLAGS_H_
#define TANDEM_WORKER_WORKER_FLAGS_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "engine/runtime/engine.h"
#include "kvtransfer/agent_factory.h"
#include "kvtransfer/transfer_agent.h"
#include "kvtransfer/ucx_agent.h"
#include "proto/worker.pb.h"
#include "worker/worker_model.h"
#include "worker/worker_server.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(std::string, served_model_name);
ABSL_DECLARE_FLAG(std::string, router);
ABSL_DECLARE_FLAG(std::string, host);
ABSL_DECLARE_FLAG(std::string, advertise_host);
ABSL_DECLARE_FLAG(int, port);
ABSL_DECLARE_FLAG(int, metrics_port);
ABSL_DECLARE_FLAG(std::string, backend);
ABSL_DECLARE_FLAG(int, block_size);
ABSL_DECLARE_FLAG(std::string, kv_cache_memory);
ABSL_DECLARE_FLAG(double, gpu_memory_utilization);
ABSL_DECLARE_FLAG(int, max_num_seqs);
ABSL_DECLARE_FLAG(int64_t, max_model_len);
ABSL_DECLARE_FLAG(int, num_blocks);
ABSL_DECLARE_FLAG(int64_t, max_tokens_per_step);
ABSL_DECLARE_FLAG(int, tp);
ABSL_DECLARE_FLAG(std::string, tp_fail_rank_at_step);
ABSL_DECLARE_FLAG(std::string, ucx_tls);
ABSL_DECLARE_FLAG(bool, ucx_peer_failure_detection);
ABSL_DECLARE_FLAG(std::string, kv_transport);
ABSL_DECLARE_FLAG(std::string, kv_buffer);
ABSL_DECLARE_FLAG(bool, kv_device_ipc);
ABSL_DECLARE_FLAG(std::string, kv_progress_timeout);
ABSL_DECLARE_FLAG(std::string, kv_require_rdma);

namespace tandem::worker {

// The model (--model, --backend, --served_model_name).
absl::StatusOr<std::unique_ptr<WorkerModel>> LoadWorkerModelFromFlags();
// Engine options from --block_size, --max_tokens_per_step, --tp and
// --tp_fail_rank_at_step (logs a warning when the drill is armed), the cache
// sized for `model` (SizeWorkerCache, memory_sizing.h: on the host from
// --kv_cache_memory, bytes or a fraction of MemAvailable now; on a device from
// --gpu_memory_utilization after a profiling forward, --kv_cache_memory
// overriding), --max_num_seqs, --max_model_len and --num_blocks; the sizing is
// logged and returned in `sizing`. On a device backend call it after every model
// on the device is loaded (a draft model too): what is in use is measured.
// `speculative_tokens`: drafts verified per decode step (decode_main's
// --num_speculative_tokens where speculative decoding is on; 0 otherwise): a
// step's rows with logits are at most --max_num_seqs * (1 + it), which is what
// the profiling forward computes logits for.
// INVALID_ARGUMENT for bad flags, the sizing's errors.
absl::StatusOr<engine::EngineOptions> EngineOptionsFromFlags(
    const WorkerModel& model, engine::CacheSizing* sizing,
    int32_t speculative_tokens = 0);
// --kv_progress_timeout: "10s", "500ms" (absl durations), "2.5" (seconds),
// "inf" or "off" (InfiniteDuration); INVALID_ARGUMENT for anything else or <= 0.
absl::StatusOr<absl::Duration> ParseKvProgressTimeout(absl::string_view spec);
// --kv_require_rdma=true refuses a libfabric `provider` (as opened) that moves
// over sockets (tcp, sockets, udp): FAILED_PRECONDITION. OK otherwise (auto and
// false: a libfabric provider is always chosen explicitly, no fallback).
absl::Status CheckLibfabricRdma(absl::string_view provider,
                                kvtransfer::UcxRdmaRequirement requirement);
// The UCX agent named `worker_id` (--ucx_tls, --ucx_peer_failure_detection,
// --kv_progress_timeout, --kv_require_rdma); INVALID_ARGUMENT for bad values.
absl::StatusOr<kvtransfer::UcxAgentConfig> UcxConfigFromFlags(
    const std::string& worker_id);
// The factory's configuration: UCX as above, libfabric's progress timeout from
// --kv_progress_timeout, the transport from --kv_transport.
absl::StatusOr<kvtransfer::AgentFactoryConfig> AgentConfigFromFlags(
    const std::string& worker_id);
// The transfer agent --kv_transport names (UCX configured as above, or
// libfabric), started and logged with what it opened (agent, provider, fabric,
// domain, rails; also into `*info` when given, for the metric label); its
// errors (no fallback between transports). It comes wrapped in a
// kvtransfer::HostStagingAgent carrying --kv_buffer (RegisterCache reads it);
// its page release is chosen once the caches are registered
// (ChooseStagingPageRelease). `on_peer_connected` (UCX: called
// for every peer once UCX chose its transports, agent lock held) is how the
// worker counts connections by transport (WorkerMetrics::CountKvPeerConnection).
// Whether the host has RDMA devices (InfiniBand, RoCE, EFA: entries in
// /sys/class/infiniband), whose transports pin registered memory.
bool HostHasRdmaDevices(const std::string& sysfs_dir = "/sys/class/infiniband");
// Whether a host staging agent gives its shadow pages back after each
// transfer (kvtransfer::HostStagingOptions::release_pages): never with RDMA
// (pinned pages); otherwise when its shadows, `shadow_bytes` in all, are over
// a quarter of `mem_available` (unknown: <= 0) — kept resident, a shadow grows
// towards its size, and faulting pages in again costs every transfer.
bool StagingPageRelease(uint64_t shadow_bytes, int64_t mem_available, bool rdma);
// Applies StagingPageRelease to `agent` (once its caches are registered; a
// no-op unless it is a staging agent with staged regions) from this host's
// MemAvailable and RDMA devices, and logs the decision.
void ChooseStagingPageRelease(kvtransfer::TransferAgent* agent,
                              const std::string& meminfo_path = "/proc/meminfo");
absl::StatusOr<std::unique_ptr<kvtransfer::TransferAgent>> TransferAgentFromFlags(
    const std::string& worker_id, kvtransfer::TransportInfo* info = nullptr,
    std::function<void(const kvtransfer::UcxPeerTransport&)> on_peer_connected =
        nullptr);
// Server and registration (--host, --advertise_host, --port, --metrics_port,
// --router; id, role, model, --tp, the longest request the cache holds
// (`max_context_tokens`: the router refuses longer ones with INVALID_ARGUMENT),
// the cache layout).
WorkerServerOptions ServerOptionsFromFlags(const std::string& worker_id,
                                           tandem::v1::WorkerRole role,
                                           const WorkerModel& model,
                                           const tandem::v1::KvLayout& layout,
                                           int64_t max_context_tokens);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_WORKER_FLAGS_H_
