#include "engine/grammar/testing_validator.h"

#include <cmath>
#include <cstdlib>

#include "re2/re2.h"

namespace tandem::grammar::testing {
namespace {

using nlohmann::json;

size_t CodepointCount(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

bool IsLeap(int y) { return (y % 4 == 0 && y % 100 != 0) || y % 400 == 0; }

bool ValidDate(const std::string& s) {
  int y, m, d;
  if (!RE2::FullMatch(s, R"((\d{4})-(\d{2})-(\d{2}))", &y, &m, &d)) return false;
  static const int kDays[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  if (m < 1 || m > 12 || d < 1) return false;
  int max = kDays[m - 1] + (m == 2 && IsLeap(y) ? 1 : 0);
  return d <= max;
}

bool ValidTime(const std::string& s) {
  int h, mi, se;
  std::string tz;
  if (!RE2::FullMatch(s, R"((\d{2}):(\d{2}):(\d{2})(?:\.\d+)?([zZ]|[+-]\d{2}:\d{2}))",
                      &h, &mi, &se, &tz)) {
    return false;
  }
  if (h > 23 || mi > 59 || se > 60) return false;
  if (tz.size() == 6) {
    int th = std::atoi(tz.substr(1, 2).c_str()),
        tm = std::atoi(tz.substr(4, 2).c_str());
    if (th > 23 || tm > 59) return false;
  }
  return true;
}

bool ValidFormat(const std::string& f, const std::string& s) {
  if (f == "date") return ValidDate(s);
  if (f == "time") return ValidTime(s);
  if (f == "date-time") {
    size_t t = s.find_first_of("Tt");
    return t != std::string::npos && ValidDate(s.substr(0, t)) &&
           ValidTime(s.substr(t + 1));
  }
  if (f == "uuid")
    return RE2::FullMatch(
        s, "(?i)[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}");
  if (f == "email") {
    // ajv-formats' "email" (fast mode), case-insensitive.
    return RE2::FullMatch(s,
                          "(?i)[a-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\\.[a-z0-9!#$%&'*+/"
                          "=?^_`{|}~-]+)*@(?:[a-z0-9](?:[a-z0-9-]*[a-z0-9])?\\.)+[a-z0-"
                          "9](?:[a-z0-9-]*[a-z0-9])?");
  }
  if (f == "ipv4") {
    return RE2::FullMatch(s,
                          "(?:(?:25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)\\.){3}(?:25[0-5]|"
                          "2[0-4]\\d|1\\d\\d|[1-9]?\\d)");
  }
  return false;
}

class Validator {
 public:
  explicit Validator(const json& root) : root_(root) {}

  std::string Check(const json& s, const json& x, const std::string& path, int depth) {
    if (depth > 200) return "recursion too deep";
    if (s.is_boolean()) return s.get<bool>() ? "" : path + ": false schema";
    if (s.contains("$ref")) {
      const json* t = Resolve(s["$ref"].get<std::string>());
      if (t == nullptr) return "bad $ref";
      std::string e = Check(*t, x, path, depth + 1);
      if (!e.empty()) return e;
    }
    if (s.contains("allOf")) {
      for (const json& sub : s["allOf"]) {
        std::string e = Check(sub, x, path, depth + 1);
        if (!e.empty()) return e;
      }
    }
    if (s.contains("anyOf")) {
      bool any = false;
      for (const json& sub : s["anyOf"])
        any = any || Check(sub, x, path, depth + 1).empty();
      if (!any) return path + ": no anyOf branch matches";
    }
    if (s.contains("oneOf")) {
      int n = 0;
      for (const json& sub : s["oneOf"]) n += Check(sub, x, path, depth + 1).empty();
      if (n != 1) return path + ": " + std::to_string(n) + " oneOf branches match";
    }
    if (s.contains("const") && !(s["const"] == x)) return path + ": not the const";
    if (s.contains("enum")) {
      bool found = false;
      for (const json& v : s["enum"]) found = found || v == x;
      if (!found) return path + ": not in enum";
    }
    if (s.contains("type")) {
      std::vector<std::string> types;
      if (s["type"].is_string()) {
        types.push_back(s["type"]);
      } else {
        for (const json& t : s["type"]) types.push_back(t);
      }
      if (s.value("nullable", false)) types.push_back("null");
      bool ok = false;
      for (const std::string& t : types) ok = ok || HasType(x, t);
      if (!ok) return path + ": wrong type " + x.dump();
    }
    if (x.is_string()) {
      const std::string v = x.get<std::string>();
      if (s.contains("minLength") && CodepointCount(v) < s["minLength"].get<size_t>()) {
        return path + ": shorter than minLength";
      }
      if (s.contains("maxLength") && CodepointCount(v) > s["maxLength"].get<size_t>()) {
        return path + ": longer than maxLength";
      }
      if (s.contains("pattern")) {
        RE2 re(s["pattern"].get<std::string>());
        if (!re.ok()) return "pattern not understood by RE2";
        if (!RE2::PartialMatch(v, re)) return path + ": does not match pattern";
      }
      if (s.contains("format") && !ValidFormat(s["format"], v)) {
        return path + ": not a valid " + s["format"].get<std::string>() + ": " + v;
      }
    }
    if (x.is_number()) {
      const double v = x.get<double>();
      if (s.contains("minimum") && v < s["minimum"].get<double>())
        return path + ": below minimum";
      if (s.contains("maximum") && v > s["maximum"].get<double>())
        return path + ": above maximum";
      if (s.contains("exclusiveMinimum") && v <= s["exclusiveMinimum"].get<double>()) {
        return path + ": not above exclusiveMinimum";
      }
      if (s.contains("exclusiveMaximum") && v >= s["exclusiveMaximum"].get<double>()) {
        return path + ": not below exclusiveMaximum";
      }
    }
    if (x.is_object()) {
      if (s.contains("required")) {
        for (const json& r : s["required"]) {
          if (!x.contains(r.get<std::string>()))
            return path + ": missing " + r.get<std::string>();
        }
      }
      for (auto it = x.begin(); it != x.end(); ++it) {
        const std::string p = path + "/" + it.key();
        if (s.contains("properties") && s["properties"].contains(it.key())) {
          std::string e = Check(s["properties"][it.key()], it.value(), p, depth + 1);
          if (!e.empty()) return e;
        } else if (s.contains("additionalProperties")) {
          std::string e = Check(s["additionalProperties"], it.value(), p, depth + 1);
          if (!e.empty()) return e;
        }
      }
    }
    if (x.is_array()) {
      size_t prefix = 0;
      if (s.contains("prefixItems")) {
        prefix = s["prefixItems"].size();
        for (size_t i = 0; i < prefix && i < x.size(); ++i) {
          std::string e = Check(s["prefixItems"][i], x[i],
                                path + "/" + std::to_string(i), depth + 1);
          if (!e.empty()) return e;
        }
      }
      if (s.contains("items")) {
        for (size_t i = prefix; i < x.size(); ++i) {
          std::string e =
              Check(s["items"], x[i], path + "/" + std::to_string(i), depth + 1);
          if (!e.empty()) return e;
        }
      }
      if (s.contains("minItems") && x.size() < s["minItems"].get<size_t>())
        return path + ": too few items";
      if (s.contains("maxItems") && x.size() > s["maxItems"].get<size_t>())
        return path + ": too many items";
    }
    return "";
  }

 private:
  static bool HasType(const json& x, const std::string& t) {
    if (t == "string") return x.is_string();
    if (t == "boolean") return x.is_boolean();
    if (t == "null") return x.is_null();
    if (t == "object") return x.is_object();
    if (t == "array") return x.is_array();
    if (t == "number") return x.is_number();
    if (t == "integer") {
      return x.is_number_integer() ||
             (x.is_number_float() && std::floor(x.get<double>()) == x.get<double>());
    }
    return false;
  }

  const json* Resolve(const std::string& ref) {
    if (ref == "#") return &root_;
    if (ref.rfind("#/", 0) != 0) return nullptr;
    try {
      std::string ptr = ref.substr(1);
      return &root_.at(json::json_pointer(ptr));
    } catch (const std::exception&) {
      return nullptr;
    }
  }

  const json& root_;
};

}  // namespace

std::string Validate(const json& schema, const json& instance) {
  return Validator(schema).Check(schema, instance, "", 0);
}

}  // namespace tandem::grammar::testing
