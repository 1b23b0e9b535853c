#include "engine/grammar/json_schema.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/grammar/regex_parser.h"
#include "nlohmann/json.hpp"

namespace tandem::grammar {
namespace {

using Json = nlohmann::ordered_json;

constexpr int64_t kMaxMagnitude = 999999999999999;  // 15 digits

const absl::flat_hash_set<std::string>& Annotations() {
  static const auto* k = new absl::flat_hash_set<std::string>{
      "title", "description", "default",         "examples",        "$schema",
      "$id",   "$comment",    "deprecated",      "readOnly",        "writeOnly",
      "$defs", "definitions", "contentEncoding", "contentMediaType"};
  return *k;
}

const absl::flat_hash_set<std::string>& Supported() {
  static const auto* k = new absl::flat_hash_set<std::string>{"type",
                                                              "properties",
                                                              "required",
                                                              "additionalProperties",
                                                              "items",
                                                              "prefixItems",
                                                              "enum",
                                                              "const",
                                                              "anyOf",
                                                              "oneOf",
                                                              "allOf",
                                                              "$ref",
                                                              "pattern",
                                                              "format",
                                                              "minLength",
                                                              "maxLength",
                                                              "minItems",
                                                              "maxItems",
                                                              "minimum",
                                                              "maximum",
                                                              "exclusiveMinimum",
                                                              "exclusiveMaximum",
                                                              "nullable"};
  return *k;
}

absl::Status Invalid(absl::string_view msg) {
  return absl::InvalidArgumentError(absl::StrCat("JSON Schema: ", msg));
}

// JSON string characters that never need escaping.
CodepointRanges PlainStringChars() {
  return NormalizeRanges({{0x20, 0x21}, {0x23, 0x5B}, {0x5D, kMaxCodepoint}});
}

ExprPtr HexDigit() { return Codepoints({{'0', '9'}, {'A', 'F'}, {'a', 'f'}}); }

// One JSON string character: plain or an escape (no lone surrogates).
ExprPtr StringChar() {
  static const ExprPtr* k = [] {
    ExprPtr simple = Seq({Bytes("\\"), Codepoints({{'"', '"'},
                                                   {'\\', '\\'},
                                                   {'/', '/'},
                                                   {'b', 'b'},
                                                   {'f', 'f'},
                                                   {'n', 'n'},
                                                   {'r', 'r'},
                                                   {'t', 't'}})});
    ExprPtr non_surrogate = Alt(
        {Seq({Codepoints({{'0', '9'}, {'A', 'C'}, {'E', 'F'}, {'a', 'c'}, {'e', 'f'}}),
              HexDigit(), HexDigit(), HexDigit()}),
         Seq({Codepoints({{'D', 'D'}, {'d', 'd'}}), Codepoints({{'0', '7'}}),
              HexDigit(), HexDigit()})});
    ExprPtr unicode = Seq({Bytes("\\u"), non_surrogate});
    return new ExprPtr(Alt({Codepoints(PlainStringChars()), simple, unicode}));
  }();
  return *k;
}

ExprPtr Digits(int min, int max) { return Repeat(Codepoints({{'0', '9'}}), min, max); }

std::string AllDigits(char d, size_t n) { return std::string(n, d); }

// Digit strings of one width between a and b (same length, leading zeros
// allowed inside).
ExprPtr FixedWidth(const std::string& a, const std::string& b) {
  if (a.empty()) return Empty();
  if (a == b) return Bytes(a);
  if (a[0] == b[0]) {
    return Seq({Bytes(a.substr(0, 1)), FixedWidth(a.substr(1), b.substr(1))});
  }
  const size_t rest = a.size() - 1;
  std::vector<ExprPtr> alts;
  char mid_lo = a[0] + 1, mid_hi = b[0] - 1;
  if (a.substr(1) == AllDigits('0', rest)) {
    mid_lo = a[0];
  } else {
    alts.push_back(
        Seq({Bytes(a.substr(0, 1)), FixedWidth(a.substr(1), AllDigits('9', rest))}));
  }
  bool high_merged = b.substr(1) == AllDigits('9', rest);
  if (high_merged) mid_hi = b[0];
  if (mid_lo <= mid_hi) {
    alts.push_back(Seq(
        {Codepoints({{static_cast<uint32_t>(mid_lo), static_cast<uint32_t>(mid_hi)}}),
         Digits(static_cast<int>(rest), static_cast<int>(rest))}));
  }
  if (!high_merged) {
    alts.push_back(
        Seq({Bytes(b.substr(0, 1)), FixedWidth(AllDigits('0', rest), b.substr(1))}));
  }
  return Alt(std::move(alts));
}

ExprPtr NonNegativeRange(int64_t a, int64_t b) {
  std::vector<ExprPtr> alts;
  int64_t width_lo = 0, width_hi = 9;
  for (int n = 1; n <= 19 && width_lo <= b; ++n) {
    int64_t lo = std::max(a, width_lo), hi = std::min(b, width_hi);
    if (lo <= hi) alts.push_back(FixedWidth(std::to_string(lo), std::to_string(hi)));
    if (width_hi > INT64_MAX / 10) break;
    width_lo = width_hi + 1;
    width_hi = width_hi * 10 + 9;
  }
  if (alts.empty()) return Codepoints({});
  return Alt(std::move(alts));
}

}  // namespace

ExprPtr IntegerRange(int64_t lo, int64_t hi) {
  std::vector<ExprPtr> alts;
  if (lo > hi) return Codepoints({});
  if (lo < 0) {
    int64_t mag_lo = hi < 0 ? -hi : 1;
    alts.push_back(Seq({Bytes("-"), NonNegativeRange(mag_lo, -lo)}));
  }
  if (hi >= 0) alts.push_back(NonNegativeRange(std::max<int64_t>(lo, 0), hi));
  return Alt(std::move(alts));
}

namespace {

class SchemaCompiler {
 public:
  explicit SchemaCompiler(const CompileLimits& limits) : limits_(limits) {
    const uint32_t n = std::max(0, limits.json_max_whitespace);
    std::bitset<256> ws;
    for (char c : {' ', '\n', '\t', '\r'}) ws.set(static_cast<uint8_t>(c));
    ws_ = n == 0 ? Empty() : Repeat(ByteSet(ws), 0, static_cast<int>(n));
  }

