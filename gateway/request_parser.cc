#include "gateway/request_parser.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/chat/openai_parse.h"
#include "nlohmann/json.hpp"

namespace tandem::gateway {
namespace {

using json = nlohmann::json;

// The value at `key`, or nullptr when absent or null (OpenAI treats both as
// "not given").
const json* Find(const json& body, const char* key) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::Status TypeError(const char* key, const char* expected, const json& got) {
  return InvalidArgument(key, ": expected ", expected, ", got ", got.type_name());
}

absl::StatusOr<std::optional<double>> OptNumber(const json& body, const char* key,
                                                double lo, double hi,
                                                bool lo_open = false) {
  const json* v = Find(body, key);
  if (v == nullptr) return std::optional<double>();
  if (!v->is_number()) return TypeError(key, "a number", *v);
  const double d = v->get<double>();
  if (!std::isfinite(d) || d > hi || (lo_open ? d <= lo : d < lo)) {
    return InvalidArgument(key, ": ", v->dump(), " is out of range ",
                           lo_open ? "(" : "[", lo, ", ", hi, "]");
  }
  return std::optional<double>(d);
}

absl::StatusOr<std::optional<int64_t>> OptInteger(const json& body, const char* key,
                                                  int64_t lo, int64_t hi) {
  const json* v = Find(body, key);
  if (v == nullptr) return std::optional<int64_t>();
  int64_t i = 0;
  if (v->is_number_integer()) {
    if (v->is_number_unsigned() &&
        v->get<uint64_t>() >
            static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return InvalidArgument(key, ": ", v->dump(), " is out of range [", lo, ", ", hi,
                             "]");
    }
    i = v->get<int64_t>();
  } else if (v->is_number_float() && std::isfinite(v->get<double>()) &&
             v->get<double>() == std::floor(v->get<double>()) &&
             std::fabs(v->get<double>()) < 9e15) {
    i = static_cast<int64_t>(v->get<double>());  // 5.0 is an integer in JSON
  } else {
    return TypeError(key, "an integer", *v);
  }
  if (i < lo || i > hi) {
    return InvalidArgument(key, ": ", i, " is out of range [", lo, ", ", hi, "]");
  }
  return std::optional<int64_t>(i);
}

absl::StatusOr<bool> OptBool(const json& body, const char* key) {
  const json* v = Find(body, key);
  if (v == nullptr) return false;
  if (!v->is_boolean()) return TypeError(key, "a boolean", *v);
  return v->get<bool>();
}

absl::Status ParseStop(const json& body, std::vector<std::string>* out) {
  const json* v = Find(body, "stop");
  if (v == nullptr) return absl::OkStatus();
  if (v->is_string()) {
    out->push_back(v->get<std::string>());
  } else if (v->is_array()) {
    if (v->size() > static_cast<size_t>(kMaxStopStrings)) {
      return InvalidArgument("stop: at most ", kMaxStopStrings, " stop strings, got ",
                             v->size());
    }
    for (size_t i = 0; i < v->size(); ++i) {
      if (!(*v)[i].is_string()) {
        return InvalidArgument("stop[", i, "]: expected a string, got ",
                               (*v)[i].type_name());
      }
      out->push_back((*v)[i].get<std::string>());
    }
  } else {
    return TypeError("stop", "a string or an array of strings", *v);
  }
  for (const std::string& s : *out) {
    if (s.empty()) return InvalidArgument("stop: stop strings must not be empty");
  }
  return absl::OkStatus();
}

// A JSON Schema given as an object (or a boolean schema), or as JSON text.
absl::StatusOr<std::string> SchemaText(const json& v, const std::string& where) {
  if (v.is_object() || v.is_boolean()) return v.dump();
  if (v.is_string()) {
    json parsed =
        json::parse(v.get<std::string>(), nullptr, /*allow_exceptions=*/false);
    if (parsed.is_discarded() || !(parsed.is_object() || parsed.is_boolean())) {
      return InvalidArgument(where, ": a JSON schema string must hold a JSON object");
    }
    return parsed.dump();
  }
  return InvalidArgument(where, ": expected a JSON schema object, got ", v.type_name());
}

absl::StatusOr<std::string> NonEmptyString(const json& v, const std::string& where) {
  if (!v.is_string())
    return InvalidArgument(where, ": expected a string, got ", v.type_name());
  if (v.get<std::string>().empty())
    return InvalidArgument(where, ": must not be empty");
  return v.get<std::string>();
}

absl::StatusOr<std::vector<std::string>> ChoiceList(const json& v,
                                                    const std::string& where) {
  if (!v.is_array() || v.empty()) {
    return InvalidArgument(where, ": expected a non-empty array of strings");
  }
  std::vector<std::string> out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string()) {
      return InvalidArgument(where, "[", i, "]: expected a string, got ",
                             v[i].type_name());
    }
    out.push_back(v[i].get<std::string>());
  }
  return out;
}

