#include "engine/chat/renderer.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/status.h"
#include "engine/chat/python_json.h"

namespace tandem::chat {
namespace {

using Attrs = std::vector<std::pair<absl::string_view, std::string>>;

class SegmentWriter {
 public:
  void Markup(absl::string_view text) {
    if (!text.empty()) out_.push_back({Segment::Kind::kMarkup, std::string(text)});
  }
  void Text(absl::string_view text) {
    if (!text.empty()) out_.push_back({Segment::Kind::kText, std::string(text)});
  }
  void OpenTag(absl::string_view tag, const Attrs& attrs = {}) {
    Markup(kOpenToken);
    Markup(tag);
    for (const auto& [key, value] : attrs) {
      Markup(absl::StrCat(" ", key));
      Markup("=\"");
      Text(EscapeAttributeValue(value));
      Markup("\"");
    }
    Markup(kSepToken);
  }
  void CloseTag(absl::string_view tag) {
    Markup(kCloseToken);
    Markup(tag);
    Markup(kSepToken);
  }
  void EndOfMsg() { Markup(kEndOfMsgToken); }
  void MediaPad(int count) {
    std::string text;
    text.reserve(kMediaPadToken.size() * count);
    for (int i = 0; i < count; ++i) {
      text.append(kMediaPadToken.data(), kMediaPadToken.size());
    }
    out_.push_back({Segment::Kind::kMediaPad, std::move(text)});
  }

  // A role="system" note of the given type (thinking-effort, tool-choice, ...).
  void InternalSystemMessage(absl::string_view type, absl::string_view body) {
    OpenTag("message", {{"role", "system"}, {"type", std::string(type)}});
    Text(absl::StripAsciiWhitespace(body));
    CloseTag("message");
    EndOfMsg();
  }

  std::vector<Segment> Take() { return std::move(out_); }