  absl::StatusOr<Grammar> CompileDocument(absl::string_view text) {
    Json doc = Json::parse(text.begin(), text.end(), nullptr,
                           /*allow_exceptions=*/false);
    if (doc.is_discarded()) return Invalid("the schema is not valid JSON");
    root_ = std::move(doc);
    int root = g_.RuleId("root");
    auto e = Compile(root_, 0);
    if (!e.ok()) return e.status();
    g_.bodies[root] = *e;
    g_.root = root;
    return std::move(g_);
  }

  Grammar ObjectDocument() {
    int root = g_.RuleId("root");
    g_.bodies[root] = Ref(AnyObjectRule());
    g_.root = root;
    return std::move(g_);
  }

 private:
  ExprPtr Sep() { return Seq({ws_, Bytes(","), ws_}); }

  // ----- any JSON value (recursive rules) -----
  ExprPtr JsonString() { return Seq({Bytes("\""), Star(StringChar()), Bytes("\"")}); }
  ExprPtr JsonNumber() {
    return Seq({Optional(Bytes("-")),
                Alt({Bytes("0"), Seq({Codepoints({{'1', '9'}}),
                                      Digits(0, kMaxJsonIntegerDigits - 1)})}),
                Optional(Seq({Bytes("."), Digits(1, kMaxJsonIntegerDigits)})),
                Optional(Seq({Codepoints({{'e', 'e'}, {'E', 'E'}}),
                              Optional(Codepoints({{'+', '+'}, {'-', '-'}})),
                              Digits(1, 2)}))});
  }
  int AnyValueRule() {
    if (any_value_ >= 0) return any_value_;
    any_value_ = g_.RuleId("any_value");
    int object = AnyObjectRule();
    int array = g_.RuleId("any_array");
    g_.bodies[array] =
        Seq({Bytes("["), ws_,
             Optional(Seq({Ref(any_value_), Star(Seq({Sep(), Ref(any_value_)}))})), ws_,
             Bytes("]")});
    g_.bodies[any_value_] = Alt({Ref(object), Ref(array), JsonString(), JsonNumber(),
                                 Bytes("true"), Bytes("false"), Bytes("null")});
    return any_value_;
  }
  int AnyObjectRule() {
    if (any_object_ >= 0) return any_object_;
    any_object_ = g_.RuleId("any_object");
    int value = AnyValueRule();
    ExprPtr member = Seq({JsonString(), ws_, Bytes(":"), ws_, Ref(value)});
    g_.bodies[any_object_] =
        Seq({Bytes("{"), ws_, Optional(Seq({member, Star(Seq({Sep(), member}))})), ws_,
             Bytes("}")});
    return any_object_;
  }