// Every structured-output field of the body; more than one is an error.
absl::StatusOr<std::optional<StructuredOutputRequest>> ParseStructured(
    const json& body) {
  using K = StructuredOutputRequest::Kind;
  std::vector<StructuredOutputRequest> found;
  auto add = [&](K kind, std::string param) -> StructuredOutputRequest& {
    found.push_back({kind, "", {}, std::move(param)});
    return found.back();
  };
  if (const json* rf = Find(body, "response_format")) {
    std::string type;
    if (rf->is_string()) {
      type = rf->get<std::string>();
    } else if (rf->is_object() && rf->contains("type") && (*rf)["type"].is_string()) {
      type = (*rf)["type"].get<std::string>();
    } else {
      return InvalidArgument("response_format.type: required");
    }
    if (type == "json_object") {
      add(K::kJsonObject, "response_format");
    } else if (type == "json_schema") {
      const json* js = rf->is_object() ? Find(*rf, "json_schema") : nullptr;
      if (js == nullptr || !js->is_object()) {
        return InvalidArgument(
            "response_format.json_schema: required (an object with a schema)");
      }
      if (const json* strict = Find(*js, "strict");
          strict != nullptr && !strict->is_boolean()) {
        return TypeError("response_format.json_schema.strict", "a boolean", *strict);
      }
      // As the chat template reads it: json_schema.schema, else
      // json_schema.json_schema.
      const json* schema = Find(*js, "schema");
      if (schema == nullptr) schema = Find(*js, "json_schema");
      if (schema == nullptr) {
        return InvalidArgument("response_format.json_schema.schema: required");
      }
      TANDEM_ASSIGN_OR_RETURN(
          std::string text, SchemaText(*schema, "response_format.json_schema.schema"));
      add(K::kJsonSchema, "response_format").source = std::move(text);
    } else if (type != "text") {
      return InvalidArgument("response_format.type: unknown value '", type, "'");
    }
  }
  if (const json* so = Find(body, "structured_outputs")) {
    if (!so->is_object()) return TypeError("structured_outputs", "an object", *so);
    for (auto it = so->begin(); it != so->end(); ++it) {
      if (it->is_null()) continue;
      const std::string where = absl::StrCat("structured_outputs.", it.key());
      if (it.key() == "json") {
        TANDEM_ASSIGN_OR_RETURN(std::string text, SchemaText(*it, where));
        add(K::kJsonSchema, where).source = std::move(text);
      } else if (it.key() == "regex") {
        TANDEM_ASSIGN_OR_RETURN(std::string re, NonEmptyString(*it, where));
        add(K::kRegex, where).source = std::move(re);
      } else if (it.key() == "choice") {
        TANDEM_ASSIGN_OR_RETURN(std::vector<std::string> c, ChoiceList(*it, where));
        add(K::kChoice, where).choices = std::move(c);
      } else if (it.key() == "grammar") {
        TANDEM_ASSIGN_OR_RETURN(std::string g, NonEmptyString(*it, where));
        add(K::kEbnf, where).source = std::move(g);
      } else if (it.key() == "json_object") {
        if (!it->is_boolean())
          return TypeError("structured_outputs.json_object", "a boolean", *it);
        if (it->get<bool>()) add(K::kJsonObject, where);
      } else if (it.key() == "structural_tag") {
        return Unimplemented("structured_outputs.structural_tag: not supported");
      } else if (it.key() == "disable_any_whitespace" ||
                 it.key() == "disable_additional_properties" ||
                 it.key() == "whitespace_pattern" || it.key() == "backend" ||
                 it.key() == "disable_fallback") {
        // vLLM's backend options: Tandem has one engine; accepted, ignored.
      } else {
        return InvalidArgument(where, ": unknown field");
      }
    }
  }
  if (const json* v = Find(body, "guided_json")) {
    TANDEM_ASSIGN_OR_RETURN(std::string text, SchemaText(*v, "guided_json"));
    add(K::kJsonSchema, "guided_json").source = std::move(text);
  }
  if (const json* v = Find(body, "guided_regex")) {
    TANDEM_ASSIGN_OR_RETURN(std::string re, NonEmptyString(*v, "guided_regex"));
    add(K::kRegex, "guided_regex").source = std::move(re);
  }
  if (const json* v = Find(body, "guided_choice")) {
    TANDEM_ASSIGN_OR_RETURN(std::vector<std::string> c,
                            ChoiceList(*v, "guided_choice"));
    add(K::kChoice, "guided_choice").choices = std::move(c);
  }
  if (const json* v = Find(body, "guided_grammar")) {
    TANDEM_ASSIGN_OR_RETURN(std::string g, NonEmptyString(*v, "guided_grammar"));
    add(K::kEbnf, "guided_grammar").source = std::move(g);
  }
  if (found.size() > 1) {
    return InvalidArgument(found[1].param,
                           ": only one structured output may be given (",
                           found[0].param, " is set too)");
  }
  if (found.empty()) return std::optional<StructuredOutputRequest>();
  return std::optional<StructuredOutputRequest>(std::move(found[0]));
}

