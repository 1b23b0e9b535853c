#include "engine/grammar/automaton.h"

#include <algorithm>
#include <functional>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/tokenizer/utf8.h"

namespace tandem::grammar {
namespace {

// Rules whose inlined body is at most this many expression nodes are
// substituted into their callers (when not recursive).
constexpr int64_t kInlineMaxNodes = 4000;

// ---------------------------------------------------------------- NFA ------

struct NfaEdge {
  uint8_t lo;
  uint8_t hi;
  int32_t to;
};

class Nfa {
 public:
  explicit Nfa(CompileBudget* budget) : budget_(budget) {}

  struct Frag {
    int32_t start;
    int32_t end;
  };

  absl::StatusOr<int32_t> NewState() {
    if (eps_.size() % 256 == 0) {
      absl::Status s = budget_->AddStates(256);
      if (!s.ok()) return s;
      if (auto t = budget_->CheckTime(); !t.ok()) return t;
    }
    eps_.emplace_back();
    edges_.emplace_back();
    return static_cast<int32_t>(eps_.size()) - 1;
  }

  absl::StatusOr<Frag> Build(const Expr& e) {
    switch (e.kind) {
      case Expr::Kind::kEmpty: {
        auto s = NewState();
        if (!s.ok()) return s.status();
        return Frag{*s, *s};
      }
      case Expr::Kind::kBytes: {
        auto s = NewState();
        if (!s.ok()) return s.status();
        int32_t cur = *s;
        for (unsigned char c : e.bytes) {
          auto n = NewState();
          if (!n.ok()) return n.status();
          edges_[cur].push_back({c, c, *n});
          cur = *n;
        }
        return Frag{*s, cur};
      }
      case Expr::Kind::kByteSet: {
        auto s = NewState();
        auto t = NewState();
        if (!s.ok()) return s.status();
        if (!t.ok()) return t.status();
        int b = 0;
        while (b < 256) {
          if (!e.byte_set.test(b)) {
            ++b;
            continue;
          }
          int hi = b;
          while (hi + 1 < 256 && e.byte_set.test(hi + 1)) ++hi;
          edges_[*s].push_back({static_cast<uint8_t>(b), static_cast<uint8_t>(hi), *t});
          b = hi + 1;
        }
        return Frag{*s, *t};
      }
      case Expr::Kind::kCodepoints: {
        auto s = NewState();
        auto t = NewState();
        if (!s.ok()) return s.status();
        if (!t.ok()) return t.status();
        std::vector<std::vector<std::pair<uint8_t, uint8_t>>> seqs;
        for (auto [lo, hi] : e.ranges) Utf8Split(lo, hi, &seqs);
        for (const auto& seq : seqs) {
          int32_t cur = *s;
          for (size_t i = 0; i < seq.size(); ++i) {
            int32_t to = *t;
            if (i + 1 < seq.size()) {
              auto n = NewState();
              if (!n.ok()) return n.status();
              to = *n;
            }
            edges_[cur].push_back({seq[i].first, seq[i].second, to});
            cur = to;
          }
        }
        return Frag{*s, *t};
      }
      case Expr::Kind::kSeq: {
        auto first = Build(*e.children[0]);
        if (!first.ok()) return first;
        Frag f = *first;
        for (size_t i = 1; i < e.children.size(); ++i) {
          auto next = Build(*e.children[i]);
          if (!next.ok()) return next;
          eps_[f.end].push_back(next->start);
          f.end = next->end;
        }
        return f;
      }
      case Expr::Kind::kAlt: {
        auto s = NewState();
        auto t = NewState();
        if (!s.ok()) return s.status();
        if (!t.ok()) return t.status();
        for (const auto& c : e.children) {
          auto f = Build(*c);
          if (!f.ok()) return f;
          eps_[*s].push_back(f->start);
          eps_[f->end].push_back(*t);
        }
        return Frag{*s, *t};
      }
      case Expr::Kind::kRepeat: {
        auto s = NewState();
        if (!s.ok()) return s.status();
        Frag f{*s, *s};
        for (int i = 0; i < e.min; ++i) {
          auto c = Build(*e.children[0]);
          if (!c.ok()) return c;
          eps_[f.end].push_back(c->start);
          f.end = c->end;
        }
        if (e.max == kUnbounded) {
          auto c = Build(*e.children[0]);
          if (!c.ok()) return c;
          auto t = NewState();
          if (!t.ok()) return t.status();
          eps_[f.end].push_back(c->start);
          eps_[f.end].push_back(*t);
          eps_[c->end].push_back(c->start);
          eps_[c->end].push_back(*t);
          f.end = *t;
        } else {
          // Nested optionals: (c (c (c)?)?)? keeps the automaton linear.
          auto t = NewState();
          if (!t.ok()) return t.status();
          for (int i = e.min; i < e.max; ++i) {
            auto c = Build(*e.children[0]);
            if (!c.ok()) return c;
            eps_[f.end].push_back(c->start);
            eps_[f.end].push_back(*t);
            f.end = c->end;
          }
          eps_[f.end].push_back(*t);
          f.end = *t;
        }
        return f;
      }
      case Expr::Kind::kRuleRef:
        return absl::InternalError("rule reference inside a regular run");
    }
    return absl::InternalError("bad expression kind");
  }

