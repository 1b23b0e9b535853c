#include "engine/grammar/regex_parser.h"

#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tandem::grammar {

bool DecodeUtf8(absl::string_view s, size_t* i, uint32_t* cp) {
  const unsigned char c = s[*i];
  int len;
  uint32_t v;
  if (c < 0x80) {
    *cp = c;
    ++*i;
    return true;
  } else if ((c & 0xE0) == 0xC0) {
    len = 2;
    v = c & 0x1F;
  } else if ((c & 0xF0) == 0xE0) {
    len = 3;
    v = c & 0x0F;
  } else if ((c & 0xF8) == 0xF0) {
    len = 4;
    v = c & 0x07;
  } else {
    return false;
  }
  if (*i + len > s.size()) return false;
  for (int k = 1; k < len; ++k) {
    const unsigned char d = s[*i + k];
    if ((d & 0xC0) != 0x80) return false;
    v = (v << 6) | (d & 0x3F);
  }
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (v < kMin[len] || v > kMaxCodepoint || (v >= 0xD800 && v <= 0xDFFF)) {
    return false;
  }
  *cp = v;
  *i += len;
  return true;
}

namespace {

CodepointRanges Digits() { return {{'0', '9'}}; }
CodepointRanges Word() { return {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}}; }
CodepointRanges Space() {
  // ECMAScript \s: WhiteSpace and LineTerminator.
  return NormalizeRanges({{0x09, 0x0D},
                          {0x20, 0x20},
                          {0xA0, 0xA0},
                          {0x1680, 0x1680},
                          {0x2000, 0x200A},
                          {0x2028, 0x2029},
                          {0x202F, 0x202F},
                          {0x205F, 0x205F},
                          {0x3000, 0x3000},
                          {0xFEFF, 0xFEFF}});
}
CodepointRanges Dot() {
  // Any code point but the line terminators \n \r U+2028 U+2029.
  return ComplementRanges({{0x0A, 0x0A}, {0x0D, 0x0D}, {0x2028, 0x2029}});
}

class RegexParser {
 public:
  RegexParser(absl::string_view p, const RegexOptions& o) : p_(p), o_(o) {}

  absl::StatusOr<ParsedRegex> Parse() {
    ParsedRegex out;
    if (!p_.empty() && p_[0] == '^') {
      out.anchored_start = true;
      ++i_;
    }
    size_t end = p_.size();
    if (end > i_ && p_[end - 1] == '$' && !EscapedAt(end - 1)) {
      out.anchored_end = true;
      p_ = p_.substr(0, end - 1);
    }
    auto e = ParseAlt(0);
    if (!e.ok()) return e.status();
    if (i_ < p_.size()) return Error("unbalanced ')'");
    out.expr = *e;
    return out;
  }