absl::StatusOr<GenerationFields> ParseFields(const json& body, bool chat) {
  GenerationFields f;
  const json* model = Find(body, "model");
  if (model == nullptr) return InvalidArgument("model: required");
  if (!model->is_string()) return TypeError("model", "a string", *model);
  f.model = model->get<std::string>();
  if (f.model.empty()) return InvalidArgument("model: must not be empty");

  TANDEM_ASSIGN_OR_RETURN(f.temperature, OptNumber(body, "temperature", 0, 2));
  TANDEM_ASSIGN_OR_RETURN(f.top_p, OptNumber(body, "top_p", 0, 1, /*lo_open=*/true));
  TANDEM_ASSIGN_OR_RETURN(auto n, OptInteger(body, "n", 1, kMaxN));
  if (n) f.n = static_cast<int>(*n);
  if (!chat) {
    TANDEM_ASSIGN_OR_RETURN(auto best_of, OptInteger(body, "best_of", 1, kMaxN));
    if (best_of && *best_of != f.n) {
      return Unimplemented("best_of: only best_of == n is supported");
    }
  }
  constexpr int64_t kMaxTokensLimit = 1 << 30;
  // 0: completions with echo only (checked once echo is parsed).
  TANDEM_ASSIGN_OR_RETURN(
      auto max_tokens, OptInteger(body, "max_tokens", chat ? 1 : 0, kMaxTokensLimit));
  if (chat) {
    TANDEM_ASSIGN_OR_RETURN(
        auto mct, OptInteger(body, "max_completion_tokens", 1, kMaxTokensLimit));
    if (mct) max_tokens = mct;
  }
  if (max_tokens) f.max_tokens = static_cast<int>(*max_tokens);
  TANDEM_RETURN_IF_ERROR(ParseStop(body, &f.stop));
  TANDEM_ASSIGN_OR_RETURN(auto seed,
                          OptInteger(body, "seed", std::numeric_limits<int64_t>::min(),
                                     std::numeric_limits<int64_t>::max()));
  if (seed) f.seed = static_cast<uint64_t>(*seed);
  TANDEM_ASSIGN_OR_RETURN(auto pp, OptNumber(body, "presence_penalty", -2, 2));
  if (pp) f.presence_penalty = *pp;
  TANDEM_ASSIGN_OR_RETURN(auto fp, OptNumber(body, "frequency_penalty", -2, 2));
  if (fp) f.frequency_penalty = *fp;

  if (chat) {
    TANDEM_ASSIGN_OR_RETURN(f.logprobs, OptBool(body, "logprobs"));
    TANDEM_ASSIGN_OR_RETURN(auto top,
                            OptInteger(body, "top_logprobs", 0, kMaxTopLogprobs));
    if (top) {
      if (!f.logprobs) {
        return InvalidArgument("top_logprobs: requires logprobs to be true");
      }
      f.top_logprobs = static_cast<int>(*top);
    }
  } else {
    // Completions: `logprobs` is the number of alternatives (0..20).
    TANDEM_ASSIGN_OR_RETURN(auto lp, OptInteger(body, "logprobs", 0, kMaxTopLogprobs));
    if (lp) {
      f.logprobs = true;
      f.top_logprobs = static_cast<int>(*lp);
    }
  }

  TANDEM_ASSIGN_OR_RETURN(f.stream, OptBool(body, "stream"));
  if (const json* so = Find(body, "stream_options")) {
    if (!so->is_object()) return TypeError("stream_options", "an object", *so);
    if (!f.stream) {
      return InvalidArgument("stream_options: only allowed when stream is true");
    }
    auto iu = so->find("include_usage");
    if (iu != so->end() && !iu->is_null()) {
      if (!iu->is_boolean()) {
        return InvalidArgument("stream_options.include_usage: expected a boolean, got ",
                               iu->type_name());
      }
      f.include_usage = iu->get<bool>();
    }
  }
  if (const json* user = Find(body, "user")) {
    if (!user->is_string()) return TypeError("user", "a string", *user);
    f.user = user->get<std::string>();
  }
  if (const json* salt = Find(body, "cache_salt")) {
    if (!salt->is_string()) return TypeError("cache_salt", "a string", *salt);
    f.cache_salt = salt->get<std::string>();
    if (f.cache_salt.empty()) {
      return InvalidArgument("cache_salt: must be a non-empty string");
    }
    if (f.cache_salt.size() > 1024) {
      return InvalidArgument("cache_salt: at most 1024 bytes");
    }
  }
  if (const json* bias = Find(body, "logit_bias")) {
    // OpenAI: token ids (as the object's keys) to a bias in [-100, 100].
    if (!bias->is_object()) return TypeError("logit_bias", "an object", *bias);
    for (auto it = bias->begin(); it != bias->end(); ++it) {
      const std::string& key = it.key();
      int64_t id = -1;
      if (key.empty() || key.size() > 10 ||
          !std::all_of(key.begin(), key.end(),
                       [](char c) { return c >= '0' && c <= '9'; }) ||
          !absl::SimpleAtoi(key, &id) || id > std::numeric_limits<int32_t>::max()) {
        return InvalidArgument("logit_bias: the key '", key.substr(0, 40),
                               "' is not a token id (a non-negative integer)");
      }
      const json& v = it.value();
      if (!v.is_number()) {
        return InvalidArgument("logit_bias: the bias of token ", id,
                               " must be a number, got ", v.type_name());
      }
      const double b = v.get<double>();
      if (!std::isfinite(b) || b < -100 || b > 100) {
        return InvalidArgument("logit_bias: the bias of token ", id,
                               " must be in [-100, 100], got ", b);
      }
      if (!f.logit_bias.emplace(static_cast<int>(id), b).second) {
        return InvalidArgument("logit_bias: token id ", id, " is given more than once");
      }
    }
  }

  TANDEM_ASSIGN_OR_RETURN(auto top_k, OptInteger(body, "top_k", -1, 1 << 20));
  if (top_k) f.top_k = static_cast<int>(*top_k < 0 ? 0 : *top_k);
  TANDEM_ASSIGN_OR_RETURN(f.min_p, OptNumber(body, "min_p", 0, 1));
  TANDEM_ASSIGN_OR_RETURN(f.repetition_penalty, OptNumber(body, "repetition_penalty", 0,
                                                          2, /*lo_open=*/true));
  TANDEM_ASSIGN_OR_RETURN(f.ignore_eos, OptBool(body, "ignore_eos"));
  TANDEM_ASSIGN_OR_RETURN(auto min_tokens, OptInteger(body, "min_tokens", 0, 1 << 30));
  if (min_tokens) f.min_tokens = static_cast<int>(*min_tokens);
  TANDEM_ASSIGN_OR_RETURN(auto priority,
                          OptInteger(body, "priority", -(1 << 30), 1 << 30));
  if (priority) f.priority = static_cast<int>(*priority);
  TANDEM_ASSIGN_OR_RETURN(auto prompt_lp,
                          OptInteger(body, "prompt_logprobs", 0, kMaxTopLogprobs));
  if (prompt_lp) {
    if (chat && f.stream) {
      return InvalidArgument(
          "prompt_logprobs: not returned when streaming a chat completion");
    }
    f.prompt_logprobs = static_cast<int>(*prompt_lp);
  }
  if (f.max_tokens && f.min_tokens > *f.max_tokens) {
    return InvalidArgument("min_tokens: must not exceed max_tokens");
  }
  if (const json* ids = Find(body, "stop_token_ids")) {
    if (!ids->is_array()) return TypeError("stop_token_ids", "an array", *ids);
    for (size_t i = 0; i < ids->size(); ++i) {
      const json& id = (*ids)[i];
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
        return InvalidArgument("stop_token_ids[", i, "]: expected a token id");
      }
      f.stop_token_ids.push_back(static_cast<int>(id.get<int64_t>()));
    }
  }
  TANDEM_ASSIGN_OR_RETURN(f.structured, ParseStructured(body));
  if (f.structured) {
    // The constraint ends with a stop token: it cannot be held back or ignored.
    if (f.ignore_eos) {
      return InvalidArgument("ignore_eos: cannot be combined with ",
                             f.structured->param);
    }
    if (f.min_tokens > 0) {
      return InvalidArgument("min_tokens: cannot be combined with ",
                             f.structured->param);
    }
  }
  return f;
}

