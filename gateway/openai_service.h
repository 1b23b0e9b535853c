// The OpenAI-compatible REST API on top of the router's gRPC API.
//
//   POST /v1/chat/completions
//     → auth → ParseChatCompletionRequest (400 naming the param)
//     → models (ListModels, cached) → 404 model_not_found
//     → RenderChat + EncodeChat (engine/chat) → prompt ids
//     → context check (400 context_length_exceeded)
//     → n × Router.Generate (seeds from `seed`), each feeding a ChoiceDecoder
//     → stream: SSE chunks (role, deltas, finish, [usage], [DONE]);
//       else: one chat.completion when every choice is done
//   POST /v1/completions     same, prompt text tokenised here (or token ids)
//   GET  /v1/models          ListModels
//   POST /v1/admin/reset_prefix_cache   (alias POST /reset_prefix_cache, vLLM's)
//                            Router.ResetPrefixCache: every worker's prefix
//                            cache cleared; 200 {"reset": [...]} when all were,
//                            503 with "failed" naming the others otherwise
//   GET  /health             grpc.health.v1 Check of the router (no auth)
//   GET  /metrics            this process's registry (no auth)
//
// One Generation (generation.h) per chat/completions request owns its router
// calls and its response from the first router call on; the service keeps the
// live ones (LiveGenerations) for CancelAll.
//
// Router errors: RESOURCE_EXHAUSTED → 429, UNAVAILABLE → 503 (Retry-After),
// others via api_error.h. In a stream, the HTTP status is chosen when the
// first token (or error) arrives, so an early router error is still a proper
// 4xx/5xx; a later one becomes an SSE error event followed by [DONE]. A
// client that disconnects cancels its router calls.
#ifndef TANDEM_GATEWAY_OPENAI_SERVICE_H_
#define TANDEM_GATEWAY_OPENAI_SERVICE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/ids.h"
#include "engine/media/chat_images.h"
#include "engine/tokenizer/tokenizer.h"
#include "gateway/api_error.h"
#include "gateway/gateway_metrics.h"
#include "gateway/generation.h"
#include "gateway/request_context.h"
#include "gateway/router_client.h"
#include "http/handler.h"
#include "metrics/registry.h"

namespace tandem::gateway {

struct OpenAIServiceOptions {
  // The model id clients use; empty: the router's ids. When set, it names the
  // router's (first) model.
  std::string served_model_name;
  // Required as `Authorization: Bearer KEY` on /v1/*; empty: no auth.
  std::string api_key;
  // Deadline of one generation (the gRPC deadline of each Generate).
  absl::Duration request_timeout = absl::Minutes(10);
  // Deadline of ListModels / health checks.
  absl::Duration router_rpc_timeout = absl::Seconds(5);
  // Deadline of admin calls that fan out to every worker (reset_prefix_cache);
  // above the router's own per-worker deadline (10 s), so its answer arrives.
  absl::Duration admin_rpc_timeout = absl::Seconds(15);
  // How long a ListModels answer is reused.
  absl::Duration models_ttl = absl::Seconds(5);
  // Streamed responses: after a choice's first output (sent at once), tokens
  // are held until this many are ready (or it ends), then go out as one chunk
  // (SGLang's and vLLM's --stream-interval). 1: every router message at once. The
  // content is the same either way; larger values trade smoothness for less work per
  // token.
  int stream_interval = 1;
  // Image content parts: limits, the media config and the URL fetcher's
  // allow-list (engine/media/chat_images.h).
  media::ImageInputOptions images;
};

class OpenAIService {
 public:
  // Not owned; must outlive the service. `registry` is also what /metrics shows.
  OpenAIService(OpenAIServiceOptions options, const tokenizer::Tokenizer* tokenizer,
                RouterClient* router, metrics::Registry* registry);
  ~OpenAIService();

  // The HttpHandler.
  void Handle(http::HttpRequest request, std::shared_ptr<http::ResponseWriter> writer);
  // The HttpServer's error formatter (OpenAI-shaped bodies).
  static http::HttpResponse FormatServerError(int status, std::string message);

  // Cancels every generation in flight and waits (up to `wait`) until they
  // have released their writers. For shutdown.
  void CancelAll(absl::Duration wait);
  int active_generations() const;

 private:
  void HandleChat(std::shared_ptr<RequestContext> ctx);
  void HandleCompletions(std::shared_ptr<RequestContext> ctx);
  void HandleModels(std::shared_ptr<RequestContext> ctx);
  void HandleHealth(std::shared_ptr<RequestContext> ctx);
  void HandleResetPrefixCache(std::shared_ptr<RequestContext> ctx);
  void HandleTokenize(std::shared_ptr<RequestContext> ctx);
  void HandleDetokenize(std::shared_ptr<RequestContext> ctx);
  GenerationDeps Deps();

  // The router's models, from the cache when fresh; `done` may run inline.
  void WithModels(
      std::function<
          void(absl::StatusOr<std::shared_ptr<const tandem::v1::ListModelsResponse>>)>
          done);

  const OpenAIServiceOptions options_;
  const tokenizer::Tokenizer* const tokenizer_;  // not owned
  RouterClient* const router_;                   // not owned
  metrics::Registry* const registry_;            // not owned
  GatewayMetrics metrics_;
  IdGenerator ids_;

  absl::Mutex models_mu_;
  std::shared_ptr<const tandem::v1::ListModelsResponse> models_
      ABSL_GUARDED_BY(models_mu_);
  absl::Time models_fetched_ ABSL_GUARDED_BY(models_mu_) = absl::InfinitePast();
  bool models_fetching_ ABSL_GUARDED_BY(models_mu_) = false;
  std::vector<std::function<
      void(absl::StatusOr<std::shared_ptr<const tandem::v1::ListModelsResponse>>)>>
      models_waiters_ ABSL_GUARDED_BY(models_mu_);

  LiveGenerations live_;

  // Router RPCs in flight whose callbacks use this service (ListModels for
  // WithModels and /v1/models): each callback holds a HoldForRpc() token, and
  // the destructor waits (bounded: every RPC has a deadline) until none is
  // left, so that no callback runs on a destroyed service.
  std::shared_ptr<void> HoldForRpc();
  absl::Mutex rpc_mu_;
  int rpcs_in_flight_ ABSL_GUARDED_BY(rpc_mu_) = 0;
};

}  // namespace tandem::gateway

#endif  // TANDEM_GATEWAY_OPENAI_SERVICE_H_