  // ----- $ref -----
  absl::StatusOr<const Json*> Resolve(const std::string& ref) {
    if (ref.empty() || ref[0] != '#') {
      return Invalid(absl::StrCat("unsupported feature: remote or relative $ref '", ref,
                                  "' (only '#...' pointers into this schema)"));
    }
    const Json* cur = &root_;
    std::string pointer = ref.substr(1);
    if (pointer.empty()) return cur;
    if (pointer[0] != '/') {
      return Invalid(
          absl::StrCat("unsupported feature: $ref to an anchor '", ref, "'"));
    }
    size_t pos = 1;
    while (pos <= pointer.size()) {
      size_t next = pointer.find('/', pos);
      if (next == std::string::npos) next = pointer.size();
      std::string token = pointer.substr(pos, next - pos);
      std::string unescaped;
      for (size_t k = 0; k < token.size(); ++k) {
        if (token[k] == '~' && k + 1 < token.size()) {
          unescaped += token[k + 1] == '1' ? '/' : '~';
          ++k;
        } else {
          unescaped += token[k];
        }
      }
      if (cur->is_object() && cur->contains(unescaped)) {
        cur = &(*cur)[unescaped];
      } else if (cur->is_array() && !unescaped.empty() &&
                 std::all_of(unescaped.begin(), unescaped.end(), ::isdigit) &&
                 std::stoul(unescaped) < cur->size()) {
        cur = &(*cur)[std::stoul(unescaped)];
      } else {
        return Invalid(absl::StrCat("$ref '", ref, "' does not resolve"));
      }
      pos = next + 1;
    }
    return cur;
  }

  absl::StatusOr<ExprPtr> CompileRef(const std::string& ref, int depth) {
    auto it = ref_rules_.find(ref);
    if (it != ref_rules_.end()) return Ref(it->second);
    auto target = Resolve(ref);
    if (!target.ok()) return target.status();
    int rule = g_.NewRule(absl::StrCat("ref:", ref));
    ref_rules_[ref] = rule;
    auto body = Compile(**target, depth + 1);
    if (!body.ok()) return body;
    g_.bodies[rule] = *body;
    return Ref(rule);
  }

  // ----- allOf merging -----
  absl::StatusOr<Json> Deref(const Json& s, int depth) {
    if (depth > limits_.max_nesting_depth) {
      return absl::ResourceExhaustedError("JSON Schema: nested too deeply");
    }
    if (s.is_object() && s.contains("$ref")) {
      if (!s["$ref"].is_string()) return Invalid("$ref must be a string");
      auto t = Resolve(s["$ref"].get<std::string>());
      if (!t.ok()) return t.status();
      Json rest = s;
      rest.erase("$ref");
      auto inner = Deref(**t, depth + 1);
      if (!inner.ok()) return inner;
      return Merge(*inner, rest, depth + 1);
    }
    return s;
  }

