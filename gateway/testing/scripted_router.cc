#include "gateway/testing/scripted_router.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "rpc/session_stream.h"

namespace tandem::gateway::testing {
namespace {

using json = nlohmann::json;

constexpr absl::string_view kThinkOpen = "<|open|>think<|sep|>";
constexpr absl::string_view kResponseOpen = "<|open|>response<|sep|>";
constexpr absl::string_view kTail =
    "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>";

std::vector<int> Encode(const tokenizer::Tokenizer& t, const std::string& text) {
  static const auto* const kStructure = new absl::flat_hash_set<std::string>{
      "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[EOS]"};
  return t.EncodeWithSpecial(text, *kStructure).value_or(std::vector<int>{});
}

// The number after `key` in `text` ("#tokens:25" → 25), or -1.
int64_t NumberAfter(absl::string_view text, absl::string_view key) {
  size_t at = text.find(key);
  if (at == absl::string_view::npos) return -1;
  at += key.size();
  size_t end = at;
  while (end < text.size() && text[end] >= '0' && text[end] <= '9') ++end;
  int64_t n = -1;
  if (!absl::SimpleAtoi(text.substr(at, end - at), &n)) return -1;
  return n;
}

grpc::StatusCode CodeByName(absl::string_view name) {
  if (absl::StartsWith(name, "RESOURCE_EXHAUSTED")) return grpc::RESOURCE_EXHAUSTED;
  if (absl::StartsWith(name, "UNAVAILABLE")) return grpc::UNAVAILABLE;
  if (absl::StartsWith(name, "INVALID_ARGUMENT")) return grpc::INVALID_ARGUMENT;
  if (absl::StartsWith(name, "DEADLINE_EXCEEDED")) return grpc::DEADLINE_EXCEEDED;
  if (absl::StartsWith(name, "NOT_FOUND")) return grpc::NOT_FOUND;
  return grpc::INTERNAL;
}

// The message carrying script tokens [*sent, end) of `request` (with made-up
// logprobs when asked, the seed on the first message, finish reason and usage
// once `limit` tokens are out); advances *sent.
void BuildMessage(const tandem::v1::GenerateRequest& request,
                  const ScriptedRouter::Script& script, int limit, int end, int* sent,
                  bool* seed_sent, tandem::v1::GenerateResponse* response) {
  response->set_request_id(request.request_id());
  if (*sent == 0 && request.sampling().has_prompt_logprobs()) {
    // Made-up prompt scores: token k scored -1 - 0.25 (k % 5), rank 1 + k % 3.
    const auto& prompt = request.prompt_token_ids().ids();
    for (int k = 1; k < prompt.size(); ++k) {
      auto* lp = response->add_prompt_logprobs();
      const float value = -1.0f - 0.25f * static_cast<float>(k % 5);
      lp->set_token_id(prompt[k]);
      lp->set_logprob(value);
      lp->set_rank(1 + k % 3);
      for (int a = 0; a < request.sampling().prompt_logprobs(); ++a) {
        auto* top = lp->add_top();
        top->set_token_id((prompt[k] + a + 1) % tokenizer::kNumBaseTokens);
        top->set_logprob(value + 0.5f - static_cast<float>(a) * 0.125f);
      }
    }
  }
  for (; *sent < end; ++*sent) {
    const int id = script.ids[*sent];
    response->add_token_ids(id);
    if (request.sampling().logprobs()) {
      auto* lp = response->add_logprobs();
      const float value = -0.5f - 0.1f * static_cast<float>(*sent % 7);
      lp->set_token_id(id);
      lp->set_logprob(value);
      for (int k = 0; k < request.sampling().top_logprobs(); ++k) {
        auto* top = lp->add_top();
        top->set_token_id(k == 0 ? id : (id + k) % tokenizer::kNumBaseTokens);
        top->set_logprob(value - static_cast<float>(k));
      }
    }
  }
  if (!*seed_sent && request.sampling().has_seed()) {
    *seed_sent = true;
    response->set_seed(request.sampling().seed());
  }
  if (*sent >= limit) {
    const bool length = limit < static_cast<int>(script.ids.size());
    response->set_finish_reason(length ? tandem::v1::FINISH_REASON_LENGTH
                                       : tandem::v1::FINISH_REASON_STOP);
    auto* usage = response->mutable_usage();
    usage->set_prompt_tokens(request.prompt_token_ids().ids_size());
    usage->set_completion_tokens(*sent);
  }
}

// {"token id": bias}, as the OpenAI field.
json LogitBias(const tandem::v1::SamplingParams& s) {
  json out = json::object();
  for (const auto& [id, bias] : s.logit_bias()) out[std::to_string(id)] = bias;
  return out;
}

json GenerateEvent(const tandem::v1::GenerateRequest& request) {
  return {{"event", "generate"},
          {"request_id", request.request_id()},
          {"model", request.model()},
          {"prompt_tokens", request.prompt_token_ids().ids_size()},
          {"seed", request.sampling().has_seed() ? json(request.sampling().seed())
                                                 : json(nullptr)},
          {"temperature", request.sampling().temperature()},
          {"top_p", request.sampling().top_p()},
          {"presence_penalty", request.sampling().presence_penalty()},
          {"frequency_penalty", request.sampling().frequency_penalty()},
          {"logit_bias", LogitBias(request.sampling())},
          {"max_tokens", request.stop().max_tokens()},
          {"stop_strings",
           json(std::vector<std::string>(request.stop().stop_strings().begin(),
                                         request.stop().stop_strings().end()))},
          {"logprobs", request.sampling().logprobs()},
          {"top_logprobs", request.sampling().top_logprobs()}};
}

}  // namespace

// Streams a Script. Full speed (the default): one token per message, each
// written as soon as the previous write completed. "#per_message:K": K tokens
// per message (as a router that coalesced them would send). "#paced" (with
// Options::step > 0): the tokens come from the router's step clock, one per
// step, like a decode engine's batch step; tokens that arrive while a write
// is in flight go out together in the next message (the coalescing a real
// router does).
//   START → write tokens (with logprobs) → OnWriteDone → ... → last message
//   carries finish_reason + usage → Finish(OK)
//   cancelled (OnCancel / failed write) → Finish(CANCELLED); error → Finish(code)
class ScriptedStream final
    : public grpc::ServerWriteReactor<tandem::v1::GenerateResponse> {
 public:
  ScriptedStream(ScriptedRouter* owner, grpc::CallbackServerContext* context,
                 const tandem::v1::GenerateRequest& request)
      : owner_(owner), context_(context), request_(request) {
    script_ = owner_->Plan(request_);
    const int max_tokens = request_.stop().max_tokens();
    limit_ = static_cast<int>(script_.ids.size());
    if (max_tokens > 0 && max_tokens < limit_) limit_ = max_tokens;
    owner_->Emit(GenerateEvent(request_));
    if (script_.fail_after < 0 && !script_.error.ok()) {
      absl::MutexLock lock(&mu_);
      FinishLocked(script_.error);
      return;
    }
    per_message_ = std::max(1, script_.per_message);
    paced_ = script_.paced && owner_->paced();
    {
      absl::MutexLock lock(&mu_);
      available_ = paced_ ? 1 : limit_;  // paced: the first token comes at once
      NextLocked();
    }
    if (paced_) owner_->AddPaced(this);
  }

  // One step of the router's clock: one more token is ready.
  void Step() {
    absl::MutexLock lock(&mu_);
    if (finish_called_) return;
    if (available_ < limit_) ++available_;
    if (context_->IsCancelled()) {
      if (!writing_) FinishLocked(grpc::Status(grpc::CANCELLED, "cancelled"));
      return;
    }
    if (!writing_) NextLocked();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok || context_->IsCancelled()) {
      FinishLocked(grpc::Status(grpc::CANCELLED, "cancelled"));
      return;
    }
    if (finished_writing_) {
      FinishLocked(grpc::Status::OK);
      return;
    }
    NextLocked();
  }

