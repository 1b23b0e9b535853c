#include "engine/chat/openai_parse.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace tandem::chat {
namespace {

using json = nlohmann::json;

absl::StatusOr<std::string> OptionalString(const json& object, const char* key,
                                           const std::string& where) {
  auto it = object.find(key);
  if (it == object.end() || it->is_null()) return std::string();
  if (!it->is_string()) {
    return InvalidArgument(where, ".", key, ": expected a string, got ",
                           it->type_name());
  }
  return it->get<std::string>();
}

// {"type":"image_url","image_url":{"url":..,"detail":..}} (or "image_url" a
// plain URL string, as some clients send), or {"type":"image","image":URL}.
absl::StatusOr<ImagePart> ParseImagePart(const json& part, const std::string& type,
                                         const std::string& where) {
  ImagePart image;
  image.where = where;
  auto it = part.find(type);
  if (it == part.end() || it->is_null()) {
    return InvalidArgument(where, ".", type, ": required for a part of type '", type,
                           "'");
  }
  const std::string field_where = absl::StrCat(where, ".", type);
  if (it->is_string()) {
    image.url = it->get<std::string>();
  } else if (it->is_object()) {
    TANDEM_ASSIGN_OR_RETURN(image.url, OptionalString(*it, "url", field_where));
    TANDEM_ASSIGN_OR_RETURN(std::string detail,
                            OptionalString(*it, "detail", field_where));
    if (!detail.empty()) image.detail = detail;
  } else {
    return InvalidArgument(field_where, ": expected an object or a URL string, got ",
                           it->type_name());
  }
  if (image.url.empty()) return InvalidArgument(field_where, ".url: required");
  if (image.detail != "auto" && image.detail != "low" && image.detail != "high") {
    return InvalidArgument(field_where,
                           ".detail: expected 'auto', 'low' or 'high', got '",
                           image.detail, "'");
  }
  return image;
}

// `images` is null where image parts are not accepted (non-user messages).
absl::Status ParseContent(const json& message, const std::string& where,
                          std::vector<std::string>* out,
                          std::vector<ImagePart>* images) {
  auto it = message.find("content");
  if (it == message.end() || it->is_null()) return absl::OkStatus();
  if (it->is_string()) {
    out->push_back(it->get<std::string>());
    return absl::OkStatus();
  }
  if (!it->is_array()) {
    return InvalidArgument(
        where, ".content: expected a string, an array of parts or null, got ",
        it->type_name());
  }
  for (size_t i = 0; i < it->size(); ++i) {
    const json& part = (*it)[i];
    const std::string part_where = absl::StrCat(where, ".content[", i, "]");
    if (!part.is_object()) return InvalidArgument(part_where, ": expected an object");
    TANDEM_ASSIGN_OR_RETURN(std::string type, OptionalString(part, "type", part_where));
    if (type == "image_url" || type == "image") {
      if (images == nullptr) {
        return InvalidArgument(part_where,
                               ": image parts are accepted in user "
                               "messages only");
      }
      TANDEM_ASSIGN_OR_RETURN(ImagePart image, ParseImagePart(part, type, part_where));
      image.position = out->size();
      images->push_back(std::move(image));
      continue;
    }
    if (type == "input_audio") {
      return Unimplemented(part_where, ": content parts of type '", type,
                           "' are not supported (text and images only)");
    }
    if (type != "text" && !type.empty()) {
      return InvalidArgument(part_where, ".type: unknown content part type '", type,
                             "'");
    }
    auto text = part.find("text");
    if (text == part.end() || !text->is_string()) {
      return InvalidArgument(part_where, ".text: expected a string");
    }
    out->push_back(text->get<std::string>());
  }
  return absl::OkStatus();
}

absl::StatusOr<ToolCall> ParseToolCall(const json& call, const std::string& where) {
  if (!call.is_object()) return InvalidArgument(where, ": expected an object");
  ToolCall out;
  TANDEM_ASSIGN_OR_RETURN(out.id, OptionalString(call, "id", where));
  const json* function = &call;
  std::string fn_where = where;
  auto fit = call.find("function");
  if (fit != call.end()) {
    if (!fit->is_object())
      return InvalidArgument(where, ".function: expected an object");
    function = &*fit;
    fn_where = absl::StrCat(where, ".function");
  }
  TANDEM_ASSIGN_OR_RETURN(out.name, OptionalString(*function, "name", fn_where));
  if (out.name.empty()) return InvalidArgument(fn_where, ".name: required");
  auto args = function->find("arguments");
  if (args == function->end() || args->is_null()) return out;
  if (args->is_string()) {
    out.arguments = args->get<std::string>();
  } else if (args->is_object()) {
    out.arguments = args->dump();
  } else {
    return InvalidArgument(fn_where,
                           ".arguments: expected a JSON string or an object, got ",
                           args->type_name());
  }
  return out;
}

absl::StatusOr<ToolDeclaration> ParseTool(const json& tool, const std::string& where) {
  if (!tool.is_object()) return InvalidArgument(where, ": expected an object");
  TANDEM_ASSIGN_OR_RETURN(std::string type, OptionalString(tool, "type", where));
  if (!type.empty() && type != "function") {
    return InvalidArgument(where, ".type: only 'function' tools are supported, got '",
                           type, "'");
  }
  auto fit = tool.find("function");
  if (fit == tool.end() || !fit->is_object()) {
    return InvalidArgument(where, ".function: expected an object");
  }
  const std::string fn_where = absl::StrCat(where, ".function");
  ToolDeclaration out;
  TANDEM_ASSIGN_OR_RETURN(out.name, OptionalString(*fit, "name", fn_where));
  if (out.name.empty()) return InvalidArgument(fn_where, ".name: required");
  TANDEM_ASSIGN_OR_RETURN(out.description,
                          OptionalString(*fit, "description", fn_where));
  auto params = fit->find("parameters");
  if (params != fit->end() && !params->is_null()) {
    if (!params->is_object()) {
      return InvalidArgument(fn_where, ".parameters: expected a JSON schema object");
    }
    out.parameters = *params;
  }
  out.original = tool;
  return out;
}

absl::StatusOr<std::vector<ToolDeclaration>> ParseToolList(const json& tools,
                                                           const std::string& where) {
  std::vector<ToolDeclaration> out;
  if (tools.is_null()) return out;
  if (!tools.is_array()) return InvalidArgument(where, ": expected an array");
  for (size_t i = 0; i < tools.size(); ++i) {
    TANDEM_ASSIGN_OR_RETURN(ToolDeclaration tool,
                            ParseTool(tools[i], absl::StrCat(where, "[", i, "]")));
    out.push_back(std::move(tool));
  }
  return out;
}

absl::StatusOr<ChatMessage> ParseMessage(const json& message,
                                         const std::string& where) {
  if (!message.is_object()) return InvalidArgument(where, ": expected an object");
  TANDEM_ASSIGN_OR_RETURN(std::string role, OptionalString(message, "role", where));
  ChatMessage out;
  if (role == "system" || role == "developer") {
    out.role = Role::kSystem;
  } else if (role == "user") {
    out.role = Role::kUser;
  } else if (role == "assistant") {
    out.role = Role::kAssistant;
  } else if (role == "tool") {
    out.role = Role::kTool;
  } else if (role.empty()) {
    return InvalidArgument(where, ".role: required");
  } else {
    return InvalidArgument(where, ".role: unknown role '", role, "'");
  }
  TANDEM_RETURN_IF_ERROR(ParseContent(message, where, &out.content,
                                      out.role == Role::kUser ? &out.images : nullptr));
  TANDEM_ASSIGN_OR_RETURN(out.name, OptionalString(message, "name", where));
  switch (out.role) {
    case Role::kAssistant: {
      TANDEM_ASSIGN_OR_RETURN(out.reasoning,
                              OptionalString(message, "reasoning_content", where));
      if (out.reasoning.empty()) {
        TANDEM_ASSIGN_OR_RETURN(out.reasoning,
                                OptionalString(message, "reasoning", where));
      }
      auto calls = message.find("tool_calls");
      if (calls != message.end() && !calls->is_null()) {
        if (!calls->is_array())
          return InvalidArgument(where, ".tool_calls: expected an array");
        for (size_t i = 0; i < calls->size(); ++i) {
          TANDEM_ASSIGN_OR_RETURN(
              ToolCall call,
              ParseToolCall((*calls)[i], absl::StrCat(where, ".tool_calls[", i, "]")));
          out.tool_calls.push_back(std::move(call));
        }
      }
      break;
    }
    case Role::kTool: {
      TANDEM_ASSIGN_OR_RETURN(out.tool_call_id,
                              OptionalString(message, "tool_call_id", where));
      TANDEM_ASSIGN_OR_RETURN(std::string tool, OptionalString(message, "tool", where));
      if (!tool.empty()) out.name = tool;
      break;
    }
    case Role::kSystem: {
      auto tools = message.find("tools");
      if (tools != message.end()) {
        TANDEM_ASSIGN_OR_RETURN(out.tools,
                                ParseToolList(*tools, absl::StrCat(where, ".tools")));
      }
      break;
    }
    case Role::kUser:
      break;
  }
  return out;
}

absl::StatusOr<ThinkingEffort> ParseEffort(const json& value, const char* key,
                                           bool* thinking) {
  if (!value.is_string()) return InvalidArgument(key, ": expected a string");
  const std::string effort = value.get<std::string>();
  if (effort == "low") return ThinkingEffort::kLow;
  if (effort == "high") return ThinkingEffort::kHigh;
  if (effort == "max") return ThinkingEffort::kMax;
  if (effort == "none") return ThinkingEffort::kNone;
  if (effort == "minimal") {
    *thinking = false;
    return ThinkingEffort::kNone;
  }
  return InvalidArgument(key, ": unsupported value '", effort,
                         "' (K3 supports none, minimal, low, high, max)");
}

}  // namespace

