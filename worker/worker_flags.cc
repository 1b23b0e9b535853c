#include "worker/worker_flags.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status.h"
#include "engine/cache/host_tier.h"
#include "engine/cache/memory_budget.h"
#include "kvtransfer/agent_factory.h"
#include "kvtransfer/host_staging_agent.h"
#include "worker/memory_sizing.h"

ABSL_FLAG(std::string, model, "",
          "Checkpoint directory (config.json, weights, tokenizer).");
ABSL_FLAG(std::string, served_model_name, "", "Model id (default as the router's).");
ABSL_FLAG(std::string, router, "",
          "Router gRPC address to register with (empty: none).");
ABSL_FLAG(std::string, host, "127.0.0.1", "Address to listen on.");
ABSL_FLAG(std::string, advertise_host, "", "Host the router dials (default: --host).");
ABSL_FLAG(int, port, 0, "gRPC port (0: any free port, logged).");
ABSL_FLAG(int, metrics_port, 0, "/metrics port (0: any free port, logged).");
ABSL_FLAG(double, drain_timeout_s, 60,
          "On SIGTERM: seconds to let requests in flight finish (the router places "
          "nothing new on a draining worker) before the server stops. Kubernetes' "
          "terminationGracePeriodSeconds must be longer.");
ABSL_FLAG(std::string, backend, "cpu",
          "Kernel backend: cpu | cpu_bf16 | cpu_reference (host memory) | cuda | "
          "cuda_bf16 | cuda:N (a GPU, --config=cuda builds: weights, KV cache and "
          "activations in its memory, the cache registered with the transfer agent as "
          "CUDA memory) | cuda_sim | cuda_sim_bf16 (the GPU kernels on the CPU's SIMT "
          "emulator, slow).");
ABSL_FLAG(int, block_size, 16, "Engine KV cache block size (tokens).");
ABSL_FLAG(std::string, kv_cache_memory, "",
          "Memory for the KV cache and KDA state of all this worker's TP ranks: bytes "
          "with a unit (8GiB, 512MiB) or a fraction in (0, 1]. Host backends (cpu): "
          "default 0.1, a fraction of the host memory available at start "
          "(MemAvailable). Device backends (cuda, cuda_sim): unset, the cache gets "
          "--gpu_memory_utilization's share; given, it overrides that: bytes, or a "
          "fraction of what the device has left after the weights and the profiling "
          "forward. The MLA blocks and KDA slots are derived from it and the model's "
          "per-token and per-sequence sizes, and logged at start.");
ABSL_FLAG(double, gpu_memory_utilization, 0.9,
          "Device backends (cuda, cuda_sim), as vLLM's: the share of each device's "
          "memory this worker may use. After loading the weights and a profiling "
          "forward at the largest step (--max_tokens_per_step), the rest of it becomes "
          "MLA cache blocks and KDA slots (logged and exported at start). Unused on "
          "the host backends and when --kv_cache_memory is given. cuda_sim's device "
          "holds $TANDEM_SIM_DEVICE_BYTES (default 2 GiB).");
ABSL_FLAG(int, max_num_seqs, 256,
          "Sequences running at once at most (= KDA state slots; fewer when their "
          "state would take more than half of --kv_cache_memory).");
ABSL_FLAG(int64_t, max_model_len, 0,
          "Prompt + output tokens of one request at most (0: the model's "
          "max_position_embeddings, lowered to what the cache holds). A request "
          "longer than this is refused (400 / INVALID_ARGUMENT).");
ABSL_FLAG(int, num_blocks, 0,
          "Override: exactly this many MLA cache blocks (0: from --kv_cache_memory).");
ABSL_FLAG(int64_t, max_tokens_per_step, 0,
          "Engine token budget per step (the prefill chunk, with the decoding rows). "
          "0: by device: 8192 on a GPU of at least 70 GiB, 2048 on a smaller one "
          "(vLLM's defaults for an API server), 256 on the CPU and the emulator.");