absl::StatusOr<json> ParseBody(absl::string_view body) {
  json parsed = json::parse(body.begin(), body.end(), nullptr,
                            /*allow_exceptions=*/false);
  if (parsed.is_discarded()) {
    return InvalidArgument(
        "We could not parse the JSON body of your request. The body must be a "
        "JSON object.");
  }
  if (!parsed.is_object()) {
    return InvalidArgument("The request body must be a JSON object, got ",
                           parsed.type_name());
  }
  return parsed;
}

// The prompt value as token ids, if it is an array of integers.
absl::StatusOr<std::vector<int>> TokenArray(const json& v, const std::string& where) {
  std::vector<int> ids;
  ids.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const json& id = v[i];
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return InvalidArgument(where, "[", i, "]: expected a token id (integer >= 0)");
    }
    ids.push_back(static_cast<int>(id.get<int64_t>()));
  }
  if (ids.empty()) return InvalidArgument(where, ": an empty token array");
  return ids;
}

}  // namespace

absl::StatusOr<ChatCompletionRequest> ParseChatCompletionRequest(
    absl::string_view body) {
  TANDEM_ASSIGN_OR_RETURN(json parsed, ParseBody(body));
  ChatCompletionRequest req;
  TANDEM_ASSIGN_OR_RETURN(req.fields, ParseFields(parsed, /*chat=*/true));
  const json* messages = Find(parsed, "messages");
  if (messages == nullptr) return InvalidArgument("messages: required");
  if (!messages->is_array()) return TypeError("messages", "an array", *messages);
  if (messages->empty()) return InvalidArgument("messages: must not be empty");
  TANDEM_ASSIGN_OR_RETURN(req.messages, chat::ParseOpenAIMessages(*messages));
  if (const json* tools = Find(parsed, "tools")) {
    TANDEM_ASSIGN_OR_RETURN(req.tools, chat::ParseOpenAITools(*tools));
  }
  if (Find(parsed, "functions") != nullptr ||
      Find(parsed, "function_call") != nullptr) {
    return Unimplemented(
        "functions: the deprecated functions API is not supported; use tools");
  }
  TANDEM_ASSIGN_OR_RETURN(req.options, chat::ParseOpenAIChatOptions(parsed));
  if (const json* p = Find(parsed, "parallel_tool_calls");
      p != nullptr && !p->is_null()) {
    if (!p->is_boolean()) return TypeError("parallel_tool_calls", "a boolean", *p);
    req.parallel_tool_calls = p->get<bool>();
  }
  if (req.options.tool_choice == chat::ToolChoice::kRequired && req.tools.empty()) {
    return InvalidArgument("tool_choice: 'required' needs at least one tool in tools");
  }
  if (req.options.tool_choice == chat::ToolChoice::kNamed) {
    bool found = false;
    for (const auto& t : req.tools)
      found = found || t.name == req.options.tool_choice_name;
    if (!found) {
      return InvalidArgument("tool_choice: function '", req.options.tool_choice_name,
                             "' is not in tools");
    }
  }
  if (!req.options.add_generation_prompt) {
    return InvalidArgument(
        "chat_template_kwargs: add_generation_prompt=false is not supported for "
        "chat completions");
  }
  return req;
}

