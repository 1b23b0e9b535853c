#include "engine/chat/chat_types.h"

#include "absl/strings/str_join.h"

namespace tandem::chat {

absl::string_view RoleName(Role role) {
  switch (role) {
    case Role::kSystem:
      return "system";
    case Role::kUser:
      return "user";
    case Role::kAssistant:
      return "assistant";
    case Role::kTool:
      return "tool";
  }
  return "unknown";
}

absl::string_view ThinkingEffortName(ThinkingEffort effort) {
  switch (effort) {
    case ThinkingEffort::kNone:
      return "none";
    case ThinkingEffort::kLow:
      return "low";
    case ThinkingEffort::kHigh:
      return "high";
    case ThinkingEffort::kMax:
      return "max";
  }
  return "none";
}

nlohmann::json ToolDeclaration::ToJson() const {
  if (!original.is_null()) return original;
  nlohmann::json function = nlohmann::json::object();
  function["name"] = name;
  if (!description.empty()) function["description"] = description;
  function["parameters"] = parameters;
  return nlohmann::json{{"type", "function"}, {"function", function}};
}

std::string ChatMessage::ContentText() const { return absl::StrJoin(content, ""); }

}  // namespace tandem::chat