ABSL_FLAG(bool, enforce_eager, false,
          "Run every step eagerly: no CUDA graphs for decode steps (by default a "
          "device backend captures one per batch-size bucket and replays it).");
ABSL_FLAG(
    bool, device_sampling, true,
    "Sample tokens on the device where the backend can (cuda, cuda_sim): the "
    "logits stay in GPU memory and only the chosen tokens come back (structured-"
    "output masks go up). Steps with speculative drafts sample on the host. false: "
    "every step copies its logits back and samples on the host (the same "
    "tokens).");
ABSL_FLAG(bool, overlap_steps, true,
          "Overlap the host's work with the device's (async scheduling): on a device "
          "backend a decode step whose rows all sample on the device runs on a device "
          "thread while the next step is planned and launched (fed the running "
          "step's tokens on the device) and the running step's tokens are "
          "detokenised afterwards. Steps that need the host first (new requests, "
          "drafts, structured outputs, penalties) run as before. The same tokens "
          "either way; false: every step waits for the one before.");
ABSL_FLAG(int, tp, 1,
          "Tensor-parallel size: ranks run as threads of this process, one cache "
          "shard each, all registered with the one UCX agent. Prefill and decode "
          "workers of one router must use the same size (the router refuses "
          "others at registration and this worker exits).");
ABSL_FLAG(std::string, tp_fail_rank_at_step, "",
          "FAILURE DRILL: 'R:S' makes TP rank R (>= 1) die instead of running its "
          "forward step S (0-based); the worker fails its requests UNAVAILABLE and "
          "stops taking work (health NOT_SERVING, no more heartbeats).");
ABSL_FLAG(std::string, ucx_tls, "", "UCX transports (UCX_TLS), empty: UCX chooses.");
ABSL_FLAG(bool, ucx_peer_failure_detection, true,
          "UCX endpoints with peer-failure detection (a dead peer fails transfers at "
          "once). UCX 1.13 then uses only tcp/RDMA; false allows shared memory on one "
          "host (much faster; a dead decode worker is then noticed by the router's "
          "health checks, not the transfer). docs/kvtransfer.md.");

ABSL_FLAG(std::string, kv_progress_timeout, "10s",
          "KV transfer agents (UCX and libfabric): a peer holding operations and "
          "completing none for this long is failed UNAVAILABLE (how a killed or "
          "stopped peer is noticed over shared memory, where UCX has no keep-alive). "
          "A duration (10s, 500ms, 1m) or seconds (2.5); inf turns it off. "
          "docs/kvtransfer.md.");
ABSL_FLAG(std::string, kv_require_rdma, "auto",
          "Whether KV may move over TCP (issue 19: no silent fallback from RDMA). "
          "auto: a UCX peer connected over TCP only is refused (the transfer fails "
          "FAILED_PRECONDITION naming the peer and its lanes) when this host has "
          "RDMA (UCX opened an rc/ud/dc/srd device); hosts without RDMA and shared "
          "memory run as before. true: every UCX peer needs RDMA or shared memory, "
          "and a libfabric tcp/sockets/udp provider stops the worker at start (the "
          "RDMA clusters' manifests). false: TCP is logged and counted only. "
          "docs/kvtransfer.md.");
ABSL_FLAG(std::string, kv_buffer, "auto",
          "Where the KV cache meets the transfer agent, for a cache in GPU memory: "
          "device (registered in place; needs a transport built with CUDA: UCX "
          "with cuda_copy/cuda_ipc, libfabric with FI_HMEM), host (staged through "
          "host memory: device -> host before each write on the prefill worker, "
          "host -> device once the state landed on the decode worker; any "
          "transport), auto (device where the agent accepts the GPU memory, else "
          "host, logged). A cache in host memory is registered as it is. "
          "docs/kvtransfer.md, 'Host staging'.");