absl::StatusOr<std::vector<ChatMessage>> ParseOpenAIMessages(
    const nlohmann::json& messages) {
  if (!messages.is_array()) return InvalidArgument("messages: expected an array");
  std::vector<ChatMessage> out;
  out.reserve(messages.size());
  for (size_t i = 0; i < messages.size(); ++i) {
    TANDEM_ASSIGN_OR_RETURN(
        ChatMessage message,
        ParseMessage(messages[i], absl::StrCat("messages[", i, "]")));
    out.push_back(std::move(message));
  }
  return out;
}

absl::StatusOr<std::vector<ToolDeclaration>> ParseOpenAITools(
    const nlohmann::json& tools) {
  return ParseToolList(tools, "tools");
}

absl::StatusOr<ChatOptions> ParseOpenAIChatOptions(const nlohmann::json& body) {
  if (!body.is_object()) return InvalidArgument("request: expected a JSON object");
  ChatOptions options;
  const json* kwargs = nullptr;
  auto kw = body.find("chat_template_kwargs");
  if (kw != body.end() && !kw->is_null()) {
    if (!kw->is_object())
      return InvalidArgument("chat_template_kwargs: expected an object");
    kwargs = &*kw;
  }
  auto lookup = [&](const char* key) -> const json* {
    if (kwargs != nullptr) {
      auto it = kwargs->find(key);
      if (it != kwargs->end() && !it->is_null()) return &*it;
    }
    auto it = body.find(key);
    if (it != body.end() && !it->is_null()) return &*it;
    return nullptr;
  };
  if (const json* thinking = lookup("thinking")) {
    if (thinking->is_boolean()) {
      options.thinking = thinking->get<bool>();
    } else if (thinking->is_object() && thinking->contains("type") &&
               (*thinking)["type"].is_string()) {
      // Anthropic-style {"type": "enabled" | "disabled"}.
      options.thinking = (*thinking)["type"].get<std::string>() != "disabled";
    } else {
      return InvalidArgument("thinking: expected a boolean");
    }
  }
  if (const json* effort = lookup("thinking_effort")) {
    TANDEM_ASSIGN_OR_RETURN(options.thinking_effort,
                            ParseEffort(*effort, "thinking_effort", &options.thinking));
  } else if (const json* effort = lookup("reasoning_effort")) {
    TANDEM_ASSIGN_OR_RETURN(
        options.thinking_effort,
        ParseEffort(*effort, "reasoning_effort", &options.thinking));
  }
  if (kwargs != nullptr) {
    auto agp = kwargs->find("add_generation_prompt");
    if (agp != kwargs->end() && agp->is_boolean())
      options.add_generation_prompt = agp->get<bool>();
  }
  if (const json* choice = lookup("tool_choice")) {
    if (choice->is_string()) {
      const std::string c = choice->get<std::string>();
      if (c == "auto") {
        options.tool_choice = ToolChoice::kAuto;
      } else if (c == "none") {
        options.tool_choice = ToolChoice::kNone;
      } else if (c == "required") {
        options.tool_choice = ToolChoice::kRequired;
      } else {
        return InvalidArgument("tool_choice: unknown value '", c, "'");
      }
    } else if (choice->is_object()) {
      auto fn = choice->find("function");
      if (fn == choice->end() || !fn->is_object() || !fn->contains("name") ||
          !(*fn)["name"].is_string()) {
        return InvalidArgument("tool_choice.function.name: required");
      }
      options.tool_choice = ToolChoice::kNamed;
      options.tool_choice_name = (*fn)["name"].get<std::string>();
    } else {
      return InvalidArgument("tool_choice: expected a string or an object");
    }
  }
  if (const json* format = lookup("response_format")) {
    std::string type;
    if (format->is_string()) {
      type = format->get<std::string>();
    } else if (format->is_object() && format->contains("type") &&
               (*format)["type"].is_string()) {
      type = (*format)["type"].get<std::string>();
    } else {
      return InvalidArgument("response_format.type: required");
    }
    if (type == "json_object") {
      options.response_format = ResponseFormat::kJsonObject;
    } else if (type == "json_schema") {
      options.response_format = ResponseFormat::kJsonSchema;
      // The reference's extract_response_schema: json_schema.schema, else
      // json_schema.json_schema, else json_schema itself.
      if (format->is_object()) {
        auto js = format->find("json_schema");
        if (js != format->end() && !js->is_null()) {
          if (js->is_object() && js->contains("schema")) {
            options.response_schema = (*js)["schema"];
          } else if (js->is_object() && js->contains("json_schema")) {
            options.response_schema = (*js)["json_schema"];
          } else {
            options.response_schema = *js;
          }
        }
      }
    } else if (type != "text") {
      return InvalidArgument("response_format.type: unknown value '", type, "'");
    }
  }
  return options;
}

}  // namespace tandem::chat
