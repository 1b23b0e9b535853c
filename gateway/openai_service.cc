#include "gateway/openai_service.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/chat/renderer.h"
#include "engine/chat/stream_parser.h"
#include "gateway/auth.h"
#include "gateway/choice_decoder.h"
#include "gateway/json_escape.h"
#include "gateway/request_parser.h"
#include "gateway/structured_output.h"
#include "metrics/http_exposer.h"
#include "metrics/text_format.h"
#include "nlohmann/json.hpp"

namespace tandem::gateway {

using json = nlohmann::json;
using ModelsOr = absl::StatusOr<std::shared_ptr<const tandem::v1::ListModelsResponse>>;

http::HttpResponse OpenAIService::FormatServerError(int status, std::string message) {
  ApiError e;
  e.http_status = status;
  e.type = status >= 500 ? "server_error" : "invalid_request_error";
  if (status == 413) e.code = "request_too_large";
  if (status == 408) e.code = "timeout";
  e.message = std::move(message);
  return ErrorResponse(e);
}

OpenAIService::OpenAIService(OpenAIServiceOptions options,
                             const tokenizer::Tokenizer* tokenizer,
                             RouterClient* router, metrics::Registry* registry)
    : options_(std::move(options)),
      tokenizer_(tokenizer),
      router_(router),
      registry_(registry),
      metrics_(registry) {}

OpenAIService::~OpenAIService() {
  CancelAll(absl::Seconds(10));
  absl::MutexLock lock(&rpc_mu_);
  const absl::Time deadline =
      absl::Now() + options_.router_rpc_timeout + absl::Seconds(5);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(rpc_mu_) {
    return rpcs_in_flight_ == 0;
  };
  // Every RPC ends by its deadline (router_rpc_timeout), so this returns.
  rpc_mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
}

std::shared_ptr<void> OpenAIService::HoldForRpc() {
  {
    absl::MutexLock lock(&rpc_mu_);
    ++rpcs_in_flight_;
  }
  return std::shared_ptr<void>(nullptr, [this](void*) {
    absl::MutexLock lock(&rpc_mu_);
    --rpcs_in_flight_;
  });
}

int OpenAIService::active_generations() const { return live_.size(); }

void OpenAIService::CancelAll(absl::Duration wait) { live_.CancelAll(wait); }

GenerationDeps OpenAIService::Deps() {
  return {.tokenizer = tokenizer_,
          .router = router_,
          .metrics = &metrics_,
          .live = &live_,
          .request_timeout = options_.request_timeout,
          .stream_interval = options_.stream_interval};
}

void OpenAIService::WithModels(std::function<void(ModelsOr)> done) {
  std::shared_ptr<const tandem::v1::ListModelsResponse> cached;
  {
    absl::MutexLock lock(&models_mu_);
    if (models_ != nullptr && absl::Now() - models_fetched_ < options_.models_ttl) {
      cached = models_;
    } else {
      models_waiters_.push_back(std::move(done));
      if (models_fetching_) return;
      models_fetching_ = true;
    }
  }
  if (cached != nullptr) {
    done(cached);
    return;
  }
  router_->ListModels(absl::Now() + options_.router_rpc_timeout,
                      [this, hold = HoldForRpc()](
                          absl::StatusOr<tandem::v1::ListModelsResponse> result) {
                        std::vector<std::function<void(ModelsOr)>> waiters;
                        ModelsOr out = absl::UnknownError("");
                        {
                          absl::MutexLock lock(&models_mu_);
                          models_fetching_ = false;
                          waiters.swap(models_waiters_);
                          if (result.ok()) {
                            models_ =
                                std::make_shared<const tandem::v1::ListModelsResponse>(
                                    *std::move(result));
                            models_fetched_ = absl::Now();
                            out = models_;
                          } else {
                            out = result.status();
                          }
                        }
                        for (auto& w : waiters) w(out);
                      });
}

namespace {

// The router model a request names, or 404.
absl::StatusOr<const tandem::v1::ModelInfo*> ResolveModel(
    const tandem::v1::ListModelsResponse& models, const std::string& served_name,
    const std::string& requested) {
  if (!served_name.empty()) {
    if (requested == served_name && models.models_size() > 0) return &models.models(0);
  } else {
    for (const auto& m : models.models()) {
      if (m.id() == requested) return &m;
    }
  }
  return absl::NotFoundError(
      absl::StrCat("The model `", requested, "` does not exist."));
}

ApiError ModelNotFound(const absl::Status& s) {
  ApiError e = ApiErrorFromStatus(s);
  e.code = "model_not_found";
  e.param = "model";
  return e;
}

ApiError ContextTooLong(int64_t limit, int64_t prompt, int64_t completion,
                        const char* param) {
  return BadRequest(
      absl::StrCat("This model's maximum context length is ", limit,
                   " tokens. However, you requested ", prompt + completion, " tokens (",
                   prompt, " in the ",
                   std::string(param) == "messages" ? "messages" : "prompt", ", ",
                   completion,
                   " in the completion). Please reduce the length of the prompt or "
                   "completion."),
      param, "context_length_exceeded");
}

// Context check for one prompt; nullopt when it fits.
std::optional<ApiError> CheckContext(const tandem::v1::ModelInfo& model, size_t prompt,
                                     const GenerationFields& f, const char* param) {
  const int64_t limit = model.max_context_tokens();
  if (limit <= 0) return std::nullopt;
  const int64_t completion = f.max_tokens.value_or(0);
  if (static_cast<int64_t>(prompt) + std::max<int64_t>(completion, 1) > limit) {
    return ContextTooLong(limit, static_cast<int64_t>(prompt), completion, param);
  }
  return std::nullopt;
}

ApiError ParseError(const absl::Status& s) {
  return BadRequest(std::string(s.message()), ParamFromMessage(s.message()));
}

// Every image of `messages` decoded and preprocessed (their placeholders sized;
// a bad one is an error naming its part); none: empty.
absl::StatusOr<std::vector<tandem::v1::ImageInput>> ChatImages(
    std::vector<chat::ChatMessage>* messages, const media::ImageInputOptions& options) {
  bool has_images = false;
  for (const chat::ChatMessage& m : *messages) has_images |= !m.images.empty();
  if (!has_images) return std::vector<tandem::v1::ImageInput>();
  return media::PrepareImages(messages, options);
}

// The model a /tokenize or /detokenize request names, or the served one when it
// names none; null after answering `ctx` with the error.
const tandem::v1::ModelInfo* OptionalModelOrError(
    const absl::StatusOr<std::shared_ptr<const tandem::v1::ListModelsResponse>>& models,
    const std::string& served_name, const std::string& requested, RequestContext* ctx) {
  if (!models.ok()) {
    ctx->Error(ApiErrorFromStatus(models.status()));
    return nullptr;
  }
  if (requested.empty()) {
    if ((*models)->models_size() > 0) return &(*models)->models(0);
    ctx->Error(
        ApiErrorFromStatus(absl::UnavailableError("the router serves no model yet")));
    return nullptr;
  }
  auto model = ResolveModel(**models, served_name, requested);
  if (!model.ok()) {
    ctx->Error(ModelNotFound(model.status()));
    return nullptr;
  }
  return *model;
}

}  // namespace

void OpenAIService::Handle(http::HttpRequest request,
                           std::shared_ptr<http::ResponseWriter> writer) {
  auto ctx = std::make_shared<RequestContext>();
  ctx->metrics = &metrics_;
  ctx->writer = std::move(writer);
  ctx->start = absl::Now();
  const std::string path = request.path;
  const std::string method = request.method;
  ctx->request = std::move(request);

  struct Route {
    const char* path;
    const char* method;
    const char* endpoint;
    bool auth;
    void (OpenAIService::*handler)(std::shared_ptr<RequestContext>);
  };
  static constexpr Route kRoutes[] = {
      {"/v1/chat/completions", "POST", "chat_completions", true,
       &OpenAIService::HandleChat},
      {"/v1/completions", "POST", "completions", true,
       &OpenAIService::HandleCompletions},
      {"/v1/models", "GET", "models", true, &OpenAIService::HandleModels},
      {"/v1/admin/reset_prefix_cache", "POST", "reset_prefix_cache", true,
       &OpenAIService::HandleResetPrefixCache},
      {"/reset_prefix_cache", "POST", "reset_prefix_cache", true,
       &OpenAIService::HandleResetPrefixCache},
      {"/tokenize", "POST", "tokenize", true, &OpenAIService::HandleTokenize},
      {"/detokenize", "POST", "detokenize", true, &OpenAIService::HandleDetokenize},
      {"/health", "GET", "health", false, &OpenAIService::HandleHealth},
      {"/metrics", "GET", "metrics", false, nullptr},
  };
  for (const Route& route : kRoutes) {
    const bool match =
        path == route.path || (route.handler == &OpenAIService::HandleModels &&
                               absl::StartsWith(path, "/v1/models/"));
    if (!match) continue;
    ctx->endpoint = route.endpoint;
    if (method != route.method) {
      ApiError e;
      e.http_status = 405;
      e.type = "invalid_request_error";
      e.message = absl::StrCat("Method ", method, " is not allowed on ", path, "; use ",
                               route.method, ".");
      http::HttpResponse r = ErrorResponse(e);
      r.headers.emplace_back("Allow", route.method);
      ctx->Send(std::move(r));
      return;
    }
    if (route.auth &&
        !AuthorizationMatches(ctx->request.Header("authorization"), options_.api_key)) {
      ApiError e;
      e.http_status = 401;
      e.type = "invalid_request_error";
      e.code = "invalid_api_key";
      e.message = ctx->request.Header("authorization").empty()
                      ? "You didn't provide an API key. Provide it as "
                        "`Authorization: Bearer YOUR_KEY`."
                      : "Incorrect API key provided.";
      ctx->Error(e);
      return;
    }
    if (route.handler == nullptr) {  // /metrics
      http::HttpResponse r;
      r.content_type = std::string(metrics::kTextContentType);
      r.body = metrics::RenderMetrics({registry_});
      ctx->Send(std::move(r));
      return;
    }
    (this->*route.handler)(std::move(ctx));
    return;
  }
  ctx->endpoint = "other";
  ApiError e;
  e.http_status = 404;
  e.type = "invalid_request_error";
  e.code = "unknown_url";
  e.message = absl::StrCat("Unknown request URL: ", method, " ", path, ".");
  ctx->Error(e);
}

void OpenAIService::HandleModels(std::shared_ptr<RequestContext> ctx) {
  std::string single;
  if (absl::StartsWith(ctx->request.path, "/v1/models/")) {
    single = ctx->request.path.substr(std::string("/v1/models/").size());
  }
  router_->ListModels(absl::Now() + options_.router_rpc_timeout,
                      [this, ctx, single, hold = HoldForRpc()](
                          absl::StatusOr<tandem::v1::ListModelsResponse> result) {
                        if (!result.ok())
                          return ctx->Error(ApiErrorFromStatus(result.status()));
                        json data = json::array();
                        for (int i = 0; i < result->models_size(); ++i) {
                          const auto& m = result->models(i);
                          std::string id = m.id();
                          if (!options_.served_model_name.empty()) {
                            if (i > 0) break;
                            id = options_.served_model_name;
                          }
                          data.push_back({{"id", id},
                                          {"object", "model"},
                                          {"created", m.created_unix()},
                                          {"owned_by", "tandem"},
                                          {"root", m.id()},
                                          {"max_model_len", m.max_context_tokens()}});
                        }
                        if (single.empty())
                          return ctx->Json(200, {{"object", "list"}, {"data", data}});
                        for (const json& m : data) {
                          if (m["id"] == single) return ctx->Json(200, m);
                        }
                        ctx->Error(ModelNotFound(absl::NotFoundError(
                            absl::StrCat("The model `", single, "` does not exist."))));
                      });
}

void OpenAIService::HandleHealth(std::shared_ptr<RequestContext> ctx) {
  router_->CheckHealth(
      absl::Now() + options_.router_rpc_timeout,
      [ctx](absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> s) {
        if (s.ok() && *s == grpc::health::v1::HealthCheckResponse::SERVING) {
          return ctx->Json(200, {{"status", "ok"}});
        }
        http::HttpResponse r;
        r.status = 503;
        r.headers.emplace_back("Retry-After", "1");
        r.body = DumpJson({{"status", "unavailable"},
                           {"detail", s.ok() ? std::string("router is not serving")
                                             : std::string(s.status().message())}});
        ctx->Send(std::move(r));
      });
}

void OpenAIService::HandleResetPrefixCache(std::shared_ptr<RequestContext> ctx) {
  router_->ResetPrefixCache(
      absl::Now() + options_.admin_rpc_timeout,
      [ctx](absl::StatusOr<tandem::v1::ResetPrefixCacheResponse> result) {
        if (!result.ok()) return ctx->Error(ApiErrorFromStatus(result.status()));
        json reset = json::array();
        for (const std::string& id : result->reset()) reset.push_back(id);
        json body = {{"object", "prefix_cache.reset"}, {"reset", reset}};
        if (result->failed_size() == 0) return ctx->Json(200, body);
        // Some caches still hold their prefixes: not a success.
        json failed = json::array();
        for (const auto& f : result->failed()) {
          failed.push_back(
              {{"worker_id", f.worker_id()}, {"role", f.role()}, {"error", f.error()}});
        }
        body["failed"] = failed;
        body["error"] = {
            {"message", absl::StrCat(result->failed_size(), " of ",
                                     result->failed_size() + result->reset_size(),
                                     " workers did not reset their prefix cache")},
            {"type", "server_error"},
            {"code", "partial_reset"}};
        ctx->Json(503, body);
      });
}

void OpenAIService::HandleChat(std::shared_ptr<RequestContext> ctx) {
  absl::StatusOr<ChatCompletionRequest> parsed =
      ParseChatCompletionRequest(ctx->request.body);
  if (!parsed.ok()) return ctx->Error(ParseError(parsed.status()));
  auto req = std::make_shared<ChatCompletionRequest>(*std::move(parsed));
  // Every image is decoded and preprocessed here (a bad one is a 400 naming
  // its part); the ImageInputs travel to the prefill worker, which runs the
  // vision tower over the same bytes.
  absl::StatusOr<std::vector<tandem::v1::ImageInput>> prepared =
      ChatImages(&req->messages, options_.images);
  if (!prepared.ok()) return ctx->Error(ApiErrorFromStatus(prepared.status()));
  auto images =
      std::make_shared<std::vector<tandem::v1::ImageInput>>(*std::move(prepared));
  WithModels([this, ctx, req, images](ModelsOr models) {
    if (!models.ok()) return ctx->Error(ApiErrorFromStatus(models.status()));
    auto model = ResolveModel(**models, options_.served_model_name, req->fields.model);
    if (!model.ok()) return ctx->Error(ModelNotFound(model.status()));
    absl::StatusOr<std::vector<chat::Segment>> segments =
        chat::RenderChat(req->messages, req->tools, req->options);
    if (!segments.ok()) return ctx->Error(ParseError(segments.status()));
    absl::StatusOr<std::vector<int>> ids = chat::EncodeChat(*tokenizer_, *segments);
    if (!ids.ok()) return ctx->Error(ParseError(ids.status()));
    if (!images->empty()) {
      // Each image's run of <|media_pad|> ids in the encoded prompt.
      absl::Status located = media::LocatePlaceholders(*ids, images.get());
      if (!located.ok()) return ctx->Error(ApiErrorFromStatus(located));
    }
    if (auto e = CheckContext(**model, ids->size(), req->fields, "messages")) {
      return ctx->Error(*e);
    }
    std::vector<Generation::Choice> choices;
    for (int j = 0; j < req->fields.n; ++j) {
      Generation::Choice c;
      c.prompt = *ids;
      if (req->fields.seed) c.seed = ChoiceSeed(*req->fields.seed, j);
      choices.push_back(std::move(c));
    }
    ChoiceDecoder::Options o;
    o.chat = true;
    o.start = chat::ChatStreamParser::StartFor(req->options);
    o.stop = req->fields.stop;
    o.logprobs = req->fields.logprobs;
    o.max_tool_calls = req->parallel_tool_calls ? 0 : 1;
    o.tool_call_id_prefix = absl::StrCat("call_", ids_.Next().substr(0, 12), "_");
    const std::string name = options_.served_model_name.empty()
                                 ? (*model)->id()
                                 : options_.served_model_name;
    absl::StatusOr<std::optional<tandem::v1::StructuredOutput>> constraint =
        ChatConstraint(*req, *tokenizer_);
    if (!constraint.ok()) return ctx->Error(ParseError(constraint.status()));
    auto g = std::make_shared<Generation>(
        ctx, Deps(), /*chat=*/true, ids_.Next("chatcmpl-"), name, (*model)->id(),
        req->fields, std::move(o), std::move(choices), static_cast<int>(ids->size()));
    if (*constraint) g->set_structured_output(**std::move(constraint));
    if (!images->empty()) g->set_images(std::move(*images));
    g->Start();
  });
}

void OpenAIService::HandleTokenize(std::shared_ptr<RequestContext> ctx) {
  absl::StatusOr<TokenizeRequest> parsed = ParseTokenizeRequest(ctx->request.body);
  if (!parsed.ok()) return ctx->Error(ParseError(parsed.status()));
  auto req = std::make_shared<TokenizeRequest>(*std::move(parsed));
  // Images count as the chat path counts them (decoded here for their grids).
  absl::StatusOr<std::vector<tandem::v1::ImageInput>> prepared =
      ChatImages(&req->messages, options_.images);
  if (!prepared.ok()) return ctx->Error(ApiErrorFromStatus(prepared.status()));
  WithModels([this, ctx, req](ModelsOr models) {
    const tandem::v1::ModelInfo* model =
        OptionalModelOrError(models, options_.served_model_name, req->model, ctx.get());
    if (model == nullptr) return;
    absl::StatusOr<std::vector<int>> ids;
    if (req->chat) {
      absl::StatusOr<std::vector<chat::Segment>> segments =
          chat::RenderChat(req->messages, req->tools, req->options);
      if (!segments.ok()) return ctx->Error(ParseError(segments.status()));
      ids = chat::EncodeChat(*tokenizer_, *segments);
      if (!ids.ok()) return ctx->Error(ParseError(ids.status()));
    } else {
      ids = tokenizer_->Encode(req->prompt);
      if (!ids.ok()) {
        return ctx->Error(
            BadRequest(absl::StrCat("prompt: ", ids.status().message()), "prompt"));
      }
    }
    json token_strs = nullptr;
    if (req->return_token_strs) {
      token_strs = json::array();
      for (int id : *ids) {
        absl::StatusOr<std::string> t = tokenizer_->IdToken(id);
        token_strs.push_back(t.ok() ? *std::move(t) : std::string());
      }
    }
    ctx->Json(200, {{"count", ids->size()},
                    {"max_model_len", model->max_context_tokens()},
                    {"tokens", *ids},
                    {"token_strs", token_strs}});
  });
}

void OpenAIService::HandleDetokenize(std::shared_ptr<RequestContext> ctx) {
  absl::StatusOr<DetokenizeRequest> parsed = ParseDetokenizeRequest(ctx->request.body);
  if (!parsed.ok()) return ctx->Error(ParseError(parsed.status()));
  auto req = std::make_shared<DetokenizeRequest>(*std::move(parsed));
  WithModels([this, ctx, req](ModelsOr models) {
    const tandem::v1::ModelInfo* model =
        OptionalModelOrError(models, options_.served_model_name, req->model, ctx.get());
    if (model == nullptr) return;
    for (size_t i = 0; i < req->tokens.size(); ++i) {
      if (!tokenizer_->IsValidId(req->tokens[i])) {
        return ctx->Error(ParseError(absl::InvalidArgumentError(absl::StrCat(
            "tokens[", i, "]: token id ", req->tokens[i],
            " is outside the vocabulary [0, ", tokenizer_->vocab_size(), ")"))));
      }
    }
    // Special tokens kept (as vLLM's /detokenize); bytes that are not UTF-8
    // (a character split between ids) become U+FFFD in the JSON.
    absl::StatusOr<std::string> text = tokenizer_->Decode(req->tokens);
    if (!text.ok()) return ctx->Error(ParseError(text.status()));
    ctx->Json(200, {{"prompt", *std::move(text)}});
  });
}

void OpenAIService::HandleCompletions(std::shared_ptr<RequestContext> ctx) {
  absl::StatusOr<CompletionRequest> parsed = ParseCompletionRequest(ctx->request.body);
  if (!parsed.ok()) return ctx->Error(ParseError(parsed.status()));
  auto req = std::make_shared<CompletionRequest>(*std::move(parsed));
  WithModels([this, ctx, req](ModelsOr models) {
    if (!models.ok()) return ctx->Error(ApiErrorFromStatus(models.status()));
    auto model = ResolveModel(**models, options_.served_model_name, req->fields.model);
    if (!model.ok()) return ctx->Error(ModelNotFound(model.status()));
    const int vocab =
        (*model)->vocab_size() > 0 ? (*model)->vocab_size() : tokenizer_->vocab_size();
    std::vector<Generation::Choice> choices;
    int prompt_tokens = 0;
    for (size_t p = 0; p < req->prompts.size(); ++p) {
      std::vector<int> ids;
      if (const auto* text = std::get_if<std::string>(&req->prompts[p])) {
        absl::StatusOr<std::vector<int>> enc = tokenizer_->Encode(*text);
        if (!enc.ok()) {
          return ctx->Error(
              BadRequest(absl::StrCat("prompt: ", enc.status().message()), "prompt"));
        }
        ids = *std::move(enc);
        if (ids.empty()) {
          return ctx->Error(BadRequest("prompt: must not be empty", "prompt"));
        }
      } else {
        ids = std::get<std::vector<int>>(req->prompts[p]);
        for (int id : ids) {
          if (id >= vocab) {
            return ctx->Error(
                BadRequest(absl::StrCat("prompt: token id ", id,
                                        " is outside the vocabulary [0, ", vocab, ")"),
                           "prompt"));
          }
        }
      }
      if (auto e = CheckContext(**model, ids.size(), req->fields, "prompt")) {
        return ctx->Error(*e);
      }
      prompt_tokens += static_cast<int>(ids.size());
      for (int j = 0; j < req->fields.n; ++j) {
        Generation::Choice c;
        c.prompt_index = static_cast<int>(p);
        c.prompt = ids;
        if (req->fields.seed) c.seed = ChoiceSeed(*req->fields.seed, j);
        choices.push_back(std::move(c));
      }
    }
    ChoiceDecoder::Options o;
    o.chat = false;
    o.stop = req->fields.stop;
    o.logprobs = req->fields.logprobs;
    const std::string name = options_.served_model_name.empty()
                                 ? (*model)->id()
                                 : options_.served_model_name;
    absl::StatusOr<std::optional<tandem::v1::StructuredOutput>> constraint =
        CompletionConstraint(req->fields);
    if (!constraint.ok()) return ctx->Error(ParseError(constraint.status()));
    auto g = std::make_shared<Generation>(
        ctx, Deps(), /*chat=*/false, ids_.Next("cmpl-"), name, (*model)->id(),
        req->fields, std::move(o), std::move(choices), prompt_tokens);
    if (*constraint) g->set_structured_output(**std::move(constraint));
    g->Start();
  });
}

}  // namespace tandem::gateway