  absl::StatusOr<Json> Merge(const Json& a_in, const Json& b_in, int depth) {
    if (a_in.is_boolean() && a_in.get<bool>()) return b_in;
    if (b_in.is_boolean() && b_in.get<bool>()) return a_in;
    if (!a_in.is_object() || !b_in.is_object()) {
      return Invalid("unsupported feature: allOf with a false schema");
    }
    auto a_d = Deref(a_in, depth + 1);
    if (!a_d.ok()) return a_d;
    auto b_d = Deref(b_in, depth + 1);
    if (!b_d.ok()) return b_d;
    Json out = *a_d;
    for (auto it = b_d->begin(); it != b_d->end(); ++it) {
      const std::string& k = it.key();
      const Json& v = it.value();
      if (!out.contains(k) || Annotations().contains(k)) {
        if (!out.contains(k)) out[k] = v;
        continue;
      }
      Json& cur = out[k];
      if (cur == v) continue;
      if (k == "properties" && cur.is_object() && v.is_object()) {
        for (auto p = v.begin(); p != v.end(); ++p) {
          if (!cur.contains(p.key())) {
            cur[p.key()] = p.value();
          } else {
            auto m = Merge(cur[p.key()], p.value(), depth + 1);
            if (!m.ok()) return m;
            cur[p.key()] = *m;
          }
        }
      } else if (k == "required" && cur.is_array() && v.is_array()) {
        for (const auto& r : v) {
          if (std::find(cur.begin(), cur.end(), r) == cur.end()) cur.push_back(r);
        }
      } else if ((k == "minLength" || k == "minItems" || k == "minimum" ||
                  k == "exclusiveMinimum") &&
                 cur.is_number() && v.is_number()) {
        if (v.get<double>() > cur.get<double>()) cur = v;
      } else if ((k == "maxLength" || k == "maxItems" || k == "maximum" ||
                  k == "exclusiveMaximum") &&
                 cur.is_number() && v.is_number()) {
        if (v.get<double>() < cur.get<double>()) cur = v;
      } else if (k == "additionalProperties" &&
                 ((cur.is_boolean() && !cur.get<bool>()) ||
                  (v.is_boolean() && !v.get<bool>()))) {
        cur = false;
      } else if (k == "type") {
        auto types = [](const Json& t) {
          std::vector<std::string> out;
          if (t.is_string()) out.push_back(t.get<std::string>());
          if (t.is_array()) {
            for (const auto& x : t) {
              if (x.is_string()) out.push_back(x.get<std::string>());
            }
          }
          return out;
        };
        std::vector<std::string> ta = types(cur), tb = types(v), both;
        for (const auto& t : ta) {
          bool in_b =
              std::find(tb.begin(), tb.end(), t) != tb.end() ||
              (t == "integer" && std::find(tb.begin(), tb.end(), "number") != tb.end());
          if (in_b) both.push_back(t);
        }
        for (const auto& t : tb) {
          if (t == "integer" && std::find(ta.begin(), ta.end(), "number") != ta.end() &&
              std::find(both.begin(), both.end(), "integer") == both.end()) {
            both.push_back(t);
          }
        }
        if (both.empty())
          return Invalid("allOf: the subschemas' types do not intersect");
        cur = both.size() == 1 ? Json(both[0]) : Json(both);
      } else {
        return Invalid(
            absl::StrCat("unsupported feature: allOf subschemas that disagree on '", k,
                         "' cannot be merged"));
      }
    }
    // additionalProperties: false on one side forbids the other side's
    // extra properties (JSON Schema evaluates each subschema on its own).
    for (const Json* side : {&*a_d, &*b_d}) {
      if (!side->contains("additionalProperties") ||
          !(*side)["additionalProperties"].is_boolean() ||
          (*side)["additionalProperties"].get<bool>()) {
        continue;
      }
      const Json none = Json::object();
      const Json& allowed = side->contains("properties") ? (*side)["properties"] : none;
      if (out.contains("properties")) {
        Json kept = Json::object();
        for (auto p = out["properties"].begin(); p != out["properties"].end(); ++p) {
          if (allowed.contains(p.key())) kept[p.key()] = p.value();
        }
        out["properties"] = kept;
      }
      if (out.contains("required")) {
        for (const Json& r : out["required"]) {
          if (r.is_string() && !allowed.contains(r.get<std::string>())) {
            return Invalid(absl::StrCat(
                "allOf: required property '", r.get<std::string>(),
                "' is excluded by another subschema's additionalProperties: false"));
          }
        }
      }
    }
    return out;
  }

