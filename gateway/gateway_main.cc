// The OpenAI gateway process: REST + SSE on Boost.Beast in front of the
// router's gRPC API. /health and /metrics are served on the same port.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/synchronization/mutex.h"
#include "common/init.h"
#include "common/logging.h"
#include "common/signals.h"
#include "common/tls/tls_flags.h"
#include "engine/tokenizer/tokenizer.h"
#include "gateway/openai_service.h"
#include "gateway/router_client.h"
#include "http/server.h"
#include "metrics/registry.h"

ABSL_FLAG(std::string, host, "127.0.0.1", "Address to listen on (0.0.0.0 for all).");
ABSL_FLAG(int, port, 8000, "HTTP port (0 picks a free one and logs it).");
ABSL_FLAG(std::string, router, "127.0.0.1:50051", "The router's gRPC address.");
ABSL_FLAG(std::string, model, "",
          "Model directory holding the tokenizer (tiktoken.model, "
          "tokenizer_config.json).");
ABSL_FLAG(std::string, served_model_name, "",
          "Model id clients use (default: the router's model ids).");
ABSL_FLAG(std::string, api_key, "",
          "Required API key (Authorization: Bearer KEY); default: $TANDEM_API_KEY; "
          "empty: no authentication.");
ABSL_FLAG(int, io_threads, 2, "HTTP I/O threads.");
ABSL_FLAG(int64_t, max_body_bytes, 4 << 20,
          "Largest request body accepted (413 above).");
ABSL_FLAG(int, max_connections, 10000, "Concurrent connections accepted.");
ABSL_FLAG(double, header_timeout_s, 10, "Deadline for reading a request's headers.");
ABSL_FLAG(double, body_timeout_s, 30, "Deadline for reading a request's body.");
ABSL_FLAG(double, idle_timeout_s, 60,
          "Keep-alive connections idle this long are closed.");
ABSL_FLAG(double, write_timeout_s, 30, "Deadline for each write to a client.");
ABSL_FLAG(double, request_timeout_s, 600, "Deadline of one generation (router calls).");
ABSL_FLAG(double, router_rpc_timeout_s, 5, "Deadline of ListModels and health checks.");
ABSL_FLAG(
    std::vector<std::string>, allowed_media_domains, {},
    "Domains (and their subdomains) whose http(s) image URLs the gateway fetches; "
    "'*' for any. Empty: image URLs must be data: URLs.");
ABSL_FLAG(bool, media_allow_private_addresses, false,
          "Fetch image URLs that resolve to loopback, private or link-local addresses "
          "(SSRF risk: only for trusted networks).");
ABSL_FLAG(int, limit_mm_per_prompt, 16, "Images accepted in one chat request.");
ABSL_FLAG(double, media_fetch_timeout_s, 10,
          "Deadline of one image URL fetch, redirects included.");
ABSL_FLAG(int, stream_interval, 1,
          "Streamed tokens go out in chunks of this many (the last of a choice may "
          "be shorter): fewer, larger SSE chunks for less work per token. 1: as "
          "soon as the router sends them.");
ABSL_FLAG(int, router_sessions, 2,
          "Generate calls are multiplexed on this many Router.GenerateSession "
          "streams (one gRPC message per router batch instead of per token); 0: "
          "one Router.Generate call per request (for routers without sessions).");
ABSL_FLAG(std::string, ssl_certfile, "",
          "HTTPS: PEM certificate chain (with --ssl_keyfile; vLLM's names). Re-read "
          "when the file changes (a renewed Kubernetes Secret), for new connections.");
ABSL_FLAG(std::string, ssl_keyfile, "", "HTTPS: PEM private key of --ssl_certfile.");
ABSL_FLAG(std::string, ssl_ca_certs, "",
          "HTTPS: clients must present a certificate this CA (PEM) signed.");
ABSL_FLAG(double, shutdown_grace_s, 10,
          "On SIGTERM, time given to requests in flight before they are cancelled.");