  void OnCancel() override {
    owner_->Emit({{"event", "cancelled"}, {"request_id", request_.request_id()}});
    absl::MutexLock lock(&mu_);
    if (!writing_) FinishLocked(grpc::Status(grpc::CANCELLED, "cancelled"));
  }

  void OnDone() override {
    if (paced_) owner_->RemovePaced(this);
    int sent;
    {
      absl::MutexLock lock(&mu_);
      sent = sent_;
    }
    owner_->Emit(
        {{"event", "done"}, {"request_id", request_.request_id()}, {"sent", sent}});
    delete this;
  }

 private:
  void FinishLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finish_called_) return;
    finish_called_ = true;
    Finish(status);
  }

  // Writes the tokens that are ready (at most per_message_), if any.
  void NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finish_called_ || writing_) return;
    if (script_.fail_after >= 0 && sent_ >= script_.fail_after) {
      FinishLocked(script_.error);
      return;
    }
    int end = paced_ ? available_ : std::min(available_, sent_ + per_message_);
    if (script_.fail_after >= 0) end = std::min(end, script_.fail_after);
    if (end <= sent_) return;  // paced: wait for the next step
    response_.Clear();
    BuildMessage(request_, script_, limit_, end, &sent_, &seed_sent_, &response_);
    finished_writing_ = sent_ >= limit_;
    writing_ = true;
    StartWrite(&response_);
  }

  ScriptedRouter* const owner_;
  grpc::CallbackServerContext* const context_;
  const tandem::v1::GenerateRequest request_;
  ScriptedRouter::Script script_;
  int limit_ = 0;
  int per_message_ = 1;
  bool paced_ = false;

  absl::Mutex mu_;
  int available_ ABSL_GUARDED_BY(mu_) = 0;  // tokens ready to send
  int sent_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool seed_sent_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_called_ ABSL_GUARDED_BY(mu_) = false;
  tandem::v1::GenerateResponse response_ ABSL_GUARDED_BY(mu_);
};

