#include "gateway/choice_decoder.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace tandem::gateway {

ChoiceDecoder::ChoiceDecoder(const tokenizer::Tokenizer* tokenizer, Options options)
    : tokenizer_(tokenizer), options_(std::move(options)), stop_(options_.stop) {
  if (options_.chat) {
    chat::ChatStreamParser::Options po;
    po.start = options_.start;
    po.tool_call_id_prefix = options_.tool_call_id_prefix;
    parser_.emplace(tokenizer_, std::move(po));
  } else {
    detokenizer_.emplace(tokenizer_, tokenizer::IncrementalDetokenizer::Options{
                                         .skip_special_tokens = true});
  }
}

LogprobEntry ChoiceDecoder::MakeLogprob(const tandem::v1::TokenLogprob& lp) const {
  LogprobEntry e;
  e.token = tokenizer_->IdToken(lp.token_id()).value_or("");
  e.logprob = lp.logprob();
  for (const auto& top : lp.top()) {
    e.top.emplace_back(tokenizer_->IdToken(top.token_id()).value_or(""), top.logprob());
  }
  return e;
}

ChoiceDelta* ChoiceDecoder::DeltaFor(Kind kind, int tool_index,
                                     std::vector<ChoiceDelta>* deltas) {
  if (!deltas->empty()) {
    ChoiceDelta& last = deltas->back();
    bool fits = false;
    switch (kind) {
      case Kind::kReasoning:
        fits = last.content.empty() && last.tool_calls.empty();
        break;
      case Kind::kContent:
        fits = last.reasoning.empty() && last.tool_calls.empty();
        break;
      case Kind::kToolCall:
        fits = last.reasoning.empty() && last.content.empty() &&
               (last.tool_calls.empty() || last.tool_calls.back().index == tool_index);
        break;
    }
    if (fits) return &last;
  }
  deltas->emplace_back();
  return &deltas->back();
}

void ChoiceDecoder::AddText(std::string text, bool content,
                            std::vector<ChoiceDelta>* deltas) {
  if (text.empty()) return;
  ++outputs_;
  if (!content) {
    reasoning_ += text;
    DeltaFor(Kind::kReasoning, -1, deltas)->reasoning += text;
    return;
  }
  std::string out;
  if (stop_.Feed(text, &out)) done_ = true;
  if (out.empty()) {  // held back (a possible stop string's start)
    --outputs_;
    return;
  }
  content_ += out;
  DeltaFor(Kind::kContent, -1, deltas)->content += out;
}

void ChoiceDecoder::Apply(const chat::ChatEvent& event,
                          std::vector<ChoiceDelta>* deltas) {
  using Type = chat::ChatEvent::Type;
  switch (event.type) {
    case Type::kReasoningDelta:
      AddText(event.text, /*content=*/false, deltas);
      break;
    case Type::kContentDelta:
      AddText(event.text, /*content=*/true, deltas);
      break;
    case Type::kToolCallStart: {
      if (event.tool_index < 0) break;
      if (options_.max_tool_calls > 0 && event.tool_index >= options_.max_tool_calls) {
        tool_call_limit_hit_ = true;
        done_ = true;  // the caller cancels the rest
        break;
      }
      if (tool_calls_.size() <= static_cast<size_t>(event.tool_index)) {
        tool_calls_.resize(event.tool_index + 1);
      }
      tool_calls_[event.tool_index].id = event.tool_call_id;
      tool_calls_[event.tool_index].name = event.tool_name;
      ++outputs_;
      ChoiceDelta* delta = DeltaFor(Kind::kToolCall, event.tool_index, deltas);
      delta->tool_calls.push_back(
          {event.tool_index, event.tool_call_id, event.tool_name, ""});
      break;
    }
    case Type::kToolCallArgumentsDelta:
      if (event.tool_index < 0 || event.text.empty() || OverToolLimit(event)) break;
      if (tool_calls_.size() <= static_cast<size_t>(event.tool_index)) {
        tool_calls_.resize(event.tool_index + 1);
      }
      tool_calls_[event.tool_index].arguments += event.text;
      {
        // Consecutive pieces of one call's arguments concatenate.
        ++outputs_;
        ChoiceDelta* delta = DeltaFor(Kind::kToolCall, event.tool_index, deltas);
        if (!delta->tool_calls.empty()) {
          delta->tool_calls.back().arguments += event.text;
        } else {
          delta->tool_calls.push_back({event.tool_index, "", "", event.text});
        }
      }
      break;
    case Type::kToolCallEnd:
      // The deltas already carried every piece; keep the complete text (the
      // parser's final word) for the whole-message form.
      if (event.tool_index >= 0 && !OverToolLimit(event) &&
          static_cast<size_t>(event.tool_index) < tool_calls_.size()) {
        tool_calls_[event.tool_index].arguments = event.text;
      }
      break;
    case Type::kWarning:
      warnings_.push_back(event.text);
      break;
    case Type::kChannelStart:
    case Type::kMessageEnd:
      break;
  }
}

