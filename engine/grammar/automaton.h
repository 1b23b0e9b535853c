// The byte-level pushdown automaton every constraint compiles to.
//
//   Grammar (expr.h) → inline non-recursive rules → per rule: alternatives of
//   element sequences, where each maximal regular run of a sequence becomes
//   ONE byte DFA element, and the rest are rule calls and repeats of rules.
//
// A non-recursive JSON Schema thus becomes a single DFA; recursion ($ref
// cycles, EBNF recursion, nested any-JSON values) uses the stack. The matcher
// (pda.h) keeps a set of stacks whose tops are DFA elements.
#ifndef TANDEM_ENGINE_GRAMMAR_AUTOMATON_H_
#define TANDEM_ENGINE_GRAMMAR_AUTOMATON_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/grammar/compile_limits.h"
#include "engine/grammar/expr.h"

namespace tandem::grammar {

// A trimmed byte DFA: every state can reach an accepting state.
struct Dfa {
  int32_t num_states = 0;
  int32_t start = 0;
  std::vector<int32_t> next;       // num_states * 256; -1 = no transition
  std::vector<uint8_t> accepting;  // per state
  std::vector<uint8_t> has_next;   // per state: some byte has a transition

  int32_t Next(int32_t state, uint8_t byte) const {
    return next[static_cast<size_t>(state) * 256 + byte];
  }
  // Whole-string match (tests).
  bool Matches(const std::string& s) const;
};

struct Element {
  enum class Kind : uint8_t { kDfa, kRule, kRepeat };
  Kind kind = Kind::kDfa;
  int32_t id = 0;   // DFA index (kDfa) or rule index (kRule, kRepeat)
  int32_t min = 1;  // kRepeat
  int32_t max = 1;  // kRepeat; kUnbounded for no upper bound
};

// Positions: every (rule, alternative, element index) has an id, with one
// extra id per alternative for "alternative complete"; ids of one
// alternative are consecutive, so the next element is position + 1.
struct Automaton {
  std::vector<Dfa> dfas;
  std::vector<std::vector<std::vector<Element>>> rules;  // rule → alts → seq
  std::vector<std::string> rule_names;
  int32_t root = 0;

  std::vector<std::vector<int32_t>> alt_position;  // rule → alt → first id
  std::vector<int32_t> position_rule;
  std::vector<int32_t> position_alt;
  std::vector<int32_t> position_elem;
  std::vector<uint8_t> position_is_end;
  // For a DFA element's position: mask_key_base[p] + DFA state is its mask
  // cache key; -1 for other positions.
  std::vector<int32_t> mask_key_base;
  int32_t num_mask_keys = 0;
  int64_t dfa_states = 0;

  const Element& element(int32_t position) const {
    return rules[position_rule[position]][position_alt[position]]
                [position_elem[position]];
  }
  int32_t num_positions() const { return static_cast<int32_t>(position_rule.size()); }
};

// Builds the automaton for `grammar` (its rules must all be defined).
// InvalidArgument: undefined rule, left recursion, empty language.
// ResourceExhausted: over the state or time budget.
absl::StatusOr<Automaton> BuildAutomaton(const Grammar& grammar, CompileBudget* budget);

// One regular expression (no rule references) as a trimmed DFA.
absl::StatusOr<Dfa> BuildDfa(const Expr& expr, CompileBudget* budget);

}  // namespace tandem::grammar

#endif  // TANDEM_ENGINE_GRAMMAR_AUTOMATON_H_