// A Script on one stream id of a GenerateSession: pushes into the session's
// sink, which merges what queues behind a write in flight (as the router's
// session does). "#paced": one token per step of the clock. Otherwise "full
// speed": up to kBurstTokens tokens (in per_message-token messages) per
// millisecond, so that a long script cannot pile up in the sink faster than
// any client reads (a session has no per-request flow control).
//   START → Push* → Close(OK | scripted error | CANCELLED on the cancel hook)
class ScriptedSessionRequest final
    : public std::enable_shared_from_this<ScriptedSessionRequest> {
 public:
  ScriptedSessionRequest(ScriptedRouter* owner, tandem::v1::GenerateRequest request,
                         rpc::ResponseSink* sink)
      : owner_(owner), request_(std::move(request)), sink_(sink) {}

  void Start() {
    script_ = owner_->Plan(request_);
    const int max_tokens = request_.stop().max_tokens();
    limit_ = static_cast<int>(script_.ids.size());
    if (max_tokens > 0 && max_tokens < limit_) limit_ = max_tokens;
    owner_->Emit(GenerateEvent(request_));
    std::weak_ptr<ScriptedSessionRequest> weak = weak_from_this();
    sink_->SetOnCancel([weak] {
      if (auto self = weak.lock()) self->Cancelled();
    });
    paced_ = script_.paced && owner_->paced();
    absl::MutexLock lock(&mu_);
    if (script_.fail_after < 0 && !script_.error.ok()) {
      CloseLocked(script_.error);
      return;
    }
    if (paced_) {
      PushLocked(1);  // the first token comes at once
    } else {
      BurstLocked();
    }
  }

  bool paced() const { return paced_; }

  // One step of the clock: the next token (paced) or burst; false once the
  // request is over.
  bool Step() {
    absl::MutexLock lock(&mu_);
    if (paced_) {
      if (!closed_) PushLocked(sent_ + 1);
    } else {
      BurstLocked();
    }
    return !closed_;
  }

  static constexpr int kBurstTokens = 64;
  static constexpr absl::Duration kBurstPeriod = absl::Milliseconds(1);

 private:
  void Cancelled() {
    owner_->Emit({{"event", "cancelled"}, {"request_id", request_.request_id()}});
    absl::MutexLock lock(&mu_);
    CloseLocked(grpc::Status(grpc::CANCELLED, "cancelled"));
  }

  void BurstLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int per_message = std::max(1, script_.per_message);
    const int until = sent_ + kBurstTokens;
    while (!closed_ && sent_ < until) PushLocked(std::min(until, sent_ + per_message));
  }

  // Pushes the tokens up to `end` (capped by the script's failure point and
  // the limit); closes after the last one or at the failure.
  void PushLocked(int end) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (script_.fail_after >= 0 && sent_ >= script_.fail_after) {
      CloseLocked(script_.error);
      return;
    }
    end = std::min(end, limit_);
    if (script_.fail_after >= 0) end = std::min(end, script_.fail_after);
    tandem::v1::GenerateResponse m;
    BuildMessage(request_, script_, limit_, end, &sent_, &seed_sent_, &m);
    sink_->Push(std::move(m));
    if (sent_ >= limit_) CloseLocked(grpc::Status::OK);
  }

  void CloseLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (closed_) return;
    closed_ = true;
    sink_->Close(status);
    owner_->Emit(
        {{"event", "done"}, {"request_id", request_.request_id()}, {"sent", sent_}});
  }

  ScriptedRouter* const owner_;
  const tandem::v1::GenerateRequest request_;
  rpc::ResponseSink* const sink_;  // producer reference until Close
  ScriptedRouter::Script script_;
  int limit_ = 0;
  bool paced_ = false;
  absl::Mutex mu_;
  int sent_ ABSL_GUARDED_BY(mu_) = 0;
  bool seed_sent_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

