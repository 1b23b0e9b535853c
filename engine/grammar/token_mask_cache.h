// The adaptive token mask cache (XGrammar's idea, own implementation).
//
// For every DFA item (position, DFA state) the vocabulary is walked once in
// sorted-bytes (trie) order from that item alone, with the stack below it
// unknown (kContextFrame). Each token is then
//   accepted  — all its bytes are read without leaving the current rule,
//   rejected  — some byte cannot be read and the rule never completed before,
//   uncertain — the rule completed before the failing byte, so the rest of
//               the token depends on the stack: checked at run time.
// Items directly under the root have a known context (nothing follows), so
// they get a second, exact entry without uncertain tokens. Lists of ids are
// kept when short (<= kMaxListIds), else a bitset (fast to OR).
// Entries are computed on first use, are immutable afterwards and are shared
// by every matcher of the compiled grammar (lock-free reads).
#ifndef TANDEM_ENGINE_GRAMMAR_TOKEN_MASK_CACHE_H_
#define TANDEM_ENGINE_GRAMMAR_TOKEN_MASK_CACHE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/grammar/pda.h"
#include "engine/grammar/token_vocabulary.h"

namespace tandem::grammar {

inline constexpr size_t kMaxListIds = 1024;

struct MaskEntry {
  enum class Form : uint8_t { kAcceptedList, kRejectedList, kBitset };
  Form form = Form::kAcceptedList;
  std::vector<int32_t> ids;    // accepted (kAcceptedList) / rejected ids
  std::vector<uint32_t> bits;  // accepted (kBitset)
  std::vector<int32_t> uncertain;

  // ORs the accepted tokens into `mask` (uncertain ones are not set); with
  // `overwrite`, assigns instead (mask assumed all zero before).
  void OrAccepted(const TokenVocabulary& vocab, absl::Span<uint32_t> mask,
                  bool overwrite = false) const;
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
  // `at_root`: the item's parent is kRootFrame, so the context is known
  // (nothing may follow the root) and the entry has no uncertain tokens.
  const MaskEntry& Get(int32_t position, int32_t state, bool at_root) const;
  // Computes the entries not computed yet, in key order (each DFA's states are
  // numbered from its start, so the first states an output visits come
  // first), until `deadline`; true once every entry an item can need is
  // computed (for the root rule's positions the exact at-root entry, for the
  // others the context one). Safe beside Get on other threads (whoever
  // computes an entry first stores it, the other copy is dropped); one caller
  // at a time. The worker's compile thread runs it while idle
  // (worker::EngineLoop), so a schema's first requests find most states warm.
  bool PrecomputeUntil(absl::Time deadline) const;
  bool precomputed() const { return precomputed_.load(std::memory_order_acquire); }
  // Entries computed so far and their memory.
  int64_t computed_entries() const { return computed_.load(); }
  int64_t entry_bytes() const { return bytes_.load(); }

 private:
  MaskEntry Compute(int32_t position, int32_t state, int32_t parent) const;

  const Pda* pda_;
  const TokenVocabulary* vocab_;
  int32_t num_keys_;
  std::unique_ptr<std::atomic<MaskEntry*>[]> entries_;
  const MaskEntry& Store(int32_t key, MaskEntry entry) const;

  mutable std::atomic<int64_t> computed_{0};
  mutable std::atomic<int32_t> precompute_position_{0};
  mutable std::atomic<bool> precomputed_{false};
  mutable std::atomic<int64_t> bytes_{0};
};

}  // namespace tandem::grammar

#endif  // TANDEM_ENGINE_GRAMMAR_TOKEN_MASK_CACHE_H_