  // Subset construction, then trimming of states that cannot accept.
  absl::StatusOr<Dfa> ToDfa(Frag frag) {
    const int32_t accept = frag.end;
    std::vector<std::vector<int32_t>> sets;
    absl::flat_hash_map<std::vector<int32_t>, int32_t> ids;
    std::vector<int32_t> next;
    std::vector<uint8_t> accepting;
    std::vector<uint8_t> mark(eps_.size(), 0);

    auto closure = [&](std::vector<int32_t> seed) {
      std::vector<int32_t> out;
      std::vector<int32_t> work = std::move(seed);
      while (!work.empty()) {
        int32_t s = work.back();
        work.pop_back();
        if (mark[s]) continue;
        mark[s] = 1;
        out.push_back(s);
        for (int32_t t : eps_[s]) work.push_back(t);
      }
      for (int32_t s : out) mark[s] = 0;
      std::sort(out.begin(), out.end());
      return out;
    };
    auto intern = [&](std::vector<int32_t> set) -> absl::StatusOr<int32_t> {
      auto it = ids.find(set);
      if (it != ids.end()) return it->second;
      absl::Status s = budget_->AddStates(1);
      if (!s.ok()) return s;
      if ((sets.size() & 63) == 0) {
        if (auto t = budget_->CheckTime(); !t.ok()) return t;
      }
      int32_t id = static_cast<int32_t>(sets.size());
      accepting.push_back(std::binary_search(set.begin(), set.end(), accept));
      ids.emplace(set, id);
      sets.push_back(std::move(set));
      next.resize(next.size() + 256, -1);
      return id;
    };
    auto start = intern(closure({frag.start}));
    if (!start.ok()) return start.status();
    std::vector<std::vector<int32_t>> targets(256);
    for (size_t d = 0; d < sets.size(); ++d) {
      for (auto& t : targets) t.clear();
      for (int32_t s : sets[d]) {
        for (const NfaEdge& e : edges_[s]) {
          for (int b = e.lo; b <= e.hi; ++b) targets[b].push_back(e.to);
        }
      }
      for (int b = 0; b < 256; ++b) {
        if (targets[b].empty()) continue;
        auto id = intern(closure(targets[b]));
        if (!id.ok()) return id.status();
        next[d * 256 + b] = *id;
      }
    }
    // Trim: keep states from which an accepting state is reachable.
    const int32_t n = static_cast<int32_t>(sets.size());
    std::vector<std::vector<int32_t>> rev(n);
    for (int32_t s = 0; s < n; ++s) {
      for (int b = 0; b < 256; ++b) {
        int32_t t = next[s * 256 + b];
        if (t >= 0) rev[t].push_back(s);
      }
    }
    std::vector<uint8_t> live(n, 0);
    std::vector<int32_t> work;
    for (int32_t s = 0; s < n; ++s) {
      if (accepting[s]) {
        live[s] = 1;
        work.push_back(s);
      }
    }
    while (!work.empty()) {
      int32_t s = work.back();
      work.pop_back();
      for (int32_t p : rev[s]) {
        if (!live[p]) {
          live[p] = 1;
          work.push_back(p);
        }
      }
    }
    Dfa dfa;
    if (!live[*start]) return dfa;  // the empty language
    std::vector<int32_t> remap(n, -1);
    for (int32_t s = 0; s < n; ++s) {
      if (live[s]) remap[s] = dfa.num_states++;
    }
    dfa.start = remap[*start];
    dfa.next.assign(static_cast<size_t>(dfa.num_states) * 256, -1);
    dfa.accepting.assign(dfa.num_states, 0);
    dfa.has_next.assign(dfa.num_states, 0);
    for (int32_t s = 0; s < n; ++s) {
      if (!live[s]) continue;
      int32_t r = remap[s];
      dfa.accepting[r] = accepting[s];
      for (int b = 0; b < 256; ++b) {
        int32_t t = next[s * 256 + b];
        if (t >= 0 && live[t]) {
          dfa.next[static_cast<size_t>(r) * 256 + b] = remap[t];
          dfa.has_next[r] = 1;
        }
      }
    }
    return dfa;
  }

