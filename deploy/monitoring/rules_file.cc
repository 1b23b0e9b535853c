#include "deploy/monitoring/rules_file.h"

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status.h"

namespace tandem::monitoring {
namespace {

size_t Indent(absl::string_view line) {
  size_t n = 0;
  while (n < line.size() && line[n] == ' ') ++n;
  return n;
}

bool Blank(absl::string_view line) {
  const absl::string_view t = absl::StripAsciiWhitespace(line);
  return t.empty() || t[0] == '#';
}

// A scalar written plain or single-quoted ('' is a quote).
absl::StatusOr<std::string> Scalar(absl::string_view v, int line) {
  v = absl::StripAsciiWhitespace(v);
  if (v.empty()) return InvalidArgument("rules line ", line, ": empty value");
  if (v[0] == '"') {
    return InvalidArgument("rules line ", line, ": double-quoted values are not read");
  }
  if (v[0] != '\'') return std::string(v);
  if (v.size() < 2 || v.back() != '\'') {
    return InvalidArgument("rules line ", line, ": unterminated quote");
  }
  std::string out;
  v = v.substr(1, v.size() - 2);
  for (size_t i = 0; i < v.size(); ++i) {
    out += v[i];
    if (v[i] == '\'' && i + 1 < v.size() && v[i + 1] == '\'') ++i;
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<Rule>> ParseRules(absl::string_view yaml) {
  const std::vector<absl::string_view> lines = absl::StrSplit(yaml, '\n');
  std::vector<Rule> rules;
  size_t key_indent = 0;  // column of the current rule's keys
  bool in_rule = false;
  for (size_t i = 0; i < lines.size(); ++i) {
    const int lineno = static_cast<int>(i) + 1;
    absl::string_view line = absl::StripTrailingAsciiWhitespace(lines[i]);
    if (Blank(line)) continue;
    const size_t indent = Indent(line);
    absl::string_view rest = line.substr(indent);
    size_t col = indent;
    const bool item = absl::ConsumePrefix(&rest, "- ");
    if (item) {
      const size_t extra = Indent(rest);
      rest.remove_prefix(extra);
      col += 2 + extra;
    }
    // A shallower key, or a list item at the rule's own depth, ends the rule.
    if (in_rule && (item ? col <= key_indent : col < key_indent)) in_rule = false;
    for (const char* kind : {"record", "alert"}) {
      absl::string_view r = rest;
      if (item && absl::ConsumePrefix(&r, kind) && absl::ConsumePrefix(&r, ":")) {
        if (!rules.empty() && rules.back().expr.empty()) {
          return InvalidArgument("rules line ", rules.back().line, ": rule ",
                                 rules.back().name, " has no expr");
        }
        TANDEM_ASSIGN_OR_RETURN(std::string name, Scalar(r, lineno));
        rules.push_back({.kind = kind, .name = std::move(name), .line = lineno});
        key_indent = col;
        in_rule = true;
      }
    }
    absl::string_view e = rest;
    if (!absl::ConsumePrefix(&e, "expr:")) continue;
    if (!in_rule || item || col != key_indent) {
      return InvalidArgument("rules line ", lineno, ": expr outside a rule");
    }
    if (!rules.back().expr.empty()) {
      return InvalidArgument("rules line ", lineno, ": a second expr in rule ",
                             rules.back().name);
    }
    e = absl::StripAsciiWhitespace(e);
    std::string expr;
    if (!e.empty() && (e[0] == '|' || e[0] == '>')) {
      // Block scalar: every following line indented deeper than the key.
      while (i + 1 < lines.size() &&
             (absl::StripAsciiWhitespace(lines[i + 1]).empty() ||
              Indent(lines[i + 1]) > col)) {
        ++i;
        absl::StrAppend(&expr, absl::StripAsciiWhitespace(lines[i]), "\n");
      }
      while (absl::EndsWith(expr, "\n\n")) expr.pop_back();  // trailing blank lines
    } else {
      TANDEM_ASSIGN_OR_RETURN(expr, Scalar(e, lineno));
    }
    if (absl::StripAsciiWhitespace(expr).empty()) {
      return InvalidArgument("rules line ", lineno, ": empty expr");
    }
    rules.back().expr = std::move(expr);
  }
  if (!rules.empty() && rules.back().expr.empty()) {
    return InvalidArgument("rules line ", rules.back().line, ": rule ",
                           rules.back().name, " has no expr");
  }
  return rules;
}

}  // namespace tandem::monitoring
