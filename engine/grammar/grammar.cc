#include "engine/grammar/grammar.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/grammar/ebnf_parser.h"
#include "engine/grammar/json_schema.h"
#include "engine/grammar/regex_parser.h"
#include "engine/grammar/tool_calls.h"

namespace tandem::grammar {

std::string SpecKey(const ConstraintSpec& spec) {
  std::string key = absl::StrCat(static_cast<int>(spec.kind), ":", spec.source.size(),
                                 ":", spec.source);
  for (const std::string& c : spec.choices) {
    absl::StrAppend(&key, "|", c.size(), ":", c);
  }
  return key;
}

absl::StatusOr<Automaton> CompileToAutomaton(const ConstraintSpec& spec,
                                             const CompileLimits& limits) {
  int64_t size = static_cast<int64_t>(spec.source.size());
  for (const std::string& c : spec.choices) size += c.size();
  if (size > limits.max_source_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("constraint source is ", size,
                                                     " bytes; the limit is ",
                                                     limits.max_source_bytes));
  }
  CompileBudget budget(limits);
  Grammar g;
  switch (spec.kind) {
    case ConstraintSpec::Kind::kRegex: {
      RegexOptions options;
      options.max_depth = limits.max_nesting_depth;
      auto e = ParseRegex(spec.source, options);
      if (!e.ok()) return e.status();
      g.root = g.RuleId("root");
      g.bodies[g.root] = e->expr;
      break;
    }
    case ConstraintSpec::Kind::kChoice: {
      if (spec.choices.empty()) {
        return absl::InvalidArgumentError(
            "a choice constraint needs at least one choice");
      }
      std::vector<ExprPtr> alts;
      for (const std::string& c : spec.choices) alts.push_back(Bytes(c));
      g.root = g.RuleId("root");
      g.bodies[g.root] = Alt(std::move(alts));
      break;
    }
    case ConstraintSpec::Kind::kEbnf: {
      auto parsed = ParseEbnf(spec.source, limits.max_nesting_depth);
      if (!parsed.ok()) return parsed.status();
      g = std::move(*parsed);
      break;
    }
    case ConstraintSpec::Kind::kJsonSchema: {
      auto parsed = JsonSchemaToGrammar(spec.source, limits);
      if (!parsed.ok()) return parsed.status();
      g = std::move(*parsed);
      break;
    }
    case ConstraintSpec::Kind::kJsonObject:
      g = JsonObjectGrammar(limits);
      break;
    case ConstraintSpec::Kind::kToolCalls: {
      auto parsed = ToolCallsToGrammar(spec.source, limits);
      if (!parsed.ok()) return parsed.status();
      g = std::move(*parsed);
      break;
    }
  }
  return BuildAutomaton(g, &budget);
}

CompiledGrammar::CompiledGrammar(Automaton automaton,
                                 std::shared_ptr<const TokenVocabulary> vocab)
    : automaton_(std::move(automaton)),
      vocab_(std::move(vocab)),
      pda_(&automaton_),
      cache_(&pda_, vocab_.get()) {}

GrammarCompiler::GrammarCompiler(std::shared_ptr<const TokenVocabulary> vocab,
                                 CompileLimits limits)
    : vocab_(std::move(vocab)), limits_(limits) {}

int64_t GrammarCompiler::cache_hits() const {
  absl::MutexLock lock(&mu_);
  return hits_;
}

absl::StatusOr<std::shared_ptr<const CompiledGrammar>> GrammarCompiler::Compile(
    const ConstraintSpec& spec) {
  std::string key = SpecKey(spec);
  {
    absl::MutexLock lock(&mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second.lru);
      ++hits_;
      return it->second.grammar;
    }
  }
  auto automaton = CompileToAutomaton(spec, limits_);
  if (!automaton.ok()) return automaton.status();
  auto compiled =
      std::make_shared<const CompiledGrammar>(std::move(*automaton), vocab_);
  absl::MutexLock lock(&mu_);
  auto it = cache_.find(key);
  if (it != cache_.end()) return it->second.grammar;  // compiled concurrently
  if (limits_.cache_capacity > 0) {
    lru_.push_front(key);
    cache_.emplace(key, CacheEntry{compiled, lru_.begin()});
    while (static_cast<int>(lru_.size()) > limits_.cache_capacity) {
      cache_.erase(lru_.back());
      lru_.pop_back();
    }
  }
  return compiled;
}

GrammarMatcher::GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar,
                               int max_rollback_tokens)
    : grammar_(std::move(grammar)), max_rollback_(std::max(0, max_rollback_tokens)) {
  StepResult r;
  grammar_->pda().Start(&pool_, &state_.frontier, &r);
  state_.can_end = r.can_end;
}

