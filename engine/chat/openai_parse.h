// OpenAI chat-completions JSON → chat_types.h, with errors that name the
// offending field ("messages[2].tool_calls[0].function.name: ..."). The
// gateway calls these on the request body; nothing here throws.
//
//   ParseOpenAIMessages(body["messages"]) → std::vector<ChatMessage>
//   ParseOpenAITools(body["tools"])       → std::vector<ToolDeclaration>
//   ParseOpenAIChatOptions(body)          → ChatOptions
#ifndef TANDEM_ENGINE_CHAT_OPENAI_PARSE_H_
#define TANDEM_ENGINE_CHAT_OPENAI_PARSE_H_

#include <vector>

#include "absl/status/statusor.h"
#include "engine/chat/chat_types.h"
#include "nlohmann/json.hpp"

namespace tandem::chat {

// Roles system, developer (rendered as system), user, assistant, tool.
// content: string, null, or an array of {"type":"text","text":...} parts and,
// in user messages, {"type":"image_url","image_url":{"url","detail"}} parts
// (ChatMessage::images; decoding is the gateway's); input_audio is
// Unimplemented. assistant: reasoning_content (or
// reasoning), tool_calls [{id, type:"function", function:{name, arguments}}]
// where arguments is a JSON string or an object. tool: tool_call_id, name
// (or tool). system: optional tools (a mid-conversation tool declaration).
absl::StatusOr<std::vector<ChatMessage>> ParseOpenAIMessages(
    const nlohmann::json& messages);

// [{"type":"function","function":{"name","description","parameters"}}];
// null means none.
absl::StatusOr<std::vector<ToolDeclaration>> ParseOpenAITools(
    const nlohmann::json& tools);

// From the request body: thinking (top-level `thinking` bool, or
// chat_template_kwargs.thinking), thinking_effort / reasoning_effort
// ("none" | "low" | "high" | "max"; "minimal" turns thinking off; "medium" is
// InvalidArgument as in the reference), tool_choice ("auto" | "none" |
// "required" | {"type":"function","function":{"name":..}}), response_format
// ({"type":"text" | "json_object" | "json_schema", "json_schema":{"schema"}}).
// add_generation_prompt is true unless chat_template_kwargs says otherwise.
absl::StatusOr<ChatOptions> ParseOpenAIChatOptions(const nlohmann::json& body);

}  // namespace tandem::chat

#endif  // TANDEM_ENGINE_CHAT_OPENAI_PARSE_H_
