// The chat request as the K3 renderer sees it: OpenAI-style messages, tool
// declarations and rendering options. Filled by openai_parse.h (gateway JSON)
// or directly by callers; rendered by renderer.h into XTML segments.
#ifndef TANDEM_ENGINE_CHAT_CHAT_TYPES_H_
#define TANDEM_ENGINE_CHAT_CHAT_TYPES_H_

#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace tandem::chat {

enum class Role { kSystem, kUser, kAssistant, kTool };
absl::string_view RoleName(Role role);

// One call in an assistant message's `tool_calls`.
struct ToolCall {
  std::string id;
  std::string name;
  // The OpenAI `function.arguments` JSON text (an object, key order kept).
  // Empty or blank means no arguments; text that is not JSON is rendered
  // verbatim in a `json` child (as the reference does).
  std::string arguments;
};

// A function the model may call (OpenAI `tools[]`).
struct ToolDeclaration {
  std::string name;
  std::string description;  // empty: left out of a synthesised spec
  nlohmann::json parameters = nlohmann::json::object();  // JSON schema
  // The whole OpenAI entry as received ({"type":"function","function":{..}});
  // rendered as is when set, else synthesised from the fields above.
  nlohmann::json original;

  // The entry that the `tool-declare` message lists.
  nlohmann::json ToJson() const;
};

// An OpenAI `image_url` (or `image`) content part of a user message. The
// parser fills the request fields; the gateway decodes and preprocesses the
// image (engine/media) and fills the size and token count the renderer writes
// (VISION.md section 3).
struct ImagePart {
  // The image sits before content[position] (content.size(): after the last
  // text part).
  size_t position = 0;
  // "messages[1].content[2]": for error messages.
  std::string where;
  // The `data:` or http(s) URL as sent.
  std::string url;
  // "auto" (default), "low" or "high": accepted; K3 has one resolution.
  std::string detail = "auto";
  // Filled after preprocessing: the original size and the number of
  // <|media_pad|> tokens (merged patches). The renderer refuses num_tokens 0.
  int width = 0;
  int height = 0;
  int num_tokens = 0;
};

struct ChatMessage {
  Role role = Role::kUser;
  // Text parts, concatenated without separator (a plain string is one part).
  std::vector<std::string> content;
  // user: image parts, in order, placed among the text parts by `position`.
  std::vector<ImagePart> images;
  // system/user/assistant: the optional `name` attribute. tool: the tool's
  // name (resolved from the preceding assistant's tool_calls when empty).
  std::string name;
  // assistant: the thinking channel (OpenAI `reasoning_content`).
  std::string reasoning;
  // assistant: the calls it made.
  std::vector<ToolCall> tool_calls;
  // tool: the call this result answers.
  std::string tool_call_id;
  // system only: tools loaded mid-conversation. A system message with tools
  // renders as a dynamic `tool-declare` message (its content is not shown).
  std::vector<ToolDeclaration> tools;

  std::string ContentText() const;
};

enum class ThinkingEffort { kNone, kLow, kHigh, kMax };
absl::string_view ThinkingEffortName(ThinkingEffort effort);

enum class ToolChoice { kAuto, kNone, kRequired, kNamed };

enum class ResponseFormat { kText, kJsonObject, kJsonSchema };

struct ChatOptions {
  // Thinking mode: assistant turns carry a `think` channel and the generation
  // prompt opens `think`; off: no `think` channel, the prompt opens `response`.
  bool thinking = true;
  // Emitted as a `thinking-effort` system note when thinking is on. The
  // reference entry point (apply_chat_template) defaults to max; kNone emits
  // no note.
  ThinkingEffort thinking_effort = ThinkingEffort::kMax;
  bool add_generation_prompt = true;
  ToolChoice tool_choice = ToolChoice::kAuto;
  std::string tool_choice_name;  // for kNamed (the reference renders nothing)
  ResponseFormat response_format = ResponseFormat::kText;
  nlohmann::json response_schema;  // for kJsonSchema (null renders "null")
};

}  // namespace tandem::chat

#endif  // TANDEM_ENGINE_CHAT_CHAT_TYPES_H_