int main(int argc, char** argv) {
  tandem::BlockTerminationSignals();
  tandem::InitProgram(
      argc, argv, "gateway",
      "Tandem OpenAI-compatible gateway.\n"
      "usage: gateway_main --model=DIR [--router=HOST:PORT] [--port=8000]");
  // Debian's Abseil is built without NDEBUG, which leaves Mutex deadlock
  // detection on: a global graph update on every lock (5% of the gateway's
  // CPU in the streaming benchmark). It is a debugging aid; turn it off.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  const std::string model_dir = absl::GetFlag(FLAGS_model);
  if (model_dir.empty()) {
    fprintf(stderr, "gateway: --model=DIR (the tokenizer directory) is required\n");
    return 2;
  }
  auto tokenizer = tandem::tokenizer::Tokenizer::Load(model_dir);
  if (!tokenizer.ok()) {
    TLOG(ERROR, "cannot load the tokenizer").Kv("status", tokenizer.status());
    return 1;
  }
  std::string api_key = absl::GetFlag(FLAGS_api_key);
  if (api_key.empty()) {
    if (const char* env = std::getenv("TANDEM_API_KEY")) api_key = env;
  }

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  // The GenerateSession streams live as long as the gateway: keepalive pings
  // notice a router that vanished without closing the connection (a host
  // gone, a partition) within ~30 s, and the next request opens a new
  // session, instead of every request waiting out its deadline on a dead one.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 20000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // --tls_*: the channel to the router presents this gateway's certificate.
  auto creds = tandem::tls::GrpcCredentialsFromFlags();
  if (!creds.ok()) {
    TLOG(ERROR, "bad TLS flags").Kv("status", creds.status());
    return 2;
  }
  auto channel =
      grpc::CreateCustomChannel(absl::GetFlag(FLAGS_router), creds->channel, args);
  tandem::metrics::Registry registry;
  tandem::gateway::RouterClient router(
      channel, {.sessions = std::max(0, absl::GetFlag(FLAGS_router_sessions)),
                .registry = &registry});
  tandem::media::ImageInputOptions images;
  images.max_images_per_request = std::max(0, absl::GetFlag(FLAGS_limit_mm_per_prompt));
  images.fetch.allowed_domains = absl::GetFlag(FLAGS_allowed_media_domains);
  images.fetch.allow_private_addresses =
      absl::GetFlag(FLAGS_media_allow_private_addresses);
  images.fetch.timeout = absl::Seconds(absl::GetFlag(FLAGS_media_fetch_timeout_s));
  tandem::gateway::OpenAIService service(
      {.served_model_name = absl::GetFlag(FLAGS_served_model_name),
       .api_key = api_key,
       .request_timeout = absl::Seconds(absl::GetFlag(FLAGS_request_timeout_s)),
       .router_rpc_timeout = absl::Seconds(absl::GetFlag(FLAGS_router_rpc_timeout_s)),
       .stream_interval = std::max(1, absl::GetFlag(FLAGS_stream_interval)),
       .images = images},
      tokenizer->get(), &router, &registry);

  tandem::http::HttpServer server(
      {.server_name = "tandem-gateway",
       .host = absl::GetFlag(FLAGS_host),
       .port = absl::GetFlag(FLAGS_port),
       .io_threads = absl::GetFlag(FLAGS_io_threads),
       .max_body_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_max_body_bytes)),
       .header_timeout = absl::Seconds(absl::GetFlag(FLAGS_header_timeout_s)),
       .body_timeout = absl::Seconds(absl::GetFlag(FLAGS_body_timeout_s)),
       .idle_timeout = absl::Seconds(absl::GetFlag(FLAGS_idle_timeout_s)),
       .write_timeout = absl::Seconds(absl::GetFlag(FLAGS_write_timeout_s)),
       .max_connections = absl::GetFlag(FLAGS_max_connections),
       .tls_cert_file = absl::GetFlag(FLAGS_ssl_certfile),
       .tls_key_file = absl::GetFlag(FLAGS_ssl_keyfile),
       .tls_client_ca_file = absl::GetFlag(FLAGS_ssl_ca_certs)},
      [&service](tandem::http::HttpRequest request,
                 std::shared_ptr<tandem::http::ResponseWriter> writer) {
        service.Handle(std::move(request), std::move(writer));
      },
      &tandem::gateway::OpenAIService::FormatServerError);
  if (absl::Status s = server.Start(); !s.ok()) {
    TLOG(ERROR, "cannot listen").Kv("status", s);
    return 1;
  }
  TLOG(INFO, "gateway serving")
      .Kv("port", server.port())
      .Kv("scheme", absl::GetFlag(FLAGS_ssl_certfile).empty() ? "http" : "https")
      .Kv("router", absl::GetFlag(FLAGS_router))
      .Kv("auth", !api_key.empty());

  const int sig = tandem::WaitForTerminationSignal();
  TLOG(INFO, "shutting down").Kv("signal", sig);
  server.Shutdown(absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_s)));
  service.CancelAll(absl::Seconds(5));
  return 0;
}
