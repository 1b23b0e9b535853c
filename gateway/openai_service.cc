#include "gateway/openai_service.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "engine/chat/renderer.h"
#include "engine/chat/stream_parser.h"
#include "engine/tokenizer/utf8.h"
#include "gateway/auth.h"
#include "gateway/choice_decoder.h"
#include "gateway/json_escape.h"
#include "gateway/request_parser.h"
#include "gateway/sse.h"
#include "metrics/buckets.h"
#include "metrics/http_exposer.h"
#include "metrics/text_format.h"
#include "nlohmann/json.hpp"
#include "rpc/response_stream.h"

namespace tandem::gateway {

using json = nlohmann::json;
using ModelsOr = absl::StatusOr<std::shared_ptr<const tandem::v1::ListModelsResponse>>;

namespace {

std::string Dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::vector<double> LatencyBuckets() {
  return *metrics::ExponentialBuckets(0.001, 2, 18);  // 1 ms .. ~131 s
}

json BytesArray(const std::string& s) {
  json out = json::array();
  for (unsigned char c : s) out.push_back(static_cast<int>(c));
  return out;
}

json ChatLogprobs(const std::vector<LogprobEntry>& entries) {
  json content = json::array();
  for (const LogprobEntry& e : entries) {
    json top = json::array();
    for (const auto& [token, lp] : e.top) {
      top.push_back({{"token", tokenizer::ReplaceInvalidUtf8(token)},
                     {"logprob", lp},
                     {"bytes", BytesArray(token)}});
    }
    content.push_back({{"token", tokenizer::ReplaceInvalidUtf8(e.token)},
                       {"logprob", e.logprob},
                       {"bytes", BytesArray(e.token)},
                       {"top_logprobs", std::move(top)}});
  }
  return {{"content", std::move(content)}};
}

// Legacy completions logprobs; `offset` is the text length before the first
// entry (advanced here).
json CompletionLogprobs(const std::vector<LogprobEntry>& entries, bool with_top,
                        size_t* offset) {
  json tokens = json::array(), lps = json::array(), tops = json::array(),
       offsets = json::array();
  for (const LogprobEntry& e : entries) {
    tokens.push_back(tokenizer::ReplaceInvalidUtf8(e.token));
    lps.push_back(e.logprob);
    offsets.push_back(*offset);
    *offset += e.token.size();
    json top = json::object();
    for (const auto& [token, lp] : e.top)
      top[tokenizer::ReplaceInvalidUtf8(token)] = lp;
    tops.push_back(std::move(top));
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(lps)},
          {"top_logprobs", with_top ? std::move(tops) : json(nullptr)},
          {"text_offset", std::move(offsets)}};
}

json ToolCallsJson(const std::vector<ParsedToolCallOut>& calls) {
  json out = json::array();
  for (const ParsedToolCallOut& c : calls) {
    out.push_back({{"id", c.id},
                   {"type", "function"},
                   {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
  }
  return out;
}

}  // namespace

GatewayMetrics::GatewayMetrics(metrics::Registry* registry)
    : requests(*registry->AddCounter("tandem_gateway_requests_total",
                                     "HTTP requests by endpoint and status code.")),
      latency(*registry->AddHistogram(
          "tandem_gateway_request_duration_seconds",
          "Time from request to the end of its response, by endpoint.",
          LatencyBuckets())),
      ttft(*registry->AddHistogram("tandem_gateway_time_to_first_token_seconds",
                                   "Time from request to the first generated token.",
                                   LatencyBuckets())),
      active_streams(*registry->AddGauge("tandem_gateway_active_streams",
                                         "SSE responses currently streaming.")),
      tokens(*registry->AddCounter("tandem_gateway_generated_tokens_total",
                                   "Generated tokens received from the router.")) {
  active_streams->Add({}).Set(0);  // exported from the start
}

// One HTTP request: its writer, endpoint label and start time; answers once
// and records the metrics.
struct OpenAIService::Context {
  OpenAIService* service;
  HttpRequest request;
  std::shared_ptr<ResponseWriter> writer;
  std::string endpoint;
  absl::Time start;
  bool answered = false;

  void Record(int status) {
    service->metrics_.requests
        ->Add({{"endpoint", endpoint}, {"status", absl::StrCat(status)}})
        .Increment();
    service->metrics_.latency->Add({{"endpoint", endpoint}})
        .Observe(absl::ToDoubleSeconds(absl::Now() - start));
  }
  void Send(HttpResponse response) {
    if (answered) return;
    answered = true;
    Record(response.status);
    writer->Send(std::move(response));
  }
  void Json(int status, const json& body) {
    HttpResponse r;
    r.status = status;
    r.body = Dump(body);
    Send(std::move(r));
  }
  void Error(const ApiError& e) { Send(ErrorResponse(e)); }
};

HttpResponse OpenAIService::ErrorResponse(const ApiError& error) {
  HttpResponse r;
  r.status = error.http_status;
  r.body = error.ToJson();
  if (error.retry_after_s > 0) {
    r.headers.emplace_back("Retry-After", absl::StrCat(error.retry_after_s));
  }
  if (error.http_status == 401) r.headers.emplace_back("WWW-Authenticate", "Bearer");
  return r;
}

HttpResponse OpenAIService::FormatServerError(int status, std::string message) {
  ApiError e;
  e.http_status = status;
  e.type = status >= 500 ? "server_error" : "invalid_request_error";
  if (status == 413) e.code = "request_too_large";
  if (status == 408) e.code = "timeout";
  e.message = std::move(message);
  return ErrorResponse(e);
}

// ---------------------------------------------------------------------------
// Generation: the n router calls of one chat/completions request.
//
//   Start → n × Generate ──OnResponse(i)──> ChoiceDecoder(i) → SSE chunk
//                        ──OnDone(i)─────> finish choice i | fail request
//   all choices done → usage chunk + [DONE] | whole JSON response
//   client gone / stop string / a failed choice → Cancel the router calls
//
// All state is under mu_; router calls are cancelled outside it.
class Generation : public std::enable_shared_from_this<Generation> {
 public:
  struct Choice {
    int prompt_index = 0;
    std::vector<int> prompt;
    std::optional<uint64_t> seed;
  };

  Generation(std::shared_ptr<OpenAIService::Context> ctx, bool chat, std::string id,
             std::string model_name, std::string router_model, GenerationFields fields,
             ChoiceDecoder::Options decoder_options, std::vector<Choice> choices,
             int prompt_tokens)
      : ctx_(std::move(ctx)),
        service_(ctx_->service),
        chat_(chat),
        id_(std::move(id)),
        created_(absl::ToUnixSeconds(absl::Now())),
        model_name_(std::move(model_name)),
        router_model_(std::move(router_model)),
        fields_(std::move(fields)),
        choices_(std::move(choices)),
        prompt_tokens_(prompt_tokens) {
    service_->Register(this);
    for (size_t i = 0; i < choices_.size(); ++i) {
      ChoiceDecoder::Options o = decoder_options;
      o.tool_call_id_prefix = absl::StrCat(decoder_options.tool_call_id_prefix, i, "_");
      state_.push_back(
          std::make_unique<ChoiceState>(service_->tokenizer_, std::move(o)));
    }
    remaining_ = static_cast<int>(choices_.size());
  }
  ~Generation() {
    if (streaming_) service_->metrics_.active_streams->Add({}).Decrement();
    service_->Unregister(this);
  }

  void Start() {
    std::weak_ptr<Generation> weak = weak_from_this();
    ctx_->writer->OnClientGone([weak] {
      if (auto self = weak.lock()) self->ClientGone();
    });
    const absl::Time deadline = absl::Now() + service_->options_.request_timeout;
    for (size_t i = 0; i < choices_.size(); ++i) {
      tandem::v1::GenerateRequest req = BuildRequest(static_cast<int>(i), deadline);
      auto self = shared_from_this();
      const int index = static_cast<int>(i);
      std::shared_ptr<GenerateCall> call = service_->router_->Generate(
          std::move(req), deadline,
          {.on_response =
               [self, index](const tandem::v1::GenerateResponse& r) {
                 self->OnResponse(index, r);
               },
           .on_done = [self,
                       index](const grpc::Status& s) { self->OnDone(index, s); }});
      bool cancel = false;
      {
        absl::MutexLock lock(&mu_);
        state_[i]->call = call;
        cancel = closed_ || state_[i]->cancel_requested;
      }
      if (cancel) call->Cancel();
    }
  }

  void Cancel() {
    std::vector<std::shared_ptr<GenerateCall>> calls;
    {
      absl::MutexLock lock(&mu_);
      closed_ = true;
      calls = TakeCallsToCancel();
    }
    for (auto& c : calls) c->Cancel();
  }

 private:
  struct ChoiceState {
    ChoiceState(const tokenizer::Tokenizer* t, ChoiceDecoder::Options o)
        : decoder(t, std::move(o)) {}
    ChoiceDecoder decoder;
    std::shared_ptr<GenerateCall> call;
    bool cancel_requested = false;
    bool role_sent = false;
    bool finished = false;
    size_t text_offset = 0;
    // Router output held back by stream_interval (has_pending: something is).
    tandem::v1::GenerateResponse pending;
    bool has_pending = false;
    bool output_sent = false;  // some of this choice's output went out
  };

  tandem::v1::GenerateRequest BuildRequest(int i, absl::Time deadline) const {
    tandem::v1::GenerateRequest req;
    req.set_request_id(absl::StrCat(id_, "-", i));
    req.set_model(router_model_);
    auto* ids = req.mutable_prompt_token_ids()->mutable_ids();
    ids->Add(choices_[i].prompt.begin(), choices_[i].prompt.end());
    auto* s = req.mutable_sampling();
    // OpenAI's default temperature is 1.
    s->set_temperature(static_cast<float>(fields_.temperature.value_or(1.0)));
    if (fields_.top_p) s->set_top_p(static_cast<float>(*fields_.top_p));
    if (fields_.top_k) s->set_top_k(*fields_.top_k);
    if (fields_.min_p) s->set_min_p(static_cast<float>(*fields_.min_p));
    if (choices_[i].seed) s->set_seed(*choices_[i].seed);
    s->set_presence_penalty(static_cast<float>(fields_.presence_penalty));
    s->set_frequency_penalty(static_cast<float>(fields_.frequency_penalty));
    if (fields_.repetition_penalty) {
      s->set_repetition_penalty(static_cast<float>(*fields_.repetition_penalty));
    }
    s->set_logprobs(fields_.logprobs);
    s->set_top_logprobs(fields_.top_logprobs);
    auto* stop = req.mutable_stop();
    if (fields_.max_tokens) stop->set_max_tokens(*fields_.max_tokens);
    for (const std::string& str : fields_.stop) stop->add_stop_strings(str);
    for (int id : fields_.stop_token_ids) stop->add_stop_token_ids(id);
    stop->set_ignore_eos(fields_.ignore_eos);
    stop->set_min_tokens(fields_.min_tokens);
    req.set_deadline_unix_ms(absl::ToUnixMillis(deadline));
    return req;
  }

  std::vector<std::shared_ptr<GenerateCall>> TakeCallsToCancel()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<std::shared_ptr<GenerateCall>> calls;
    for (auto& st : state_) {
      st->cancel_requested = true;
      if (st->call) calls.push_back(st->call);
    }
    return calls;
  }

  void ClientGone() {
    {
      absl::MutexLock lock(&mu_);
      if (!closed_) {
        ctx_->answered = true;
        ctx_->Record(499);  // client closed request (nginx's code)
      }
    }
    Cancel();
  }

  // --- output ------------------------------------------------------------

  json ChunkBase() const {
    json j = {{"id", id_},
              {"object", chat_ ? "chat.completion.chunk" : "text_completion"},
              {"created", created_},
              {"model", model_name_}};
    return j;
  }

  void WriteChunk(json choice) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    json j = ChunkBase();
    j["choices"] = json::array({std::move(choice)});
    if (fields_.include_usage) j["usage"] = nullptr;
    ctx_->writer->Write(SseEvent(Dump(j)));
  }

  void StartStream() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (streaming_) return;
    streaming_ = true;
    ctx_->answered = true;
    service_->metrics_.active_streams->Add({}).Increment();
    ctx_->writer->StartStream(200, "text/event-stream; charset=utf-8", {});
  }