bool GrammarMatcher::CanTerminate() const {
  return state_.can_end || state_.terminated;
}
bool GrammarMatcher::IsTerminated() const { return state_.terminated; }

bool GrammarMatcher::TokenAllowedFrom(const Item& item, const std::string& bytes) {
  const size_t mark = pool_.size();
  std::vector<Item> frontier = {item};
  bool ok = grammar_->pda().StepBytes(&frontier, bytes, &pool_, nullptr);
  pool_.Truncate(mark);
  return ok;
}

void GrammarMatcher::FillNextTokenBitmask(absl::Span<uint32_t> bitmask) {
  const TokenVocabulary& vocab = grammar_->vocab();
  std::fill(bitmask.begin(), bitmask.end(), 0u);
  if (static_cast<int32_t>(bitmask.size()) != vocab.bitmask_words()) return;
  auto set = [&](int32_t id) { bitmask[id >> 5] |= 1u << (id & 31); };
  if (!state_.terminated) {
    bool first = true;
    for (const Item& item : state_.frontier) {
      const MaskEntry& entry = grammar_->mask_cache().Get(item.position, item.state,
                                                          item.parent == kRootFrame);
      entry.OrAccepted(vocab, bitmask, /*overwrite=*/first);
      first = false;
      for (int32_t id : entry.uncertain) {
        if (bitmask[id >> 5] & (1u << (id & 31))) continue;
        if (TokenAllowedFrom(item, vocab.token_bytes(id))) set(id);
      }
    }
  }
  if (state_.can_end || state_.terminated) {
    for (int32_t id : vocab.stop_token_ids()) set(id);
  }
}

bool GrammarMatcher::AcceptBytes(absl::string_view bytes) {
  if (state_.terminated || bytes.empty()) return false;
  const size_t mark = pool_.size();
  State next;
  next.frontier = state_.frontier;
  StepResult last;
  if (!grammar_->pda().StepBytes(&next.frontier, bytes, &pool_, &last)) {
    pool_.Truncate(mark);
    return false;
  }
  next.can_end = last.can_end;
  history_.push_back(std::move(state_));
  if (static_cast<int>(history_.size()) > max_rollback_) history_.pop_front();
  state_ = std::move(next);
  return true;
}

bool GrammarMatcher::AcceptToken(int32_t token_id) {
  const TokenVocabulary& vocab = grammar_->vocab();
  if (state_.terminated || token_id < 0 || token_id >= vocab.size()) return false;
  if (vocab.is_stop(token_id)) {
    if (!state_.can_end) return false;
    history_.push_back(state_);
    if (static_cast<int>(history_.size()) > max_rollback_) history_.pop_front();
    state_.terminated = true;
    return true;
  }
  if (!vocab.matchable(token_id)) return false;
  return AcceptBytes(vocab.token_bytes(token_id));
}

absl::Status GrammarMatcher::Rollback(int n) {
  if (n < 0 || n > static_cast<int>(history_.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot roll back ", n, " tokens; ", history_.size(),
                     " can be undone (max_rollback_tokens ", max_rollback_, ")"));
  }
  if (n == 0) return absl::OkStatus();
  state_ = std::move(history_[history_.size() - n]);
  history_.resize(history_.size() - n);
  return absl::OkStatus();
}

std::string GrammarMatcher::FindJumpForwardString() {
  constexpr int kMaxBytes = 64;
  std::string out;
  if (state_.terminated) return out;
  const size_t mark = pool_.size();
  std::vector<Item> frontier = state_.frontier;
  std::vector<Item> next;
  bool can_end = state_.can_end;
  const Automaton& a = grammar_->automaton();
  while (!can_end && !frontier.empty() && static_cast<int>(out.size()) < kMaxBytes) {
    int only = -1;
    bool unique = true;
    for (const Item& it : frontier) {
      const Dfa& dfa = a.dfas[a.element(it.position).id];
      for (int b = 0; b < 256 && unique; ++b) {
        if (dfa.Next(it.state, b) < 0) continue;
        if (only < 0) {
          only = b;
        } else if (only != b) {
          unique = false;
        }
      }
      if (!unique) break;
    }
    if (!unique || only < 0) break;
    StepResult r =
        grammar_->pda().Step(frontier, static_cast<uint8_t>(only), &pool_, &next);
    out.push_back(static_cast<char>(only));
    frontier.swap(next);
    can_end = r.can_end;
  }
  pool_.Truncate(mark);
  return out;
}

void ApplyTokenBitmask(absl::Span<const uint32_t> bitmask, absl::Span<float> logits) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < logits.size(); ++i) {
    const size_t w = i >> 5;
    if (w >= bitmask.size() || !(bitmask[w] & (1u << (i & 31)))) logits[i] = neg_inf;
  }
}

}  // namespace tandem::grammar
