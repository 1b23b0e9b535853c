#include "engine/grammar/ebnf_parser.h"

#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/grammar/regex_parser.h"
#include "engine/tokenizer/utf8.h"

namespace tandem::grammar {
namespace {

constexpr int kMaxRepeat = 1000;

class EbnfParser {
 public:
  EbnfParser(absl::string_view t, int max_depth) : t_(t), max_depth_(max_depth) {}

  absl::StatusOr<Grammar> Parse() {
    SkipSpace(true);
    while (!AtEnd()) {
      std::string name = Name();
      if (name.empty()) return Error("expected a rule name");
      SkipSpace(true);
      if (t_.substr(i_, 3) != "::=") return Error("expected '::='");
      i_ += 3;
      int id = g_.RuleId(name);
      if (defined_.size() <= static_cast<size_t>(id)) defined_.resize(id + 1, false);
      if (defined_[id]) return Error(absl::StrCat("rule '", name, "' defined twice"));
      defined_[id] = true;
      auto body = ParseAlt(0);
      if (!body.ok()) return body.status();
      g_.bodies[id] = *body;
      SkipSpace(true);
    }
    int root = -1;
    for (size_t r = 0; r < g_.names.size(); ++r) {
      if (g_.names[r] == "root") root = static_cast<int>(r);
    }
    if (root < 0) return absl::InvalidArgumentError("EBNF: no 'root' rule");
    for (size_t r = 0; r < g_.names.size(); ++r) {
      if (g_.bodies[r] == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("EBNF: rule '", g_.names[r], "' is used but not defined"));
      }
    }
    g_.root = root;
    return std::move(g_);
  }

 private:
  bool AtEnd() const { return i_ >= t_.size(); }