 private:
  // True when the character at `pos` is preceded by an odd run of '\'.
  bool EscapedAt(size_t pos) const {
    size_t n = 0;
    while (pos > n && p_[pos - n - 1] == '\\') ++n;
    return n % 2 == 1;
  }

  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("regex: ", what, " at offset ", i_));
  }
  absl::Status Unsupported(absl::string_view feature) const {
    return absl::InvalidArgumentError(
        absl::StrCat("regex: unsupported feature: ", feature, " at offset ", i_));
  }

  bool AtEnd() const { return i_ >= p_.size(); }
  char Peek() const { return p_[i_]; }

  ExprPtr Chars(CodepointRanges r) const {
    r = NormalizeRanges(std::move(r));
    if (!o_.universe.empty()) r = IntersectRanges(r, o_.universe);
    return Codepoints(std::move(r));
  }

  absl::StatusOr<ExprPtr> ParseAlt(int depth) {
    if (depth > o_.max_depth) {
      return absl::ResourceExhaustedError("regex: groups nested too deeply");
    }
    std::vector<ExprPtr> alts;
    while (true) {
      auto s = ParseSeq(depth);
      if (!s.ok()) return s;
      alts.push_back(*s);
      if (!AtEnd() && Peek() == '|') {
        ++i_;
        continue;
      }
      break;
    }
    return Alt(std::move(alts));
  }

  absl::StatusOr<ExprPtr> ParseSeq(int depth) {
    std::vector<ExprPtr> items;
    while (!AtEnd() && Peek() != '|' && Peek() != ')') {
      auto atom = ParseAtom(depth);
      if (!atom.ok()) return atom;
      auto q = ParseQuantifier(*atom);
      if (!q.ok()) return q;
      items.push_back(*q);
    }
    return Seq(std::move(items));
  }

  // Parses an optional {m,n}: returns false (position unchanged) when the
  // text is not a quantifier (then '{' is a literal, as in ECMAScript).
  bool ParseBraces(int* min, int* max) {
    size_t j = i_ + 1;
    auto number = [&](int* out) {
      size_t start = j;
      int64_t v = 0;
      while (j < p_.size() && p_[j] >= '0' && p_[j] <= '9') {
        v = std::min<int64_t>(v * 10 + (p_[j] - '0'), 1 << 30);
        ++j;
      }
      *out = static_cast<int>(v);
      return j > start;
    };
    if (!number(min)) return false;
    if (j < p_.size() && p_[j] == '}') {
      *max = *min;
    } else if (j < p_.size() && p_[j] == ',') {
      ++j;
      if (j < p_.size() && p_[j] == '}') {
        *max = kUnbounded;
      } else if (!number(max) || j >= p_.size() || p_[j] != '}') {
        return false;
      }
    } else {
      return false;
    }
    i_ = j + 1;
    return true;
  }

  absl::StatusOr<ExprPtr> ParseQuantifier(ExprPtr atom) {
    if (AtEnd()) return atom;
    int min = 0, max = 0;
    char c = Peek();
    if (c == '*') {
      min = 0, max = kUnbounded;
      ++i_;
    } else if (c == '+') {
      min = 1, max = kUnbounded;
      ++i_;
    } else if (c == '?') {
      min = 0, max = 1;
      ++i_;
    } else if (c == '{') {
      if (!ParseBraces(&min, &max)) return atom;
      if (max != kUnbounded && max < min) return Error("{m,n} with n < m");
      if (min > o_.max_repeat || max > o_.max_repeat) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "regex: repeat count over ", o_.max_repeat, " at offset ", i_));
      }
    } else {
      return atom;
    }
    if (!AtEnd() && Peek() == '?') ++i_;  // lazy: same language
    if (!AtEnd() && (Peek() == '*' || Peek() == '+' || Peek() == '?' ||
                     (Peek() == '{' && i_ + 1 < p_.size() && p_[i_ + 1] >= '0' &&
                      p_[i_ + 1] <= '9'))) {
      return Error("nothing to repeat (a quantifier after a quantifier)");
    }
    return Repeat(std::move(atom), min, max);
  }

  absl::StatusOr<ExprPtr> ParseAtom(int depth) {
    char c = Peek();
    switch (c) {
      case '(': {
        ++i_;
        if (!AtEnd() && Peek() == '?') {
          absl::string_view rest = p_.substr(i_);
          if (rest.substr(0, 2) == "?:") {
            i_ += 2;
          } else if (rest.substr(0, 2) == "?=" || rest.substr(0, 2) == "?!" ||
                     rest.substr(0, 3) == "?<=" || rest.substr(0, 3) == "?<!") {
            return Unsupported("lookaround assertions");
          } else if (rest.substr(0, 2) == "?<" || rest.substr(0, 3) == "?P<") {
            size_t close = p_.find('>', i_);
            if (close == absl::string_view::npos)
              return Error("unterminated group name");
            i_ = close + 1;
          } else {
            return Unsupported("inline flags or group modifiers '(?'");
          }
        }
        auto e = ParseAlt(depth + 1);
        if (!e.ok()) return e;
        if (AtEnd() || Peek() != ')') return Error("missing ')'");
        ++i_;
        return e;
      }
      case ')':
        return Error("unbalanced ')'");
      case '[':
        return ParseClass();
      case '.':
        ++i_;
        return Chars(Dot());
      case '^':
        return Unsupported("'^' anchor inside the pattern");
      case '$':
        return Unsupported("'$' anchor inside the pattern");
      case '*':
      case '+':
      case '?':
        return Error("nothing to repeat");
      case '{': {
        int min, max;
        size_t save = i_;
        if (ParseBraces(&min, &max)) {
          i_ = save;
          return Error("nothing to repeat");
        }
        ++i_;
        return Chars({{'{', '{'}});
      }
      case '\\': {
        CodepointRanges r;
        auto s = ParseEscape(/*in_class=*/false, &r);
        if (!s.ok()) return s;
        return Chars(std::move(r));
      }
      default: {
        uint32_t cp;
        if (!DecodeUtf8(p_, &i_, &cp)) return Error("invalid UTF-8");
        return Chars({{cp, cp}});
      }
    }
  }

  static bool HexValue(char c, uint32_t* v) {
    if (c >= '0' && c <= '9') {
      *v = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      *v = c - 'a' + 10;
    } else if (c >= 'A' && c <= 'F') {
      *v = c - 'A' + 10;
    } else {
      return false;
    }
    return true;
  }

  absl::Status ParseHex(int digits, uint32_t* out) {
    uint32_t v = 0;
    for (int k = 0; k < digits; ++k) {
      uint32_t d;
      if (AtEnd() || !HexValue(Peek(), &d)) return Error("bad hex escape");
      v = v * 16 + d;
      ++i_;
    }
    *out = v;
    return absl::OkStatus();
  }

  // At '\'; sets `out` to the escape's code points.
  absl::Status ParseEscape(bool in_class, CodepointRanges* out) {
    ++i_;
    if (AtEnd()) return Error("trailing '\\'");
    char c = Peek();
    ++i_;
    uint32_t cp;
    switch (c) {
      case 'd':
        *out = Digits();
        return absl::OkStatus();
      case 'D':
        *out = ComplementRanges(Digits());
        return absl::OkStatus();
      case 'w':
        *out = Word();
        return absl::OkStatus();
      case 'W':
        *out = ComplementRanges(Word());
        return absl::OkStatus();
      case 's':
        *out = Space();
        return absl::OkStatus();
      case 'S':
        *out = ComplementRanges(Space());
        return absl::OkStatus();
      case 'n':
        cp = '\n';
        break;
      case 'r':
        cp = '\r';
        break;
      case 't':
        cp = '\t';
        break;
      case 'f':
        cp = '\f';
        break;
      case 'v':
        cp = '\v';
        break;
      case '0':
        if (!AtEnd() && Peek() >= '0' && Peek() <= '9') {
          --i_;
          return Unsupported("octal escapes");
        }
        cp = 0;
        break;
      case 'b':
        if (!in_class) {
          --i_;
          return Unsupported("word boundary '\\b'");
        }
        cp = '\b';
        break;
      case 'B':
        --i_;
        return Unsupported("word boundary '\\B'");
      case 'x': {
        absl::Status s = ParseHex(2, &cp);
        if (!s.ok()) return s;
        break;
      }
      case 'u': {
        if (!AtEnd() && Peek() == '{') {
          ++i_;
          uint32_t v = 0;
          int n = 0;
          uint32_t d;
          while (!AtEnd() && HexValue(Peek(), &d) && n < 8) {
            v = v * 16 + d;
            ++i_;
            ++n;
          }
          if (n == 0 || AtEnd() || Peek() != '}') return Error("bad \\u{...} escape");
          ++i_;
          cp = v;
        } else {
          absl::Status s = ParseHex(4, &cp);
          if (!s.ok()) return s;
        }
        if (cp > kMaxCodepoint || (cp >= 0xD800 && cp <= 0xDFFF)) {
          return Unsupported("surrogate or out-of-range \\u escapes");
        }
        break;
      }
      case 'p':
      case 'P':
        --i_;
        return Unsupported("Unicode property classes '\\p{...}'");
      case 'c':
        --i_;
        return Unsupported("control escapes '\\cX'");
      case 'k':
        --i_;
        return Unsupported("named backreferences '\\k<...>'");
      default:
        if (c >= '1' && c <= '9') {
          --i_;
          return Unsupported("backreferences");
        }
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
          --i_;
          return Unsupported(absl::StrCat("escape '\\", std::string(1, c), "'"));
        }
        {
          --i_;
          if (!DecodeUtf8(p_, &i_, &cp)) return Error("invalid UTF-8");
        }
        break;
    }
    *out = {{cp, cp}};
    return absl::OkStatus();
  }

  absl::StatusOr<ExprPtr> ParseClass() {
    ++i_;  // '['
    bool negate = false;
    if (!AtEnd() && Peek() == '^') {
      negate = true;
      ++i_;
    }
    CodepointRanges set;
    bool first = true;
    while (true) {
      if (AtEnd()) return Error("missing ']'");
      if (Peek() == ']' && !first) break;
      if (Peek() == ']' && first) {
        // "[]" matches nothing in ECMAScript; "[^]" matches anything.
        break;
      }
      first = false;
      CodepointRanges lo_set;
      uint32_t lo = 0;
      bool single = false;
      if (absl::Status s = ClassAtom(&lo_set, &lo, &single); !s.ok()) return s;
      if (single && i_ + 1 < p_.size() && Peek() == '-' && p_[i_ + 1] != ']') {
        ++i_;
        CodepointRanges hi_set;
        uint32_t hi = 0;
        bool hi_single = false;
        if (absl::Status s = ClassAtom(&hi_set, &hi, &hi_single); !s.ok()) return s;
        if (!hi_single) return Unsupported("a class escape as a range bound");
        if (hi < lo) return Error("class range out of order");
        set.push_back({lo, hi});
      } else {
        set.insert(set.end(), lo_set.begin(), lo_set.end());
      }
    }
    ++i_;  // ']'
    set = NormalizeRanges(std::move(set));
    if (negate) set = ComplementRanges(set);
    return Chars(std::move(set));
  }

  absl::Status ClassAtom(CodepointRanges* set, uint32_t* cp, bool* single) {
    if (Peek() == '\\') {
      absl::Status s = ParseEscape(/*in_class=*/true, set);
      if (!s.ok()) return s;
      *single = set->size() == 1 && (*set)[0].first == (*set)[0].second;
      if (*single) *cp = (*set)[0].first;
      return absl::OkStatus();
    }
    if (Peek() == '[' && i_ + 1 < p_.size() && p_[i_ + 1] == ':') {
      return Unsupported("POSIX classes '[:name:]'");
    }
    if (!DecodeUtf8(p_, &i_, cp)) return Error("invalid UTF-8");
    *set = {{*cp, *cp}};
    *single = true;
    return absl::OkStatus();
  }

  absl::string_view p_;
  const RegexOptions& o_;
  size_t i_ = 0;
};

}  // namespace

absl::StatusOr<ParsedRegex> ParseRegex(absl::string_view pattern,
                                       const RegexOptions& options) {
  return RegexParser(pattern, options).Parse();
}

}  // namespace tandem::grammar