ABSL_FLAG(bool, kv_device_ipc, true,
          "For a KV cache in GPU memory staged through host memory (--kv_buffer): "
          "allocate it shareable between processes and, between a prefill and a "
          "decode worker on one host, write the KV device to device into the "
          "decode worker's GPU memory (CUDA IPC; no host copy, no shadow pages), "
          "falling back to the host staging per peer where it cannot map the "
          "peer's memory (another host, a GPU it cannot reach; logged, "
          "tandem_worker_kv_direct_refused_peers_total). docs/kvtransfer.md, "
          "'Device to device on one host'.");
ABSL_FLAG(std::string, kv_transport, "ucx",
          "KV transfer agent: ucx | libfabric | libfabric:<provider>[:<rails>] "
          "(provider efa on AWS, tcp or shm elsewhere; default $FI_PROVIDER, else "
          "tcp; rails = endpoints a transfer is striped over). Never falls back: an "
          "unavailable transport or provider stops the worker. docs/kvtransfer.md.");

ABSL_FLAG(bool, enable_prefix_caching, true,
          "Prefix caching (on, as K3 deployments run it; --enable-prefix-caching=false "
          "turns it off): prompts' full MLA blocks cached by content, KDA state "
          "snapshots at chunk-aligned positions; a hit reuses both "
          "(engine/cache/prefix_cache.h).");
ABSL_FLAG(double, prefix_snapshot_memory, 0.05,
          "Share of --kv_cache_memory for prefix-cache KDA snapshots, in [0, 0.9] "
          "(0: no snapshots, so no hits).");
ABSL_FLAG(std::string, prefix_host_memory, "",
          "Prefix caching's host-memory tier: bytes of host memory (64GiB, 512MiB; "
          "K/M/G mean KiB/MiB/GiB) that hold the MLA blocks and KDA snapshots the "
          "engine's cache evicts, loaded back on a hit instead of recomputed; 0: off "
          "(evictions drop). Default: min(2 x --kv_cache_memory's budget, half the "
          "host memory available at start) (docs/prefix_caching.md).");
ABSL_FLAG(bool, prefix_snapshot_generations, true,
          "Prefix caching: snapshot the end of every finished generation for the "
          "next chat turn (a background prefill continuation recomputes prompt + "
          "output to the last 64-token multiple on spare capacity; "
          "docs/prefix_caching.md).");
ABSL_FLAG(int64_t, prefix_snapshot_grid, 16384,
          "Prefix caching: also snapshot long prompts every this many tokens "
          "(0: only at the last full chunk and at branch points).");

namespace tandem::worker {
namespace {

// --max_tokens_per_step's default off a GPU: a CPU forward of 256 tokens takes
// about a decode step's latency budget.
constexpr int64_t kHostMaxTokensPerStep = 256;

}  // namespace

bool HostHasRdmaDevices(const std::string& sysfs_dir) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(sysfs_dir, ec)) {
    (void)e;
    return true;
  }
  return false;
}

bool StagingPageRelease(uint64_t shadow_bytes, int64_t mem_available, bool rdma) {
  if (rdma) return false;  // the NIC may pin the pages: never drop them
  return mem_available <= 0 || shadow_bytes > static_cast<uint64_t>(mem_available) / 4;
}