  // The streamed form of `delta` for choice i (nothing when empty).
  void WriteDelta(int i, const ChoiceDelta& delta, const char* finish_reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ChoiceState& st = *state_[i];
    if (delta.tool_calls.empty() && delta.logprobs.empty()) {
      return WriteTextDelta(i, st, delta, finish_reason);
    }
    json c = {{"index", i}};
    if (chat_) {
      json d = json::object();
      if (!st.role_sent) {
        d["role"] = "assistant";
        d["content"] = "";
        st.role_sent = true;
      }
      if (!delta.reasoning.empty()) d["reasoning_content"] = delta.reasoning;
      if (!delta.content.empty()) d["content"] = delta.content;
      if (!delta.tool_calls.empty()) {
        json calls = json::array();
        for (const ToolCallDelta& t : delta.tool_calls) {
          json call = {{"index", t.index}};
          if (!t.id.empty()) {
            call["id"] = t.id;
            call["type"] = "function";
            call["function"] = {{"name", t.name}, {"arguments", t.arguments}};
          } else {
            call["function"] = {{"arguments", t.arguments}};
          }
          calls.push_back(std::move(call));
        }
        d["tool_calls"] = std::move(calls);
      }
      if (d.empty() && finish_reason == nullptr) return;
      c["delta"] = std::move(d);
      c["logprobs"] =
          delta.logprobs.empty() ? json(nullptr) : ChatLogprobs(delta.logprobs);
    } else {
      if (delta.content.empty() && delta.logprobs.empty() && finish_reason == nullptr) {
        return;
      }
      c["text"] = delta.content;
      c["logprobs"] = delta.logprobs.empty()
                          ? json(nullptr)
                          : CompletionLogprobs(delta.logprobs, fields_.top_logprobs > 0,
                                               &st.text_offset);
    }
    c["finish_reason"] = finish_reason == nullptr ? json(nullptr) : json(finish_reason);
    WriteChunk(std::move(c));
  }

