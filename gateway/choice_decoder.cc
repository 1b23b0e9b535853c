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

void ChoiceDecoder::AddText(std::string text, bool content, ChoiceDelta* delta) {
  if (text.empty()) return;
  if (!content) {
    reasoning_ += text;
    delta->reasoning += text;
    return;
  }
  std::string out;
  if (stop_.Feed(text, &out)) done_ = true;
  content_ += out;
  delta->content += out;
}

void ChoiceDecoder::Apply(const chat::ChatEvent& event, ChoiceDelta* delta) {
  using Type = chat::ChatEvent::Type;
  switch (event.type) {
    case Type::kReasoningDelta:
      AddText(event.text, /*content=*/false, delta);
      break;
    case Type::kContentDelta:
      AddText(event.text, /*content=*/true, delta);
      break;
    case Type::kToolCallStart: {
      if (event.tool_index < 0) break;
      if (tool_calls_.size() <= static_cast<size_t>(event.tool_index)) {
        tool_calls_.resize(event.tool_index + 1);
      }
      tool_calls_[event.tool_index].id = event.tool_call_id;
      tool_calls_[event.tool_index].name = event.tool_name;
      delta->tool_calls.push_back(
          {event.tool_index, event.tool_call_id, event.tool_name, ""});
      break;
    }
    case Type::kToolCallArgumentsDelta:
      if (event.tool_index < 0 || event.text.empty()) break;
      if (tool_calls_.size() <= static_cast<size_t>(event.tool_index)) {
        tool_calls_.resize(event.tool_index + 1);
      }
      tool_calls_[event.tool_index].arguments += event.text;
      delta->tool_calls.push_back({event.tool_index, "", "", event.text});
      break;
    case Type::kToolCallEnd:
      // The deltas already carried every piece; keep the complete text (the
      // parser's final word) for the whole-message form.
      if (event.tool_index >= 0 &&
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
    if (options_.logprobs && i < response.logprobs_size()) {
      LogprobEntry e = MakeLogprob(response.logprobs(i));
      logprobs_.push_back(e);
      delta->logprobs.push_back(std::move(e));
    }
    if (parser_) {
      std::vector<chat::ChatEvent> events;
      absl::Status s = parser_->Feed(id, &events);
      if (!s.ok()) return s;
      for (const chat::ChatEvent& e : events) Apply(e, delta);
    } else {
      absl::StatusOr<std::string> text = detokenizer_->Add(id);
      if (!text.ok()) return text.status();
      AddText(*std::move(text), /*content=*/true, delta);
    }
  }
  if (done_) finish_reason_ = "stop";
  return absl::OkStatus();
}

void ChoiceDecoder::Finish(ChoiceDelta* delta) {
  if (done_) return;
  if (parser_) {
    std::vector<chat::ChatEvent> events;
    parser_->Finish(&events);
    for (const chat::ChatEvent& e : events) Apply(e, delta);
  } else {
    AddText(detokenizer_->Flush(), /*content=*/true, delta);
  }
  if (!done_) {
    std::string rest;
    stop_.Flush(&rest);
    content_ += rest;
    delta->content += rest;
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