void ChooseStagingPageRelease(kvtransfer::TransferAgent* agent,
                              const std::string& meminfo_path) {
  auto* staging = dynamic_cast<kvtransfer::HostStagingAgent*>(agent);
  if (staging == nullptr) return;
  const kvtransfer::HostStagingStats st = staging->stats();
  if (st.staged_regions == 0) return;
  const bool rdma = HostHasRdmaDevices();
  const absl::StatusOr<int64_t> avail = engine::ReadMemAvailable(meminfo_path);
  const int64_t mem = avail.ok() ? *avail : 0;
  const bool release = StagingPageRelease(st.shadow_bytes, mem, rdma);
  staging->set_release_pages(release);
  const absl::Status ipc = staging->ipc_export_status();
  auto log = [&](auto&& line) {
    line.Kv("shadow_bytes", st.shadow_bytes)
        .Kv("mem_available_bytes", mem)
        .Kv("rdma", rdma)
        .Kv("release_pages", release)
        .Kv("device_ipc_regions", st.exported_regions)
        .Kv("device_ipc", !ipc.ok()                 ? std::string(ipc.message())
                          : st.exported_regions > 0 ? std::string("published")
                          : !staging->options().device_ipc
                              ? std::string("off (--kv_device_ipc=false)")
                              : std::string("maps its peers' (a prefill "
                                            "worker publishes none)"));
  };
  // Large shadows kept only because of RDMA (no release otherwise means small).
  if (rdma && StagingPageRelease(st.shadow_bytes, mem, /*rdma=*/false)) {
    log(TLOG(WARNING,
             "KV cache staged through host memory; its shadow pages are kept "
             "resident (the RDMA transport may pin them) and may grow to their "
             "size: use a transport built with CUDA"));
  } else {
    log(TLOG(INFO, release ? "KV cache staged through host memory; pages go back "
                             "once their bytes moved (bounded memory, a fault per "
                             "page per transfer)"
                           : "KV cache staged through host memory; pages kept "
                             "resident (the shadows fit in a quarter of the host's "
                             "available memory)"));
  }
}

absl::StatusOr<std::unique_ptr<kvtransfer::TransferAgent>> TransferAgentFromFlags(
    const std::string& worker_id, kvtransfer::TransportInfo* info,
    std::function<void(const kvtransfer::UcxPeerTransport&)> on_peer_connected) {
  TANDEM_ASSIGN_OR_RETURN(kvtransfer::AgentFactoryConfig config,
                          AgentConfigFromFlags(worker_id));
  config.ucx.on_peer_connected = std::move(on_peer_connected);
  TANDEM_ASSIGN_OR_RETURN(kvtransfer::CreatedAgent created,
                          kvtransfer::CreateTransferAgent(config));
  if (config.transport == kvtransfer::KvTransport::kLibfabric) {
    TANDEM_RETURN_IF_ERROR(
        CheckLibfabricRdma(created.info.provider, config.ucx.require_rdma));
  }
  TLOG(INFO, "KV transfer agent started")
      .Kv("kv_transport", absl::GetFlag(FLAGS_kv_transport))
      .Kv("agent", created.description)
      .Kv("provider", created.info.provider)
      .Kv("fabric", created.info.fabric)
      .Kv("domain", created.info.domain)
      .Kv("rails", created.info.rails)
      .Kv("kv_require_rdma", absl::GetFlag(FLAGS_kv_require_rdma))
      .Kv("kv_progress_timeout", absl::FormatDuration(config.ucx.progress_timeout))
      .Kv("nics", absl::StrJoin(created.info.nics, "; "));
  if (info != nullptr) *info = created.info;
  // Device caches may be staged through host memory (--kv_buffer); over host
  // memory the staging agent is its inner agent.
  kvtransfer::HostStagingOptions staging;
  TANDEM_ASSIGN_OR_RETURN(staging.buffer,
                          kvtransfer::ParseKvBuffer(absl::GetFlag(FLAGS_kv_buffer)));
  staging.release_pages = false;  // ChooseStagingPageRelease, once registered
  staging.device_ipc = absl::GetFlag(FLAGS_kv_device_ipc);
  return std::unique_ptr<kvtransfer::TransferAgent>(
      new kvtransfer::HostStagingAgent(std::move(created.agent), staging));
}

absl::StatusOr<std::unique_ptr<WorkerModel>> LoadWorkerModelFromFlags() {
  return LoadWorkerModel(absl::GetFlag(FLAGS_model), absl::GetFlag(FLAGS_backend),
                         absl::GetFlag(FLAGS_served_model_name),
                         absl::GetFlag(FLAGS_tp));
}