 private:
  std::vector<Segment> out_;
};

absl::Status WriteImage(const ImagePart& image, SegmentWriter* w) {
  if (image.num_tokens <= 0 || image.width <= 0 || image.height <= 0) {
    // The gateway fills these (engine/media/chat_images.h PrepareImages)
    // before rendering; a caller that did not cannot render the image.
    return Unimplemented(image.where,
                         ": the image was not preprocessed (no size or token count; "
                         "media::PrepareImages fills them)");
  }
  w->Markup(kMediaBeginToken);
  w->Text(absl::StrCat("image ", image.width, "x", image.height));
  w->Markup(kMediaContentToken);
  w->MediaPad(image.num_tokens);
  w->Markup(kMediaEndToken);
  return absl::OkStatus();
}

absl::Status WriteContent(const ChatMessage& message, SegmentWriter* w) {
  size_t next_image = 0;
  for (size_t i = 0; i <= message.content.size(); ++i) {
    while (next_image < message.images.size() &&
           message.images[next_image].position <= i) {
      TANDEM_RETURN_IF_ERROR(WriteImage(message.images[next_image++], w));
    }
    if (i < message.content.size()) w->Text(message.content[i]);
  }
  return absl::OkStatus();
}

void WriteToolDeclare(const std::vector<ToolDeclaration>& tools, bool dynamic,
                      SegmentWriter* w) {
  nlohmann::json list = nlohmann::json::array();
  for (const ToolDeclaration& tool : tools) list.push_back(tool.ToJson());
  // nlohmann::json keeps object keys sorted: the reference's deep_sort_dict.
  const std::string compact = PythonJsonDumps(list, JsonSeparators::kCompact);
  std::string body;
  if (dynamic) {
    body = absl::StrCat(
        "## New Tools Available\n"
        "The system dynamically extends the toolset via lazy-loading.\n"
        "You have access to all existing and extended tools.\n"
        "Here are the specs for the extended tools.\n\n"
        "```json\n",
        compact, "\n```");
  } else {
    body = absl::StrCat(
        "# Tools\n"
        "Here are the available tools, described in JSONSchema.\n\n"
        "```json\n",
        compact, "\n```");
  }
  w->OpenTag("message", {{"role", "system"}, {"type", "tool-declare"}});
  w->Text(body);
  w->CloseTag("message");
  w->EndOfMsg();
}

absl::string_view XtmlType(const nlohmann::ordered_json& value) {
  if (value.is_boolean()) return "boolean";
  if (value.is_null()) return "null";
  if (value.is_number()) return "number";
  if (value.is_string()) return "string";
  if (value.is_object()) return "object";
  return "array";
}

absl::Status WriteToolCall(const ToolCall& call, int index, SegmentWriter* w) {
  w->OpenTag("call", {{"tool", call.name}, {"index", absl::StrCat(index)}});
  if (!absl::StripAsciiWhitespace(call.arguments).empty()) {
    nlohmann::ordered_json args = nlohmann::ordered_json::parse(
        call.arguments, nullptr, /*allow_exceptions=*/false);
    if (args.is_discarded()) {
      // Not JSON: the reference keeps the text verbatim in a json block.
      w->OpenTag("json", {{"type", "object"}});
      w->Text(call.arguments);
      w->CloseTag("json");
    } else if (!args.is_object()) {
      return InvalidArgument("tool call '", call.name,
                             "': arguments must be a JSON object, got ",
                             args.type_name());
    } else {
      for (auto it = args.begin(); it != args.end(); ++it) {
        w->OpenTag("argument",
                   {{"key", it.key()}, {"type", std::string(XtmlType(it.value()))}});
        if (it.value().is_string()) {
          w->Text(it.value().get_ref<const std::string&>());
        } else {
          w->Text(PythonJsonDumps(it.value(), JsonSeparators::kPython));
        }
        w->CloseTag("argument");
      }
    }
  }
  w->CloseTag("call");
  return absl::OkStatus();
}

absl::Status WriteAssistant(const ChatMessage& message, bool thinking,
                            SegmentWriter* w) {
  if (thinking) {
    w->OpenTag("think");
    if (!absl::StripAsciiWhitespace(message.reasoning).empty())
      w->Text(message.reasoning);
    w->CloseTag("think");
  }
  w->OpenTag("response");
  TANDEM_RETURN_IF_ERROR(WriteContent(message, w));
  w->CloseTag("response");
  if (!message.tool_calls.empty()) {
    w->OpenTag("tools");
    int index = 1;
    for (const ToolCall& call : message.tool_calls) {
      TANDEM_RETURN_IF_ERROR(WriteToolCall(call, index++, w));
    }
    w->CloseTag("tools");
  }
  return absl::OkStatus();
}

// The reference's normalize_xtml_tool_result_messages: each run of
// consecutive tool messages whose tool_call_ids all match the latest
// assistant's tool_calls is sorted into call order (stable), and each gets the
// matched call's name. A run with any unmatched id is left as it is.
std::vector<ChatMessage> ReorderToolResults(const std::vector<ChatMessage>& messages) {
  std::vector<ChatMessage> out;
  out.reserve(messages.size());
  // tool_call_id → (1-based position, name); the first of duplicate ids wins.
  absl::flat_hash_map<std::string, std::pair<int, std::string>> index;
  size_t i = 0;
  while (i < messages.size()) {
    const ChatMessage& m = messages[i];
    if (m.role == Role::kAssistant) {
      index.clear();
      int position = 0;
      for (const ToolCall& call : m.tool_calls) {
        ++position;
        if (call.id.empty()) continue;
        index.try_emplace(call.id, position, call.name);
      }
      out.push_back(m);
      ++i;
      continue;
    }
    if (m.role != Role::kTool) {
      out.push_back(m);
      ++i;
      continue;
    }
    struct Item {
      int position;
      size_t offset;
      const ChatMessage* message;
      std::string name;
    };
    std::vector<Item> run;
    bool unresolved = false;
    for (size_t offset = 0; i < messages.size() && messages[i].role == Role::kTool;
         ++i, ++offset) {
      auto it = messages[i].tool_call_id.empty() ? index.end()
                                                 : index.find(messages[i].tool_call_id);
      if (it == index.end()) {
        unresolved = true;
        run.push_back({0, offset, &messages[i], ""});
      } else {
        run.push_back({it->second.first, offset, &messages[i], it->second.second});
      }
    }
    if (!unresolved) {
      std::stable_sort(run.begin(), run.end(), [](const Item& a, const Item& b) {
        return a.position < b.position;
      });
    }
    for (const Item& item : run) {
      out.push_back(*item.message);
      if (!unresolved && !item.name.empty()) out.back().name = item.name;
    }
  }
  return out;
}

}  // namespace

std::string EscapeAttributeValue(absl::string_view value) {
  return absl::StrReplaceAll(absl::StrReplaceAll(value, {{"&", "&amp;"}}),
                             {{"\"", "&quot;"}});
}

absl::StatusOr<std::vector<Segment>> RenderChat(
    const std::vector<ChatMessage>& messages, const std::vector<ToolDeclaration>& tools,
    const ChatOptions& options) {
  const std::vector<ChatMessage> ordered = ReorderToolResults(messages);
  SegmentWriter w;
  if (!tools.empty()) WriteToolDeclare(tools, /*dynamic=*/false, &w);
  if (options.thinking && options.thinking_effort != ThinkingEffort::kNone) {
    w.InternalSystemMessage(
        "thinking-effort",
        absl::StrCat("`thinking_effort` guides on how much to think in your "
                     "thinking channel (not including the response channel), "
                     "supported values include `low`, `medium`, `high`, and `max`.\n"
                     "Now the system is invoked with `thinking_effort=",
                     ThinkingEffortName(options.thinking_effort), "`."));
  }

  const ChatMessage* last_assistant = nullptr;
  int tool_index = 0;
  for (size_t m = 0; m < ordered.size(); ++m) {
    const ChatMessage& message = ordered[m];
    switch (message.role) {
      case Role::kUser:
      case Role::kSystem: {
        if (message.role == Role::kSystem && !message.tools.empty()) {
          WriteToolDeclare(message.tools, /*dynamic=*/true, &w);
          break;
        }
        Attrs attrs = {{"role", std::string(RoleName(message.role))}};
        if (!message.name.empty()) attrs.push_back({"name", message.name});
        w.OpenTag("message", attrs);
        TANDEM_RETURN_IF_ERROR(WriteContent(message, &w));
        w.CloseTag("message");
        w.EndOfMsg();
        break;
      }
      case Role::kTool: {
        ++tool_index;
        std::string name = message.name;
        if (name.empty() && last_assistant != nullptr &&
            tool_index <= static_cast<int>(last_assistant->tool_calls.size())) {
          name = last_assistant->tool_calls[tool_index - 1].name;
        }
        if (name.empty()) {
          return InvalidArgument(
              "message ", m,
              ": a tool message needs a tool name: set `name`, or "
              "answer a preceding assistant tool call by order or id");
        }
        w.OpenTag(
            "message",
            {{"role", "tool"}, {"tool", name}, {"index", absl::StrCat(tool_index)}});
        TANDEM_RETURN_IF_ERROR(WriteContent(message, &w));
        w.CloseTag("message");
        w.EndOfMsg();
        break;
      }
      case Role::kAssistant: {
        last_assistant = &message;
        tool_index = 0;
        for (const ToolCall& call : message.tool_calls) {
          if (call.name.empty()) {
            return InvalidArgument("message ", m, ": a tool call has no function name");
          }
        }
        Attrs attrs = {{"role", "assistant"}};
        if (!message.name.empty()) attrs.push_back({"name", message.name});
        w.OpenTag("message", attrs);
        TANDEM_RETURN_IF_ERROR(Annotate(WriteAssistant(message, options.thinking, &w),
                                        absl::StrCat("message ", m)));
        w.CloseTag("message");
        w.EndOfMsg();
        break;
      }
    }
  }

  if (options.tool_choice == ToolChoice::kRequired) {
    w.InternalSystemMessage("tool-choice",
                            "The system is invoked with `tool_choice=required`.\n"
                            "You MUST call tools in the next message.");
  } else if (options.tool_choice == ToolChoice::kNone) {
    w.InternalSystemMessage("tool-choice",
                            "The system is invoked with `tool_choice=none`.\n"
                            "You MUST NOT call any tools in the next message.");
  }
  if (options.response_format == ResponseFormat::kJsonObject) {
    w.InternalSystemMessage(
        "response-format",
        "The system is invoked with `response_format=json_object`.\n"
        "Your response must be raw JSON data without markdown code "
        "blocks (```json) or any additional formatting.");
  } else if (options.response_format == ResponseFormat::kJsonSchema) {
    w.InternalSystemMessage(
        "response-format",
        absl::StrCat("The system is invoked with `response_format=json_schema`.\n"
                     "Your response must be raw JSON data without markdown code "
                     "blocks (```json) or any additional formatting.\n"
                     "The JSON data must match the following schema:\n"
                     "```json\n",
                     PythonJsonDumps(options.response_schema, JsonSeparators::kCompact),
                     "\n```"));
  }

  if (options.add_generation_prompt) {
    w.OpenTag("message", {{"role", "assistant"}});
    w.OpenTag(options.thinking ? "think" : "response");
  }
  return w.Take();
}

absl::StatusOr<std::vector<int>> EncodeChat(const tokenizer::Tokenizer& tokenizer,
                                            absl::Span<const Segment> segments) {
  static const auto* const kStructure = new absl::flat_hash_set<std::string>{
      std::string(kOpenToken), std::string(kCloseToken), std::string(kSepToken),
      std::string(kEndOfMsgToken)};
  std::vector<int> ids;
  for (const Segment& segment : segments) {
    if (segment.kind == Segment::Kind::kText) {
      TANDEM_RETURN_IF_ERROR(tokenizer.EncodeTo(segment.text, &ids));
      continue;
    }
    if (segment.kind == Segment::Kind::kMediaPad) {
      ids.insert(ids.end(), segment.text.size() / kMediaPadToken.size(), kMediaPadId);
      continue;
    }
    if (segment.text == kOpenToken) {
      ids.push_back(tokenizer::kOpenId);
    } else if (segment.text == kCloseToken) {
      ids.push_back(tokenizer::kCloseId);
    } else if (segment.text == kSepToken) {
      ids.push_back(tokenizer::kSepId);
    } else if (segment.text == kEndOfMsgToken) {
      ids.push_back(tokenizer::kEndOfMsgId);
    } else if (segment.text == kMediaBeginToken) {
      ids.push_back(kMediaBeginId);
    } else if (segment.text == kMediaContentToken) {
      ids.push_back(kMediaContentId);
    } else if (segment.text == kMediaEndToken) {
      ids.push_back(kMediaEndId);
    } else {
      TANDEM_ASSIGN_OR_RETURN(std::vector<int> part,
                              tokenizer.EncodeWithSpecial(segment.text, *kStructure));
      ids.insert(ids.end(), part.begin(), part.end());
    }
  }
  return ids;
}

std::string RenderText(absl::Span<const Segment> segments) {
  std::string out;
  for (const Segment& segment : segments) out += segment.text;
  return out;
}

std::string SegmentsDebugString(absl::Span<const Segment> segments) {
  std::string out;
  for (const Segment& segment : segments) {
    if (segment.kind == Segment::Kind::kMediaPad) {
      absl::StrAppend(&out, "P x", segment.text.size() / kMediaPadToken.size(), "\n");
      continue;
    }
    absl::StrAppend(&out, segment.kind == Segment::Kind::kMarkup ? "M \"" : "T \"",
                    absl::CEscape(segment.text), "\"\n");
  }
  return out;
}

}  // namespace tandem::chat
