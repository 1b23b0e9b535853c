#include "gateway/generation.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "engine/tokenizer/utf8.h"
#include "gateway/json_escape.h"
#include "gateway/sse.h"
#include "rpc/deadline.h"
#include "rpc/response_stream.h"

namespace tandem::gateway {

using json = nlohmann::json;

namespace {

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

// Appends `more`'s legacy logprobs arrays to `into`'s (top_logprobs stays null
// when it is).
void AppendCompletionLogprobs(json* into, json more) {
  for (const char* key : {"tokens", "token_logprobs", "text_offset"}) {
    for (json& v : more[key]) (*into)[key].push_back(std::move(v));
  }
  if (!(*into)["top_logprobs"].is_null()) {
    for (json& v : more["top_logprobs"])
      (*into)["top_logprobs"].push_back(std::move(v));
  }
}

std::string TokenText(const tokenizer::Tokenizer& t, int32_t id) {
  return tokenizer::ReplaceInvalidUtf8(t.IdToken(id).value_or(""));
}

// Completions' echo: the prompt's tokens as legacy logprobs entries (the first
// token's logprob and alternatives null: nothing predicts it); `offset` as in
// CompletionLogprobs. `scores[k]` scores prompt token k + 1.
json EchoLogprobs(const tokenizer::Tokenizer& t, const std::vector<int>& prompt,
                  const std::vector<tandem::v1::TokenLogprob>& scores, int top_n,
                  size_t* offset) {
  const bool with_top = top_n > 0;
  json tokens = json::array(), lps = json::array(), tops = json::array(),
       offsets = json::array();
  for (size_t k = 0; k < prompt.size(); ++k) {
    const std::string token = t.IdToken(prompt[k]).value_or("");
    tokens.push_back(tokenizer::ReplaceInvalidUtf8(token));
    offsets.push_back(*offset);
    *offset += token.size();
    const tandem::v1::TokenLogprob* s =
        k > 0 && k - 1 < scores.size() ? &scores[k - 1] : nullptr;
    lps.push_back(s != nullptr ? json(s->logprob()) : json(nullptr));
    if (s == nullptr) {
      tops.push_back(nullptr);
      continue;
    }
    // The scores may carry more alternatives (prompt_logprobs asked for more).
    json top = json::object();
    for (int a = 0; a < s->top_size() && a < top_n; ++a) {
      top[TokenText(t, s->top(a).token_id())] = s->top(a).logprob();
    }
    tops.push_back(std::move(top));
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(lps)},
          {"top_logprobs", with_top ? std::move(tops) : json(nullptr)},
          {"text_offset", std::move(offsets)}};
}

// vLLM's prompt_logprobs: null for the first prompt token, then per token a
// map from token id (a string) to {logprob, rank, decoded_token}: the prompt's
// own token and the alternatives (rank = their place, 1 first).
json VllmPromptLogprobs(const tokenizer::Tokenizer& t, const std::vector<int>& prompt,
                        const std::vector<tandem::v1::TokenLogprob>& scores,
                        int top_n) {
  json out = json::array();
  if (prompt.empty()) return out;
  out.push_back(nullptr);
  for (size_t k = 1; k < prompt.size(); ++k) {
    if (k - 1 >= scores.size()) {
      out.push_back(nullptr);
      continue;
    }
    const tandem::v1::TokenLogprob& s = scores[k - 1];
    json entry = json::object();
    for (int a = 0; a < s.top_size() && a < top_n; ++a) {
      entry[std::to_string(s.top(a).token_id())] = {
          {"logprob", s.top(a).logprob()},
          {"rank", a + 1},
          {"decoded_token", TokenText(t, s.top(a).token_id())}};
    }
    entry[std::to_string(s.token_id())] = {
        {"logprob", s.logprob()},
        {"rank", s.rank()},
        {"decoded_token", TokenText(t, s.token_id())}};
    out.push_back(std::move(entry));
  }
  return out;
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

void LiveGenerations::Add(Generation* g) {
  absl::MutexLock lock(&mu_);
  live_.insert(g);
}

void LiveGenerations::Remove(Generation* g) {
  absl::MutexLock lock(&mu_);
  live_.erase(g);
  changed_.SignalAll();
}

int LiveGenerations::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(live_.size());
}

void LiveGenerations::CancelAll(absl::Duration wait) {
  std::vector<std::shared_ptr<Generation>> live;
  {
    absl::MutexLock lock(&mu_);
    for (Generation* g : live_) {
      if (auto sp = g->weak_from_this().lock()) live.push_back(std::move(sp));
    }
  }
  for (auto& g : live) g->Cancel();
  live.clear();
  absl::MutexLock lock(&mu_);
  const absl::Time deadline = absl::Now() + wait;
  while (!live_.empty()) {
    if (changed_.WaitWithDeadline(&mu_, deadline)) break;
  }
}

Generation::Generation(std::shared_ptr<RequestContext> ctx, GenerationDeps deps,
                       bool chat, std::string id, std::string model_name,
                       std::string router_model, GenerationFields fields,
                       ChoiceDecoder::Options decoder_options,
                       std::vector<Choice> choices, int prompt_tokens)
    : ctx_(std::move(ctx)),
      deps_(deps),
      chat_(chat),
      id_(std::move(id)),
      created_(absl::ToUnixSeconds(absl::Now())),
      model_name_(std::move(model_name)),
      router_model_(std::move(router_model)),
      fields_(std::move(fields)),
      choices_(std::move(choices)),
      prompt_tokens_(prompt_tokens) {
  deps_.live->Add(this);
  for (size_t i = 0; i < choices_.size(); ++i) {
    ChoiceDecoder::Options o = decoder_options;
    o.tool_call_id_prefix = absl::StrCat(decoder_options.tool_call_id_prefix, i, "_");
    state_.push_back(std::make_unique<ChoiceState>(deps_.tokenizer, std::move(o)));
  }
  remaining_ = static_cast<int>(choices_.size());
}

Generation::~Generation() {
  if (streaming_) deps_.metrics->active_streams->Add({}).Decrement();
  // Everything that reaches outside this object (the HTTP writer through the
  // request context, the decoders) goes BEFORE Remove: Remove is what lets a
  // shutdown (LiveGenerations::CancelAll) return and destroy the HTTP server
  // and the service, so nothing may touch them after it.
  ctx_.reset();
  {
    absl::MutexLock lock(&mu_);
    state_.clear();
    deltas_.clear();
  }
  deps_.live->Remove(this);
}

void Generation::Start() {
  std::weak_ptr<Generation> weak = weak_from_this();
  ctx_->writer->OnClientGone([weak] {
    if (auto self = weak.lock()) self->ClientGone();
  });
  const absl::Time deadline = absl::Now() + deps_.request_timeout;
  for (size_t i = 0; i < choices_.size(); ++i) {
    tandem::v1::GenerateRequest req = BuildRequest(static_cast<int>(i), deadline);
    auto self = shared_from_this();
    const int index = static_cast<int>(i);
    std::shared_ptr<GenerateCall> call = deps_.router->Generate(
        std::move(req), deadline,
        {.on_response =
             [self, index](const tandem::v1::GenerateResponse& r) {
               self->OnResponse(index, r);
             },
         .on_done = [self, index](const grpc::Status& s) { self->OnDone(index, s); }});
    bool cancel = false;
    {
      absl::MutexLock lock(&mu_);
      state_[i]->call = call;
      cancel = closed_ || state_[i]->cancel_requested;
    }
    if (cancel) call->Cancel();
  }
}

void Generation::Cancel() {
  std::vector<std::shared_ptr<GenerateCall>> calls;
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    calls = TakeCallsToCancel();
  }
  for (auto& c : calls) c->Cancel();
}