 private:
  // Code points [lo, hi] as sequences of UTF-8 byte ranges (the standard
  // split into ranges with a common encoded prefix shape).
  static void Utf8Split(uint32_t lo, uint32_t hi,
                        std::vector<std::vector<std::pair<uint8_t, uint8_t>>>* out) {
    static constexpr uint32_t kMaxLen[] = {0x7F, 0x7FF, 0xFFFF};
    for (uint32_t m : kMaxLen) {
      if (lo <= m && hi > m) {
        Utf8Split(lo, m, out);
        Utf8Split(m + 1, hi, out);
        return;
      }
    }
    if (hi <= 0x7F) {
      out->push_back({{static_cast<uint8_t>(lo), static_cast<uint8_t>(hi)}});
      return;
    }
    for (int i = 1; i < 4; ++i) {
      uint32_t m = (1u << (6 * i)) - 1;
      if ((lo & ~m) != (hi & ~m)) {
        if ((lo & m) != 0) {
          Utf8Split(lo, lo | m, out);
          Utf8Split((lo | m) + 1, hi, out);
          return;
        }
        if ((hi & m) != m) {
          Utf8Split(lo, (hi & ~m) - 1, out);
          Utf8Split(hi & ~m, hi, out);
          return;
        }
      }
    }
    std::string a = Encode(lo), b = Encode(hi);
    std::vector<std::pair<uint8_t, uint8_t>> seq;
    for (size_t i = 0; i < a.size(); ++i) {
      seq.push_back({static_cast<uint8_t>(a[i]), static_cast<uint8_t>(b[i])});
    }
    out->push_back(std::move(seq));
  }

  static std::string Encode(uint32_t cp) {
    std::string s;
    tokenizer::AppendUtf8(static_cast<char32_t>(cp), &s);
    return s;
  }

  CompileBudget* budget_;  // not owned
  std::vector<std::vector<int32_t>> eps_;
  std::vector<std::vector<NfaEdge>> edges_;
};

// ------------------------------------------------------------ lowering -----

class Lowering {
 public:
  Lowering(const Grammar& g, CompileBudget* budget) : g_(g), budget_(budget) {}

  absl::StatusOr<Automaton> Run() {
    const int n = static_cast<int>(g_.names.size());
    for (int r = 0; r < n; ++r) {
      if (g_.bodies[r] == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("rule '", g_.names[r], "' is used but not defined"));
      }
    }
    if (g_.root < 0 || g_.root >= n) {
      return absl::InvalidArgumentError("the grammar has no root rule");
    }
    FindRecursiveRules();
    inlined_.assign(n, nullptr);
    out_rule_.assign(n, -1);
    // Lower the root and, transitively, every rule it still calls.
    auto root = OutRule(g_.root);
    if (!root.ok()) return root.status();
    a_.root = *root;
    while (!pending_.empty()) {
      auto [src, dst] = pending_.back();
      pending_.pop_back();
      auto body = Inlined(src);
      if (!body.ok()) return body.status();
      auto alts = LowerAlts(**body, g_.names[src]);
      if (!alts.ok()) return alts.status();
      a_.rules[dst] = std::move(*alts);
    }
    if (auto s = RemoveUnproductive(); !s.ok()) return s;
    if (auto s = CheckLeftRecursion(); !s.ok()) return s;
    Number();
    return std::move(a_);
  }