  // ----- the main dispatch -----
  absl::StatusOr<ExprPtr> Compile(const Json& s, int depth) {
    if (depth > limits_.max_nesting_depth) {
      return absl::ResourceExhaustedError(
          absl::StrCat("JSON Schema: nested deeper than ", limits_.max_nesting_depth));
    }
    if (s.is_boolean()) {
      if (s.get<bool>()) return Ref(AnyValueRule());
      return Invalid("unsupported feature: the false schema (matches nothing)");
    }
    if (!s.is_object()) return Invalid("a schema must be an object or a boolean");
    for (auto it = s.begin(); it != s.end(); ++it) {
      if (!Annotations().contains(it.key()) && !Supported().contains(it.key())) {
        return Invalid(absl::StrCat("unsupported feature: keyword '", it.key(), "'"));
      }
    }
    if (s.contains("allOf")) {
      const Json& all = s["allOf"];
      if (!all.is_array() || all.empty())
        return Invalid("allOf must be a non-empty array");
      Json merged = s;
      merged.erase("allOf");
      for (const Json& sub : all) {
        auto m = Merge(merged, sub, depth + 1);
        if (!m.ok()) return m.status();
        merged = std::move(*m);
      }
      return Compile(merged, depth + 1);
    }
    if (s.contains("$ref")) {
      if (!s["$ref"].is_string()) return Invalid("$ref must be a string");
      for (auto it = s.begin(); it != s.end(); ++it) {
        if (it.key() != "$ref" && !Annotations().contains(it.key())) {
          // Keywords beside $ref: merge them into the target.
          auto d = Deref(s, depth + 1);
          if (!d.ok()) return d.status();
          return Compile(*d, depth + 1);
        }
      }
      return CompileRef(s["$ref"].get<std::string>(), depth);
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      if (!s.contains(key)) continue;
      const Json& branches = s[key];
      if (!branches.is_array() || branches.empty()) {
        return Invalid(absl::StrCat(key, " must be a non-empty array"));
      }
      Json siblings = s;
      siblings.erase(key);
      bool plain = true;
      for (auto it = siblings.begin(); it != siblings.end(); ++it) {
        if (!Annotations().contains(it.key())) plain = false;
      }
      std::vector<ExprPtr> alts;
      for (const Json& b : branches) {
        absl::StatusOr<ExprPtr> e;
        if (plain) {
          e = Compile(b, depth + 1);
        } else {
          auto m = Merge(siblings, b, depth + 1);
          if (!m.ok()) return m.status();
          e = Compile(*m, depth + 1);
        }
        if (!e.ok()) return e;
        alts.push_back(*e);
      }
      return Alt(std::move(alts));
    }
    if (s.contains("const")) return Bytes(s["const"].dump());
    if (s.contains("enum")) {
      const Json& values = s["enum"];
      if (!values.is_array() || values.empty())
        return Invalid("enum must be a non-empty array");
      std::vector<ExprPtr> alts;
      for (const Json& v : values) alts.push_back(Bytes(v.dump()));
      return Alt(std::move(alts));
    }
    std::vector<std::string> types;
    if (s.contains("type")) {
      const Json& t = s["type"];
      if (t.is_string()) {
        types.push_back(t.get<std::string>());
      } else if (t.is_array() && !t.empty()) {
        for (const Json& x : t) {
          if (!x.is_string()) return Invalid("type entries must be strings");
          types.push_back(x.get<std::string>());
        }
      } else {
        return Invalid("type must be a string or a non-empty array");
      }
    } else {
      types = InferTypes(s);
    }
    if (s.contains("nullable") && s["nullable"].is_boolean() &&
        s["nullable"].get<bool>() &&
        std::find(types.begin(), types.end(), "null") == types.end() &&
        !types.empty()) {
      types.push_back("null");
    }
    if (types.empty()) return Ref(AnyValueRule());
    std::vector<ExprPtr> alts;
    for (const std::string& t : types) {
      absl::StatusOr<ExprPtr> e;
      if (t == "string") {
        e = CompileString(s);
      } else if (t == "integer") {
        e = CompileNumber(s, /*integer=*/true);
      } else if (t == "number") {
        e = CompileNumber(s, /*integer=*/false);
      } else if (t == "boolean") {
        e = Alt({Bytes("true"), Bytes("false")});
      } else if (t == "null") {
        e = Bytes("null");
      } else if (t == "object") {
        e = CompileObject(s, depth);
      } else if (t == "array") {
        e = CompileArray(s, depth);
      } else {
        return Invalid(absl::StrCat("unknown type '", t, "'"));
      }
      if (!e.ok()) return e;
      alts.push_back(*e);
    }
    return Alt(std::move(alts));
  }

  static std::vector<std::string> InferTypes(const Json& s) {
    std::vector<std::string> t;
    auto has = [&](std::initializer_list<const char*> keys) {
      for (const char* k : keys) {
        if (s.contains(k)) return true;
      }
      return false;
    };
    if (has({"properties", "required", "additionalProperties"})) t.push_back("object");
    if (has({"items", "prefixItems", "minItems", "maxItems"})) t.push_back("array");
    if (has({"pattern", "format", "minLength", "maxLength"})) t.push_back("string");
    if (has({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})) {
      t.push_back("number");
    }
    return t;
  }

  absl::StatusOr<int64_t> NonNegativeInt(const Json& s, const char* key, int64_t def) {
    if (!s.contains(key)) return def;
    const Json& v = s[key];
    if (!v.is_number_integer() &&
        !(v.is_number_float() && v.get<double>() == std::floor(v.get<double>()))) {
      return Invalid(absl::StrCat(key, " must be a non-negative integer"));
    }
    double d = v.get<double>();
    if (d < 0) return Invalid(absl::StrCat(key, " must be a non-negative integer"));
    return d > 1e9 ? int64_t{1000000000} : static_cast<int64_t>(d);
  }