tandem::v1::GenerateRequest Generation::BuildRequest(int i, absl::Time deadline) const {
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
  if (const int k = PromptLogprobsAsked(); k >= 0) s->set_prompt_logprobs(k);
  for (const auto& [id, bias] : fields_.logit_bias) {
    (*s->mutable_logit_bias())[id] = static_cast<float>(bias);
  }
  if (structured_output_) *s->mutable_structured_output() = *structured_output_;
  auto* stop = req.mutable_stop();
  // Score-only (echo, max_tokens 0): one token is computed with the prompt's
  // scores and dropped here (ApplyLocked).
  if (fields_.max_tokens) stop->set_max_tokens(std::max(*fields_.max_tokens, 1));
  for (const std::string& str : fields_.stop) stop->add_stop_strings(str);
  for (int id : fields_.stop_token_ids) stop->add_stop_token_ids(id);
  stop->set_ignore_eos(fields_.ignore_eos);
  stop->set_min_tokens(fields_.min_tokens);
  req.set_deadline_unix_ms(rpc::ToUnixMillisOrZero(deadline));
  req.set_priority(fields_.priority);
  if (!fields_.cache_salt.empty()) req.set_cache_salt(fields_.cache_salt);
  for (const tandem::v1::ImageInput& image : images_) *req.add_images() = image;
  return req;
}

std::vector<std::shared_ptr<GenerateCall>> Generation::TakeCallsToCancel() {
  std::vector<std::shared_ptr<GenerateCall>> calls;
  for (auto& st : state_) {
    st->cancel_requested = true;
    if (st->call) calls.push_back(st->call);
  }
  return calls;
}

