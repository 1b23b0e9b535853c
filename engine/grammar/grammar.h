// Structured outputs: the grammar engine (issue #21). See README.md.
//
//   ConstraintSpec ──GrammarCompiler::Compile (cached by spec hash, LRU)──►
//   CompiledGrammar (byte pushdown automaton + shared token mask cache)
//   ──► GrammarMatcher per request: FillNextTokenBitmask → sample →
//       AcceptToken (→ Rollback for rejected speculative drafts)
//
// Thread safety: TokenVocabulary, CompiledGrammar and GrammarCompiler are
// safe to share; a GrammarMatcher belongs to one request (one thread at a
// time).
#ifndef TANDEM_ENGINE_GRAMMAR_GRAMMAR_H_
#define TANDEM_ENGINE_GRAMMAR_GRAMMAR_H_

#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "engine/grammar/automaton.h"
#include "engine/grammar/compile_limits.h"
#include "engine/grammar/pda.h"
#include "engine/grammar/token_mask_cache.h"
#include "engine/grammar/token_vocabulary.h"

namespace tandem::grammar {

struct ConstraintSpec {
  // kToolCalls: one or more tool calls in the structure tokens' markup
  // (tool_calls.h; the source is its JSON).
  enum class Kind { kJsonObject, kJsonSchema, kRegex, kChoice, kEbnf, kToolCalls };
  Kind kind = Kind::kJsonObject;
  std::string source;  // schema JSON text / regex / EBNF text / tool calls JSON
  std::vector<std::string> choices;  // kChoice
};

// Stable text key of a spec (kind + contents); the compiler's cache key.
std::string SpecKey(const ConstraintSpec& spec);

// An immutable compiled constraint; its token mask cache fills lazily
// (internally synchronised), so it is shareable across requests and threads.
class CompiledGrammar {
 public:
  CompiledGrammar(Automaton automaton, std::shared_ptr<const TokenVocabulary> vocab);
  CompiledGrammar(const CompiledGrammar&) = delete;
  CompiledGrammar& operator=(const CompiledGrammar&) = delete;

  const TokenVocabulary& vocab() const { return *vocab_; }
  const Automaton& automaton() const { return automaton_; }
  const Pda& pda() const { return pda_; }
  const TokenMaskCache& mask_cache() const { return cache_; }
  // TokenMaskCache::PrecomputeUntil: fills the mask cache ahead of use.
  bool PrecomputeMasks(absl::Time deadline) const {
    return cache_.PrecomputeUntil(deadline);
  }

 private:
  Automaton automaton_;
  std::shared_ptr<const TokenVocabulary> vocab_;
  Pda pda_;
  TokenMaskCache cache_;
};

// Compiles a spec to the automaton only (no vocabulary): front ends + lowering.
absl::StatusOr<Automaton> CompileToAutomaton(const ConstraintSpec& spec,
                                             const CompileLimits& limits);

class GrammarCompiler {
 public:
  GrammarCompiler(std::shared_ptr<const TokenVocabulary> vocab,
                  CompileLimits limits = CompileLimits());

  // InvalidArgument naming the unsupported feature / the error position;
  // ResourceExhausted when over the time/memory/depth budget.
  absl::StatusOr<std::shared_ptr<const CompiledGrammar>> Compile(
      const ConstraintSpec& spec);

  const TokenVocabulary& vocab() const { return *vocab_; }
  const CompileLimits& limits() const { return limits_; }
  int64_t cache_hits() const;

 private:
  std::shared_ptr<const TokenVocabulary> vocab_;
  CompileLimits limits_;
  mutable absl::Mutex mu_;
  std::list<std::string> lru_ ABSL_GUARDED_BY(mu_);  // front = newest
  struct CacheEntry {
    std::shared_ptr<const CompiledGrammar> grammar;
    std::list<std::string>::iterator lru;
  };
  absl::flat_hash_map<std::string, CacheEntry> cache_ ABSL_GUARDED_BY(mu_);
  int64_t hits_ ABSL_GUARDED_BY(mu_) = 0;
};

class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const CompiledGrammar> grammar,
                          int max_rollback_tokens = 16);

  // Bitmask of allowed next tokens: bit i of word i/32 = token i allowed;
  // bitmask.size() must be ceil(vocab/32) (otherwise nothing is written).
  // Stop tokens are allowed exactly when the bytes so far are a complete
  // match (alongside whatever continues the match); special tokens never.
  void FillNextTokenBitmask(absl::Span<uint32_t> bitmask);
  // Accepts a token; false (state unchanged) when it is not allowed.
  bool AcceptToken(int32_t token_id);
  // Undoes the last n accepted tokens; InvalidArgument when n is negative or
  // more than were accepted / kept (max_rollback_tokens).
  absl::Status Rollback(int n);
  bool CanTerminate() const;  // the bytes so far are a complete match
  bool IsTerminated() const;  // a stop token was accepted
  // Bytes the grammar forces next (for jump-forward); may be empty.
  std::string FindJumpForwardString();
  // Bytes accepted so far would be valid (tests): AcceptBytes without tokens.
  bool AcceptBytes(absl::string_view bytes);
  const CompiledGrammar& grammar() const { return *grammar_; }

 private:
  struct State {
    std::vector<Item> frontier;
    bool can_end = false;
    bool terminated = false;
  };
  bool TokenAllowedFrom(const Item& item, const std::string& bytes);

  std::shared_ptr<const CompiledGrammar> grammar_;
  int max_rollback_;
  FramePool pool_;
  State state_;
  std::deque<State> history_;
  std::vector<uint32_t> scratch_;
};

// Applies a bitmask to a logits row: disallowed → -inf. Tokens past the
// bitmask are disallowed; bits past the logits are ignored.
void ApplyTokenBitmask(absl::Span<const uint32_t> bitmask, absl::Span<float> logits);

}  // namespace tandem::grammar

#endif  // TANDEM_ENGINE_GRAMMAR_GRAMMAR_H_
