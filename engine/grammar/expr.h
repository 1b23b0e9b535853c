// The front ends' common output: a grammar of named rules whose bodies are
// expressions over bytes / Unicode code points, sequences, alternatives,
// bounded or unbounded repeats and rule references. Regexes, choice lists,
// EBNF and JSON Schema all compile to this; automaton.h lowers it to the byte
// pushdown automaton the matcher runs.
#ifndef TANDEM_ENGINE_GRAMMAR_EXPR_H_
#define TANDEM_ENGINE_GRAMMAR_EXPR_H_

#include <bitset>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace tandem::grammar {

inline constexpr int kUnbounded = -1;
inline constexpr uint32_t kMaxCodepoint = 0x10FFFF;

// Inclusive code point ranges, sorted and disjoint.
using CodepointRanges = std::vector<std::pair<uint32_t, uint32_t>>;

struct Expr;
using ExprPtr = std::shared_ptr<const Expr>;

struct Expr {
  enum class Kind {
    kEmpty,       // matches ""
    kBytes,       // the literal bytes
    kByteSet,     // one byte out of byte_set
    kCodepoints,  // one UTF-8 encoded code point out of ranges
    kSeq,         // children in order
    kAlt,         // one of children
    kRepeat,      // children[0] between min and max (kUnbounded) times
    kRuleRef,     // the rule with index `rule`
  };
  Kind kind = Kind::kEmpty;
  std::string bytes;
  std::bitset<256> byte_set;
  CodepointRanges ranges;
  std::vector<ExprPtr> children;
  int min = 0;
  int max = 0;
  int rule = -1;
};

ExprPtr Empty();
ExprPtr Bytes(absl::string_view bytes);
ExprPtr ByteSet(const std::bitset<256>& set);
ExprPtr ByteRange(uint8_t lo, uint8_t hi);
// Empty `ranges` never matches (an empty alternation).
ExprPtr Codepoints(CodepointRanges ranges);
ExprPtr Seq(std::vector<ExprPtr> children);
ExprPtr Alt(std::vector<ExprPtr> children);
ExprPtr Repeat(ExprPtr child, int min, int max);
ExprPtr Optional(ExprPtr child);
ExprPtr Star(ExprPtr child);
ExprPtr Plus(ExprPtr child);
ExprPtr Ref(int rule);

// Code point set algebra (ranges sorted, merged; surrogates never included).
CodepointRanges NormalizeRanges(CodepointRanges ranges);
CodepointRanges ComplementRanges(const CodepointRanges& ranges);
CodepointRanges IntersectRanges(const CodepointRanges& a, const CodepointRanges& b);
CodepointRanges AnyCodepoint();

// True when `e` contains no rule reference (a regular expression).
bool IsRegular(const Expr& e);
// Number of nodes (shared subtrees counted each time they occur).
int64_t ExprSize(const Expr& e, int64_t cap);

// Named rules; the root rule derives the whole output.
struct Grammar {
  std::vector<std::string> names;
  std::vector<ExprPtr> bodies;  // nullptr until defined
  int root = 0;

  // Index of `name`, adding an undefined rule when new.
  int RuleId(absl::string_view name);
  // Index of a new rule named after `hint` (made unique).
  int NewRule(absl::string_view hint);
};

// Debug form of an expression (tests, errors).
std::string ExprDebugString(const Expr& e, const Grammar* g = nullptr);

}  // namespace tandem::grammar

#endif  // TANDEM_ENGINE_GRAMMAR_EXPR_H_
