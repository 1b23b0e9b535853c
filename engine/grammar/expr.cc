#include "engine/grammar/expr.h"

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tandem::grammar {
namespace {

std::shared_ptr<Expr> Make(Expr::Kind kind) {
  auto e = std::make_shared<Expr>();
  e->kind = kind;
  return e;
}

}  // namespace

ExprPtr Empty() { return Make(Expr::Kind::kEmpty); }

ExprPtr Bytes(absl::string_view bytes) {
  if (bytes.empty()) return Empty();
  auto e = Make(Expr::Kind::kBytes);
  e->bytes = std::string(bytes);
  return e;
}

ExprPtr ByteSet(const std::bitset<256>& set) {
  auto e = Make(Expr::Kind::kByteSet);
  e->byte_set = set;
  return e;
}

ExprPtr ByteRange(uint8_t lo, uint8_t hi) {
  std::bitset<256> set;
  for (int b = lo; b <= hi; ++b) set.set(b);
  return ByteSet(set);
}

ExprPtr Codepoints(CodepointRanges ranges) {
  auto e = Make(Expr::Kind::kCodepoints);
  e->ranges = NormalizeRanges(std::move(ranges));
  return e;
}

ExprPtr Seq(std::vector<ExprPtr> children) {
  if (children.empty()) return Empty();
  if (children.size() == 1) return children[0];
  auto e = Make(Expr::Kind::kSeq);
  for (auto& c : children) {
    if (c->kind == Expr::Kind::kEmpty) continue;
    if (c->kind == Expr::Kind::kSeq) {
      e->children.insert(e->children.end(), c->children.begin(), c->children.end());
    } else {
      e->children.push_back(std::move(c));
    }
  }
  if (e->children.empty()) return Empty();
  if (e->children.size() == 1) return e->children[0];
  return e;
}

ExprPtr Alt(std::vector<ExprPtr> children) {
  if (children.size() == 1) return children[0];
  auto e = Make(Expr::Kind::kAlt);
  e->children = std::move(children);
  return e;
}

ExprPtr Repeat(ExprPtr child, int min, int max) {
  if (max == 0) return Empty();
  if (min == 1 && max == 1) return child;
  auto e = Make(Expr::Kind::kRepeat);
  e->children.push_back(std::move(child));
  e->min = min;
  e->max = max;
  return e;
}

ExprPtr Optional(ExprPtr child) { return Repeat(std::move(child), 0, 1); }
ExprPtr Star(ExprPtr child) { return Repeat(std::move(child), 0, kUnbounded); }
ExprPtr Plus(ExprPtr child) { return Repeat(std::move(child), 1, kUnbounded); }

ExprPtr Ref(int rule) {
  auto e = Make(Expr::Kind::kRuleRef);
  e->rule = rule;
  return e;
}

CodepointRanges NormalizeRanges(CodepointRanges ranges) {
  // Drop surrogates and out-of-range values, then sort and merge.
  CodepointRanges split;
  for (auto [lo, hi] : ranges) {
    if (hi > kMaxCodepoint) hi = kMaxCodepoint;
    if (lo > hi) continue;
    if (lo < 0xD800 && hi >= 0xD800) {
      split.push_back({lo, 0xD7FF});
      if (hi > 0xDFFF) split.push_back({0xE000, hi});
    } else if (lo >= 0xD800 && lo <= 0xDFFF) {
      if (hi > 0xDFFF) split.push_back({0xE000, hi});
    } else {
      split.push_back({lo, hi});
    }
  }
  std::sort(split.begin(), split.end());
  CodepointRanges out;
  for (auto r : split) {
    if (!out.empty() && r.first <= out.back().second + 1) {
      out.back().second = std::max(out.back().second, r.second);
    } else {
      out.push_back(r);
    }
  }
  return out;
}

CodepointRanges AnyCodepoint() { return NormalizeRanges({{0, kMaxCodepoint}}); }

CodepointRanges ComplementRanges(const CodepointRanges& ranges) {
  CodepointRanges norm = NormalizeRanges(ranges);
  CodepointRanges out;
  uint32_t next = 0;
  for (auto [lo, hi] : norm) {
    if (lo > next) out.push_back({next, lo - 1});
    next = hi + 1;
  }
  if (next <= kMaxCodepoint) out.push_back({next, kMaxCodepoint});
  return NormalizeRanges(out);
}

CodepointRanges IntersectRanges(const CodepointRanges& a, const CodepointRanges& b) {
  CodepointRanges out;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    uint32_t lo = std::max(a[i].first, b[j].first);
    uint32_t hi = std::min(a[i].second, b[j].second);
    if (lo <= hi) out.push_back({lo, hi});
    if (a[i].second < b[j].second) {
      ++i;
    } else {
      ++j;
    }
  }
  return out;
}

bool IsRegular(const Expr& e) {
  if (e.kind == Expr::Kind::kRuleRef) return false;
  for (const auto& c : e.children) {
    if (!IsRegular(*c)) return false;
  }
  return true;
}

int64_t ExprSize(const Expr& e, int64_t cap) {
  int64_t n = 1;
  for (const auto& c : e.children) {
    n += ExprSize(*c, cap - n);
    if (n > cap) return n;
  }
  return n;
}

int Grammar::RuleId(absl::string_view name) {
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name) return static_cast<int>(i);
  }
  names.emplace_back(name);
  bodies.push_back(nullptr);
  return static_cast<int>(names.size()) - 1;
}

int Grammar::NewRule(absl::string_view hint) {
  std::string name = absl::StrCat(hint, "#", names.size());
  names.push_back(name);
  bodies.push_back(nullptr);
  return static_cast<int>(names.size()) - 1;
}

std::string ExprDebugString(const Expr& e, const Grammar* g) {
  switch (e.kind) {
    case Expr::Kind::kEmpty:
      return "()";
    case Expr::Kind::kBytes:
      return absl::StrCat("\"", absl::CEscape(e.bytes), "\"");
    case Expr::Kind::kByteSet:
      return absl::StrFormat("[bytes:%d]", e.byte_set.count());
    case Expr::Kind::kCodepoints: {
      std::string s = "[";
      for (auto [lo, hi] : e.ranges) absl::StrAppendFormat(&s, "%x-%x,", lo, hi);
      return s + "]";
    }
    case Expr::Kind::kSeq:
    case Expr::Kind::kAlt: {
      std::string s = "(";
      for (size_t i = 0; i < e.children.size(); ++i) {
        if (i > 0) s += e.kind == Expr::Kind::kAlt ? " | " : " ";
        s += ExprDebugString(*e.children[i], g);
      }
      return s + ")";
    }
    case Expr::Kind::kRepeat:
      return absl::StrFormat("%s{%d,%d}", ExprDebugString(*e.children[0], g), e.min,
                             e.max);
    case Expr::Kind::kRuleRef:
      return g != nullptr && e.rule < static_cast<int>(g->names.size())
                 ? g->names[e.rule]
                 : absl::StrCat("rule", e.rule);
  }
  return "?";
}

}  // namespace tandem::grammar
