#include "gateway/testing/scripted_router.h"

#include <cstdlib>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

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

// Streams a Script one token per message.
//   START → write token k (with logprobs) → OnWriteDone → ... → last message
//   carries finish_reason + usage → Finish(OK)
//   cancelled (OnCancel / failed write) → Finish(CANCELLED); error → Finish(code)
class ScriptedStream final
    : public grpc::ServerWriteReactor<tandem::v1::GenerateResponse> {
 public:
  ScriptedStream(const ScriptedRouter* owner, grpc::CallbackServerContext* context,
                 const tandem::v1::GenerateRequest& request)
      : owner_(owner), context_(context), request_(request) {
    script_ = owner_->Plan(request_);
    const int max_tokens = request_.stop().max_tokens();
    limit_ = static_cast<int>(script_.ids.size());
    if (max_tokens > 0 && max_tokens < limit_) limit_ = max_tokens;
    owner_->Emit(
        {{"event", "generate"},
         {"request_id", request_.request_id()},
         {"model", request_.model()},
         {"prompt_tokens", request_.prompt_token_ids().ids_size()},
         {"seed", request_.sampling().has_seed() ? json(request_.sampling().seed())
                                                 : json(nullptr)},
         {"temperature", request_.sampling().temperature()},
         {"top_p", request_.sampling().top_p()},
         {"presence_penalty", request_.sampling().presence_penalty()},
         {"frequency_penalty", request_.sampling().frequency_penalty()},
         {"max_tokens", request_.stop().max_tokens()},
         {"stop_strings",
          json(std::vector<std::string>(request_.stop().stop_strings().begin(),
                                        request_.stop().stop_strings().end()))},
         {"logprobs", request_.sampling().logprobs()},
         {"top_logprobs", request_.sampling().top_logprobs()}});
    if (script_.fail_after < 0 && !script_.error.ok()) {
      Finish(script_.error);
      return;
    }
    Next();
  }

  void OnWriteDone(bool ok) override {
    if (!ok || context_->IsCancelled()) {
      Finish(grpc::Status(grpc::CANCELLED, "cancelled"));
      return;
    }
    if (finished_writing_) {
      Finish(grpc::Status::OK);
      return;
    }
    Next();
  }

  void OnCancel() override {
    owner_->Emit({{"event", "cancelled"}, {"request_id", request_.request_id()}});
  }

  void OnDone() override {
    owner_->Emit(
        {{"event", "done"}, {"request_id", request_.request_id()}, {"sent", sent_}});
    delete this;
  }

 private:
  void Next() {
    if (script_.fail_after >= 0 && sent_ >= script_.fail_after) {
      Finish(script_.error);
      return;
    }
    response_.Clear();
    response_.set_request_id(request_.request_id());
    const int id = script_.ids[sent_];
    response_.add_token_ids(id);
    if (request_.sampling().logprobs()) {
      auto* lp = response_.add_logprobs();
      const float value = -0.5f - 0.1f * static_cast<float>(sent_ % 7);
      lp->set_token_id(id);
      lp->set_logprob(value);
      for (int k = 0; k < request_.sampling().top_logprobs(); ++k) {
        auto* top = lp->add_top();
        top->set_token_id(k == 0 ? id : (id + k) % tokenizer::kNumBaseTokens);
        top->set_logprob(value - static_cast<float>(k));
      }
    }
    if (sent_ == 0 && request_.sampling().has_seed()) {
      response_.set_seed(request_.sampling().seed());
    }
    ++sent_;
    if (sent_ >= limit_) {
      finished_writing_ = true;
      const bool length = limit_ < static_cast<int>(script_.ids.size());
      response_.set_finish_reason(length ? tandem::v1::FINISH_REASON_LENGTH
                                         : tandem::v1::FINISH_REASON_STOP);
      auto* usage = response_.mutable_usage();
      usage->set_prompt_tokens(request_.prompt_token_ids().ids_size());
      usage->set_completion_tokens(sent_);
    }
    StartWrite(&response_);
  }

  const ScriptedRouter* owner_;
  grpc::CallbackServerContext* context_;
  const tandem::v1::GenerateRequest request_;
  ScriptedRouter::Script script_;
  int limit_ = 0;
  int sent_ = 0;
  bool finished_writing_ = false;
  tandem::v1::GenerateResponse response_;
};

}  // namespace

ScriptedRouter::ScriptedRouter(const tokenizer::Tokenizer* tokenizer, Options options,
                               EventSink events)
    : tokenizer_(tokenizer), options_(std::move(options)), events_(std::move(events)) {}

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
