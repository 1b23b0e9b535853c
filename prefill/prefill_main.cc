// The prefill worker process: PrefillWorker gRPC service over one engine thread,
// a UCX transfer agent with the engine's cache registered, registration with the
// router, grpc.health.v1, /metrics.
//
//   prefill_main --model=DIR --router=HOST:PORT [--port=0] [--metrics_port=0]
//                [--kv_stream_layers=true] [--tp=N] [--tp_fail_rank_at_step=R:S]
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "common/init.h"
#include "common/logging.h"
#include "common/signals.h"
#include "common/tls/tls_flags.h"
#include "engine/vision/vision_tower.h"
#include "kernels/backend_factory.h"
#include "kvtransfer/host_staging_agent.h"
#include "kvtransfer/ucx_agent.h"
#include "metrics/registry.h"
#include "prefill/prefill_service.h"
#include "worker/device_checksum.h"
#include "worker/engine_loop.h"
#include "worker/worker_flags.h"
#include "worker/worker_metrics.h"
#include "worker/worker_model.h"
#include "worker/worker_server.h"

ABSL_DECLARE_FLAG(int, tp);  // worker/worker_flags.cc

ABSL_FLAG(std::string, worker_id, "prefill-0", "Worker id registered with the router.");
ABSL_FLAG(bool, kv_stream_layers, true,
          "Stream each layer's KV/KDA state to the decode worker while the prefill "
          "computes (false: the whole state after the prefill).");
ABSL_FLAG(bool, kv_write_after_held_prefix, true,
          "Write only the KV rows after the decode worker's held prefix "
          "(KvTarget.cached_prefix_tokens) and say so at registration "
          "(writes_after_held_prefix), so the router lets decode workers share "
          "cached blocks for this worker's transfers. false: register without it "
          "(decode workers then share nothing for its transfers, as for a worker "
          "older than the field) and refuse a target with held rows.");
ABSL_FLAG(bool, test_corrupt_transfer, false,
          "TEST ONLY: flip one byte of every transfer after checksumming it.");