absl::StatusOr<CompletionRequest> ParseCompletionRequest(absl::string_view body) {
  TANDEM_ASSIGN_OR_RETURN(json parsed, ParseBody(body));
  CompletionRequest req;
  TANDEM_ASSIGN_OR_RETURN(req.fields, ParseFields(parsed, /*chat=*/false));
  TANDEM_ASSIGN_OR_RETURN(req.fields.echo, OptBool(parsed, "echo"));
  if (req.fields.max_tokens && *req.fields.max_tokens == 0) {
    if (!req.fields.echo) {
      return InvalidArgument(
          "max_tokens: must be at least 1 (0 only with echo, to score the prompt "
          "without generating)");
    }
    if (req.fields.min_tokens > 0) {
      return InvalidArgument("min_tokens: must be 0 with max_tokens 0");
    }
    if (req.fields.structured) {
      return InvalidArgument(
          "max_tokens: 0 scores the prompt only; a structured-output constraint "
          "has nothing to constrain");
    }
  }
  if (const json* suffix = Find(parsed, "suffix")) {
    if (!suffix->is_string()) return TypeError("suffix", "a string", *suffix);
    if (!suffix->get<std::string>().empty()) {
      return Unimplemented("suffix: not supported");
    }
  }
  const json* prompt = Find(parsed, "prompt");
  if (prompt == nullptr) return InvalidArgument("prompt: required");
  if (prompt->is_string()) {
    req.prompts.push_back(prompt->get<std::string>());
  } else if (prompt->is_array()) {
    if (prompt->empty()) return InvalidArgument("prompt: must not be empty");
    if ((*prompt)[0].is_number()) {
      TANDEM_ASSIGN_OR_RETURN(std::vector<int> ids, TokenArray(*prompt, "prompt"));
      req.prompts.push_back(std::move(ids));
    } else {
      for (size_t i = 0; i < prompt->size(); ++i) {
        const json& p = (*prompt)[i];
        const std::string where = absl::StrCat("prompt[", i, "]");
        if (p.is_string()) {
          req.prompts.push_back(p.get<std::string>());
        } else if (p.is_array()) {
          TANDEM_ASSIGN_OR_RETURN(std::vector<int> ids, TokenArray(p, where));
          req.prompts.push_back(std::move(ids));
        } else {
          return InvalidArgument(where,
                                 ": expected a string or an array of token ids, got ",
                                 p.type_name());
        }
      }
    }
  } else {
    return TypeError("prompt", "a string, an array of strings or token ids", *prompt);
  }
  if (req.prompts.size() * static_cast<size_t>(req.fields.n) > kMaxN) {
    return InvalidArgument("n: prompts x n must be at most ", kMaxN);
  }
  return req;
}