  absl::Status Error(absl::string_view what) const {
    int line = 1, col = 1;
    for (size_t k = 0; k < i_ && k < t_.size(); ++k) {
      if (t_[k] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    return absl::InvalidArgumentError(
        absl::StrCat("EBNF: ", what, " at line ", line, " column ", col));
  }

  // Skips blanks and comments; newlines too when `newlines`.
  void SkipSpace(bool newlines) {
    while (!AtEnd()) {
      char c = t_[i_];
      if (c == ' ' || c == '\t' || c == '\r' || (newlines && c == '\n')) {
        ++i_;
      } else if (c == '#') {
        while (!AtEnd() && t_[i_] != '\n') ++i_;
      } else {
        break;
      }
    }
  }

  static bool NameChar(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '_' || c == '-';
  }

  std::string Name() {
    size_t start = i_;
    while (!AtEnd() && NameChar(t_[i_])) ++i_;
    return std::string(t_.substr(start, i_ - start));
  }

  // True when a new rule ("name ::=") starts at the current position.
  bool RuleStartsHere() const {
    size_t j = i_;
    while (j < t_.size() && NameChar(t_[j])) ++j;
    if (j == i_) return false;
    while (j < t_.size() && (t_[j] == ' ' || t_[j] == '\t')) ++j;
    return t_.substr(j, 3) == "::=";
  }

  absl::StatusOr<ExprPtr> ParseAlt(int depth) {
    if (depth > max_depth_) {
      return absl::ResourceExhaustedError("EBNF: groups nested too deeply");
    }
    std::vector<ExprPtr> alts;
    while (true) {
      auto s = ParseSeq(depth);
      if (!s.ok()) return s;
      alts.push_back(*s);
      SkipSpace(true);
      if (!AtEnd() && t_[i_] == '|') {
        ++i_;
        continue;
      }
      break;
    }
    return Alt(std::move(alts));
  }

  absl::StatusOr<ExprPtr> ParseSeq(int depth) {
    std::vector<ExprPtr> items;
    while (true) {
      // Inside a group newlines are blanks; at the top level a newline ends
      // the rule unless the next line continues it.
      SkipSpace(true);
      if (AtEnd()) break;
      char c = t_[i_];
      if (c == '|' || c == ')') break;
      if (NameChar(c) && RuleStartsHere()) break;
      auto atom = ParseAtom(depth);
      if (!atom.ok()) return atom;
      auto q = ParseQuantifier(*atom);
      if (!q.ok()) return q;
      items.push_back(*q);
    }
    return Seq(std::move(items));
  }

  absl::StatusOr<ExprPtr> ParseQuantifier(ExprPtr atom) {
    if (AtEnd()) return atom;
    char c = t_[i_];
    if (c == '*') {
      ++i_;
      return Star(atom);
    }
    if (c == '+') {
      ++i_;
      return Plus(atom);
    }
    if (c == '?') {
      ++i_;
      return Optional(atom);
    }
    if (c != '{') return atom;
    ++i_;
    auto number = [&](int* out) {
      SkipSpace(false);
      size_t start = i_;
      int64_t v = 0;
      while (!AtEnd() && t_[i_] >= '0' && t_[i_] <= '9') {
        v = std::min<int64_t>(v * 10 + (t_[i_] - '0'), 1 << 30);
        ++i_;
      }
      *out = static_cast<int>(v);
      SkipSpace(false);
      return i_ > start;
    };
    int min = 0, max = 0;
    if (!number(&min)) return Error("expected a number in {m,n}");
    if (!AtEnd() && t_[i_] == '}') {
      max = min;
    } else if (!AtEnd() && t_[i_] == ',') {
      ++i_;
      if (!number(&max)) max = kUnbounded;
    }
    if (AtEnd() || t_[i_] != '}') return Error("expected '}'");
    ++i_;
    if (max != kUnbounded && max < min) return Error("{m,n} with n < m");
    if (min > kMaxRepeat || max > kMaxRepeat) {
      return absl::ResourceExhaustedError(
          absl::StrCat("EBNF: repeat count over ", kMaxRepeat));
    }
    return Repeat(atom, min, max);
  }

  absl::StatusOr<uint32_t> Escape() {
    ++i_;  // '\'
    if (AtEnd()) return Error("trailing '\\'");
    char c = t_[i_++];
    auto hex = [&](int n) -> absl::StatusOr<uint32_t> {
      uint32_t v = 0;
      for (int k = 0; k < n; ++k) {
        if (AtEnd()) return Error("bad hex escape");
        char h = t_[i_++];
        int d = (h >= '0' && h <= '9')   ? h - '0'
                : (h >= 'a' && h <= 'f') ? h - 'a' + 10
                : (h >= 'A' && h <= 'F') ? h - 'A' + 10
                                         : -1;
        if (d < 0) return Error("bad hex escape");
        v = v * 16 + d;
      }
      return v;
    };
    switch (c) {
      case 'n':
        return uint32_t{'\n'};
      case 'r':
        return uint32_t{'\r'};
      case 't':
        return uint32_t{'\t'};
      case '\\':
        return uint32_t{'\\'};
      case '"':
        return uint32_t{'"'};
      case '\'':
        return uint32_t{'\''};
      case '[':
        return uint32_t{'['};
      case ']':
        return uint32_t{']'};
      case '-':
        return uint32_t{'-'};
      case '^':
        return uint32_t{'^'};
      case 'x':
        return hex(2);
      case 'u':
        return hex(4);
      case 'U':
        return hex(8);
      default:
        --i_;
        return Error(absl::StrCat("unknown escape '\\", std::string(1, c), "'"));
    }
  }

  absl::StatusOr<uint32_t> Char() {
    if (t_[i_] == '\\') return Escape();
    uint32_t cp;
    if (!DecodeUtf8(t_, &i_, &cp)) return Error("invalid UTF-8");
    return cp;
  }

  static std::string Utf8(uint32_t cp) {
    std::string s;
    tokenizer::AppendUtf8(static_cast<char32_t>(cp), &s);
    return s;
  }

  absl::StatusOr<ExprPtr> ParseAtom(int depth) {
    char c = t_[i_];
    if (c == '"' || c == '\'') {
      const char quote = c;
      ++i_;
      std::string bytes;
      while (true) {
        if (AtEnd() || t_[i_] == '\n') return Error("unterminated string");
        if (t_[i_] == quote) break;
        auto cp = Char();
        if (!cp.ok()) return cp.status();
        if (*cp > kMaxCodepoint || (*cp >= 0xD800 && *cp <= 0xDFFF)) {
          return Error("escape outside Unicode");
        }
        bytes += Utf8(*cp);
      }
      ++i_;
      return Bytes(bytes);
    }
    if (c == '[') {
      ++i_;
      bool negate = false;
      if (!AtEnd() && t_[i_] == '^') {
        negate = true;
        ++i_;
      }
      CodepointRanges set;
      while (true) {
        if (AtEnd()) return Error("missing ']'");
        if (t_[i_] == ']') break;
        auto lo = Char();
        if (!lo.ok()) return lo.status();
        uint32_t hi = *lo;
        if (i_ + 1 < t_.size() && t_[i_] == '-' && t_[i_ + 1] != ']') {
          ++i_;
          auto h = Char();
          if (!h.ok()) return h.status();
          hi = *h;
          if (hi < *lo) return Error("class range out of order");
        }
        set.push_back({*lo, hi});
      }
      ++i_;
      set = NormalizeRanges(std::move(set));
      if (negate) set = ComplementRanges(set);
      return Codepoints(std::move(set));
    }
    if (c == '.') {
      ++i_;
      return Codepoints(AnyCodepoint());
    }
    if (c == '(') {
      ++i_;
      auto e = ParseAlt(depth + 1);
      if (!e.ok()) return e;
      SkipSpace(true);
      if (AtEnd() || t_[i_] != ')') return Error("missing ')'");
      ++i_;
      return e;
    }
    if (NameChar(c)) {
      std::string name = Name();
      return Ref(g_.RuleId(name));
    }
    return Error(absl::StrCat("unexpected character '", std::string(1, c), "'"));
  }

  absl::string_view t_;
  int max_depth_;
  size_t i_ = 0;
  Grammar g_;
  std::vector<bool> defined_;
};

}  // namespace

absl::StatusOr<Grammar> ParseEbnf(absl::string_view text, int max_depth) {
  return EbnfParser(text, max_depth).Parse();
}

}  // namespace tandem::grammar