int main(int argc, char** argv) {
  tandem::BlockTerminationSignals();
  tandem::InitProgram(argc, argv, "prefill",
                      "Tandem prefill worker.\nusage: prefill_main --model=DIR "
                      "--router=HOST:PORT [--port=N] [--metrics_port=N]");
  // --tls_*: mTLS on this worker's server and its channel to the router.
  auto creds = tandem::tls::GrpcCredentialsFromFlags();
  if (!creds.ok()) {
    TLOG(ERROR, "bad TLS flags").Kv("status", creds.status());
    return 2;
  }
  auto model = tandem::worker::LoadWorkerModelFromFlags();
  if (!model.ok()) {
    TLOG(ERROR, "cannot load the model").Kv("status", model.status());
    return 1;
  }
  // The vision towers, when the checkpoint has one: a prompt's images are
  // encoded here (the decode worker only receives their state), on the
  // service's encoder threads while the engine steps. So each tower gets a
  // backend of its own: on a device backend one tower per TP rank's GPU (the
  // same device as the rank, its own stream and scratch; requests' images are
  // spread over them, as vLLM's data-parallel encoder mode), on the host one
  // (its own thread pool). Loaded before the cache is sized, so that on a
  // device each tower's weights and one call's activations come out of its
  // GPU's budget.
  std::vector<std::unique_ptr<tandem::kernels::Backend>> vision_backends;
  std::vector<std::unique_ptr<tandem::vision::VisionTower>> towers;
  {
    auto parsed = tandem::kernels::ParseBackendName((*model)->backend_name);
    const bool on_device = (*model)->backend->device().name() != "host";
    const int count = on_device ? std::max(1, absl::GetFlag(FLAGS_tp)) : 1;
    for (int r = 0; r < count && parsed.ok(); ++r) {
      auto b = count == 1
                   ? tandem::kernels::CreateBackend((*model)->backend_name)
                   : tandem::kernels::CreateBackend(parsed->kind, parsed->ordinal + r);
      absl::StatusOr<std::unique_ptr<tandem::vision::VisionTower>> tower =
          b.ok() ? tandem::vision::VisionTower::Load(*(*model)->checkpoint, b->get())
                 : absl::StatusOr<std::unique_ptr<tandem::vision::VisionTower>>(
                       b.status());
      if (absl::IsNotFound(tower.status())) {
        TLOG(INFO,
             "the checkpoint has no vision tower: prompts with images are refused");
        break;
      }
      if (absl::IsFailedPrecondition(tower.status())) {
        TLOG(WARNING,
             "the vision tower cannot run on this backend: prompts with images "
             "are refused")
            .Kv("status", tower.status());
        towers.clear();
        vision_backends.clear();
        (*model)->extra_device_bytes.clear();
        break;
      }
      if (!tower.ok()) {
        TLOG(ERROR, "cannot load the vision tower")
            .Kv("tower", r)
            .Kv("status", tower.status());
        return 1;
      }
      // On a device: the weights, the calls' buffer (allocated now, for the
      // largest image and the router's 64 images a request), and the tower
      // backend's own workspace (cuBLASLt's, the op scratch).
      constexpr int64_t kImagesPerRequest = 64;  // router/request_validation.h
      constexpr int64_t kBackendWorkspaceBytes = int64_t{64} << 20;
      auto held = (*tower)->ReserveActivations(
          tandem::vision::VisionTower::kMaxPatchesPerImage, kImagesPerRequest);
      if (!held.ok()) {
        TLOG(ERROR, "cannot load the vision tower")
            .Kv("tower", r)
            .Kv("status", held.status());
        return 1;
      }
      const int64_t reserve =
          (*tower)->weight_device_bytes() > 0
              ? (*tower)->weight_device_bytes() + *held + kBackendWorkspaceBytes
              : 0;
      (*model)->extra_device_bytes.resize(r + 1, 0);
      (*model)->extra_device_bytes[r] += reserve;
      TLOG(INFO, "vision tower loaded: image input is served")
          .Kv("tower", r)
          .Kv("backend", (*b)->name())
          .Kv("device", (*b)->device().name())
          .Kv("weight_bytes", (*tower)->weight_device_bytes())
          .Kv("device_reserve_bytes", reserve);
      towers.push_back(*std::move(tower));
      vision_backends.push_back(*std::move(b));
    }
    if (!parsed.ok()) {
      TLOG(ERROR, "bad backend name").Kv("status", parsed.status());
      return 1;
    }
  }
  tandem::engine::CacheSizing sizing;
  auto options = tandem::worker::EngineOptionsFromFlags(**model, &sizing);
  if (!options.ok()) {
    TLOG(ERROR, "bad engine flags").Kv("status", options.status());
    return 1;
  }
  tandem::engine::EngineOptions& eo = *options;
  // A prefill worker writes into its decode peers' device memory (IPC); its
  // own cache is never mapped by anyone, so it stays in the device's pool.
  eo.cache_shareable = false;
  auto engine = tandem::worker::MakeEngine(model->get(), eo);
  if (!engine.ok()) {
    TLOG(ERROR, "cannot create the engine").Kv("status", engine.status());
    return 1;
  }
  std::vector<tandem::engine::KvCache*> caches = tandem::worker::RankCaches(**engine);
  // Each rank's backend when the caches are device memory: the state's checksums
  // run there (worker/device_checksum.h).
  const std::vector<tandem::kernels::Backend*> checksum_backends =
      tandem::worker::DeviceChecksumBackends(**engine);
  // The metrics first: the agent counts its peer connections by transport there
  // (declared before the agent, so they outlive it).
  tandem::metrics::Registry registry;
  tandem::worker::WorkerMetrics metrics(&registry);
  tandem::kvtransfer::TransportInfo transport;
  auto agent = tandem::worker::TransferAgentFromFlags(
      absl::GetFlag(FLAGS_worker_id), &transport,
      [&metrics](const tandem::kvtransfer::UcxPeerTransport& t) {
        metrics.CountKvPeerConnection("ucx", t.transports, t.tcp_only, t.refused);
      });
  if (!agent.ok()) {
    TLOG(ERROR, "cannot start the KV transfer agent").Kv("status", agent.status());
    return 1;
  }
  // TransferAgentFromFlags wraps the agent in the host staging (--kv_buffer).
  auto* staging = dynamic_cast<tandem::kvtransfer::HostStagingAgent*>(agent->get());
  if (staging == nullptr) {
    TLOG(ERROR, "the KV transfer agent has no host staging");
    return 1;
  }
  staging->set_publish_device_ipc(false);  // maps its peers', publishes none
  metrics.SetCacheSizing(sizing);
  metrics.SetKvTransport(transport.agent, transport.provider, transport.rails);
  auto loop = std::make_unique<tandem::worker::EngineLoop>(std::move(*engine));
  tandem::prefill::PrefillServiceOptions pso;
  pso.worker_id = absl::GetFlag(FLAGS_worker_id);
  pso.test_corrupt_transfer = absl::GetFlag(FLAGS_test_corrupt_transfer);
  pso.stream_layers = absl::GetFlag(FLAGS_kv_stream_layers);
  pso.write_after_held_prefix = absl::GetFlag(FLAGS_kv_write_after_held_prefix);
  pso.checksum_backends = checksum_backends;
  for (const auto& t : towers) pso.vision.push_back(t.get());
  if (pso.test_corrupt_transfer) {
    TLOG(WARNING, "TEST ONLY --test_corrupt_transfer: every transfer is corrupted");
  }
  auto service = tandem::prefill::PrefillService::Create(loop.get(), caches,
                                                         agent->get(), &metrics, pso);
  if (!service.ok()) {
    TLOG(ERROR, "cannot start the prefill service").Kv("status", service.status());
    return 1;
  }
  // Staged caches (--kv_buffer): keep the shadows' pages or give them back.
  tandem::worker::ChooseStagingPageRelease(agent->get());
  tandem::worker::WorkerServerOptions so = tandem::worker::ServerOptionsFromFlags(
      pso.worker_id, tandem::v1::WORKER_ROLE_PREFILL, **model, (*service)->layout(),
      eo.max_context_tokens);
  // The router lets a decode worker share cached blocks (skipping their rows
  // here) only for transfers a worker that registered this writes.
  so.registration.set_writes_after_held_prefix(pso.write_after_held_prefix);
  so.registration.set_samples_logit_bias(true);
  so.registration.set_computes_prompt_logprobs(true);
  so.health = [l = loop.get()] { return l->health(); };
  // Cache-aware routing: the router matches prompts against what the cache
  // reports (registration.h).
  if (eo.prefix_caching.enabled) {
    so.prefix_events = [l = loop.get()] { return l->TakePrefixEvents(); };
  }
  so.server_credentials = creds->server;
  so.router_credentials = creds->channel;
  so.mtls = creds->mtls;
  tandem::prefill::PrefillService* svc = service->get();
  const int rc = tandem::worker::ServeWorker(
      so, svc, &registry, [svc] { return svc->Load(); },
      [&] {
        metrics.Update(loop->stats(), absl::Now());
        metrics.UpdateKvStaging(staging->stats());
      });
  (*service)->StopEncoding();  // its last requests go through the loop
  loop.reset();                // no engine callbacks after this
  service->reset();
  towers.clear();
  return rc;
}
