#include "engine/chat/python_json.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"

namespace tandem::chat {
namespace {

template <typename Json>
void Dump(const Json& value, JsonSeparators separators, std::string* out) {
  const char* item_sep = separators == JsonSeparators::kCompact ? "," : ", ";
  const char* key_sep = separators == JsonSeparators::kCompact ? ":" : ": ";
  switch (value.type()) {
    case nlohmann::json::value_t::null:
    case nlohmann::json::value_t::discarded:
      out->append("null");
      return;
    case nlohmann::json::value_t::boolean:
      out->append(value.template get<bool>() ? "true" : "false");
      return;
    case nlohmann::json::value_t::number_integer:
      absl::StrAppend(out, value.template get<int64_t>());
      return;
    case nlohmann::json::value_t::number_unsigned:
      absl::StrAppend(out, value.template get<uint64_t>());
      return;
    case nlohmann::json::value_t::number_float:
      out->append(PythonFloatRepr(value.template get<double>()));
      return;
    case nlohmann::json::value_t::string:
      AppendJsonString(value.template get_ref<const std::string&>(), out);
      return;
    case nlohmann::json::value_t::binary:
      out->append("null");
      return;
    case nlohmann::json::value_t::array: {
      out->push_back('[');
      bool first = true;
      for (const auto& item : value) {
        if (!first) out->append(item_sep);
        first = false;
        Dump(item, separators, out);
      }
      out->push_back(']');
      return;
    }
    case nlohmann::json::value_t::object: {
      out->push_back('{');
      bool first = true;
      for (auto it = value.begin(); it != value.end(); ++it) {
        if (!first) out->append(item_sep);
        first = false;
        AppendJsonString(it.key(), out);
        out->append(key_sep);
        Dump(it.value(), separators, out);
      }
      out->push_back('}');
      return;
    }
  }
}

}  // namespace

void AppendJsonString(absl::string_view s, std::string* out) {
  out->push_back('"');
  for (char c : s) {
    switch (c) {
      case '"':
        out->append("\\\"");
        break;
      case '\\':
        out->append("\\\\");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '\r':
        out->append("\\r");
        break;
      case '\t':
        out->append("\\t");
        break;
      case '\b':
        out->append("\\b");
        break;
      case '\f':
        out->append("\\f");
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned char>(c));
          out->append(buf);
        } else {
          out->push_back(c);
        }
    }
  }
  out->push_back('"');
}

std::string PythonFloatRepr(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "Infinity" : "-Infinity";
  // Shortest round-trip digits in scientific form: [-]d[.ddd]e(+|-)XX.
  char buf[64];
  auto result =
      std::to_chars(buf, buf + sizeof(buf), value, std::chars_format::scientific);
  std::string sci(buf, result.ptr);
  std::string sign;
  size_t pos = 0;
  if (sci[0] == '-') {
    sign = "-";
    pos = 1;
  }
  size_t e = sci.find('e');
  std::string digits;
  for (size_t i = pos; i < e; ++i) {
    if (sci[i] != '.') digits.push_back(sci[i]);
  }
  int exponent = std::stoi(sci.substr(e + 1));
  // Python's repr: fixed notation for -4 <= exponent < 16, else scientific.
  if (exponent >= -4 && exponent < 16) {
    std::string fixed;
    if (exponent < 0) {
      fixed = "0." + std::string(-exponent - 1, '0') + digits;
    } else if (static_cast<int>(digits.size()) <= exponent + 1) {
      fixed = digits + std::string(exponent + 1 - digits.size(), '0') + ".0";
    } else {
      fixed = digits.substr(0, exponent + 1) + "." + digits.substr(exponent + 1);
    }
    return sign + fixed;
  }
  std::string mantissa = digits.substr(0, 1);
  if (digits.size() > 1) mantissa += "." + digits.substr(1);
  char exp_buf[16];
  std::snprintf(exp_buf, sizeof(exp_buf), "e%c%02d", exponent < 0 ? '-' : '+',
                exponent < 0 ? -exponent : exponent);
  return sign + mantissa + exp_buf;
}

std::string PythonJsonDumps(const nlohmann::json& value, JsonSeparators separators) {
  std::string out;
  Dump(value, separators, &out);
  return out;
}

std::string PythonJsonDumps(const nlohmann::ordered_json& value,
                            JsonSeparators separators) {
  std::string out;
  Dump(value, separators, &out);
  return out;
}

}  // namespace tandem::chat