absl::Status ChoiceDecoder::Add(const tandem::v1::GenerateResponse& response,
                                ChoiceDelta* delta) {
  std::vector<ChoiceDelta> deltas;
  absl::Status s = Add(response, &deltas);
  for (ChoiceDelta& d : deltas) {
    delta->reasoning += d.reasoning;
    delta->content += d.content;
    for (ToolCallDelta& t : d.tool_calls) delta->tool_calls.push_back(std::move(t));
    for (LogprobEntry& e : d.logprobs) delta->logprobs.push_back(std::move(e));
  }
  return s;
}

absl::Status ChoiceDecoder::Add(const tandem::v1::GenerateResponse& response,
                                std::vector<ChoiceDelta>* deltas) {
  if (done_) return absl::OkStatus();
  if (response.finish_reason() != tandem::v1::FINISH_REASON_UNSPECIFIED) {
    last_reason_ = response.finish_reason();
  }
  for (int i = 0; i < response.token_ids_size() && !done_; ++i) {
    const int id = response.token_ids(i);
    if (!tokenizer_->IsValidId(id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("router returned token id ", id, " outside the vocabulary"));
    }
    ++completion_tokens_;
    const int64_t outputs_before = outputs_;
    if (parser_) {
      events_.clear();
      absl::Status s = parser_->Feed(id, &events_);
      if (!s.ok()) return s;
      for (const chat::ChatEvent& e : events_) Apply(e, deltas);
    } else {
      absl::StatusOr<std::string> text = detokenizer_->Add(id);
      if (!text.ok()) return text.status();
      AddText(*std::move(text), /*content=*/true, deltas);
    }
    // The token's logprob goes with the delta its output went to (the last
    // one). Chat streams show the logprobs of tokens with visible output only
    // (structure tokens, held-back text: none), as when each token is its own
    // chunk; completions show every token's. The whole choice keeps all.
    if (options_.logprobs && i < response.logprobs_size()) {
      LogprobEntry e = MakeLogprob(response.logprobs(i));
      logprobs_.push_back(e);
      if (!parser_ || outputs_ != outputs_before) {
        if (deltas->empty()) deltas->emplace_back();
        deltas->back().logprobs.push_back(std::move(e));
      }
    }
  }
  if (response.finish_reason() == tandem::v1::FINISH_REASON_ERROR && !done_) {
    failed_ = true;
    done_ = true;
    return absl::InternalError(absl::StrCat(
        "generation failed: the worker ended the request with an error after ",
        completion_tokens_,
        " tokens (e.g. a structured-output constraint that could not continue); "
        "the output is incomplete"));
  }
  if (done_) finish_reason_ = tool_call_limit_hit_ ? "tool_calls" : "stop";
  return absl::OkStatus();
}

void ChoiceDecoder::Finish(ChoiceDelta* delta) {
  std::vector<ChoiceDelta> deltas;
  Finish(&deltas);
  for (ChoiceDelta& d : deltas) {
    delta->reasoning += d.reasoning;
    delta->content += d.content;
    for (ToolCallDelta& t : d.tool_calls) delta->tool_calls.push_back(std::move(t));
  }
}

void ChoiceDecoder::Finish(std::vector<ChoiceDelta>* deltas) {
  if (done_) return;
  if (parser_) {
    std::vector<chat::ChatEvent> events;
    parser_->Finish(&events);
    for (const chat::ChatEvent& e : events) Apply(e, deltas);
  } else {
    AddText(detokenizer_->Flush(), /*content=*/true, deltas);
  }
  if (!done_) {
    std::string rest;
    stop_.Flush(&rest);
    if (!rest.empty()) {
      content_ += rest;
      DeltaFor(Kind::kContent, -1, deltas)->content += rest;
    }
  }
  if (stop_.matched()) {
    finish_reason_ = "stop";
  } else if (last_reason_ == tandem::v1::FINISH_REASON_LENGTH) {
    finish_reason_ = "length";
  } else if (!tool_calls_.empty()) {
    finish_reason_ = "tool_calls";
  } else {
    finish_reason_ = "stop";
  }
  done_ = true;
}

}  // namespace tandem::gateway