  absl::StatusOr<ExprPtr> Format(const std::string& f) {
    std::string re;
    const std::string d2 = "[0-9]{2}";
    const std::string date =
        "[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|"
        "(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))";
    const std::string time =
        "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,6})?"
        "(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])";
    if (f == "date") {
      re = date;
    } else if (f == "time") {
      re = time;
    } else if (f == "date-time") {
      re = date + "T" + time;
    } else if (f == "uuid") {
      re =
          "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}";
    } else if (f == "email") {
      re = "[a-zA-Z0-9_+-]{1,32}(?:\\.[a-zA-Z0-9_+-]{1,32}){0,3}@"
           "(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,30}[a-zA-Z0-9])?\\.){1,3}"
           "[a-zA-Z](?:[a-zA-Z0-9-]{0,30}[a-zA-Z0-9])?";
    } else if (f == "ipv4") {
      const std::string octet = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])";
      re = octet + "\\." + octet + "\\." + octet + "\\." + octet;
    } else {
      return Invalid(absl::StrCat("unsupported feature: format '", f, "'"));
    }
    RegexOptions o;
    auto parsed = ParseRegex(re, o);
    if (!parsed.ok()) return parsed.status();
    return parsed->expr;
  }

  absl::StatusOr<ExprPtr> CompileString(const Json& s) {
    const bool has_len = s.contains("minLength") || s.contains("maxLength");
    if (s.contains("format")) {
      if (!s["format"].is_string()) return Invalid("format must be a string");
      if (s.contains("pattern") || has_len) {
        return Invalid(
            "unsupported feature: format together with pattern or minLength/maxLength");
      }
      auto f = Format(s["format"].get<std::string>());
      if (!f.ok()) return f;
      return Seq({Bytes("\""), *f, Bytes("\"")});
    }
    if (s.contains("pattern")) {
      if (!s["pattern"].is_string()) return Invalid("pattern must be a string");
      if (has_len) {
        return Invalid(
            "unsupported feature: pattern together with minLength/maxLength");
      }
      RegexOptions o;
      o.max_depth = limits_.max_nesting_depth;
      o.universe = PlainStringChars();
      auto parsed = ParseRegex(s["pattern"].get<std::string>(), o);
      if (!parsed.ok()) {
        return absl::Status(
            parsed.status().code(),
            absl::StrCat("JSON Schema pattern: ", parsed.status().message()));
      }
      // ECMAScript patterns search: an unanchored side admits any text.
      ExprPtr any = Star(Codepoints(PlainStringChars()));
      return Seq({Bytes("\""), parsed->anchored_start ? Empty() : any, parsed->expr,
                  parsed->anchored_end ? Empty() : any, Bytes("\"")});
    }
    auto min = NonNegativeInt(s, "minLength", 0);
    if (!min.ok()) return min.status();
    auto max = NonNegativeInt(s, "maxLength", kUnbounded);
    if (!max.ok()) return max.status();
    if (*max != kUnbounded && *max < *min) return Invalid("maxLength < minLength");
    if (*min > 10000 || *max > 10000) {
      return absl::ResourceExhaustedError(
          "JSON Schema: string length bound over 10000");
    }
    return Seq({Bytes("\""),
                Repeat(StringChar(), static_cast<int>(*min), static_cast<int>(*max)),
                Bytes("\"")});
  }