void Generation::ClientGone() {
  {
    absl::MutexLock lock(&mu_);
    if (!closed_) {
      ctx_->answered = true;
      ctx_->Record(499);  // client closed request (nginx's code)
    }
  }
  Cancel();
}

json Generation::ChunkBase() const {
  json j = {{"id", id_},
            {"object", chat_ ? "chat.completion.chunk" : "text_completion"},
            {"created", created_},
            {"model", model_name_}};
  return j;
}

void Generation::WriteChunk(json choice) {
  json j = ChunkBase();
  j["choices"] = json::array({std::move(choice)});
  if (fields_.include_usage) j["usage"] = nullptr;
  ctx_->writer->Write(SseEvent(DumpJson(j)));
}

void Generation::StartStream() {
  if (streaming_) return;
  streaming_ = true;
  ctx_->answered = true;
  deps_.metrics->active_streams->Add({}).Increment();
  ctx_->writer->StartStream(200, "text/event-stream; charset=utf-8", {});
}

void Generation::WriteDelta(int i, const ChoiceDelta& delta,
                            const char* finish_reason) {
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

int Generation::PromptLogprobsAsked() const {
  int k = fields_.prompt_logprobs.value_or(-1);
  if (fields_.echo && fields_.logprobs) k = std::max(k, fields_.top_logprobs);
  return k;
}

std::string Generation::PromptText(int i) const {
  absl::StatusOr<std::string> text = deps_.tokenizer->Decode(choices_[i].prompt);
  return text.ok() ? tokenizer::ReplaceInvalidUtf8(*text) : std::string();
}

void Generation::WritePromptChunk(int i) {
  ChoiceState& st = *state_[i];
  if (chat_ || st.prompt_sent || !(fields_.echo || fields_.prompt_logprobs)) return;
  st.prompt_sent = true;
  json c = {{"index", i}, {"text", fields_.echo ? PromptText(i) : std::string()}};
  c["logprobs"] =
      fields_.echo && fields_.logprobs
          ? EchoLogprobs(*deps_.tokenizer, choices_[i].prompt, st.prompt_scores,
                         fields_.top_logprobs, &st.text_offset)
          : json(nullptr);
  if (fields_.prompt_logprobs) {
    c["prompt_logprobs"] =
        VllmPromptLogprobs(*deps_.tokenizer, choices_[i].prompt, st.prompt_scores,
                           *fields_.prompt_logprobs);
  }
  c["finish_reason"] = nullptr;
  WriteChunk(std::move(c));
}

void Generation::WriteTextDelta(int i, ChoiceState& st, const ChoiceDelta& delta,
                                const char* finish_reason) {
  std::string out;
  out.reserve(chunk_tail_.size() + delta.content.size() + delta.reasoning.size() + 128);
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

void Generation::AppendFinishIndex(std::string* out, int i, const char* finish_reason) {
  *out += "\"finish_reason\":";
  if (finish_reason == nullptr) {
    *out += "null";
  } else {
    AppendJsonString(out, finish_reason);
  }
  absl::StrAppend(out, ",\"index\":", i);
}

std::string Generation::ChunkTail() const {
  json base = ChunkBase();
  if (fields_.include_usage) base["usage"] = nullptr;
  std::string dumped = DumpJson(base);  // {"created":...}
  return absl::StrCat("],", absl::string_view(dumped).substr(1), "\n\n");
}

json Generation::Usage() const {
  int completion = 0;
  int cached = 0;  // the prompt's tokens from a prefix cache (the best choice's)
  for (const auto& st : state_) {
    completion += st->decoder.completion_tokens();
    cached = std::max(cached, st->cached_prompt_tokens);
  }
  return {{"prompt_tokens", prompt_tokens_},
          {"completion_tokens", completion},
          {"total_tokens", prompt_tokens_ + completion},
          {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

void Generation::Fail(const ApiError& error) {
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

void Generation::Complete() {
  if (closed_) return;
  closed_ = true;
  if (streaming_) {
    if (fields_.include_usage) {
      json j = ChunkBase();
      j["choices"] = json::array();
      j["usage"] = Usage();
      ctx_->writer->Write(SseEvent(DumpJson(j)));
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
      size_t offset = 0;
      json logprobs = nullptr;
      if (fields_.echo) {
        c["text"] = PromptText(i) + d.content();
        if (fields_.logprobs) {
          logprobs =
              EchoLogprobs(*deps_.tokenizer, choices_[i].prompt,
                           state_[i]->prompt_scores, fields_.top_logprobs, &offset);
          AppendCompletionLogprobs(
              &logprobs,
              CompletionLogprobs(d.logprobs(), fields_.top_logprobs > 0, &offset));
        }
      } else {
        c["text"] = d.content();
        if (fields_.logprobs) {
          logprobs =
              CompletionLogprobs(d.logprobs(), fields_.top_logprobs > 0, &offset);
        }
      }
      c["logprobs"] = std::move(logprobs);
      if (fields_.prompt_logprobs) {
        c["prompt_logprobs"] =
            VllmPromptLogprobs(*deps_.tokenizer, choices_[i].prompt,
                               state_[i]->prompt_scores, *fields_.prompt_logprobs);
      }
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
  if (chat_ && fields_.prompt_logprobs && !state_.empty()) {
    // vLLM's place for a chat: the response's (every choice has the prompt).
    body["prompt_logprobs"] =
        VllmPromptLogprobs(*deps_.tokenizer, choices_[0].prompt,
                           state_[0]->prompt_scores, *fields_.prompt_logprobs);
  }
  ctx_->Json(200, body);
}

void Generation::OnResponse(int i, const tandem::v1::GenerateResponse& r) {
  std::vector<std::shared_ptr<GenerateCall>> to_cancel;
  {
    absl::MutexLock lock(&mu_);
    ChoiceState& st = *state_[i];
    if (closed_ || st.finished) return;
    const int interval = deps_.stream_interval;
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

void Generation::ApplyLocked(
    int i, const tandem::v1::GenerateResponse& r,
    std::vector<std::shared_ptr<GenerateCall>>* to_cancel_out) {
  std::vector<std::shared_ptr<GenerateCall>>& to_cancel = *to_cancel_out;
  {
    ChoiceState& st = *state_[i];
    if (closed_ || st.finished) return;
    if (!first_token_seen_ && r.token_ids_size() > 0) {
      first_token_seen_ = true;
      deps_.metrics->ttft->Add({{"endpoint", ctx_->endpoint}})
          .Observe(absl::ToDoubleSeconds(absl::Now() - ctx_->start));
    }
    if (tokens_counter_ == nullptr) {  // looked up once, at the first message
      tokens_counter_ = &deps_.metrics->tokens->Add({{"endpoint", ctx_->endpoint}});
    }
    if (!fields_.ScoreOnly()) tokens_counter_->Increment(r.token_ids_size());
    if (r.has_usage()) st.cached_prompt_tokens = r.usage().cached_prompt_tokens();
    if (r.prompt_logprobs_size() > 0) {
      st.prompt_scores.assign(r.prompt_logprobs().begin(), r.prompt_logprobs().end());
    }
    if (!st.first_message_seen) {
      st.first_message_seen = true;
      // Asked for and missing: an older router or worker dropped the field
      // (each scores prompts of 2+ tokens on the first message).
      if (PromptLogprobsAsked() >= 0 && choices_[i].prompt.size() >= 2 &&
          r.prompt_logprobs_size() == 0) {
        ApiError e;
        e.message =
            "the router returned no prompt logprobs (a router or worker older than "
            "prompt_logprobs?)";
        Fail(e);
        to_cancel = TakeCallsToCancel();
        return;
      }
    }
    // (An error ending the request goes the decoder's way: a server error.)
    if (fields_.ScoreOnly() && r.finish_reason() != tandem::v1::FINISH_REASON_ERROR) {
      // The prompt's scores are all this choice returns: its generated token
      // is dropped, the choice ends "length" with no completion tokens, and
      // the router call is cancelled.
      st.decoder.EndWithoutOutput("length");
      st.finished = true;
      if (fields_.stream) {
        StartStream();
        WritePromptChunk(i);
        WriteDelta(i, {}, "length");
      }
      st.cancel_requested = true;
      if (st.call) to_cancel.push_back(st.call);
      return;
    }
    deltas_.clear();
    absl::Status s = st.decoder.Add(r, &deltas_);
    if (!s.ok() && st.decoder.failed()) {
      // FINISH_REASON_ERROR: the engine ended the request (500 server_error,
      // as a failed router call).
      TLOG(WARNING, "generation failed").Kv("request_id", id_).Kv("status", s);
      Fail(ApiErrorFromStatus(s));
      to_cancel = TakeCallsToCancel();
    } else if (!s.ok()) {
      TLOG(ERROR, "bad router output").Kv("request_id", id_).Kv("status", s);
      ApiError e;
      e.message = absl::StrCat("the router returned invalid output: ", s.message());
      Fail(e);
      to_cancel = TakeCallsToCancel();
    } else if (fields_.stream) {
      StartStream();
      WritePromptChunk(i);
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

void Generation::OnDone(int i, const grpc::Status& status) {
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
          WritePromptChunk(i);
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

}  // namespace tandem::gateway