  // WriteDelta for the common case (text only: no tool calls, no logprobs),
  // rendered without a json object: the pre-rendered chunk tail plus the
  // escaped text. Byte for byte what dumping the json of WriteDelta gives
  // (nlohmann sorts keys: choices < created < id < model < object < usage;
  // delta < finish_reason < index < logprobs < text; content <
  // reasoning_content < role).
  void WriteTextDelta(int i, ChoiceState& st, const ChoiceDelta& delta,
                      const char* finish_reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::string out;
    out.reserve(chunk_tail_.size() + delta.content.size() + delta.reasoning.size() +
                128);
    out += "data: {\"choices\":[{";
    if (chat_) {
      const bool role = !st.role_sent;
      if (!role && delta.reasoning.empty() && delta.content.empty() &&
          finish_reason == nullptr) {
        return;
      }
      st.role_sent = true;
      out += "\"delta\":{";
      bool first = true;
      if (role || !delta.content.empty()) {
        out += "\"content\":";
        AppendJsonString(&out, delta.content);
        first = false;
      }
      if (!delta.reasoning.empty()) {
        if (!first) out += ',';
        out += "\"reasoning_content\":";
        AppendJsonString(&out, delta.reasoning);
        first = false;
      }
      if (role) {
        if (!first) out += ',';
        out += "\"role\":\"assistant\"";
      }
      out += "},";
      AppendFinishIndex(&out, i, finish_reason);
      out += ",\"logprobs\":null}";
    } else {
      if (delta.content.empty() && finish_reason == nullptr) return;
      AppendFinishIndex(&out, i, finish_reason);
      out += ",\"logprobs\":null,\"text\":";
      AppendJsonString(&out, delta.content);
      out += '}';
    }
    out += chunk_tail_;
    ctx_->writer->Write(std::move(out));
  }