 private:
  // Tarjan's SCC over rule references: a rule in a cycle is recursive.
  void FindRecursiveRules() {
    const int n = static_cast<int>(g_.names.size());
    std::vector<std::vector<int>> calls(n);
    for (int r = 0; r < n; ++r) CollectRefs(*g_.bodies[r], &calls[r]);
    recursive_.assign(n, 0);
    std::vector<int> index(n, -1), low(n, 0), stack;
    std::vector<uint8_t> on(n, 0);
    int counter = 0;
    std::function<void(int)> visit = [&](int v) {
      index[v] = low[v] = counter++;
      stack.push_back(v);
      on[v] = 1;
      for (int w : calls[v]) {
        if (index[w] < 0) {
          visit(w);
          low[v] = std::min(low[v], low[w]);
        } else if (on[w]) {
          low[v] = std::min(low[v], index[w]);
        }
      }
      if (low[v] == index[v]) {
        std::vector<int> comp;
        int w;
        do {
          w = stack.back();
          stack.pop_back();
          on[w] = 0;
          comp.push_back(w);
        } while (w != v);
        bool self = std::find(calls[v].begin(), calls[v].end(), v) != calls[v].end();
        if (comp.size() > 1 || self) {
          for (int c : comp) recursive_[c] = 1;
        }
      }
    };
    for (int r = 0; r < n; ++r) {
      if (index[r] < 0) visit(r);
    }
  }

  static void CollectRefs(const Expr& e, std::vector<int>* out) {
    if (e.kind == Expr::Kind::kRuleRef) out->push_back(e.rule);
    for (const auto& c : e.children) CollectRefs(*c, out);
  }

  // The body of `rule` with calls of small non-recursive rules substituted.
  absl::StatusOr<ExprPtr> Inlined(int rule) {
    if (inlined_[rule] != nullptr) return inlined_[rule];
    auto e = Substitute(g_.bodies[rule]);
    if (!e.ok()) return e;
    inlined_[rule] = *e;
    return *e;
  }

  absl::StatusOr<ExprPtr> Substitute(const ExprPtr& e) {
    if (auto t = budget_->CheckTime(); !t.ok()) return t;
    if (e->kind == Expr::Kind::kRuleRef) {
      if (recursive_[e->rule]) return e;
      auto body = Inlined(e->rule);
      if (!body.ok()) return body;
      if (ExprSize(**body, kInlineMaxNodes + 1) <= kInlineMaxNodes) {
        return *body;
      }
      return e;
    }
    if (e->children.empty()) return e;
    auto copy = std::make_shared<Expr>(*e);
    bool changed = false;
    for (auto& c : copy->children) {
      auto s = Substitute(c);
      if (!s.ok()) return s;
      if (*s != c) changed = true;
      c = *s;
    }
    if (!changed) return e;
    return ExprPtr(copy);
  }

  absl::StatusOr<int32_t> OutRule(int src) {
    if (out_rule_[src] >= 0) return out_rule_[src];
    int32_t id = static_cast<int32_t>(a_.rules.size());
    a_.rules.emplace_back();
    a_.rule_names.push_back(g_.names[src]);
    out_rule_[src] = id;
    pending_.push_back({src, id});
    return id;
  }

  int32_t HelperRule(const std::string& hint) {
    int32_t id = static_cast<int32_t>(a_.rules.size());
    a_.rules.emplace_back();
    a_.rule_names.push_back(absl::StrCat(hint, "$", id));
    return id;
  }

  absl::StatusOr<std::vector<std::vector<Element>>> LowerAlts(const Expr& e,
                                                              const std::string& hint) {
    std::vector<std::vector<Element>> alts;
    if (e.kind == Expr::Kind::kAlt && !IsRegular(e)) {
      for (const auto& c : e.children) {
        auto seq = LowerSeq(*c, hint);
        if (!seq.ok()) return seq.status();
        alts.push_back(std::move(*seq));
      }
    } else {
      auto seq = LowerSeq(e, hint);
      if (!seq.ok()) return seq.status();
      alts.push_back(std::move(*seq));
    }
    return alts;
  }

