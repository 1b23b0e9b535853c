// Budgets for compiling one constraint (ConstraintSpec) into an automaton.
// Over any of them, compilation stops with ResourceExhausted (a 400 at the
// API), never with an unconstrained grammar.
#ifndef TANDEM_ENGINE_GRAMMAR_COMPILE_LIMITS_H_
#define TANDEM_ENGINE_GRAMMAR_COMPILE_LIMITS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tandem::grammar {

struct CompileLimits {
  // Wall-clock time for one Compile (parse + automaton construction).
  absl::Duration max_compile_time = absl::Seconds(5);
  // Source text size (schema JSON, regex or EBNF).
  int64_t max_source_bytes = 1 << 20;
  // Nesting depth of the source (JSON Schema subschemas, regex groups,
  // EBNF parentheses).
  int max_nesting_depth = 64;
  // NFA + DFA states built for one grammar (memory: a DFA state is 1 KiB).
  int64_t max_automaton_states = 200000;
  // Whitespace bytes allowed between two JSON tokens (space, \n, \t, \r).
  // Bounded so that a model cannot loop on whitespace forever.
  int json_max_whitespace = 8;
  // Compiled grammars the GrammarCompiler keeps (LRU by spec hash).
  int cache_capacity = 256;
};

// Deadline + state counter shared by the passes of one compilation.
class CompileBudget {
 public:
  explicit CompileBudget(const CompileLimits& limits)
      : limits_(limits), deadline_(absl::Now() + limits.max_compile_time) {}

  const CompileLimits& limits() const { return limits_; }

  // ResourceExhausted once the deadline has passed.
  absl::Status CheckTime() const {
    if (absl::Now() > deadline_) {
      return absl::ResourceExhaustedError(
          "grammar compilation exceeded its time budget");
    }
    return absl::OkStatus();
  }
  // Counts `n` more automaton states; ResourceExhausted over the budget.
  absl::Status AddStates(int64_t n) {
    states_ += n;
    if (states_ > limits_.max_automaton_states) {
      return absl::ResourceExhaustedError(
          "grammar too large: more automaton states than the budget allows");
    }
    return absl::OkStatus();
  }
  int64_t states() const { return states_; }

 private:
  CompileLimits limits_;
  absl::Time deadline_;
  int64_t states_ = 0;
};

}  // namespace tandem::grammar

#endif  // TANDEM_ENGINE_GRAMMAR_COMPILE_LIMITS_H_