  static void AppendFinishIndex(std::string* out, int i, const char* finish_reason) {
    *out += "\"finish_reason\":";
    if (finish_reason == nullptr) {
      *out += "null";
    } else {
      AppendJsonString(out, finish_reason);
    }
    absl::StrAppend(out, ",\"index\":", i);
  }

  // `],"created":...,"object":...[,"usage":null]}` and the SSE end: the part
  // of every chunk after its choice.
  std::string ChunkTail() const {
    json base = ChunkBase();
    if (fields_.include_usage) base["usage"] = nullptr;
    std::string dumped = Dump(base);  // {"created":...}
    return absl::StrCat("],", absl::string_view(dumped).substr(1), "\n\n");
  }

  json Usage() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    int completion = 0;
    for (const auto& st : state_) completion += st->decoder.completion_tokens();
    return {{"prompt_tokens", prompt_tokens_},
            {"completion_tokens", completion},
            {"total_tokens", prompt_tokens_ + completion}};
  }

  void Fail(const ApiError& error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (closed_) return;
    closed_ = true;
    if (streaming_) {
      ctx_->writer->Write(SseEvent(error.ToJson()));
      ctx_->writer->Write(std::string(kSseDone));
      ctx_->writer->End();
      ctx_->Record(200);
    } else {
      ctx_->Error(error);
    }
  }

  void Complete() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (closed_) return;
    closed_ = true;
    if (streaming_) {
      if (fields_.include_usage) {
        json j = ChunkBase();
        j["choices"] = json::array();
        j["usage"] = Usage();
        ctx_->writer->Write(SseEvent(Dump(j)));
      }
      ctx_->writer->Write(std::string(kSseDone));
      ctx_->writer->End();
      ctx_->Record(200);
      return;
    }
    json choices = json::array();
    for (size_t i = 0; i < state_.size(); ++i) {
      const ChoiceDecoder& d = state_[i]->decoder;
      json c = {{"index", i}};
      if (chat_) {
        json message = {{"role", "assistant"}};
        const bool has_tools = !d.tool_calls().empty();
        message["content"] =
            d.content().empty() && has_tools ? json(nullptr) : json(d.content());
        message["reasoning_content"] =
            d.reasoning().empty() ? json(nullptr) : json(d.reasoning());
        if (has_tools) message["tool_calls"] = ToolCallsJson(d.tool_calls());
        c["message"] = std::move(message);
        c["logprobs"] = fields_.logprobs ? ChatLogprobs(d.logprobs()) : json(nullptr);
      } else {
        c["text"] = d.content();
        size_t offset = 0;
        c["logprobs"] =
            fields_.logprobs
                ? CompletionLogprobs(d.logprobs(), fields_.top_logprobs > 0, &offset)
                : json(nullptr);
      }
      c["finish_reason"] = d.finish_reason();
      choices.push_back(std::move(c));
    }
    json body = {{"id", id_},
                 {"object", chat_ ? "chat.completion" : "text_completion"},
                 {"created", created_},
                 {"model", model_name_},
                 {"choices", std::move(choices)},
                 {"usage", Usage()}};
    ctx_->Json(200, body);
  }

  // --- router callbacks ----------------------------------------------------

  void OnResponse(int i, const tandem::v1::GenerateResponse& r) {
    std::vector<std::shared_ptr<GenerateCall>> to_cancel;
    {
      absl::MutexLock lock(&mu_);
      ChoiceState& st = *state_[i];
      if (closed_ || st.finished) return;
      const int interval = service_->options_.stream_interval;
      if (fields_.stream && interval > 1) {
        // Hold tokens until `interval` of them (or the last message) are here.
        const bool last =
            r.finish_reason() != tandem::v1::FINISH_REASON_UNSPECIFIED || r.has_usage();
        if (st.has_pending) {
          tandem::v1::GenerateResponse next = r;
          if (!rpc::CoalesceResponse(&st.pending, &next)) {
            ApplyLocked(i, st.pending, &to_cancel);
            st.pending = std::move(next);
          }
        } else {
          st.pending = r;
          st.has_pending = true;
        }
        // The first tokens go at once (time to first token is not traded).
        if (last || !st.output_sent || st.pending.token_ids_size() >= interval) {
          st.has_pending = false;
          st.output_sent = true;
          ApplyLocked(i, st.pending, &to_cancel);
        }
      } else {
        ApplyLocked(i, r, &to_cancel);
      }
    }
    for (auto& c : to_cancel) c->Cancel();
  }

  // Feeds router output `r` of choice i to its decoder and streams the deltas.
  void ApplyLocked(int i, const tandem::v1::GenerateResponse& r,
                   std::vector<std::shared_ptr<GenerateCall>>* to_cancel_out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<std::shared_ptr<GenerateCall>>& to_cancel = *to_cancel_out;
    {
      ChoiceState& st = *state_[i];
      if (closed_ || st.finished) return;
      if (!first_token_seen_ && r.token_ids_size() > 0) {
        first_token_seen_ = true;
        service_->metrics_.ttft->Add({{"endpoint", ctx_->endpoint}})
            .Observe(absl::ToDoubleSeconds(absl::Now() - ctx_->start));
      }
      if (tokens_counter_ == nullptr) {  // looked up once, at the first message
        tokens_counter_ =
            &service_->metrics_.tokens->Add({{"endpoint", ctx_->endpoint}});
      }
      tokens_counter_->Increment(r.token_ids_size());
      deltas_.clear();
      absl::Status s = st.decoder.Add(r, &deltas_);
      if (!s.ok()) {
        TLOG(ERROR, "bad router output").Kv("request_id", id_).Kv("status", s);
        ApiError e;
        e.message = absl::StrCat("the router returned invalid output: ", s.message());
        Fail(e);
        to_cancel = TakeCallsToCancel();
      } else if (fields_.stream) {
        StartStream();
        for (const ChoiceDelta& delta : deltas_) WriteDelta(i, delta, nullptr);
      }
      if (s.ok() && st.decoder.done()) {  // a stop string matched: choice over
        st.finished = true;
        if (fields_.stream) WriteDelta(i, {}, st.decoder.finish_reason().c_str());
        st.cancel_requested = true;
        if (st.call) to_cancel.push_back(st.call);
      }
    }
  }

  void OnDone(int i, const grpc::Status& status) {
    std::vector<std::shared_ptr<GenerateCall>> to_cancel;
    {
      absl::MutexLock lock(&mu_);
      ChoiceState& st = *state_[i];
      if (st.has_pending) {  // held back by stream_interval: it goes out first
        st.has_pending = false;
        ApplyLocked(i, st.pending, &to_cancel);
      }
      --remaining_;
      if (!closed_ && !st.finished) {
        if (status.ok()) {
          deltas_.clear();
          st.decoder.Finish(&deltas_);
          st.finished = true;
          if (fields_.stream) {
            StartStream();
            for (const ChoiceDelta& delta : deltas_) WriteDelta(i, delta, nullptr);
            WriteDelta(i, {}, st.decoder.finish_reason().c_str());
          }
        } else {
          const absl::Status s = FromGrpcStatus(status);
          TLOG(WARNING, "router call failed").Kv("request_id", id_).Kv("status", s);
          Fail(ApiErrorFromStatus(s));
          to_cancel = TakeCallsToCancel();
        }
      }
      if (remaining_ == 0) Complete();
    }
    for (auto& c : to_cancel) c->Cancel();
  }

  std::shared_ptr<OpenAIService::Context> ctx_;
  OpenAIService* const service_;  // not owned
  const bool chat_;
  const std::string id_;
  const int64_t created_;
  const std::string model_name_;
  const std::string router_model_;
  const GenerationFields fields_;
  const std::vector<Choice> choices_;
  const int prompt_tokens_;
  const std::string chunk_tail_ = ChunkTail();

  absl::Mutex mu_;
  std::vector<std::unique_ptr<ChoiceState>> state_ ABSL_GUARDED_BY(mu_);
  int remaining_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;  // the response is over
  bool streaming_ ABSL_GUARDED_BY(mu_) = false;
  bool first_token_seen_ ABSL_GUARDED_BY(mu_) = false;
  metrics::Counter* tokens_counter_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::vector<ChoiceDelta> deltas_ ABSL_GUARDED_BY(mu_);  // reused per message
};