namespace {

absl::StatusOr<std::string> OptModel(const json& body) {
  const json* model = Find(body, "model");
  if (model == nullptr) return std::string();
  if (!model->is_string()) return TypeError("model", "a string", *model);
  return model->get<std::string>();
}

}  // namespace

absl::StatusOr<TokenizeRequest> ParseTokenizeRequest(absl::string_view body) {
  TANDEM_ASSIGN_OR_RETURN(json parsed, ParseBody(body));
  TokenizeRequest req;
  TANDEM_ASSIGN_OR_RETURN(req.model, OptModel(parsed));
  TANDEM_ASSIGN_OR_RETURN(req.return_token_strs, OptBool(parsed, "return_token_strs"));
  const json* prompt = Find(parsed, "prompt");
  const json* messages = Find(parsed, "messages");
  if ((prompt == nullptr) == (messages == nullptr)) {
    return InvalidArgument("prompt: give exactly one of prompt and messages");
  }
  if (prompt != nullptr) {
    if (!prompt->is_string()) return TypeError("prompt", "a string", *prompt);
    req.prompt = prompt->get<std::string>();
    return req;
  }
  req.chat = true;
  if (!messages->is_array()) return TypeError("messages", "an array", *messages);
  if (messages->empty()) return InvalidArgument("messages: must not be empty");
  TANDEM_ASSIGN_OR_RETURN(req.messages, chat::ParseOpenAIMessages(*messages));
  if (const json* tools = Find(parsed, "tools")) {
    TANDEM_ASSIGN_OR_RETURN(req.tools, chat::ParseOpenAITools(*tools));
  }
  TANDEM_ASSIGN_OR_RETURN(req.options, chat::ParseOpenAIChatOptions(parsed));
  // vLLM's top-level flag; it wins over chat_template_kwargs'.
  if (const json* agp = Find(parsed, "add_generation_prompt")) {
    if (!agp->is_boolean())
      return TypeError("add_generation_prompt", "a boolean", *agp);
    req.options.add_generation_prompt = agp->get<bool>();
  }
  return req;
}

absl::StatusOr<DetokenizeRequest> ParseDetokenizeRequest(absl::string_view body) {
  TANDEM_ASSIGN_OR_RETURN(json parsed, ParseBody(body));
  DetokenizeRequest req;
  TANDEM_ASSIGN_OR_RETURN(req.model, OptModel(parsed));
  const json* tokens = Find(parsed, "tokens");
  if (tokens == nullptr) return InvalidArgument("tokens: required");
  if (!tokens->is_array()) return TypeError("tokens", "an array", *tokens);
  if (tokens->empty()) return req;
  TANDEM_ASSIGN_OR_RETURN(req.tokens, TokenArray(*tokens, "tokens"));
  return req;
}

uint64_t ChoiceSeed(uint64_t seed, int index) {
  if (index == 0) return seed;
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(index);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace tandem::gateway
