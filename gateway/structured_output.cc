#include "gateway/structured_output.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/status.h"

namespace tandem::gateway {
namespace {

using Proto = tandem::v1::StructuredOutput;

Proto::Kind KindOf(StructuredOutputRequest::Kind kind) {
  using K = StructuredOutputRequest::Kind;
  switch (kind) {
    case K::kJsonObject:
      return Proto::KIND_JSON_OBJECT;
    case K::kJsonSchema:
      return Proto::KIND_JSON_SCHEMA;
    case K::kRegex:
      return Proto::KIND_REGEX;
    case K::kChoice:
      return Proto::KIND_CHOICE;
    case K::kEbnf:
      return Proto::KIND_EBNF;
  }
  return Proto::KIND_UNSPECIFIED;
}

Proto FromRequest(const StructuredOutputRequest& r) {
  Proto p;
  p.set_kind(KindOf(r.kind));
  p.set_source(r.source);
  for (const std::string& c : r.choices) p.add_choices(c);
  return p;
}

// Token ids of K3 markup and structure, appended in order.
class Ids {
 public:
  explicit Ids(const tokenizer::Tokenizer& tok) : tok_(tok) {}
  Ids& Id(int id) {
    ids_.push_back(id);
    return *this;
  }
  // Text (a tag name, an attribute): ordinary BPE, as the renderer's markup.
  Ids& Text(absl::string_view text) {
    if (!status_.ok()) return *this;
    absl::StatusOr<std::vector<int>> enc = tok_.Encode(text);
    if (!enc.ok()) {
      status_ = enc.status();
      return *this;
    }
    ids_.insert(ids_.end(), enc->begin(), enc->end());
    return *this;
  }
  Ids& Open(absl::string_view header) {
    return Id(tokenizer::kOpenId).Text(header).Id(tokenizer::kSepId);
  }
  Ids& Close(absl::string_view tag) {
    return Id(tokenizer::kCloseId).Text(tag).Id(tokenizer::kSepId);
  }
  absl::Status status() const { return status_; }
  const std::vector<int>& ids() const { return ids_; }

