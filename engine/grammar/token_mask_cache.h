// The adaptive token mask cache (XGrammar's idea, own implementation).
//
// For every DFA item (position, DFA state) the vocabulary is walked once in
// sorted-bytes (trie) order from that item alone, with the stack below it
// unknown (kContextFrame). Each token is then
//   accepted  — all its bytes are read without leaving the current rule,
//   rejected  — some byte cannot be read and the rule never completed before,
//   uncertain — the rule completed before the failing byte, so the rest of
//               the token depends on the stack: checked at run time.
// Entries are computed on first use, are immutable afterwards and are shared
// by every matcher of the compiled grammar (lock-free reads).
#ifndef TANDEM_ENGINE_GRAMMAR_TOKEN_MASK_CACHE_H_
#define TANDEM_ENGINE_GRAMMAR_TOKEN_MASK_CACHE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/types/span.h"
#include "engine/grammar/pda.h"
#include "engine/grammar/token_vocabulary.h"

namespace tandem::grammar {

struct MaskEntry {
  enum class Form : uint8_t { kAcceptedList, kRejectedList, kBitset };
  Form form = Form::kAcceptedList;
  std::vector<int32_t> ids;    // accepted (kAcceptedList) / rejected ids
  std::vector<uint32_t> bits;  // accepted (kBitset)
  std::vector<int32_t> uncertain;

  // ORs the accepted tokens into `mask` (uncertain ones are not set).
  void OrAccepted(const TokenVocabulary& vocab, absl::Span<uint32_t> mask) const;
  int64_t bytes() const {
    return static_cast<int64_t>(sizeof(*this) + 4 * ids.size() + 4 * bits.size() +
                                4 * uncertain.size());
  }
};

class TokenMaskCache {
 public:
  TokenMaskCache(const Pda* pda, const TokenVocabulary* vocab);  // not owned
  ~TokenMaskCache();
  TokenMaskCache(const TokenMaskCache&) = delete;
  TokenMaskCache& operator=(const TokenMaskCache&) = delete;

  // The entry of a frontier item's (position, state); computed on first use.
  const MaskEntry& Get(int32_t position, int32_t state) const;
  // Entries computed so far and their memory.
  int64_t computed_entries() const { return computed_.load(); }
  int64_t entry_bytes() const { return bytes_.load(); }

 private:
  MaskEntry Compute(int32_t position, int32_t state) const;

  const Pda* pda_;
  const TokenVocabulary* vocab_;
  int32_t num_keys_;
  std::unique_ptr<std::atomic<MaskEntry*>[]> entries_;
  mutable std::atomic<int64_t> computed_{0};
  mutable std::atomic<int64_t> bytes_{0};
};

}  // namespace tandem::grammar

#endif  // TANDEM_ENGINE_GRAMMAR_TOKEN_MASK_CACHE_H_
