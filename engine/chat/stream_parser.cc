#include "engine/chat/stream_parser.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/status.h"
#include "engine/chat/python_json.h"
#include "engine/tokenizer/utf8.h"
#include "nlohmann/json.hpp"

namespace tandem::chat {
namespace {

bool IsBlank(absl::string_view s) { return absl::StripAsciiWhitespace(s).empty(); }

// Keeps warning texts short and valid UTF-8 even for long or broken input.
std::string Excerpt(absl::string_view s) {
  constexpr size_t kMax = 80;
  std::string out = tokenizer::ReplaceInvalidUtf8(s.substr(0, kMax));
  if (s.size() > kMax) out += "...";
  return out;
}

std::string Unescape(absl::string_view value) {
  std::string out;
  for (size_t i = 0; i < value.size(); ++i) {
    if (value[i] == '&') {
      if (value.substr(i, 6) == "&quot;") {
        out.push_back('"');
        i += 5;
        continue;
      }
      if (value.substr(i, 5) == "&amp;") {
        out.push_back('&');
        i += 4;
        continue;
      }
    }
    out.push_back(value[i]);
  }
  return out;
}

bool TypeMatches(absl::string_view type, const nlohmann::ordered_json& value) {
  if (type == "number") return value.is_number();
  if (type == "boolean") return value.is_boolean();
  if (type == "null") return value.is_null();
  if (type == "object") return value.is_object();
  if (type == "array") return value.is_array();
  return false;
}

}  // namespace

absl::string_view ChannelName(Channel channel) {
  switch (channel) {
    case Channel::kThink:
      return "think";
    case Channel::kResponse:
      return "response";
    case Channel::kTools:
      return "tools";
  }
  return "response";
}

bool ParseTagHeader(absl::string_view header, TagHeader* out) {
  *out = TagHeader();
  size_t i = 0;
  const size_t n = header.size();
  auto is_space = [](char c) {
    return absl::ascii_isspace(static_cast<unsigned char>(c));
  };
  while (i < n && is_space(header[i])) ++i;
  size_t start = i;
  while (i < n && !is_space(header[i])) ++i;
  out->name = std::string(header.substr(start, i - start));
  if (out->name.empty() || out->name.find_first_of("=\"") != std::string::npos)
    return false;
  while (true) {
    while (i < n && is_space(header[i])) ++i;
    if (i == n) return true;
    start = i;
    while (i < n && header[i] != '=' && !is_space(header[i])) ++i;
    std::string key(header.substr(start, i - start));
    if (key.empty() || i == n || header[i] != '=') return false;
    ++i;
    if (i == n || header[i] != '"') return false;
    ++i;
    const size_t close = header.find('"', i);
    if (close == absl::string_view::npos) {
      out->attrs.push_back({key, Unescape(header.substr(i))});
      return false;
    }
    out->attrs.push_back({key, Unescape(header.substr(i, close - i))});
    i = close + 1;
    if (i < n && !is_space(header[i])) return false;
  }
}

ChatStreamParser::Start ChatStreamParser::StartFor(const ChatOptions& options) {
  if (!options.add_generation_prompt) return Start::kTop;
  return options.thinking ? Start::kThink : Start::kResponse;
}

ChatStreamParser::ChatStreamParser(const tokenizer::Tokenizer* tokenizer,
                                   Options options)
    : tokenizer_(tokenizer), options_(std::move(options)) {
  switch (options_.start) {
    case Start::kThink:
      stack_ = {{Kind::kMessage, "message"}, {Kind::kThink, "think"}};
      break;
    case Start::kResponse:
      stack_ = {{Kind::kMessage, "message"}, {Kind::kResponse, "response"}};
      break;
    case Start::kMessage:
      stack_ = {{Kind::kMessage, "message"}};
      break;
    case Start::kTop:
      break;
  }
}

absl::Status ChatStreamParser::Feed(int id, std::vector<ChatEvent>* events) {
  if (tokenizer_ == nullptr)
    return FailedPrecondition("ChatStreamParser: no tokenizer");
  if (!tokenizer_->IsValidId(id))
    return InvalidArgument("token id ", id, " is out of range");
  switch (id) {
    case tokenizer::kOpenId:
      FeedStructure(StructureToken::kOpen, events);
      return absl::OkStatus();
    case tokenizer::kCloseId:
      FeedStructure(StructureToken::kClose, events);
      return absl::OkStatus();
    case tokenizer::kSepId:
      FeedStructure(StructureToken::kSep, events);
      return absl::OkStatus();
    case tokenizer::kEndOfMsgId:
    case tokenizer::kEosId:
      FeedStructure(StructureToken::kEndOfMsg, events);
      return absl::OkStatus();
    default:
      break;
  }
  if (tokenizer_->IsSpecial(id)) {
    if (!message_ended_ && !finished_)
      Warn(events, absl::StrCat("special token ", id, " dropped"));
    return absl::OkStatus();
  }
  std::string bytes;
  TANDEM_RETURN_IF_ERROR(tokenizer_->AppendTokenBytes(id, &bytes));
  FeedText(bytes, events);
  return absl::OkStatus();
}

void ChatStreamParser::FeedText(absl::string_view bytes,
                                std::vector<ChatEvent>* events) {
  if (bytes.empty() || finished_) return;
  if (message_ended_) {
    if (!IsBlank(bytes) && !warned_after_end_) {
      warned_after_end_ = true;
      Warn(events, "output after the end of the message ignored");
    }
    return;
  }
  if (mode_ != Mode::kText) {
    absl::StrAppend(&header_, bytes);
    if (header_.size() > options_.max_header_bytes) AbandonHeader(events);
    return;
  }
  absl::StrAppend(&pending_utf8_, bytes);
  FlushText(/*final=*/false, events);
}

void ChatStreamParser::FeedStructure(StructureToken token,
                                     std::vector<ChatEvent>* events) {
  if (finished_) return;
  if (message_ended_) {
    if (token != StructureToken::kEndOfMsg && !warned_after_end_) {
      warned_after_end_ = true;
      Warn(events, "output after the end of the message ignored");
    }
    return;
  }
  if (mode_ != Mode::kText && token != StructureToken::kSep) AbandonHeader(events);
  FlushText(/*final=*/true, events);
  FlushStray(events);
  switch (token) {
    case StructureToken::kOpen:
      mode_ = Mode::kOpenHeader;
      header_.clear();
      break;
    case StructureToken::kClose:
      mode_ = Mode::kCloseHeader;
      header_.clear();
      break;
    case StructureToken::kSep:
      if (mode_ == Mode::kOpenHeader) {
        mode_ = Mode::kText;
        HandleOpen(tokenizer::ReplaceInvalidUtf8(std::exchange(header_, std::string())),
                   events);
      } else if (mode_ == Mode::kCloseHeader) {
        mode_ = Mode::kText;
        HandleClose(
            tokenizer::ReplaceInvalidUtf8(std::exchange(header_, std::string())),
            events);
      } else {
        Warn(events, "<|sep|> outside a tag ignored");
      }
      break;
    case StructureToken::kEndOfMsg:
      EndMessage(events);
      break;
  }
}

void ChatStreamParser::Finish(std::vector<ChatEvent>* events) {
  if (finished_) return;
  if (!message_ended_) {
    if (mode_ != Mode::kText) AbandonHeader(events);
    FlushText(/*final=*/true, events);
    FlushStray(events);
    for (size_t i = 0; i < stack_.size(); ++i) {
      if (stack_[i].kind != Kind::kCall) continue;
      Warn(events, "unterminated tool call at the end of the output");
      while (stack_.size() > i) Pop(events);
      break;
    }
  }
  finished_ = true;
}

void ChatStreamParser::Warn(std::vector<ChatEvent>* events, std::string message) {
  ChatEvent e{ChatEvent::Type::kWarning};
  e.text = std::move(message);
  events->push_back(std::move(e));
}

void ChatStreamParser::FlushText(bool final, std::vector<ChatEvent>* events) {
  if (pending_utf8_.empty()) return;
  std::string decided;
  absl::string_view rest = pending_utf8_;
  while (!rest.empty()) {
    const tokenizer::Utf8Step step = tokenizer::ReadUtf8(rest);
    if (step.kind == tokenizer::Utf8Step::kIncomplete) {
      if (!final) break;
      absl::StrAppend(&decided, tokenizer::kReplacementChar);
      rest = {};
      break;
    }
    if (step.kind == tokenizer::Utf8Step::kInvalid) {
      absl::StrAppend(&decided, tokenizer::kReplacementChar);
    } else {
      absl::StrAppend(&decided, rest.substr(0, step.length));
    }
    rest.remove_prefix(step.length);
  }
  pending_utf8_ = std::string(rest);
  if (!decided.empty()) RouteText(std::move(decided), events);
}

void ChatStreamParser::RouteText(std::string text, std::vector<ChatEvent>* events) {
  const Kind top = stack_.empty() ? Kind::kMessage : stack_.back().kind;
  switch (top) {
    case Kind::kThink: {
      ChatEvent e{ChatEvent::Type::kReasoningDelta};
      e.text = std::move(text);
      events->push_back(std::move(e));
      return;
    }
    case Kind::kResponse:
    case Kind::kUnknown: {
      ChatEvent e{ChatEvent::Type::kContentDelta};
      e.text = std::move(text);
      events->push_back(std::move(e));
      return;
    }
    case Kind::kArgument:
      if (arg_ignored_) return;
      if (arg_type_ == "string") {
        std::string quoted;
        AppendJsonString(text, &quoted);
        // Without the surrounding quotes: the value is still open.
        EmitArgs(absl::string_view(quoted).substr(1, quoted.size() - 2), events);
      } else {
        arg_buffer_ += text;
      }
      return;
    case Kind::kJson:
      if (!arg_ignored_) arg_buffer_ += text;
      return;
    case Kind::kMessage:
    case Kind::kTools:
    case Kind::kCall:
      stray_ += text;
      return;
  }
}

void ChatStreamParser::FlushStray(std::vector<ChatEvent>* events) {
  if (stray_.empty()) return;
  std::string text = std::exchange(stray_, std::string());
  if (IsBlank(text)) return;
  Warn(events,
       absl::StrCat("text outside a channel treated as content: ", Excerpt(text)));
  ChatEvent e{ChatEvent::Type::kContentDelta};
  e.text = std::move(text);
  events->push_back(std::move(e));
}

void ChatStreamParser::AbandonHeader(std::vector<ChatEvent>* events) {
  Warn(events,
       absl::StrCat("unterminated tag header treated as text: ", Excerpt(header_)));
  mode_ = Mode::kText;
  pending_utf8_ += std::exchange(header_, std::string());
  FlushText(/*final=*/false, events);
}

bool ChatStreamParser::IsValidChild(Kind parent, absl::string_view name) {
  switch (parent) {
    case Kind::kMessage:
      return name == "think" || name == "response" || name == "tools";
    case Kind::kTools:
      return name == "call";
    case Kind::kCall:
      return name == "argument" || name == "json";
    default:
      return false;
  }
}

void ChatStreamParser::HandleOpen(std::string header, std::vector<ChatEvent>* events) {
  TagHeader tag;
  if (!ParseTagHeader(header, &tag)) {
    Warn(events, absl::StrCat("malformed tag header: ", Excerpt(header)));
  }
  if (tag.name.empty()) return;
  const absl::string_view name = tag.name;
  auto kind_of = [](absl::string_view n) {
    if (n == "message") return Kind::kMessage;
    if (n == "think") return Kind::kThink;
    if (n == "response") return Kind::kResponse;
    if (n == "tools") return Kind::kTools;
    if (n == "call") return Kind::kCall;
    if (n == "argument") return Kind::kArgument;
    if (n == "json") return Kind::kJson;
    return Kind::kUnknown;
  };
  if (stack_.empty()) {
    if (name == "message") {
      Push(Kind::kMessage, name, tag.attrs, events);
      return;
    }
    if (IsValidChild(Kind::kMessage, name)) {
      Push(Kind::kMessage, "message", {{"role", "assistant"}}, events);
      Push(kind_of(name), name, tag.attrs, events);
      return;
    }
  } else {
    // The nearest open element that may hold `name`; elements above it were
    // left unterminated by the model.
    for (size_t j = stack_.size(); j-- > 0;) {
      if (!IsValidChild(stack_[j].kind, name)) continue;
      while (stack_.size() > j + 1) {
        Warn(events, absl::StrCat("unterminated <", stack_.back().name, "> before <",
                                  name, ">"));
        Pop(events);
      }
      Push(kind_of(name), name, tag.attrs, events);
      return;
    }
  }
  Warn(events, absl::StrCat("unexpected element <", Excerpt(name),
                            "> here; its text is treated as content"));
  Push(Kind::kUnknown, name, tag.attrs, events);
}

void ChatStreamParser::Push(
    Kind kind, absl::string_view name,
    const std::vector<std::pair<std::string, std::string>>& attrs,
    std::vector<ChatEvent>* events) {
  auto attr = [&](absl::string_view key) -> const std::string* {
    for (const auto& [k, v] : attrs) {
      if (k == key) return &v;
    }
    return nullptr;
  };
  auto channel_start = [&](Channel channel) {
    ChatEvent e{ChatEvent::Type::kChannelStart};
    e.channel = channel;
    events->push_back(std::move(e));
  };
  switch (kind) {
    case Kind::kMessage: {
      const std::string* role = attr("role");
      if (role == nullptr || *role != "assistant") {
        Warn(events, "message element without role=\"assistant\"");
      }
      break;
    }
    case Kind::kThink:
      channel_start(Channel::kThink);
      break;
    case Kind::kResponse:
      channel_start(Channel::kResponse);
      break;
    case Kind::kTools:
      channel_start(Channel::kTools);
      break;
    case Kind::kCall: {
      call_index_ = next_call_index_++;
      call_id_ = absl::StrCat(options_.tool_call_id_prefix, call_index_);
      call_args_.clear();
      args_mode_ = ArgsMode::kNone;
      arg_count_ = 0;
      const std::string* tool = attr("tool");
      call_name_ = tool != nullptr ? *tool : "";
      if (tool == nullptr || tool->empty())
        Warn(events, "tool call without a tool name");
      const std::string* index = attr("index");
      if (index == nullptr || *index != absl::StrCat(call_index_ + 1)) {
        Warn(events, absl::StrCat("tool call index ",
                                  index == nullptr ? "missing" : Excerpt(*index),
                                  ", expected ", call_index_ + 1));
      }
      ChatEvent e{ChatEvent::Type::kToolCallStart};
      e.tool_index = call_index_;
      e.tool_call_id = call_id_;
      e.tool_name = call_name_;
      events->push_back(std::move(e));
      break;
    }
    case Kind::kArgument: {
      arg_buffer_.clear();
      arg_ignored_ = args_mode_ == ArgsMode::kJson;
      if (arg_ignored_) {
        Warn(events, "argument after a json block ignored");
        break;
      }
      args_mode_ = ArgsMode::kTyped;
      const std::string* key = attr("key");
      if (key == nullptr) Warn(events, "argument without a key");
      const std::string* type = attr("type");
      arg_type_ = type != nullptr ? *type : "string";
      if (arg_type_ != "string" && arg_type_ != "number" && arg_type_ != "boolean" &&
          arg_type_ != "null" && arg_type_ != "object" && arg_type_ != "array") {
        Warn(events,
             absl::StrCat("argument type '", Excerpt(arg_type_), "' read as string"));
        arg_type_ = "string";
      }
      std::string piece = arg_count_ == 0 ? "{" : ",";
      AppendJsonString(key != nullptr ? *key : "", &piece);
      piece += ":";
      if (arg_type_ == "string") piece += "\"";
      ++arg_count_;
      EmitArgs(piece, events);
      break;
    }
    case Kind::kJson:
      arg_buffer_.clear();
      arg_ignored_ = args_mode_ != ArgsMode::kNone;
      if (arg_ignored_) {
        Warn(events, "json block after other arguments ignored");
      } else {
        args_mode_ = ArgsMode::kJson;
      }
      break;
    case Kind::kUnknown:
      break;
  }
  stack_.push_back({kind, std::string(name)});
}

void ChatStreamParser::Pop(std::vector<ChatEvent>* events) {
  if (stack_.empty()) return;
  const Kind kind = stack_.back().kind;
  switch (kind) {
    case Kind::kArgument:
      if (!arg_ignored_) {
        if (arg_type_ == "string") {
          EmitArgs("\"", events);
        } else {
          const std::string value(absl::StripAsciiWhitespace(arg_buffer_));
          nlohmann::ordered_json parsed =
              nlohmann::ordered_json::parse(value, nullptr, /*allow_exceptions=*/false);
          if (!parsed.is_discarded() && TypeMatches(arg_type_, parsed)) {
            EmitArgs(value, events);
          } else {
            Warn(events, absl::StrCat("argument value is not a JSON ", arg_type_,
                                      "; passed as a string: ", Excerpt(value)));
            std::string quoted;
            AppendJsonString(arg_buffer_, &quoted);
            EmitArgs(quoted, events);
          }
        }
      }
      arg_ignored_ = false;
      arg_buffer_.clear();
      break;
    case Kind::kJson:
      if (!arg_ignored_) {
        const std::string value(absl::StripAsciiWhitespace(arg_buffer_));
        nlohmann::ordered_json parsed =
            nlohmann::ordered_json::parse(value, nullptr, /*allow_exceptions=*/false);
        if (parsed.is_discarded() || !parsed.is_object()) {
          Warn(events, "json block is not a JSON object; passed through verbatim");
        }
        EmitArgs(value.empty() ? "{}" : value, events);
      }
      arg_ignored_ = false;
      arg_buffer_.clear();
      break;
    case Kind::kCall: {
      if (args_mode_ == ArgsMode::kTyped) EmitArgs("}", events);
      if (args_mode_ == ArgsMode::kNone) EmitArgs("{}", events);
      ChatEvent e{ChatEvent::Type::kToolCallEnd};
      e.tool_index = call_index_;
      e.tool_call_id = call_id_;
      e.tool_name = call_name_;
      e.text = call_args_;
      events->push_back(std::move(e));
      call_index_ = -1;
      break;
    }
    default:
      break;
  }
  stack_.pop_back();
}

void ChatStreamParser::HandleClose(std::string header, std::vector<ChatEvent>* events) {
  const std::string name(absl::StripAsciiWhitespace(header));
  for (size_t j = stack_.size(); j-- > 0;) {
    if (stack_[j].name != name) continue;
    while (stack_.size() > j + 1) {
      Warn(events, absl::StrCat("unterminated <", stack_.back().name, "> closed by </",
                                name, ">"));
      Pop(events);
    }
    if (stack_[j].kind == Kind::kMessage) {
      EndMessage(events);
    } else {
      Pop(events);
    }
    return;
  }
  Warn(events, absl::StrCat("close of <", Excerpt(name), "> that is not open ignored"));
}

void ChatStreamParser::EmitArgs(absl::string_view piece,
                                std::vector<ChatEvent>* events) {
  if (call_index_ < 0 || piece.empty()) return;
  absl::StrAppend(&call_args_, piece);
  ChatEvent e{ChatEvent::Type::kToolCallArgumentsDelta};
  e.tool_index = call_index_;
  e.tool_call_id = call_id_;
  e.tool_name = call_name_;
  e.text = std::string(piece);
  events->push_back(std::move(e));
}

void ChatStreamParser::EndMessage(std::vector<ChatEvent>* events) {
  while (!stack_.empty()) {
    if (stack_.back().kind != Kind::kMessage) {
      Warn(events, absl::StrCat("unterminated <", stack_.back().name,
                                "> at the end of the message"));
    }
    Pop(events);
  }
  if (!message_ended_) {
    message_ended_ = true;
    events->push_back(ChatEvent{ChatEvent::Type::kMessageEnd});
  }
}

void ParsedCompletion::Apply(const ChatEvent& event) {
  switch (event.type) {
    case ChatEvent::Type::kChannelStart:
      break;
    case ChatEvent::Type::kReasoningDelta:
      reasoning_content += event.text;
      break;
    case ChatEvent::Type::kContentDelta:
      content += event.text;
      break;
    case ChatEvent::Type::kToolCallStart:
      tool_calls.push_back({event.tool_index, event.tool_call_id, event.tool_name, ""});
      break;
    case ChatEvent::Type::kToolCallArgumentsDelta:
      for (auto it = tool_calls.rbegin(); it != tool_calls.rend(); ++it) {
        if (it->index == event.tool_index) {
          it->arguments += event.text;
          break;
        }
      }
      break;
    case ChatEvent::Type::kToolCallEnd:
      for (auto it = tool_calls.rbegin(); it != tool_calls.rend(); ++it) {
        if (it->index == event.tool_index) {
          it->arguments = event.text;
          break;
        }
      }
      break;
    case ChatEvent::Type::kMessageEnd:
      message_ended = true;
      break;
    case ChatEvent::Type::kWarning:
      warnings.push_back(event.text);
      break;
  }
}

absl::StatusOr<ParsedCompletion> ParseCompletion(const tokenizer::Tokenizer& tokenizer,
                                                 absl::Span<const int> ids,
                                                 ChatStreamParser::Options options) {
  ChatStreamParser parser(&tokenizer, std::move(options));
  ParsedCompletion out;
  std::vector<ChatEvent> events;
  for (int id : ids) {
    TANDEM_RETURN_IF_ERROR(parser.Feed(id, &events));
  }
  parser.Finish(&events);
  for (const ChatEvent& e : events) out.Apply(e);
  return out;
}

}  // namespace tandem::chat
