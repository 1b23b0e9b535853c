#include "worker/worker_flags.h"

#include "absl/flags/flag.h"
#include "common/logging.h"
#include "common/status.h"

ABSL_FLAG(std::string, model, "",
          "Checkpoint directory (config.json, weights, tokenizer).");
ABSL_FLAG(std::string, served_model_name, "", "Model id (default as the router's).");
ABSL_FLAG(std::string, router, "",
          "Router gRPC address to register with (empty: none).");
ABSL_FLAG(std::string, host, "127.0.0.1", "Address to listen on.");
ABSL_FLAG(std::string, advertise_host, "", "Host the router dials (default: --host).");
ABSL_FLAG(int, port, 0, "gRPC port (0: any free port, logged).");
ABSL_FLAG(int, metrics_port, 0, "/metrics port (0: any free port, logged).");
ABSL_FLAG(std::string, backend, "cpu", "Kernel backend: cpu | cpu_reference.");
ABSL_FLAG(int, block_size, 16, "Engine KV cache block size (tokens).");
ABSL_FLAG(int, num_slots, 8, "Concurrent sequences (KDA state slots).");
ABSL_FLAG(int, num_blocks, 0, "Engine KV blocks (0: num_slots full contexts).");
ABSL_FLAG(int64_t, max_context_tokens, 4096, "Prompt + output tokens per request.");
ABSL_FLAG(int64_t, max_tokens_per_step, 256, "Engine token budget per step.");
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

namespace tandem::worker {

absl::StatusOr<std::unique_ptr<WorkerModel>> LoadWorkerModelFromFlags() {
  return LoadWorkerModel(absl::GetFlag(FLAGS_model), absl::GetFlag(FLAGS_backend),
                         absl::GetFlag(FLAGS_served_model_name));
}

absl::StatusOr<engine::EngineOptions> EngineOptionsFromFlags() {
  engine::EngineOptions eo;
  eo.block_size = absl::GetFlag(FLAGS_block_size);
  eo.num_slots = absl::GetFlag(FLAGS_num_slots);
  eo.num_blocks = absl::GetFlag(FLAGS_num_blocks);
  eo.max_context_tokens = absl::GetFlag(FLAGS_max_context_tokens);
  eo.max_tokens_per_step = absl::GetFlag(FLAGS_max_tokens_per_step);
  TANDEM_RETURN_IF_ERROR(ApplyTpFlags(absl::GetFlag(FLAGS_tp),
                                      absl::GetFlag(FLAGS_tp_fail_rank_at_step), &eo));
  if (eo.tp.fail_rank >= 0) {
    TLOG(WARNING, "FAILURE DRILL --tp_fail_rank_at_step: a TP rank will die")
        .Kv("rank", eo.tp.fail_rank)
        .Kv("step", eo.tp.fail_rank_at_step);
  }
  return eo;
}

kvtransfer::UcxAgentConfig UcxConfigFromFlags(const std::string& worker_id) {
  kvtransfer::UcxAgentConfig uc;
  uc.tls = absl::GetFlag(FLAGS_ucx_tls);
  uc.peer_failure_detection = absl::GetFlag(FLAGS_ucx_peer_failure_detection);
  uc.name = worker_id;
  return uc;
}

WorkerServerOptions ServerOptionsFromFlags(const std::string& worker_id,
                                           tandem::v1::WorkerRole role,
                                           const WorkerModel& model,
                                           const tandem::v1::KvLayout& layout) {
  WorkerServerOptions so;
  so.host = absl::GetFlag(FLAGS_host);
  so.advertise_host = absl::GetFlag(FLAGS_advertise_host);
  so.port = absl::GetFlag(FLAGS_port);
  so.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  so.router = absl::GetFlag(FLAGS_router);
  so.registration.set_worker_id(worker_id);
  so.registration.set_role(role);
  so.registration.set_model_id(model.model_id);
  so.registration.set_model_fingerprint(model.fingerprint);
  so.registration.set_tp_size(absl::GetFlag(FLAGS_tp));
  so.registration.set_max_context_tokens(absl::GetFlag(FLAGS_max_context_tokens));
  *so.registration.mutable_layout() = layout;
  return so;
}

}  // namespace tandem::worker