absl::StatusOr<engine::EngineOptions> EngineOptionsFromFlags(
    const WorkerModel& model, engine::CacheSizing* sizing, int32_t speculative_tokens) {
  engine::EngineOptions eo;
  eo.block_size = absl::GetFlag(FLAGS_block_size);
  eo.max_tokens_per_step = absl::GetFlag(FLAGS_max_tokens_per_step);
  if (eo.max_tokens_per_step < 0) {
    return InvalidArgument("--max_tokens_per_step must be >= 0 (0: by device), got ",
                           eo.max_tokens_per_step);
  }
  if (eo.max_tokens_per_step == 0) {
    eo.max_tokens_per_step =
        engine::DefaultMaxTokensPerStep(model.backend->device(), kHostMaxTokensPerStep);
    TLOG(INFO, "step budget by device")
        .Kv("device", model.backend->device().name())
        .Kv("max_tokens_per_step", eo.max_tokens_per_step);
  }
  eo.enforce_eager = absl::GetFlag(FLAGS_enforce_eager);
  eo.device_sampling = absl::GetFlag(FLAGS_device_sampling);
  eo.overlap_steps = absl::GetFlag(FLAGS_overlap_steps);
  // A device cache others may write into directly (--kv_device_ipc).
  eo.cache_shareable = absl::GetFlag(FLAGS_kv_device_ipc);
  if (eo.block_size <= 0) {
    return InvalidArgument("--block_size must be >= 1, got ", eo.block_size);
  }
  TANDEM_RETURN_IF_ERROR(ApplyTpFlags(absl::GetFlag(FLAGS_tp),
                                      absl::GetFlag(FLAGS_tp_fail_rank_at_step), &eo));
  if (eo.tp.fail_rank >= 0) {
    TLOG(WARNING, "FAILURE DRILL --tp_fail_rank_at_step: a TP rank will die")
        .Kv("rank", eo.tp.fail_rank)
        .Kv("step", eo.tp.fail_rank_at_step);
  }
  eo.prefix_caching.enabled = absl::GetFlag(FLAGS_enable_prefix_caching);
  eo.prefix_caching.snapshot_grid = absl::GetFlag(FLAGS_prefix_snapshot_grid);
  eo.prefix_caching.snapshot_generations =
      absl::GetFlag(FLAGS_prefix_snapshot_generations);
  WorkerMemoryFlags mf;
  mf.kv_cache_memory = absl::GetFlag(FLAGS_kv_cache_memory);
  mf.gpu_memory_utilization = absl::GetFlag(FLAGS_gpu_memory_utilization);
  mf.max_num_seqs = absl::GetFlag(FLAGS_max_num_seqs);
  mf.max_model_len = absl::GetFlag(FLAGS_max_model_len);
  mf.num_blocks = absl::GetFlag(FLAGS_num_blocks);
  mf.prefix_snapshot_memory = absl::GetFlag(FLAGS_prefix_snapshot_memory);
  mf.speculative_tokens = speculative_tokens;
  TANDEM_ASSIGN_OR_RETURN(*sizing, SizeWorkerCache(model, mf, &eo));
  if (eo.prefix_caching.enabled) {
    const std::string spec = absl::GetFlag(FLAGS_prefix_host_memory);
    int64_t available = 0;
    if (spec.empty()) {
      absl::StatusOr<int64_t> a = engine::ReadMemAvailable(mf.meminfo_path);
      if (a.ok()) available = *a;
    }
    TANDEM_ASSIGN_OR_RETURN(
        eo.prefix_caching.host_memory_bytes,
        engine::ResolveHostTierBudget(spec, sizing->budget_bytes, available));
    TLOG(INFO, "prefix cache host tier")
        .Kv("prefix_host_memory", spec.empty() ? "default" : spec)
        .Kv("kv_cache_budget_bytes", sizing->budget_bytes)
        .Kv("available_bytes", available)
        .Kv("host_tier_bytes", eo.prefix_caching.host_memory_bytes);
  }
  return eo;
}

