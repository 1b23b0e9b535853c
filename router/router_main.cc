// The router process: Router + Registry gRPC services, grpc.health.v1, /metrics.
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <csignal>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/time/clock.h"
#include "common/init.h"
#include "common/logging.h"
#include "common/signals.h"
#include "common/tls/tls_flags.h"
#include "engine/model/served_model.h"
#include "engine/tokenizer/tokenizer.h"
#include "metrics/http_exposer.h"
#include "metrics/registry.h"
#include "router/handoff.h"
#include "router/placement.h"
#include "router/router_service.h"
#include "router/worker_registry.h"

ABSL_FLAG(std::string, model, "",
          "Model directory (its config.json describes the model).");
ABSL_FLAG(std::string, served_model_name, "",
          "Model id clients use (default: kimi-k3 for the K3 layout).");
ABSL_FLAG(std::string, host, "127.0.0.1", "Address to listen on (0.0.0.0 for all).");
ABSL_FLAG(int, port, 50051, "gRPC port (0 picks a free one and logs it).");
ABSL_FLAG(std::string, routing_policy, "cache_aware",
          "Prefill worker choice: cache_aware (the longest cached prefix unless "
          "the load says otherwise: router/prefix_routing.h), least_load, "
          "round_robin.");
ABSL_FLAG(int, metrics_port, 9100, "Port of the /metrics HTTP endpoint (0: any free).");
ABSL_FLAG(double, heartbeat_interval_s, 1.0, "Heartbeat interval asked of workers.");
ABSL_FLAG(double, heartbeat_timeout_s, 5.0,
          "Workers silent for this long are dropped from the registry.");
ABSL_FLAG(int, colocate_below_tokens, tandem::router::kDefaultColocateBelowTokens,
          "Prompts whose uncached part (the prompt less the deepest prefix a "
          "decode worker reported holding) is shorter than this are prefilled on "
          "that decode worker itself (conditional disaggregation, as Dynamo's "
          "max_local_prefill_length, 1000 there too); 0: always disaggregate. "
          "Prompts with images are always disaggregated.");
ABSL_FLAG(int, max_prefill_attempts, 3,
          "Prefill attempts per request when prefill workers are lost.");
ABSL_FLAG(int, max_in_flight, 256,
          "Generate calls running at once; more wait in the admission queue.");
ABSL_FLAG(int, max_queued_requests, 4096,
          "Requests that may wait for capacity (the in-flight limit, or a decode "
          "worker with room); beyond it RESOURCE_EXHAUSTED (HTTP 429). 0: none wait.");
ABSL_FLAG(double, queue_timeout_s, 300,
          "Longest wait in the admission queue (never past the request's own "
          "deadline); then RESOURCE_EXHAUSTED (HTTP 429 with Retry-After).");
ABSL_FLAG(double, request_timeout_s, 600, "Deadline of a request that has none.");
ABSL_FLAG(double, rpc_timeout_s, 5, "Deadline of Reserve and Release calls.");
ABSL_FLAG(int, lease_ms, 30000,
          "Shortest reservation lease asked of decode workers (a request asks for the "
          "time until its deadline when that is longer).");
ABSL_FLAG(bool, kv_checksums, true,
          "Checksum every transferred state (prefill computes, decode verifies).");

