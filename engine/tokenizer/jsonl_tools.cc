#include "engine/tokenizer/jsonl_tools.h"

#include <vector>

#include "engine/tokenizer/utf8.h"
#include "nlohmann/json.hpp"

namespace tandem::tokenizer {
namespace {

std::string ErrorLine(absl::string_view message, bool* ok) {
  *ok = false;
  nlohmann::json j;
  j["error"] = ReplaceInvalidUtf8(message);
  return j.dump();
}

template <typename Fn>
int RunLines(std::istream& in, std::ostream& out, Fn fn) {
  int failed = 0;
  std::string line;
  std::string buffer;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    bool ok = true;
    buffer += fn(line, &ok);
    buffer += '\n';
    if (!ok) ++failed;
    if (buffer.size() > (1 << 16)) {
      out << buffer;
      buffer.clear();
    }
  }
  out << buffer;
  out.flush();
  return failed;
}

}  // namespace

std::string TokenizeJsonLine(const Tokenizer& tokenizer, absl::string_view line,
                             bool* ok) {
  *ok = true;
  std::string text;
  try {
    nlohmann::json j = nlohmann::json::parse(line.begin(), line.end());
    if (!j.is_object() || !j.contains("text") || !j["text"].is_string()) {
      return ErrorLine("expected an object with a string \"text\"", ok);
    }
    text = j["text"].get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    return ErrorLine(e.what(), ok);
  }
  absl::StatusOr<std::vector<int>> ids = tokenizer.Encode(text);
  if (!ids.ok()) return ErrorLine(ids.status().ToString(), ok);
  std::string out = "{\"ids\":[";
  for (size_t i = 0; i < ids->size(); ++i) {
    if (i > 0) out += ',';
    out += std::to_string((*ids)[i]);
  }
  out += "]}";
  return out;
}

std::string DetokenizeJsonLine(const Tokenizer& tokenizer, absl::string_view line,
                               bool* ok) {
  *ok = true;
  std::vector<int> ids;
  try {
    nlohmann::json j = nlohmann::json::parse(line.begin(), line.end());
    if (!j.is_object() || !j.contains("ids") || !j["ids"].is_array()) {
      return ErrorLine("expected an object with an array \"ids\"", ok);
    }
    for (const nlohmann::json& v : j["ids"]) {
      if (!v.is_number_integer()) return ErrorLine("ids must be integers", ok);
      const int64_t id = v.get<int64_t>();
      if (id < 0 || id >= tokenizer.vocab_size()) {
        return ErrorLine("token id " + std::to_string(id) + " outside [0, " +
                             std::to_string(tokenizer.vocab_size()) + ")",
                         ok);
      }
      ids.push_back(static_cast<int>(id));
    }
  } catch (const nlohmann::json::exception& e) {
    return ErrorLine(e.what(), ok);
  }
  absl::StatusOr<std::string> bytes = tokenizer.Decode(ids);
  if (!bytes.ok()) return ErrorLine(bytes.status().ToString(), ok);
  nlohmann::json out;
  out["text"] = ReplaceInvalidUtf8(*bytes);
  return out.dump();
}

int RunTokenizeJsonl(const Tokenizer& tokenizer, std::istream& in, std::ostream& out) {
  return RunLines(in, out, [&](const std::string& line, bool* ok) {
    return TokenizeJsonLine(tokenizer, line, ok);
  });
}

int RunDetokenizeJsonl(const Tokenizer& tokenizer, std::istream& in,
                       std::ostream& out) {
  return RunLines(in, out, [&](const std::string& line, bool* ok) {
    return DetokenizeJsonLine(tokenizer, line, ok);
  });
}

}  // namespace tandem::tokenizer