// ---------------------------------------------------------------------------

OpenAIService::OpenAIService(OpenAIServiceOptions options,
                             const tokenizer::Tokenizer* tokenizer,
                             RouterClient* router, metrics::Registry* registry)
    : options_(std::move(options)),
      tokenizer_(tokenizer),
      router_(router),
      registry_(registry),
      metrics_(registry) {}

OpenAIService::~OpenAIService() { CancelAll(absl::Seconds(10)); }

void OpenAIService::Register(Generation* g) {
  absl::MutexLock lock(&active_mu_);
  active_.insert(g);
}

void OpenAIService::Unregister(Generation* g) {
  absl::MutexLock lock(&active_mu_);
  active_.erase(g);
  active_changed_.SignalAll();
}

int OpenAIService::active_generations() const {
  absl::MutexLock lock(&active_mu_);
  return static_cast<int>(active_.size());
}

void OpenAIService::CancelAll(absl::Duration wait) {
  std::vector<std::shared_ptr<Generation>> live;
  {
    absl::MutexLock lock(&active_mu_);
    for (Generation* g : active_) {
      if (auto sp = g->weak_from_this().lock()) live.push_back(std::move(sp));
    }
  }
  for (auto& g : live) g->Cancel();
  live.clear();
  absl::MutexLock lock(&active_mu_);
  const absl::Time deadline = absl::Now() + wait;
  while (!active_.empty()) {
    if (active_changed_.WaitWithDeadline(&active_mu_, deadline)) break;
  }
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
                      [this](absl::StatusOr<tandem::v1::ListModelsResponse> result) {
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

}  // namespace

void OpenAIService::Handle(HttpRequest request,
                           std::shared_ptr<ResponseWriter> writer) {
  auto ctx = std::make_shared<Context>();
  ctx->service = this;
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
    void (OpenAIService::*handler)(std::shared_ptr<Context>);
  };
  static constexpr Route kRoutes[] = {
      {"/v1/chat/completions", "POST", "chat_completions", true,
       &OpenAIService::HandleChat},
      {"/v1/completions", "POST", "completions", true,
       &OpenAIService::HandleCompletions},
      {"/v1/models", "GET", "models", true, &OpenAIService::HandleModels},
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
      HttpResponse r = ErrorResponse(e);
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
      HttpResponse r;
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

void OpenAIService::HandleModels(std::shared_ptr<Context> ctx) {
  std::string single;
  if (absl::StartsWith(ctx->request.path, "/v1/models/")) {
    single = ctx->request.path.substr(std::string("/v1/models/").size());
  }
  router_->ListModels(
      absl::Now() + options_.router_rpc_timeout,
      [this, ctx, single](absl::StatusOr<tandem::v1::ListModelsResponse> result) {
        if (!result.ok()) return ctx->Error(ApiErrorFromStatus(result.status()));
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
        if (single.empty()) return ctx->Json(200, {{"object", "list"}, {"data", data}});
        for (const json& m : data) {
          if (m["id"] == single) return ctx->Json(200, m);
        }
        ctx->Error(ModelNotFound(absl::NotFoundError(
            absl::StrCat("The model `", single, "` does not exist."))));
      });
}

void OpenAIService::HandleHealth(std::shared_ptr<Context> ctx) {
  router_->CheckHealth(
      absl::Now() + options_.router_rpc_timeout,
      [ctx](absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> s) {
        if (s.ok() && *s == grpc::health::v1::HealthCheckResponse::SERVING) {
          return ctx->Json(200, {{"status", "ok"}});
        }
        HttpResponse r;
        r.status = 503;
        r.headers.emplace_back("Retry-After", "1");
        r.body = Dump({{"status", "unavailable"},
                       {"detail", s.ok() ? std::string("router is not serving")
                                         : std::string(s.status().message())}});
        ctx->Send(std::move(r));
      });
}

void OpenAIService::HandleChat(std::shared_ptr<Context> ctx) {
  absl::StatusOr<ChatCompletionRequest> parsed =
      ParseChatCompletionRequest(ctx->request.body);
  if (!parsed.ok()) return ctx->Error(ParseError(parsed.status()));
  auto req = std::make_shared<ChatCompletionRequest>(*std::move(parsed));
  WithModels([this, ctx, req](ModelsOr models) {
    if (!models.ok()) return ctx->Error(ApiErrorFromStatus(models.status()));
    auto model = ResolveModel(**models, options_.served_model_name, req->fields.model);
    if (!model.ok()) return ctx->Error(ModelNotFound(model.status()));
    absl::StatusOr<std::vector<chat::Segment>> segments =
        chat::RenderChat(req->messages, req->tools, req->options);
    if (!segments.ok()) return ctx->Error(ParseError(segments.status()));
    absl::StatusOr<std::vector<int>> ids = chat::EncodeChat(*tokenizer_, *segments);
    if (!ids.ok()) return ctx->Error(ParseError(ids.status()));
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
    o.tool_call_id_prefix = absl::StrCat("call_", ids_.Next().substr(0, 12), "_");
    const std::string name = options_.served_model_name.empty()
                                 ? (*model)->id()
                                 : options_.served_model_name;
    auto g = std::make_shared<Generation>(
        ctx, /*chat=*/true, ids_.Next("chatcmpl-"), name, (*model)->id(), req->fields,
        std::move(o), std::move(choices), static_cast<int>(ids->size()));
    g->Start();
  });
}

void OpenAIService::HandleCompletions(std::shared_ptr<Context> ctx) {
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
    auto g = std::make_shared<Generation>(ctx, /*chat=*/false, ids_.Next("cmpl-"), name,
                                          (*model)->id(), req->fields, std::move(o),
                                          std::move(choices), prompt_tokens);
    g->Start();
  });
}

}  // namespace tandem::gateway