ScriptedRouter::ScriptedRouter(const tokenizer::Tokenizer* tokenizer, Options options,
                               EventSink events)
    : tokenizer_(tokenizer), options_(std::move(options)), events_(std::move(events)) {
  if (options_.step > absl::ZeroDuration()) {
    stepper_ = std::thread([this] { StepLoop(); });
  }
}

ScriptedRouter::~ScriptedRouter() {
  {
    absl::MutexLock lock(&paced_mu_);
    stopping_ = true;
  }
  if (stepper_.joinable()) stepper_.join();
  std::thread burster;
  {
    absl::MutexLock lock(&paced_mu_);
    burster.swap(burster_);
  }
  if (burster.joinable()) burster.join();
}

void ScriptedRouter::AddPaced(ScriptedStream* stream) {
  absl::MutexLock lock(&paced_mu_);
  paced_streams_.insert(stream);
}

void ScriptedRouter::RemovePaced(ScriptedStream* stream) {
  absl::MutexLock lock(&paced_mu_);
  paced_streams_.erase(stream);
}

// One step per Options::step; a late step is not made up for (a slow engine
// just runs slower), so what the gateway receives is never more than one
// token per stream per step.
void ScriptedRouter::StepLoop() {
  absl::Time next = absl::Now() + options_.step;
  for (;;) {
    {
      absl::MutexLock lock(&paced_mu_);
      paced_mu_.AwaitWithDeadline(absl::Condition(&stopping_), next);
      if (stopping_) return;
      for (ScriptedStream* s : paced_streams_) s->Step();
      for (auto it = paced_requests_.begin(); it != paced_requests_.end();) {
        if ((*it)->Step()) {
          ++it;
        } else {
          paced_requests_.erase(it++);
        }
      }
      ++steps_;
    }
    next = std::max(next + options_.step, absl::Now());
  }
}

void ScriptedRouter::BurstLoop() {
  for (;;) {
    absl::MutexLock lock(&paced_mu_);
    paced_mu_.AwaitWithTimeout(absl::Condition(&stopping_),
                               ScriptedSessionRequest::kBurstPeriod);
    if (stopping_) return;
    for (auto it = burst_requests_.begin(); it != burst_requests_.end();) {
      if ((*it)->Step()) {
        ++it;
      } else {
        burst_requests_.erase(it++);
      }
    }
  }
}

int64_t ScriptedRouter::steps() const {
  absl::MutexLock lock(&paced_mu_);
  return steps_;
}

