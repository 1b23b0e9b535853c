#include "engine/grammar/schema_corpus.h"

#include <algorithm>
#include <map>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace tandem::grammar {
namespace {

using Json = nlohmann::ordered_json;

class Builder {
 public:
  void Add(const std::string& feature, const Json& schema) {
    int n = ++counts_[feature];
    out_.push_back({absl::StrCat(feature, "/", n), feature, schema.dump()});
  }
  std::vector<CorpusSchema> Take() { return std::move(out_); }

 private:
  std::vector<CorpusSchema> out_;
  std::map<std::string, int> counts_;
};

Json J(const char* text) { return Json::parse(text); }

// A seeded random schema of bounded depth (only supported features, oneOf
// branches disjoint by type so that "exactly one" holds).
Json RandomSchema(std::mt19937* rng, int depth) {
  auto pick = [&](int n) { return static_cast<int>((*rng)() % n); };
  const int kinds = depth <= 0 ? 6 : 10;
  switch (pick(kinds)) {
    case 0: {
      Json s = {{"type", "string"}};
      if (pick(2)) s["maxLength"] = 1 + pick(12);
      if (pick(3) == 0) s["minLength"] = pick(3);
      return s;
    }
    case 1: {
      Json s = {{"type", "integer"}};
      if (pick(2)) s["minimum"] = pick(50) - 25;
      if (pick(2)) s["maximum"] = 30 + pick(1000);
      return s;
    }
    case 2: {
      Json s = {{"type", "number"}};
      if (pick(2)) {
        s["minimum"] = -pick(10);
        s["maximum"] = 1 + pick(100);
      }
      return s;
    }
    case 3:
      return {{"type", "boolean"}};
    case 4: {
      Json e = Json::array();
      int n = 1 + pick(4);
      for (int i = 0; i < n; ++i) e.push_back(absl::StrCat("v", pick(100)));
      return {{"enum", e}};
    }
    case 5: {
      static const char* kFormats[] = {"date", "time",  "date-time",
                                       "uuid", "email", "ipv4"};
      return {{"type", "string"}, {"format", kFormats[pick(6)]}};
    }
    case 6:
    case 7: {
      Json props = Json::object();
      Json req = Json::array();
      int n = 1 + pick(4);
      for (int i = 0; i < n; ++i) {
        std::string name = absl::StrCat("f", i, "_", pick(10));
        props[name] = RandomSchema(rng, depth - 1);
        if (pick(2)) req.push_back(name);
      }
      Json s = {{"type", "object"}, {"properties", props}, {"required", req}};
      if (pick(2)) s["additionalProperties"] = false;
      return s;
    }
    case 8: {
      Json s = {{"type", "array"}, {"items", RandomSchema(rng, depth - 1)}};
      if (pick(2)) s["maxItems"] = 1 + pick(4);
      if (pick(3) == 0) s["minItems"] = 1;
      return s;
    }
    default: {
      Json a = RandomSchema(rng, 0);
      return {
          {"oneOf", Json::array({{{"type", "null"}},
                                 {{"type", "array"}, {"items", a}, {"maxItems", 3}}})}};
    }
  }
}

std::vector<CorpusSchema> Build() {
  Builder b;
  // Basic types.
  for (const char* t :
       {"string", "integer", "number", "boolean", "null", "object", "array"}) {
    b.Add("type", {{"type", t}});
  }
  b.Add("type", J("{}"));
  b.Add("type", J("true"));
  // String lengths.
  for (auto [lo, hi] : std::vector<std::pair<int, int>>{
           {0, 0}, {1, 1}, {0, 5}, {3, 10}, {2, 40}, {10, 20}}) {
    b.Add("string_length", {{"type", "string"}, {"minLength", lo}, {"maxLength", hi}});
  }
  b.Add("string_length", {{"type", "string"}, {"minLength", 4}});
  b.Add("string_length", {{"type", "string"}, {"maxLength", 64}});
  // Formats.
  for (const char* f : {"date", "time", "date-time", "uuid", "email", "ipv4"}) {
    b.Add("format", {{"type", "string"}, {"format", f}});
    b.Add("format", {{"type", "object"},
                     {"properties", {{"value", {{"type", "string"}, {"format", f}}}}},
                     {"required", {"value"}}});
  }
  // Patterns (no \s, whose ECMAScript and RE2 meanings differ).
  for (const char* p :
       {"^[a-z]+$", "^[A-Z]{2,3}-[0-9]{3,5}$", "^\\d{3}-\\d{4}$", "^(red|green|blue)$",
        "^[a-f0-9]{8}$", "^v[0-9]+\\.[0-9]+\\.[0-9]+$", "^\\w+@\\w+\\.com$", "^[^@]+$",
        "^(?:ab|cd){1,3}$", "^[A-Za-z ]{1,20}$", "^\\+?[0-9]{7,12}$", "abc", "^x", "y$",
        "^[0-9]{5}(-[0-9]{4})?$"}) {
    b.Add("pattern", {{"type", "string"}, {"pattern", p}});
  }
  // Integer bounds.
  for (auto [lo, hi] :
       std::vector<std::pair<int64_t, int64_t>>{{0, 9},
                                                {1, 100},
                                                {-5, 5},
                                                {-1000, -10},
                                                {7, 7},
                                                {0, 1},
                                                {100, 999},
                                                {-99, 12345},
                                                {18, 120},
                                                {1, 65535},
                                                {-2147483648LL, 2147483647LL}}) {
    b.Add("integer_bounds", {{"type", "integer"}, {"minimum", lo}, {"maximum", hi}});
  }
  b.Add("integer_bounds", {{"type", "integer"}, {"minimum", 0}});
  b.Add("integer_bounds", {{"type", "integer"}, {"maximum", -1}});
  b.Add("integer_bounds",
        {{"type", "integer"}, {"exclusiveMinimum", 0}, {"exclusiveMaximum", 10}});
  b.Add("integer_bounds",
        {{"type", "integer"}, {"exclusiveMinimum", -3}, {"maximum", 3}});
  // Number bounds.
  b.Add("number_bounds", {{"type", "number"}, {"minimum", 0}, {"maximum", 1}});
  b.Add("number_bounds", {{"type", "number"}, {"minimum", -1}, {"maximum", 1}});
  b.Add("number_bounds", {{"type", "number"}, {"minimum", 0.5}, {"maximum", 99.5}});
  b.Add("number_bounds",
        {{"type", "number"}, {"exclusiveMinimum", 0}, {"maximum", 100}});
  b.Add("number_bounds", {{"type", "number"}, {"minimum", -273.15}});
  b.Add("number_bounds", {{"type", "number"}, {"maximum", 0}});
  b.Add("number_bounds",
        {{"type", "number"}, {"minimum", -10}, {"exclusiveMaximum", -2}});
  b.Add("number_bounds", {{"type", "number"}, {"minimum", 3}, {"maximum", 3}});
  // enum / const.
  b.Add("enum", J(R"({"enum": ["a", "b", "c"]})"));
  b.Add("enum", J(R"({"enum": [1, 2.5, "x", null, true]})"));
  b.Add("enum", J(R"({"enum": [{"k": 1}, [1, 2], "q\"uote"]})"));
  b.Add("enum", J(R"({"type": "string", "enum": ["north", "south", "east", "west"]})"));
  b.Add("enum", J(R"({"enum": ["日本", "émoji 😀", "tab\tand\\slash"]})"));
  b.Add("const", J(R"({"const": "fixed"})"));
  b.Add("const", J(R"({"const": 42})"));
  b.Add("const", J(R"({"const": {"a": [1, {"b": null}]}})"));
  b.Add(
      "const",
      J(R"({"type": "object", "properties": {"kind": {"const": "event"}, "n": {"type": "integer"}}, "required": ["kind", "n"]})"));
  // Objects.
  b.Add("object",
        J(R"({"type": "object", "properties": {}, "additionalProperties": false})"));
  b.Add(
      "object",
      J(R"({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})"));
  b.Add(
      "object",
      J(R"({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}})"));
  b.Add(
      "object",
      J(R"({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "boolean"}}, "required": ["b"], "additionalProperties": false})"));
  b.Add(
      "object",
      J(R"({"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"], "additionalProperties": false})"));
  b.Add("object",
        J(R"({"type": "object", "additionalProperties": {"type": "integer"}})"));
  b.Add(
      "object",
      J(R"({"type": "object", "additionalProperties": {"type": "string", "maxLength": 5}})"));
  b.Add("object", J(R"({"type": "object", "required": ["id"]})"));
  b.Add("object", J(R"({"properties": {"q": {"type": "string"}}, "required": ["q"]})"));
  b.Add(
      "object",
      J(R"({"type": "object", "properties": {"key with space": {"type": "null"}, "ключ": {"type": "boolean"}, "q\"k": {"type": "integer"}}, "required": ["key with space", "ключ", "q\"k"]})"));
  b.Add(
      "object",
      J(R"({"type": "object", "properties": {"p1": {"type": "integer"}, "p2": {"type": "integer"}, "p3": {"type": "integer"}, "p4": {"type": "integer"}, "p5": {"type": "integer"}, "p6": {"type": "integer"}}, "additionalProperties": false})"));
  b.Add(
      "object",
      J(R"({"type": "object", "properties": {"inner": {"type": "object", "properties": {"deep": {"type": "object", "properties": {"v": {"type": "string"}}, "required": ["v"]}}, "required": ["deep"]}}, "required": ["inner"]})"));
  // Arrays.
  b.Add("array", J(R"({"type": "array", "items": {"type": "integer"}})"));
  b.Add("array", J(R"({"type": "array", "items": {"type": "string"}, "minItems": 1})"));
  b.Add(
      "array",
      J(R"({"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 4})"));
  b.Add("array",
        J(R"({"type": "array", "items": {"type": "boolean"}, "maxItems": 0})"));
  b.Add(
      "array",
      J(R"({"type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 3})"));
  b.Add(
      "array",
      J(R"({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]})"));
  b.Add(
      "array",
      J(R"({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": false})"));
  b.Add(
      "array",
      J(R"({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": {"type": "boolean"}, "minItems": 1, "maxItems": 5})"));
  b.Add(
      "array",
      J(R"({"type": "array", "prefixItems": [{"const": "point"}, {"type": "number"}, {"type": "number"}], "items": false, "minItems": 3})"));
  b.Add(
      "array",
      J(R"({"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}, "maxItems": 3})"));
  b.Add(
      "array",
      J(R"({"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"}}, "required": ["id"]}})"));
  b.Add("array", J(R"({"type": "array"})"));
  b.Add(
      "array",
      J(R"({"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 10})"));
  // anyOf / oneOf.
  b.Add("anyOf", J(R"({"anyOf": [{"type": "string"}, {"type": "integer"}]})"));
  b.Add(
      "anyOf",
      J(R"({"anyOf": [{"type": "string", "maxLength": 3}, {"type": "string", "format": "uuid"}]})"));
  b.Add(
      "anyOf",
      J(R"({"type": "object", "properties": {"v": {"anyOf": [{"type": "null"}, {"type": "number"}]}}, "required": ["v"]})"));
  b.Add(
      "anyOf",
      J(R"({"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": false}, {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"], "additionalProperties": false}]})"));
  b.Add("oneOf", J(R"({"oneOf": [{"type": "boolean"}, {"type": "null"}]})"));
  b.Add(
      "oneOf",
      J(R"({"oneOf": [{"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}}, "required": ["kind", "r"], "additionalProperties": false}, {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "number"}}, "required": ["kind", "side"], "additionalProperties": false}]})"));
  b.Add(
      "oneOf",
      J(R"({"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "integer", "minimum": 100, "maximum": 199}]})"));
  b.Add(
      "oneOf",
      J(R"({"type": "array", "items": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}, "maxItems": 2}]}, "maxItems": 4})"));
  // allOf (mergeable).
  b.Add(
      "allOf",
      J(R"({"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}, {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]})"));
  b.Add("allOf",
        J(R"({"allOf": [{"type": "string"}, {"maxLength": 8}, {"minLength": 2}]})"));
  b.Add(
      "allOf",
      J(R"({"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 50}, {"minimum": 10}]})"));
  b.Add(
      "allOf",
      J(R"({"$defs": {"base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}}, "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"id": true, "label": {"type": "string", "maxLength": 30}}, "required": ["label"], "additionalProperties": false}]})"));
  b.Add("allOf",
        J(R"({"type": ["integer", "string"], "allOf": [{"type": "integer"}]})"));
  // $ref / $defs, including recursion.
  b.Add(
      "ref",
      J(R"({"$defs": {"name": {"type": "string", "maxLength": 10}}, "type": "object", "properties": {"first": {"$ref": "#/$defs/name"}, "last": {"$ref": "#/$defs/name"}}, "required": ["first", "last"]})"));
  b.Add(
      "ref",
      J(R"({"definitions": {"n": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/definitions/n"}, "maxItems": 5})"));
  b.Add(
      "ref",
      J(R"({"$defs": {"node": {"type": "object", "properties": {"value": {"type": "integer"}, "next": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/node"}]}}, "required": ["value", "next"], "additionalProperties": false}}, "$ref": "#/$defs/node"})"));
  b.Add(
      "ref",
      J(R"({"$defs": {"tree": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "children": {"type": "array", "items": {"$ref": "#/$defs/tree"}, "maxItems": 2}}, "required": ["name"], "additionalProperties": false}}, "$ref": "#/$defs/tree"})"));
  b.Add(
      "ref",
      J(R"({"type": "object", "properties": {"self": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}, "v": {"type": "boolean"}}, "required": ["v"], "additionalProperties": false})"));
  b.Add(
      "ref",
      J(R"({"$defs": {"expr": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "object", "properties": {"op": {"enum": ["+", "*"]}, "args": {"type": "array", "items": {"$ref": "#/$defs/expr"}, "minItems": 2, "maxItems": 2}}, "required": ["op", "args"], "additionalProperties": false}]}}, "$ref": "#/$defs/expr"})"));
  b.Add(
      "ref",
      J(R"({"$defs": {"a~b": {"type": "integer"}, "c/d": {"type": "string", "maxLength": 4}}, "type": "array", "prefixItems": [{"$ref": "#/$defs/a~0b"}, {"$ref": "#/$defs/c~1d"}], "items": false, "minItems": 2})"));
  // Type arrays and nullable.
  b.Add("type_array", J(R"({"type": ["string", "null"]})"));
  b.Add("type_array",
        J(R"({"type": ["integer", "boolean"], "minimum": 0, "maximum": 5})"));
  b.Add(
      "type_array",
      J(R"({"type": ["array", "object"], "items": {"type": "integer"}, "maxItems": 2, "properties": {"k": {"type": "integer"}}, "additionalProperties": false})"));
  b.Add(
      "type_array",
      J(R"({"type": "object", "properties": {"maybe": {"type": ["number", "null"]}}, "required": ["maybe"]})"));
  b.Add("nullable", J(R"({"type": "string", "nullable": true, "maxLength": 6})"));
  b.Add("type_array",
        J(R"({"type": ["string", "integer", "number", "boolean", "null"]})"));
  // Annotations are ignored.
  b.Add(
      "annotations",
      J(R"({"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "x", "title": "T", "description": "d", "type": "object", "properties": {"a": {"type": "integer", "default": 3, "examples": [1], "deprecated": true}}, "required": ["a"]})"));
  // Realistic tool-parameter and extraction schemas.
  b.Add(
      "realistic",
      J(R"({"type": "object", "properties": {"location": {"type": "string", "description": "City and country"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer", "minimum": 1, "maximum": 14}}, "required": ["location"], "additionalProperties": false})"));
  b.Add(
      "realistic",
      J(R"({"type": "object", "properties": {"query": {"type": "string", "maxLength": 100}, "top_k": {"type": "integer", "minimum": 1, "maximum": 50}, "filters": {"type": "object", "properties": {"site": {"type": "string"}, "after": {"type": "string", "format": "date"}}, "additionalProperties": false}}, "required": ["query"]})"));
  b.Add(
      "realistic",
      J(R"({"type": "object", "properties": {"title": {"type": "string", "maxLength": 60}, "start": {"type": "string", "format": "date-time"}, "end": {"type": "string", "format": "date-time"}, "attendees": {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 5}, "recurring": {"type": "boolean"}}, "required": ["title", "start", "end"], "additionalProperties": false})"));
  b.Add(
      "realistic",
      J(R"({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}, "email": {"type": "string", "format": "email"}, "phones": {"type": "array", "items": {"type": "string", "pattern": "^\\+?[0-9]{7,12}$"}, "maxItems": 3}}, "required": ["name", "age"]})"));
  b.Add(
      "realistic",
      J(R"({"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}, "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5}}, "required": ["sentiment", "confidence"], "additionalProperties": false})"));
  b.Add(
      "realistic",
      J(R"({"type": "object", "properties": {"path": {"type": "string", "pattern": "^/[a-z0-9/_-]*$"}, "method": {"enum": ["GET", "POST", "PUT", "DELETE"]}, "headers": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 30}}, "body": {}}, "required": ["path", "method"]})"));
  b.Add(
      "realistic",
      J(R"({"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}, "ip": {"type": "string", "format": "ipv4"}, "port": {"type": "integer", "minimum": 1, "maximum": 65535}, "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,10}$"}, "maxItems": 4}}, "required": ["id", "ip", "port"], "additionalProperties": false})"));
  b.Add(
      "realistic",
      J(R"({"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "object", "properties": {"explanation": {"type": "string", "maxLength": 80}, "output": {"type": "string", "maxLength": 40}}, "required": ["explanation", "output"], "additionalProperties": false}, "maxItems": 4}, "final_answer": {"type": "string", "maxLength": 40}}, "required": ["steps", "final_answer"], "additionalProperties": false})"));
  b.Add(
      "realistic",
      J(R"({"type": "object", "properties": {"product": {"type": "string"}, "price": {"type": "number", "minimum": 0, "maximum": 100000}, "currency": {"type": "string", "pattern": "^[A-Z]{3}$"}, "in_stock": {"type": "boolean"}, "sku": {"type": ["string", "null"], "maxLength": 12}}, "required": ["product", "price", "currency"], "additionalProperties": false})"));
  b.Add(
      "realistic",
      J(R"({"type": "object", "properties": {"file": {"type": "string", "maxLength": 40}, "line": {"type": "integer", "minimum": 1}, "severity": {"enum": ["error", "warning", "info"]}, "message": {"type": "string", "maxLength": 100}}, "required": ["file", "line", "severity", "message"], "additionalProperties": false})"));
  // Seeded random nestings.
  std::mt19937 rng(20261202);
  std::vector<CorpusSchema> out = b.Take();
  Builder r;
  int needed = std::max<int>(60, 210 - static_cast<int>(out.size()));
  for (int i = 0; i < needed; ++i) r.Add("random", RandomSchema(&rng, 3));
  for (auto& s : r.Take()) out.push_back(std::move(s));
  return out;
}

}  // namespace

const std::vector<CorpusSchema>& SchemaCorpus() {
  static const auto* corpus = new std::vector<CorpusSchema>(Build());
  return *corpus;
}

std::string SchemaCorpusJsonl() {
  std::string out;
  for (const CorpusSchema& s : SchemaCorpus()) {
    Json line = {
        {"name", s.name}, {"feature", s.feature}, {"schema", Json::parse(s.schema)}};
    out += line.dump() + "\n";
  }
  return out;
}

}  // namespace tandem::grammar