absl::StatusOr<absl::Duration> ParseKvProgressTimeout(absl::string_view spec) {
  const std::string v = absl::AsciiStrToLower(absl::StripAsciiWhitespace(spec));
  if (v == "inf" || v == "off") return absl::InfiniteDuration();
  absl::Duration d;
  double seconds = 0;
  if (absl::SimpleAtod(v, &seconds) && std::isfinite(seconds)) {
    d = absl::Seconds(seconds);
  } else if (!absl::ParseDuration(v, &d)) {
    return InvalidArgument(
        "--kv_progress_timeout must be a duration (10s, 500ms), "
        "seconds or inf, got \"",
        spec, "\"");
  }
  if (d <= absl::ZeroDuration()) {
    return InvalidArgument("--kv_progress_timeout must be > 0 (inf: off), got \"", spec,
                           "\"");
  }
  return d;
}

absl::Status CheckLibfabricRdma(absl::string_view provider,
                                kvtransfer::UcxRdmaRequirement requirement) {
  if (requirement != kvtransfer::UcxRdmaRequirement::kRequired) {
    return absl::OkStatus();
  }
  for (absl::string_view tcp : {"tcp", "sockets", "udp"}) {
    if (absl::StartsWith(provider, tcp)) {
      return FailedPrecondition(
          "--kv_require_rdma=true but libfabric opened the ", provider,
          " provider (TCP/UDP sockets): --kv_transport=libfabric:efa on EFA, "
          "libfabric:shm on one host, or --kv_require_rdma=false");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<kvtransfer::UcxAgentConfig> UcxConfigFromFlags(
    const std::string& worker_id) {
  kvtransfer::UcxAgentConfig uc;
  uc.tls = absl::GetFlag(FLAGS_ucx_tls);
  uc.peer_failure_detection = absl::GetFlag(FLAGS_ucx_peer_failure_detection);
  uc.name = worker_id;
  TANDEM_ASSIGN_OR_RETURN(
      uc.progress_timeout,
      ParseKvProgressTimeout(absl::GetFlag(FLAGS_kv_progress_timeout)));
  TANDEM_ASSIGN_OR_RETURN(uc.require_rdma, kvtransfer::ParseUcxRdmaRequirement(
                                               absl::GetFlag(FLAGS_kv_require_rdma)));
  return uc;
}

absl::StatusOr<kvtransfer::AgentFactoryConfig> AgentConfigFromFlags(
    const std::string& worker_id) {
  kvtransfer::AgentFactoryConfig config;
  TANDEM_ASSIGN_OR_RETURN(config.ucx, UcxConfigFromFlags(worker_id));
  config.libfabric.progress_timeout = config.ucx.progress_timeout;
  TANDEM_RETURN_IF_ERROR(
      kvtransfer::ParseKvTransport(absl::GetFlag(FLAGS_kv_transport), &config));
  return config;
}

WorkerServerOptions ServerOptionsFromFlags(const std::string& worker_id,
                                           tandem::v1::WorkerRole role,
                                           const WorkerModel& model,
                                           const tandem::v1::KvLayout& layout,
                                           int64_t max_context_tokens) {
  WorkerServerOptions so;
  so.host = absl::GetFlag(FLAGS_host);
  so.advertise_host = absl::GetFlag(FLAGS_advertise_host);
  so.port = absl::GetFlag(FLAGS_port);
  so.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  so.router = absl::GetFlag(FLAGS_router);
  so.drain_timeout = absl::Seconds(std::max(0.0, absl::GetFlag(FLAGS_drain_timeout_s)));
  so.registration.set_worker_id(worker_id);
  so.registration.set_role(role);
  so.registration.set_model_id(model.model_id);
  so.registration.set_model_fingerprint(model.fingerprint);
  so.registration.set_tp_size(absl::GetFlag(FLAGS_tp));
  so.registration.set_max_context_tokens(max_context_tokens);
  *so.registration.mutable_layout() = layout;
  return so;
}

}  // namespace tandem::worker