  absl::StatusOr<ExprPtr> CompileNumber(const Json& s, bool integer) {
    auto bound = [&](const char* key, double* out) -> absl::StatusOr<bool> {
      if (!s.contains(key)) return false;
      if (!s[key].is_number()) return Invalid(absl::StrCat(key, " must be a number"));
      *out = s[key].get<double>();
      return true;
    };
    double lo = -static_cast<double>(kMaxMagnitude),
           hi = static_cast<double>(kMaxMagnitude);
    bool lo_strict = false, hi_strict = false, bounded = false;
    double v;
    for (auto [key, is_lo, strict] : {std::tuple{"minimum", true, false},
                                      std::tuple{"exclusiveMinimum", true, true},
                                      std::tuple{"maximum", false, false},
                                      std::tuple{"exclusiveMaximum", false, true}}) {
      auto has = bound(key, &v);
      if (!has.ok()) return has.status();
      if (!*has) continue;
      bounded = true;
      if (is_lo && (v > lo || (v == lo && strict))) {
        lo = v;
        lo_strict = strict;
      }
      if (!is_lo && (v < hi || (v == hi && strict))) {
        hi = v;
        hi_strict = strict;
      }
    }
    const double cap = static_cast<double>(kMaxMagnitude);
    lo = std::max(lo, -cap);
    hi = std::min(hi, cap);
    // Integer values: lo <= k <= hi (strict where exclusive).
    int64_t ilo = static_cast<int64_t>(lo_strict ? std::floor(lo) + 1 : std::ceil(lo));
    int64_t ihi = static_cast<int64_t>(hi_strict ? std::ceil(hi) - 1 : std::floor(hi));
    if (integer || !bounded) {
      if (integer) {
        if (ilo > ihi) return Invalid("no integer satisfies minimum/maximum");
        return IntegerRange(ilo, ihi);
      }
      return JsonNumber();
    }
    std::vector<ExprPtr> alts;
    if (ilo <= ihi) alts.push_back(IntegerRange(ilo, ihi));
    ExprPtr frac = Seq({Bytes("."), Digits(1, kMaxJsonIntegerDigits)});
    // k.ddd (k >= 0) lies in [k, k+1): needs k >= lo (k > lo strict), k+1 <= hi.
    int64_t p_lo = std::max<int64_t>(0, ilo);
    int64_t p_hi = static_cast<int64_t>(std::floor(hi)) - 1;
    if (p_lo <= p_hi) alts.push_back(Seq({NonNegativeRange(p_lo, p_hi), frac}));
    // -k.ddd (k >= 0) lies in (-(k+1), -k]: needs -(k+1) >= lo, -k <= hi (< strict).
    int64_t n_hi = static_cast<int64_t>(std::floor(-lo)) - 1;
    int64_t n_lo = std::max<int64_t>(
        0, static_cast<int64_t>(hi_strict ? std::floor(-hi) + 1 : std::ceil(-hi)));
    if (n_lo <= n_hi)
      alts.push_back(Seq({Bytes("-"), NonNegativeRange(n_lo, n_hi), frac}));
    if (alts.empty()) return Invalid("no number satisfies minimum/maximum");
    return Alt(std::move(alts));
  }

  absl::StatusOr<ExprPtr> CompileObject(const Json& s, int depth) {
    std::vector<std::pair<std::string, const Json*>> props;
    if (s.contains("properties")) {
      if (!s["properties"].is_object()) return Invalid("properties must be an object");
      for (auto it = s["properties"].begin(); it != s["properties"].end(); ++it) {
        props.push_back({it.key(), &it.value()});
      }
    }
    absl::flat_hash_set<std::string> required;
    if (s.contains("required")) {
      if (!s["required"].is_array()) return Invalid("required must be an array");
      for (const Json& r : s["required"]) {
        if (!r.is_string()) return Invalid("required entries must be strings");
        required.insert(r.get<std::string>());
      }
    }
    const Json* additional =
        s.contains("additionalProperties") ? &s["additionalProperties"] : nullptr;
    const bool no_additional =
        additional != nullptr && additional->is_boolean() && !additional->get<bool>();
    static const Json kAny = Json::object();
    for (const std::string& r : required) {
      bool declared = false;
      for (const auto& p : props) declared = declared || p.first == r;
      if (!declared) {
        if (no_additional) {
          return Invalid(
              absl::StrCat("required property '", r,
                           "' is not in properties and additionalProperties is false"));
        }
        props.push_back(
            {r, additional != nullptr && additional->is_object() ? additional : &kAny});
      }
    }
    if (props.empty()) {
      if (no_additional) return Bytes("{}");  // the empty object only
      ExprPtr value;
      if (additional != nullptr && additional->is_object()) {
        auto v = Compile(*additional, depth + 1);
        if (!v.ok()) return v;
        value = *v;
      } else {
        value = Ref(AnyValueRule());
      }
      ExprPtr member = Seq({JsonString(), ws_, Bytes(":"), ws_, value});
      return Seq({Bytes("{"), ws_, Optional(Seq({member, Star(Seq({Sep(), member}))})),
                  ws_, Bytes("}")});
    }
    // Properties in schema order; optional ones may be left out.
    std::vector<ExprPtr> members;
    std::vector<bool> req;
    for (const auto& [name, schema] : props) {
      auto v = Compile(*schema, depth + 1);
      if (!v.ok()) return v;
      members.push_back(Seq({Bytes(Json(name).dump()), ws_, Bytes(":"), ws_, *v}));
      req.push_back(required.contains(name));
    }
    const size_t n = members.size();
    // after[i]: members i.. given that one was already written.
    // first[i]: members i.. given that none was written yet.
    std::vector<ExprPtr> after(n + 1), first(n + 1);
    after[n] = Empty();
    first[n] = Empty();
    for (size_t i = n; i-- > 0;) {
      ExprPtr with = Seq({Sep(), members[i], after[i + 1]});
      after[i] = req[i] ? with : Alt({with, after[i + 1]});
      ExprPtr lead = Seq({members[i], after[i + 1]});
      first[i] = req[i] ? lead : Alt({lead, first[i + 1]});
    }
    return Seq({Bytes("{"), ws_, first[0], ws_, Bytes("}")});
  }