ScriptedRouter::Script ScriptedRouter::Plan(
    const tandem::v1::GenerateRequest& request) const {
  Script script;
  std::vector<int> prompt(request.prompt_token_ids().ids().begin(),
                          request.prompt_token_ids().ids().end());
  std::string text;
  if (request.has_prompt_token_ids()) {
    text = tokenizer_->Decode(prompt).value_or("");
  } else {
    text = request.prompt_text();
  }
  if (size_t at = text.find("#error:"); at != std::string::npos) {
    script.error = grpc::Status(CodeByName(absl::string_view(text).substr(at + 7)),
                                "scripted failure");
    return script;
  }
  const bool thinking = absl::EndsWith(text, kThinkOpen);
  const bool chat = thinking || absl::EndsWith(text, kResponseOpen);
  const std::string seed = request.sampling().has_seed()
                               ? absl::StrCat(" seed=", request.sampling().seed())
                               : "";

  std::string body;
  const int64_t filler = NumberAfter(text, "#tokens:");
  if (filler >= 0) {
    static const int kLa = Encode(*tokenizer_, " la").front();
    const std::vector<int> head =
        chat ? Encode(*tokenizer_, thinking ? "<|close|>think<|sep|>"
                                              "<|open|>response<|sep|>"
                                            : "")
             : std::vector<int>{};
    script.ids = head;
    script.ids.insert(script.ids.end(), static_cast<size_t>(filler), kLa);
    const std::vector<int> tail =
        Encode(*tokenizer_, chat ? std::string(kTail) : "[EOS]");
    script.ids.insert(script.ids.end(), tail.begin(), tail.end());
  } else if (!chat) {
    body = absl::StrCat(" The quick brown fox jumps over the lazy dog.", seed,
                        " The end.[EOS]");
    script.ids = Encode(*tokenizer_, body);
  } else {
    std::string think = thinking ? "The user wants an answer.<|close|>think<|sep|>"
                                   "<|open|>response<|sep|>"
                                 : "";
    if (absl::StrContains(text, "<|open|>message role=\"tool\"")) {
      body = absl::StrCat(think, "The weather in Paris is sunny.", seed, kTail);
    } else if (absl::StrContains(text, "#tool")) {
      body = absl::StrCat(
          think,
          "<|close|>response<|sep|><|open|>tools<|sep|>"
          "<|open|>call tool=\"get_weather\" index=\"1\"<|sep|>"
          "<|open|>argument key=\"city\" type=\"string\"<|sep|>Paris"
          "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
          "<|close|>message<|sep|><|end_of_msg|>");
    } else {
      body = absl::StrCat(think, "Hello! The quick brown fox jumps over the lazy dog.",
                          seed, kTail);
    }
    script.ids = Encode(*tokenizer_, body);
  }
  script.per_message = static_cast<int>(std::min<int64_t>(
      std::max<int64_t>(NumberAfter(text, "#per_message:"), 1), 1 << 20));
  script.paced = absl::StrContains(text, "#paced");
  if (absl::StrContains(text, "#fail_midway")) {
    script.error = grpc::Status(grpc::UNAVAILABLE, "scripted failure mid-stream");
    script.fail_after = 3;
  }
  return script;
}

grpc::ServerWriteReactor<tandem::v1::GenerateResponse>* ScriptedRouter::Generate(
    grpc::CallbackServerContext* context, const tandem::v1::GenerateRequest* request) {
  return new ScriptedStream(this, context, *request);
}

grpc::ServerBidiReactor<tandem::v1::SessionRequest, tandem::v1::SessionResponse>*
ScriptedRouter::GenerateSession(grpc::CallbackServerContext*) {
  return new rpc::SessionStream([this](tandem::v1::GenerateRequest request,
                                       rpc::ResponseSink* sink) {
    auto r = std::make_shared<ScriptedSessionRequest>(this, std::move(request), sink);
    r->Start();
    absl::MutexLock lock(&paced_mu_);
    if (r->paced()) {
      paced_requests_.insert(std::move(r));
    } else {
      burst_requests_.insert(std::move(r));
      if (!burster_.joinable()) burster_ = std::thread([this] { BurstLoop(); });
    }
  });
}

grpc::ServerUnaryReactor* ScriptedRouter::ResetPrefixCache(
    grpc::CallbackServerContext* context, const tandem::v1::ResetPrefixCacheRequest*,
    tandem::v1::ResetPrefixCacheResponse* response) {
  grpc::Status status;
  {
    absl::MutexLock l(&reset_mu_);
    ++reset_calls_;
    if (reset_answer_set_) {
      status = reset_status_;
      *response = reset_answer_;
    } else {
      response->add_reset("prefill-0");
      response->add_reset("decode-0");
    }
  }
  auto* reactor = context->DefaultReactor();
  reactor->Finish(status);
  return reactor;
}

void ScriptedRouter::SetResetAnswer(grpc::Status status,
                                    tandem::v1::ResetPrefixCacheResponse answer) {
  absl::MutexLock l(&reset_mu_);
  reset_status_ = std::move(status);
  reset_answer_ = std::move(answer);
  reset_answer_set_ = true;
}

int ScriptedRouter::reset_calls() const {
  absl::MutexLock l(&reset_mu_);
  return reset_calls_;
}

grpc::ServerUnaryReactor* ScriptedRouter::ListModels(
    grpc::CallbackServerContext* context, const tandem::v1::ListModelsRequest*,
    tandem::v1::ListModelsResponse* response) {
  auto* m = response->add_models();
  m->set_id(options_.model_id);
  m->set_max_context_tokens(options_.max_context_tokens);
  m->set_vocab_size(tokenizer::kVocabSize);
  m->add_eos_token_ids(tokenizer::kEosId);
  m->add_eos_token_ids(tokenizer::kEndOfMsgId);
  m->set_created_unix(1700000000);
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

}  // namespace tandem::gateway::testing