  absl::StatusOr<std::vector<Element>> LowerSeq(const Expr& e,
                                                const std::string& hint) {
    std::vector<const Expr*> items;
    if (e.kind == Expr::Kind::kSeq) {
      for (const auto& c : e.children) items.push_back(c.get());
    } else {
      items.push_back(&e);
    }
    std::vector<Element> out;
    std::vector<ExprPtr> run;
    auto flush = [&]() -> absl::Status {
      if (run.empty()) return absl::OkStatus();
      ExprPtr seq = Seq(run);
      run.clear();
      Nfa nfa(budget_);
      auto frag = nfa.Build(*seq);
      if (!frag.ok()) return frag.status();
      auto dfa = nfa.ToDfa(*frag);
      if (!dfa.ok()) return dfa.status();
      if (dfa->num_states == 1 && !dfa->has_next[0] && dfa->accepting[0]) {
        return absl::OkStatus();  // matches only ""
      }
      Element el;
      el.kind = Element::Kind::kDfa;
      el.id = static_cast<int32_t>(a_.dfas.size());
      a_.dfa_states += dfa->num_states;
      a_.dfas.push_back(std::move(*dfa));
      out.push_back(el);
      return absl::OkStatus();
    };
    for (const Expr* item : items) {
      if (IsRegular(*item)) {
        // Shared pointers are needed by Seq(); wrap without copying children.
        run.push_back(ExprPtr(ExprPtr{}, item));
        continue;
      }
      if (auto s = flush(); !s.ok()) return s;
      Element el;
      switch (item->kind) {
        case Expr::Kind::kRuleRef: {
          auto r = OutRule(item->rule);
          if (!r.ok()) return r.status();
          el.kind = Element::Kind::kRule;
          el.id = *r;
          break;
        }
        case Expr::Kind::kRepeat: {
          const Expr& body = *item->children[0];
          int32_t r;
          if (body.kind == Expr::Kind::kRuleRef) {
            auto o = OutRule(body.rule);
            if (!o.ok()) return o.status();
            r = *o;
          } else {
            r = HelperRule(hint);
            auto alts = LowerAlts(body, hint);
            if (!alts.ok()) return alts.status();
            a_.rules[r] = std::move(*alts);
          }
          el.kind = Element::Kind::kRepeat;
          el.id = r;
          el.min = item->min;
          el.max = item->max;
          break;
        }
        default: {  // kAlt or kSeq with a rule reference inside
          int32_t r = HelperRule(hint);
          auto alts = LowerAlts(*item, hint);
          if (!alts.ok()) return alts.status();
          a_.rules[r] = std::move(*alts);
          el.kind = Element::Kind::kRule;
          el.id = r;
          break;
        }
      }
      out.push_back(el);
    }
    if (auto s = flush(); !s.ok()) return s;
    return out;
  }

  bool ElementProductive(const Element& el,
                         const std::vector<uint8_t>& productive) const {
    switch (el.kind) {
      case Element::Kind::kDfa:
        return a_.dfas[el.id].num_states > 0;
      case Element::Kind::kRule:
        return productive[el.id];
      case Element::Kind::kRepeat:
        return el.min == 0 || productive[el.id];
    }
    return false;
  }

  // Drops alternatives that can derive no string; the root must remain.
  absl::Status RemoveUnproductive() {
    const size_t n = a_.rules.size();
    std::vector<uint8_t> productive(n, 0);
    bool changed = true;
    while (changed) {
      changed = false;
      for (size_t r = 0; r < n; ++r) {
        if (productive[r]) continue;
        for (const auto& alt : a_.rules[r]) {
          bool ok = true;
          for (const Element& el : alt) ok = ok && ElementProductive(el, productive);
          if (ok) {
            productive[r] = 1;
            changed = true;
            break;
          }
        }
      }
    }
    if (!productive[a_.root]) {
      return absl::InvalidArgumentError(
          "the constraint admits no output at all (an empty language)");
    }
    for (size_t r = 0; r < n; ++r) {
      auto& alts = a_.rules[r];
      std::vector<std::vector<Element>> kept;
      for (auto& alt : alts) {
        bool ok = true;
        for (const Element& el : alt) ok = ok && ElementProductive(el, productive);
        if (!ok) continue;
        // A repeat of an unproductive rule can only be taken zero times.
        std::vector<Element> seq;
        for (Element el : alt) {
          if (el.kind == Element::Kind::kRepeat && !productive[el.id]) continue;
          seq.push_back(el);
        }
        kept.push_back(std::move(seq));
      }
      alts = std::move(kept);
    }
    return absl::OkStatus();
  }

