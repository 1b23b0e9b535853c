// One request's structured-output state: the grammar matcher
// (engine/grammar/grammar.h) wrapped in the framing a chat response needs.
//
// A StructuredOutputSpec's output is, in order (the phases):
//
//   kFree     free_until_token_id >= 0 only: any token except
//             free_banned_token_ids (the stop and structure tokens a thinking
//             channel must not end or nest with) until free_until_token_id is
//             sampled (K3: the `<|close|>` that ends the think channel);
//   kPrefix   the forced prefix_token_ids, one per step (K3: `think<|sep|>
//             <|open|>response<|sep|>`, or a tool call's header);
//   kGrammar  tokens the matcher allows. Where the grammar may end, the
//             model's stop tokens are allowed (the matcher's own rule); with a
//             terminator_token_id they are replaced by that token (K3:
//             `<|close|>` of the response or json element);
//   kSuffix   after the terminator: the forced suffix_token_ids (K3: the rest
//             of the closing structure and `<|end_of_msg|>`, a stop token);
//   kDone     the grammar ended (a stop token, or the suffix is written): only
//             the stop tokens are allowed (the request's stop check ends it).
//
// A forced token is a mask with one bit, so greedy and random sampling, and
// speculative verification, all pick it. Every Accept is checked against the
// mask it was sampled under: a token the state does not allow is
// InvalidArgument (a hand-off whose tokens break the constraint is refused).
//
// Rollback(n) undoes the last n accepted tokens, across phases (speculative
// verification advances through drafts to compute each position's mask, then
// rolls back to the accepted prefix). At most `max_rollback` tokens back.
//
// Not thread-safe; one per request. The mask of different requests may be
// filled on different threads at once.
#ifndef TANDEM_ENGINE_SAMPLING_STRUCTURED_OUTPUT_H_
#define TANDEM_ENGINE_SAMPLING_STRUCTURED_OUTPUT_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/grammar/grammar.h"
#include "engine/sampling/sampling_params.h"

namespace tandem::engine {

// The grammar library's spec of a constraint (kind, source, choices).
grammar::ConstraintSpec GrammarSpecOf(const StructuredOutputSpec& spec);

class OutputConstraint {
 public:
  enum class Phase { kFree, kPrefix, kGrammar, kSuffix, kDone };

  // `grammar` compiled from `spec` over a vocabulary of grammar_vocab_size
  // tokens whose stop tokens are `stop_token_ids`; masks cover `vocab_size`
  // tokens (the model's, which may exceed the tokenizer's: the extra ids are
  // never allowed).
  static absl::StatusOr<std::unique_ptr<OutputConstraint>> Create(
      std::shared_ptr<const grammar::CompiledGrammar> grammar,
      const StructuredOutputSpec& spec, absl::Span<const int32_t> stop_token_ids,
      int64_t grammar_vocab_size, int64_t vocab_size, int max_rollback);

  // Words of a mask: ceil(vocab_size / 32).
  int64_t mask_words() const { return (vocab_size_ + 31) / 32; }
  // The tokens allowed next (bit i of word i / 32), mask_words() words.
  void FillNextTokenBitmask(absl::Span<uint32_t> mask);
  // Advances by a sampled token; InvalidArgument when the state forbids it
  // (the state is then unchanged).
  absl::Status Accept(int32_t token);
  // Whether Accept(token) would succeed (state unchanged).
  bool Allows(int32_t token);
  // Undoes the last n accepted tokens (n <= max_rollback and accepted).
  absl::Status Rollback(int n);

  Phase phase() const { return phase_; }
  // The grammar has ended (the rest is forced or a stop token).
  bool Done() const { return phase_ == Phase::kDone; }

 private:
  OutputConstraint() = default;
  struct Point {  // where the state was before an accepted token
    Phase phase;
    int32_t index;
    bool grammar_token;  // the matcher accepted it
  };
  bool IsStop(int32_t token) const;
  void FillGrammar(absl::Span<uint32_t> mask);

  StructuredOutputSpec spec_;
  std::vector<int32_t> stop_ids_;
  int64_t vocab_size_ = 0;
  int64_t grammar_vocab_size_ = 0;
  int64_t grammar_words_ = 0;  // the matcher's mask width
  int max_rollback_ = 0;
  std::unique_ptr<grammar::GrammarMatcher> matcher_;
  Phase phase_ = Phase::kFree;
  int32_t index_ = 0;           // into prefix_token_ids / suffix_token_ids
  std::vector<Point> history_;  // the last max_rollback accepted tokens
  std::vector<uint32_t> scratch_;
};

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_SAMPLING_STRUCTURED_OUTPUT_H_