 private:
  const tokenizer::Tokenizer& tok_;
  std::vector<int> ids_;
  absl::Status status_;
};

// The K3 attribute escaping (renderer.cc): & first, then ".
std::string EscapeAttribute(absl::string_view v) {
  return absl::StrReplaceAll(v, {{"&", "&amp;"}, {"\"", "&quot;"}});
}

// Thinking on: free reasoning until <|close|>, which the prefix continues.
void FrameThinking(bool thinking, const tokenizer::Tokenizer& tok, Proto* p,
                   Ids* prefix) {
  if (!thinking) return;
  for (int id : tok.stop_ids()) p->add_free_banned_token_ids(id);
  p->add_free_banned_token_ids(tokenizer::kOpenId);
  p->add_free_banned_token_ids(tokenizer::kSepId);
  p->set_free_until_token_id(tokenizer::kCloseId);
  prefix->Text("think").Id(tokenizer::kSepId).Open("response");
}

// Appends `ids` to a repeated field.
template <typename Field>
void Append(const std::vector<int>& ids, Field* f) {
  for (int id : ids) f->Add(id);
}

// An empty or property-less object schema: any JSON object.
bool AnyObject(const nlohmann::json& params) {
  return !params.is_object() || params.empty() ||
         (params.size() == 1 && params.contains("type") && params["type"] == "object");
}

// tool_choice "required" with several tools: after the empty response, the
// tools channel holds one or more calls (at most kMaxRequiredToolCalls; exactly
// one with parallel_tool_calls false), each
// of one of the tools with its arguments valid against that tool's parameters
// (a KIND_TOOL_CALLS grammar: engine/grammar/tool_calls.h), then the closing
// structure; where the grammar ends, <|end_of_msg|> (the terminator, no
// suffix: a stop token) is the one token allowed.
absl::StatusOr<Proto> RequiredToolCalls(const ChatCompletionRequest& req,
                                        const tokenizer::Tokenizer& tok) {
  nlohmann::json calls = nlohmann::json::array();
  for (size_t i = 0; i < req.tools.size(); ++i) {
    const chat::ToolDeclaration& t = req.tools[i];
    // The grammar reads these spellings as structure tokens and "{index}" as
    // the call's index: a name holding them cannot be written literally.
    if (absl::StrContains(t.name, "<|") || absl::StrContains(t.name, "{index}")) {
      return InvalidArgument("tools[", i, "].function.name: '", t.name,
                             "' cannot be constrained by tool_choice 'required' "
                             "(it holds '<|' or '{index}')");
    }
    nlohmann::json c = {
        {"begin", absl::StrCat("<|open|>call tool=\"", EscapeAttribute(t.name),
                               "\" index=\"{index}\"<|sep|><|open|>json "
                               "type=\"object\"<|sep|>")},
        {"end", "<|close|>json<|sep|><|close|>call<|sep|>"}};
    if (!AnyObject(t.parameters)) c["parameters"] = t.parameters;
    calls.push_back(std::move(c));
  }
  nlohmann::json source = {
      {"calls", std::move(calls)},
      {"end", "<|close|>tools<|sep|><|close|>message<|sep|>"},
      {"max_calls", req.parallel_tool_calls ? kMaxRequiredToolCalls : 1}};
  Proto p;
  p.set_kind(Proto::KIND_TOOL_CALLS);
  p.set_source(source.dump());
  Ids prefix(tok);
  FrameThinking(req.options.thinking, tok, &p, &prefix);
  prefix.Close("response").Open("tools");
  TANDEM_RETURN_IF_ERROR(prefix.status());
  Append(prefix.ids(), p.mutable_prefix_token_ids());
  p.set_terminator_token_id(tokenizer::kEndOfMsgId);
  return p;
}

}  // namespace

absl::StatusOr<std::optional<Proto>> CompletionConstraint(
    const GenerationFields& fields) {
  if (!fields.structured) return std::optional<Proto>();
  return std::optional<Proto>(FromRequest(*fields.structured));
}

absl::StatusOr<std::optional<Proto>> ChatConstraint(const ChatCompletionRequest& req,
                                                    const tokenizer::Tokenizer& tok) {
  const bool thinking = req.options.thinking;
  const chat::ToolDeclaration* forced = nullptr;
  if (req.options.tool_choice == chat::ToolChoice::kNamed) {
    for (const auto& t : req.tools) {
      if (t.name == req.options.tool_choice_name) forced = &t;
    }
  } else if (req.options.tool_choice == chat::ToolChoice::kRequired) {
    if (req.tools.empty()) {
      return InvalidArgument("tool_choice: 'required' needs at least one tool");
    }
    if (req.fields.structured) {
      return InvalidArgument(
          req.fields.structured->param,
          ": cannot be combined with a forced tool call (tool_choice)");
    }
    if (req.tools.size() > 1) {
      TANDEM_ASSIGN_OR_RETURN(Proto p, RequiredToolCalls(req, tok));
      return std::optional<Proto>(std::move(p));
    }
    forced = &req.tools[0];
  }
  if (forced != nullptr) {
    if (req.fields.structured) {
      return InvalidArgument(
          req.fields.structured->param,
          ": cannot be combined with a forced tool call (tool_choice)");
    }
    Proto p;
    const nlohmann::json& params = forced->parameters;
    if (AnyObject(params)) {
      p.set_kind(Proto::KIND_JSON_OBJECT);
    } else {
      p.set_kind(Proto::KIND_JSON_SCHEMA);
      p.set_source(params.dump());
    }
    Ids prefix(tok);
    FrameThinking(thinking, tok, &p, &prefix);
    // The empty response, the tools channel, one call with a json argument.
    prefix.Close("response")
        .Open("tools")
        .Open(absl::StrCat("call tool=\"", EscapeAttribute(forced->name),
                           "\" index=\"1\""))
        .Open("json type=\"object\"");
    Ids suffix(tok);
    suffix.Text("json")
        .Id(tokenizer::kSepId)
        .Close("call")
        .Close("tools")
        .Close("message")
        .Id(tokenizer::kEndOfMsgId);
    TANDEM_RETURN_IF_ERROR(prefix.status());
    TANDEM_RETURN_IF_ERROR(suffix.status());
    Append(prefix.ids(), p.mutable_prefix_token_ids());
    p.set_terminator_token_id(tokenizer::kCloseId);
    Append(suffix.ids(), p.mutable_suffix_token_ids());
    return std::optional<Proto>(std::move(p));
  }
  if (!req.fields.structured) return std::optional<Proto>();
  Proto p = FromRequest(*req.fields.structured);
  Ids prefix(tok);
  FrameThinking(thinking, tok, &p, &prefix);
  Ids suffix(tok);
  suffix.Text("response")
      .Id(tokenizer::kSepId)
      .Close("message")
      .Id(tokenizer::kEndOfMsgId);
  TANDEM_RETURN_IF_ERROR(prefix.status());
  TANDEM_RETURN_IF_ERROR(suffix.status());
  Append(prefix.ids(), p.mutable_prefix_token_ids());
  p.set_terminator_token_id(tokenizer::kCloseId);
  Append(suffix.ids(), p.mutable_suffix_token_ids());
  return std::optional<Proto>(std::move(p));
}

}  // namespace tandem::gateway