  absl::Status CheckLeftRecursion() {
    const size_t n = a_.rules.size();
    std::vector<uint8_t> nullable(n, 0);
    auto el_nullable = [&](const Element& el) {
      switch (el.kind) {
        case Element::Kind::kDfa:
          return a_.dfas[el.id].accepting[a_.dfas[el.id].start] != 0;
        case Element::Kind::kRule:
          return nullable[el.id] != 0;
        case Element::Kind::kRepeat:
          return el.min == 0 || nullable[el.id] != 0;
      }
      return false;
    };
    bool changed = true;
    while (changed) {
      changed = false;
      for (size_t r = 0; r < n; ++r) {
        if (nullable[r]) continue;
        for (const auto& alt : a_.rules[r]) {
          bool all = true;
          for (const Element& el : alt) all = all && el_nullable(el);
          if (all) {
            nullable[r] = 1;
            changed = true;
            break;
          }
        }
      }
    }
    // Left-corner graph: r → s when s can be called before any byte.
    std::vector<std::vector<int32_t>> left(n);
    for (size_t r = 0; r < n; ++r) {
      for (const auto& alt : a_.rules[r]) {
        for (const Element& el : alt) {
          if (el.kind != Element::Kind::kDfa) left[r].push_back(el.id);
          if (!el_nullable(el)) break;
        }
      }
    }
    std::vector<uint8_t> color(n, 0);  // 0 new, 1 on path, 2 done
    std::function<int32_t(int32_t)> dfs = [&](int32_t v) -> int32_t {
      color[v] = 1;
      for (int32_t w : left[v]) {
        if (color[w] == 1) return w;
        if (color[w] == 0) {
          int32_t c = dfs(w);
          if (c >= 0) return c;
        }
      }
      color[v] = 2;
      return -1;
    };
    for (size_t r = 0; r < n; ++r) {
      if (color[r] != 0) continue;
      int32_t c = dfs(static_cast<int32_t>(r));
      if (c >= 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("left recursion (rule '", a_.rule_names[c],
                         "' can call itself before reading a byte) is not supported; "
                         "rewrite it with repetition"));
      }
    }
    return absl::OkStatus();
  }

  void Number() {
    const size_t n = a_.rules.size();
    a_.alt_position.assign(n, {});
    for (size_t r = 0; r < n; ++r) {
      for (size_t alt = 0; alt < a_.rules[r].size(); ++alt) {
        a_.alt_position[r].push_back(a_.num_positions());
        const auto& seq = a_.rules[r][alt];
        for (size_t e = 0; e <= seq.size(); ++e) {
          a_.position_rule.push_back(static_cast<int32_t>(r));
          a_.position_alt.push_back(static_cast<int32_t>(alt));
          a_.position_elem.push_back(static_cast<int32_t>(e));
          a_.position_is_end.push_back(e == seq.size());
          if (e < seq.size() && seq[e].kind == Element::Kind::kDfa) {
            a_.mask_key_base.push_back(a_.num_mask_keys);
            a_.num_mask_keys += a_.dfas[seq[e].id].num_states;
          } else {
            a_.mask_key_base.push_back(-1);
          }
        }
      }
    }
  }

  const Grammar& g_;
  CompileBudget* budget_;  // not owned
  Automaton a_;
  std::vector<uint8_t> recursive_;
  std::vector<ExprPtr> inlined_;
  std::vector<int32_t> out_rule_;
  std::vector<std::pair<int, int32_t>> pending_;
};

}  // namespace

bool Dfa::Matches(const std::string& s) const {
  if (num_states == 0) return false;
  int32_t st = start;
  for (unsigned char c : s) {
    st = Next(st, c);
    if (st < 0) return false;
  }
  return accepting[st] != 0;
}

absl::StatusOr<Dfa> BuildDfa(const Expr& expr, CompileBudget* budget) {
  if (!IsRegular(expr)) {
    return absl::InvalidArgumentError("expression is not regular");
  }
  Nfa nfa(budget);
  auto frag = nfa.Build(expr);
  if (!frag.ok()) return frag.status();
  return nfa.ToDfa(*frag);
}

absl::StatusOr<Automaton> BuildAutomaton(const Grammar& grammar,
                                         CompileBudget* budget) {
  return Lowering(grammar, budget).Run();
}

}  // namespace tandem::grammar
