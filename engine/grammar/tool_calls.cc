#include "engine/grammar/tool_calls.h"

#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "engine/grammar/json_schema.h"
#include "engine/grammar/token_vocabulary.h"
#include "nlohmann/json.hpp"

namespace tandem::grammar {
namespace {

using Json = nlohmann::json;

// A copy of `e` whose rule references are shifted by `offset` (shared
// subtrees stay shared).
ExprPtr Shift(const ExprPtr& e, int offset,
              absl::flat_hash_map<const Expr*, ExprPtr>* memo) {
  if (auto it = memo->find(e.get()); it != memo->end()) return it->second;
  ExprPtr out;
  if (e->kind == Expr::Kind::kRuleRef) {
    out = Ref(e->rule + offset);
  } else if (IsRegular(*e)) {
    out = e;  // no reference inside
  } else {
    auto copy = std::make_shared<Expr>(*e);
    for (ExprPtr& c : copy->children) c = Shift(c, offset, memo);
    out = std::move(copy);
  }
  memo->emplace(e.get(), out);
  return out;
}

// Appends `from`'s rules to `into`; returns the index of from's root there.
int Append(const Grammar& from, absl::string_view prefix, Grammar* into) {
  const int offset = static_cast<int>(into->names.size());
  absl::flat_hash_map<const Expr*, ExprPtr> memo;
  for (size_t r = 0; r < from.names.size(); ++r) {
    into->names.push_back(absl::StrCat(prefix, ".", from.names[r]));
    into->bodies.push_back(
        from.bodies[r] == nullptr ? nullptr : Shift(from.bodies[r], offset, &memo));
  }
  return offset + from.root;
}

bool AnyObject(const Json& p) {
  return p.is_null() || (p.is_object() && p.empty()) ||
         (p.is_object() && p.size() == 1 && p.contains("type") &&
          p["type"] == "object");
}

absl::StatusOr<std::string> TextField(const Json& j, const char* key,
                                      absl::string_view where) {
  if (!j.contains(key) || !j[key].is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tool calls: ", where, ".", key, " must be a string"));
  }
  return j[key].get<std::string>();
}

}  // namespace

std::string ToolCallText(absl::string_view text, int index) {
  std::vector<std::pair<std::string, std::string>> subs;
  for (int i = 0; i < kNumStructureTokens; ++i) {
    subs.emplace_back(kStructureTokenNames[i], StructureTokenBytes(i));
  }
  subs.emplace_back("{index}", absl::StrCat(index));
  return absl::StrReplaceAll(text, subs);
}

absl::StatusOr<Grammar> ToolCallsToGrammar(absl::string_view source_json,
                                           const CompileLimits& limits) {
  Json src = Json::parse(source_json, nullptr, /*allow_exceptions=*/false);
  if (src.is_discarded() || !src.is_object()) {
    return absl::InvalidArgumentError("tool calls: the source is not a JSON object");
  }
  if (!src.contains("calls") || !src["calls"].is_array() || src["calls"].empty()) {
    return absl::InvalidArgumentError("tool calls: calls must be a non-empty array");
  }
  int max_calls = kDefaultMaxToolCalls;
  if (src.contains("max_calls")) {
    if (!src["max_calls"].is_number_integer() || src["max_calls"].get<int64_t>() < 1 ||
        src["max_calls"].get<int64_t>() > kMaxToolCalls) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tool calls: max_calls must be an integer in [1, ", kMaxToolCalls, "]"));
    }
    max_calls = src["max_calls"].get<int>();
  }
  auto final_end = TextField(src, "end", "source");
  if (!final_end.ok()) return final_end.status();

  struct Alternative {
    std::string begin, end;
    int args = -1;  // rule of the arguments
  };
  Grammar g;
  std::vector<Alternative> alts;
  for (size_t i = 0; i < src["calls"].size(); ++i) {
    const Json& c = src["calls"][i];
    const std::string where = absl::StrCat("calls[", i, "]");
    if (!c.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tool calls: ", where, " must be an object"));
    }
    Alternative a;
    auto begin = TextField(c, "begin", where);
    if (!begin.ok()) return begin.status();
    auto end = TextField(c, "end", where);
    if (!end.ok()) return end.status();
    a.begin = *std::move(begin);
    a.end = *std::move(end);
    const Json params = c.contains("parameters") ? c["parameters"] : Json();
    Grammar sub;
    if (AnyObject(params)) {
      sub = JsonObjectGrammar(limits);
    } else {
      auto parsed = JsonSchemaToGrammar(params.dump(), limits);
      if (!parsed.ok()) {
        return absl::Status(
            parsed.status().code(),
            absl::StrCat(where, ".parameters: ", parsed.status().message()));
      }
      sub = std::move(*parsed);
    }
    a.args = Append(sub, absl::StrCat("call", i), &g);
    alts.push_back(std::move(a));
  }
  // call_n ::= (begin_i(n) args_i end_i(n) | ...) (END | call_{n+1})
  std::vector<int> chain(max_calls);
  for (int n = 0; n < max_calls; ++n)
    chain[n] = g.NewRule(absl::StrCat("calls_", n + 1));
  const ExprPtr end_all = Bytes(ToolCallText(*final_end, 0));
  for (int n = 0; n < max_calls; ++n) {
    std::vector<ExprPtr> calls;
    for (const Alternative& a : alts) {
      calls.push_back(Seq({Bytes(ToolCallText(a.begin, n + 1)), Ref(a.args),
                           Bytes(ToolCallText(a.end, n + 1))}));
    }
    ExprPtr next = n + 1 < max_calls ? Alt({end_all, Ref(chain[n + 1])}) : end_all;
    g.bodies[chain[n]] = Seq({Alt(std::move(calls)), std::move(next)});
  }
  g.root = chain[0];
  return g;
}

}  // namespace tandem::grammar
