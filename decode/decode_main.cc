// The decode worker process: DecodeWorker gRPC service over one engine thread, a
// UCX transfer agent with the engine's caches (every TP rank's: allocated through
// the agent on a host backend, the device's memory on a device backend)
// registered, so prefilled state lands in the engine's own blocks;
// registration with the router, grpc.health.v1, /metrics.
//
//   decode_main --model=DIR --router=HOST:PORT [--port=0] [--metrics_port=0]
//               [--tp=N] [--tp_fail_rank_at_step=R:S]
//               [--speculative=ngram|draft [--draft_model=DIR]]
//               [--num_speculative_tokens=K]
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "common/init.h"
#include "common/logging.h"
#include "common/signals.h"
#include "common/tls/tls_flags.h"
#include "decode/decode_service.h"
#include "kvtransfer/host_staging_agent.h"
#include "kvtransfer/ucx_agent.h"
#include "metrics/registry.h"
#include "worker/device_checksum.h"
#include "worker/engine_loop.h"
#include "worker/worker_flags.h"
#include "worker/worker_metrics.h"
#include "worker/worker_model.h"
#include "worker/worker_server.h"

ABSL_FLAG(std::string, worker_id, "decode-0", "Worker id registered with the router.");
ABSL_FLAG(
    std::string, speculative, "none",
    "Speculative decoding: none | ngram (prompt lookup) | draft (--draft_model).");
ABSL_FLAG(int, num_speculative_tokens, 3, "Drafts verified per decode step.");
ABSL_FLAG(std::string, draft_model, "",
          "Draft checkpoint for --speculative=draft (same tokenizer and vocabulary).");
ABSL_FLAG(double, max_lease_s, 3600,
          "Longest reservation lease granted (the router asks for the time until the "
          "request's deadline: a long prompt's prefill can take minutes to hours, and "
          "the reservation must outlive it).");
ABSL_FLAG(double, unlanded_quarantine_s, 5,
          "Seconds a reservation released before its state landed keeps its blocks "
          "out of use (a prefill worker the router gave up on may still write).");

int main(int argc, char** argv) {
  tandem::BlockTerminationSignals();
  tandem::InitProgram(argc, argv, "decode",
                      "Tandem decode worker.\nusage: decode_main --model=DIR "
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
  tandem::engine::CacheSizing sizing;
  // The draft model (--speculative=draft) before the sizing: on a device backend
  // the sizing measures what the device holds, the draft's weights included.
  tandem::engine::EngineOptions speculative;
  if (absl::Status s = tandem::worker::ApplySpeculativeFlags(
          absl::GetFlag(FLAGS_speculative), absl::GetFlag(FLAGS_num_speculative_tokens),
          absl::GetFlag(FLAGS_draft_model), model->get(), &speculative);
      !s.ok()) {
    TLOG(ERROR, "bad speculative-decoding flags").Kv("status", s);
    return 1;
  }
  auto options = tandem::worker::EngineOptionsFromFlags(
      **model, &sizing,
      speculative.speculative.method == tandem::engine::SpeculativeMethod::kNone
          ? 0
          : speculative.speculative.num_speculative_tokens);
  if (!options.ok()) {
    TLOG(ERROR, "bad engine flags").Kv("status", options.status());
    return 1;
  }
  tandem::engine::EngineOptions& eo = *options;
  eo.speculative = speculative.speculative;
  // The router reserves a prompt where its blocks are: announce those of the
  // prompts this worker computes itself too, not only the landed ones.
  eo.prefix_caching.announce_blocks = true;
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
  // On a host backend the engine's caches come from the agent (shared memory the
  // prefill worker's puts copy straight into); on a device backend they are the
  // device's memory, registered with the agent as such by the service. Declared
  // after the agent, so freed before it, and before the engine (the loop
  // below), so freed after it.
  tandem::worker::AgentAllocations allocations(agent->get());
  if ((*model)->backend->device().name() == "host") {
    eo.cache_allocator = allocations.Allocator();
  }
  auto engine = tandem::worker::MakeEngine(model->get(), eo);
  if (!engine.ok()) {
    TLOG(ERROR, "cannot create the engine").Kv("status", engine.status());
    return 1;
  }
  // One cache per TP rank, each registered with the agent by the service.
  const std::vector<tandem::engine::KvCache*> caches =
      tandem::worker::RankCaches(**engine);
  // Each rank's backend when the caches are device memory: the landed state's
  // checksums run there (worker/device_checksum.h).
  const std::vector<tandem::kernels::Backend*> checksum_backends =
      tandem::worker::DeviceChecksumBackends(**engine);
  metrics.SetCacheSizing(sizing);
  metrics.SetKvTransport(transport.agent, transport.provider, transport.rails);
  auto loop = std::make_unique<tandem::worker::EngineLoop>(std::move(*engine));
  tandem::decode::DecodeServiceOptions dso;
  dso.worker_id = absl::GetFlag(FLAGS_worker_id);
  dso.max_lease = absl::Seconds(absl::GetFlag(FLAGS_max_lease_s));
  dso.unlanded_quarantine = absl::Seconds(absl::GetFlag(FLAGS_unlanded_quarantine_s));
  dso.allocations = &allocations;
  dso.checksum_backends = checksum_backends;
  auto service = tandem::decode::DecodeService::Create(loop.get(), caches, agent->get(),
                                                       &metrics, dso);
  if (!service.ok()) {
    TLOG(ERROR, "cannot start the decode service").Kv("status", service.status());
    return 1;
  }
  // Staged caches (--kv_buffer): keep the shadows' pages or give them back.
  tandem::worker::ChooseStagingPageRelease(agent->get());
  tandem::worker::WorkerServerOptions so = tandem::worker::ServerOptionsFromFlags(
      dso.worker_id, tandem::v1::WORKER_ROLE_DECODE, **model, (*service)->layout(),
      eo.max_context_tokens);
  so.health = [l = loop.get()] { return l->health(); };
  // It reads ReserveRequest.images: image prompts' keys carry their hashes, and
  // their rows are never recomputed here.
  so.registration.set_reserves_with_images(true);
  so.registration.set_samples_logit_bias(true);
  so.registration.set_computes_prompt_logprobs(true);
  // Cache-aware routing: the router matches prompts against what the cache
  // reports (registration.h).
  if (eo.prefix_caching.enabled) {
    so.prefix_events = [l = loop.get()] { return l->TakePrefixEvents(); };
  }
  // Draining waits for reservations too (hand-offs whose KV has not landed yet).
  so.busy = [s = service->get()] { return s->num_reservations(); };
  so.server_credentials = creds->server;
  so.router_credentials = creds->channel;
  so.mtls = creds->mtls;
  tandem::decode::DecodeService* svc = service->get();
  const int rc = tandem::worker::ServeWorker(
      so, svc, &registry, [svc] { return svc->Load(); },
      [&] {
        metrics.Update(loop->stats(), absl::Now());
        metrics.UpdateKvStaging(staging->stats());
      });
  svc->Stop();   // no janitor or notifications calling into the loop
  loop.reset();  // no engine callbacks after this
  service->reset();
  return rc;
}