int main(int argc, char** argv) {
  tandem::BlockTerminationSignals();
  tandem::InitProgram(argc, argv, "router",
                      "Tandem router: splits requests between prefill and decode "
                      "workers.\nusage: router_main --model=DIR [--port=50051]");
  const std::string model_dir = absl::GetFlag(FLAGS_model);
  if (model_dir.empty()) {
    fprintf(stderr, "router: --model=DIR is required\n");
    return 2;
  }
  auto model =
      tandem::model::LoadServedModel(model_dir, absl::GetFlag(FLAGS_served_model_name),
                                     absl::ToUnixSeconds(absl::Now()));
  if (!model.ok()) {
    TLOG(ERROR, "cannot load the model description").Kv("status", model.status());
    return 1;
  }

  // --tls_*: mTLS on the Router/Registry server and the channels to workers.
  auto creds = tandem::tls::GrpcCredentialsFromFlags();
  if (!creds.ok()) {
    TLOG(ERROR, "bad TLS flags").Kv("status", creds.status());
    return 2;
  }

  tandem::metrics::Registry metric_registry;
  tandem::router::RouterMetrics metrics(&metric_registry);
  tandem::router::WorkerRegistry workers(
      tandem::Clock::Real(), absl::Seconds(absl::GetFlag(FLAGS_heartbeat_timeout_s)));
  std::unique_ptr<tandem::tokenizer::Tokenizer> tokenizer;
  if (auto tok = tandem::tokenizer::Tokenizer::Load(model_dir); tok.ok()) {
    tokenizer = std::move(*tok);
  } else {
    TLOG(WARNING, "no tokenizer in the model directory; prompt_text is refused")
        .Kv("status", tok.status());
  }
  tandem::router::HandoffMetrics handoff_metrics(&metric_registry);
  tandem::router::HandoffOptions ho;
  {
    auto policy =
        tandem::router::ParseRoutingPolicy(absl::GetFlag(FLAGS_routing_policy));
    if (!policy.ok()) {
      std::fprintf(stderr, "router: --routing_policy: %s\n",
                   std::string(policy.status().message()).c_str());
      return 2;
    }
    ho.routing_policy = *policy;
  }
  ho.colocate_below_tokens = absl::GetFlag(FLAGS_colocate_below_tokens);
  if (ho.colocate_below_tokens < 0) {
    std::fprintf(stderr,
                 "router: --colocate_below_tokens must be a number of tokens >= 0 "
                 "(0: always disaggregate), got %d\n",
                 ho.colocate_below_tokens);
    return 2;
  }
  ho.max_prefill_attempts = absl::GetFlag(FLAGS_max_prefill_attempts);
  ho.rpc_timeout = absl::Seconds(absl::GetFlag(FLAGS_rpc_timeout_s));
  ho.lease_ms = absl::GetFlag(FLAGS_lease_ms);
  ho.checksums = absl::GetFlag(FLAGS_kv_checksums);
  ho.max_context_tokens = model->info.max_context_tokens();
  ho.queue.max_queued_requests = absl::GetFlag(FLAGS_max_queued_requests);
  ho.queue.queue_timeout = absl::Seconds(absl::GetFlag(FLAGS_queue_timeout_s));
  tandem::router::Handoff handoff(&workers, &handoff_metrics, ho);
  handoff.SetWorkerCredentials(creds->channel);
  tandem::router::RouterServiceOptions ro;
  ro.max_in_flight = absl::GetFlag(FLAGS_max_in_flight);
  ro.request_timeout = absl::Seconds(absl::GetFlag(FLAGS_request_timeout_s));
  tandem::router::RouterService router(*model, &workers, &metrics, &handoff, ro,
                                       tokenizer.get());
  tandem::router::RegistryService registry(
      &workers, &metrics, model->fingerprint,
      absl::Seconds(absl::GetFlag(FLAGS_heartbeat_interval_s)), &handoff);

  tandem::metrics::HttpExposer exposer(
      {.host = absl::GetFlag(FLAGS_host), .port = absl::GetFlag(FLAGS_metrics_port)},
      {&metric_registry});
  if (absl::Status s = exposer.Start(); !s.ok()) {
    TLOG(ERROR, "cannot serve /metrics").Kv("status", s);
    return 1;
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  const std::string address =
      absl::GetFlag(FLAGS_host) + ":" + std::to_string(absl::GetFlag(FLAGS_port));
  builder.AddListeningPort(address, creds->server, &port);
  // A second router on a taken port fails to bind (gRPC's SO_REUSEPORT would let
  // it share the port with the first, each getting some of the connections).
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Clients that hold long-lived GenerateSession streams (the gateway) ping
  // every 20 s to notice a half-open connection; accept that rate, with or
  // without calls in flight (gRPC's default answers it with GOAWAY).
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.RegisterService(&router);
  builder.RegisterService(&registry);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    TLOG(ERROR, "cannot listen").Kv("address", address);
    return 1;
  }
  TLOG(INFO, "router serving")
      .Kv("grpc_port", port)
      .Kv("metrics_port", exposer.port())
      .Kv("mtls", creds->mtls)
      .Kv("model", model->info.id())
      .Kv("fingerprint", model->fingerprint);

  int sig = tandem::WaitForTerminationSignal();
  TLOG(INFO, "shutting down").Kv("signal", sig);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  // The hand-off calls the shutdown cancelled end on gRPC threads, through the
  // router service's callbacks: wait for them while the services are alive.
  if (!handoff.WaitCallsEnded(tandem::router::Handoff::kCallsEndWithin)) {
    TLOG(ERROR, "hand-off calls still running after the shutdown");
  }
  exposer.Stop();
  return 0;
}