  absl::StatusOr<ExprPtr> CompileArray(const Json& s, int depth) {
    std::vector<ExprPtr> prefix;
    if (s.contains("prefixItems")) {
      if (!s["prefixItems"].is_array()) return Invalid("prefixItems must be an array");
      for (const Json& p : s["prefixItems"]) {
        auto e = Compile(p, depth + 1);
        if (!e.ok()) return e;
        prefix.push_back(*e);
      }
    }
    ExprPtr item;  // nullptr: no items beyond the prefix
    if (s.contains("items")) {
      const Json& it = s["items"];
      if (it.is_array()) {
        return Invalid(
            "unsupported feature: items as an array (draft-07 tuples; use "
            "prefixItems)");
      }
      if (!(it.is_boolean() && !it.get<bool>())) {
        auto e = Compile(it, depth + 1);
        if (!e.ok()) return e;
        item = *e;
      }
    } else {
      item = Ref(AnyValueRule());
    }
    auto min = NonNegativeInt(s, "minItems", 0);
    if (!min.ok()) return min.status();
    auto max = NonNegativeInt(s, "maxItems", kUnbounded);
    if (!max.ok()) return max.status();
    const int64_t k = static_cast<int64_t>(prefix.size());
    if (item == nullptr) *max = *max == kUnbounded ? k : std::min<int64_t>(*max, k);
    if (*max != kUnbounded && *max < *min)
      return Invalid("maxItems < minItems (or too few items allowed)");
    if (*min > 1000 || *max > 1000) {
      return absl::ResourceExhaustedError("JSON Schema: item count bound over 1000");
    }
    // The items after the prefix: count in [max(0, min-k), max-k].
    ExprPtr rest = Empty();
    if (item != nullptr && (*max == kUnbounded || *max > k)) {
      int cmin = static_cast<int>(std::max<int64_t>(0, *min - k));
      int cmax = *max == kUnbounded ? kUnbounded : static_cast<int>(*max - k);
      if (k > 0) {
        rest = Repeat(Seq({Sep(), item}), cmin, cmax);
      } else {
        ExprPtr more = Repeat(Seq({Sep(), item}), std::max(0, cmin - 1),
                              cmax == kUnbounded ? kUnbounded : cmax - 1);
        ExprPtr some = Seq({item, more});
        rest = cmin > 0 ? some : Optional(some);
      }
    }
    ExprPtr tail = rest;
    for (int64_t i = std::min<int64_t>(k, *max == kUnbounded ? k : *max); i-- > 0;) {
      ExprPtr present = Seq({i > 0 ? Sep() : Empty(), prefix[i], tail});
      tail = i >= *min ? Optional(present) : present;
    }
    return Seq({Bytes("["), ws_, tail, ws_, Bytes("]")});
  }

  CompileLimits limits_;
  Grammar g_;
  Json root_;
  ExprPtr ws_;
  int any_value_ = -1;
  int any_object_ = -1;
  absl::flat_hash_map<std::string, int> ref_rules_;
};

}  // namespace

absl::StatusOr<Grammar> JsonSchemaToGrammar(absl::string_view schema_json,
                                            const CompileLimits& limits) {
  return SchemaCompiler(limits).CompileDocument(schema_json);
}

Grammar JsonObjectGrammar(const CompileLimits& limits) {
  return SchemaCompiler(limits).ObjectDocument();
}

}  // namespace tandem::grammar
