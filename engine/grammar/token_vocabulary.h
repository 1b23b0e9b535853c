// The served model's vocabulary as bytes, sorted for trie-order walks.
// Built once per model and shared by every compiled grammar.
#ifndef TANDEM_ENGINE_GRAMMAR_TOKEN_VOCABULARY_H_
#define TANDEM_ENGINE_GRAMMAR_TOKEN_VOCABULARY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/tokenizer/tokenizer.h"

namespace tandem::grammar {

// Structure tokens a grammar may contain (the K3 markup a tool call is written
// in: kToolCalls): <|open|>, <|sep|>, <|close|>, in this order. Structure token
// i reads as the two bytes StructureTokenBytes(i) = 0xFF, i + 1: no text can
// spell them, since 0xFF is never in valid UTF-8 (no front end's text reads
// it) and base tokens holding a 0xFF byte are never matchable.
inline constexpr int kNumStructureTokens = 3;
inline constexpr int32_t kStructureTokenIds[kNumStructureTokens] = {
    tokenizer::kOpenId, tokenizer::kSepId, tokenizer::kCloseId};
inline constexpr const char* kStructureTokenNames[kNumStructureTokens] = {
    "<|open|>", "<|sep|>", "<|close|>"};
std::string StructureTokenBytes(int index);

class TokenVocabulary {
 public:
  // Base tokens (ids below tokenizer::kNumBaseTokens) by their bytes (those
  // holding a 0xFF byte: never matched), the structure tokens by their
  // StructureTokenBytes (matched only by a grammar that names them); every
  // other reserved/special slot is never matched by a grammar. `stop_token_ids` (e.g.
  // [EOS], <|end_of_msg|>) are allowed exactly when the grammar can end.
  static absl::StatusOr<std::shared_ptr<const TokenVocabulary>> FromTokenizer(
      const tokenizer::Tokenizer& tokenizer, absl::Span<const int32_t> stop_token_ids);
  // Explicit vocabulary (tests): token i has bytes token_bytes[i]; ids with
  // `special[i]` (or empty bytes) never match a grammar.
  static absl::StatusOr<std::shared_ptr<const TokenVocabulary>> FromTokens(
      std::vector<std::string> token_bytes, std::vector<bool> special,
      absl::Span<const int32_t> stop_token_ids);

  int32_t size() const { return static_cast<int32_t>(bytes_.size()); }
  int32_t bitmask_words() const { return (size() + 31) / 32; }
  // Bytes of a matchable token; empty for special tokens.
  const std::string& token_bytes(int32_t id) const { return bytes_[id]; }
  bool matchable(int32_t id) const { return !bytes_[id].empty(); }
  bool is_stop(int32_t id) const;
  const std::vector<int32_t>& stop_token_ids() const { return stop_ids_; }
  // Matchable ids sorted by bytes, and lcp[i] = common prefix length of
  // sorted[i-1] and sorted[i] (lcp[0] = 0).
  const std::vector<int32_t>& sorted_ids() const { return sorted_; }
  const std::vector<int32_t>& lcp() const { return lcp_; }
  // The bytes of sorted_ids()[i], from one contiguous arena in sorted order
  // (a trie walk reads memory sequentially instead of chasing 163,840 strings).
  absl::string_view sorted_token(size_t i) const {
    return absl::string_view(sorted_bytes_.data() + sorted_offsets_[i],
                             sorted_offsets_[i + 1] - sorted_offsets_[i]);
  }
  // next_shorter()[i]: the first j > i with lcp[j] < lcp[i] (size() when none).
  // From i + 1, following it while lcp[j] >= L reaches the end of the run of
  // tokens that share token i's first L bytes, in a few hops.
  const std::vector<int32_t>& next_shorter() const { return next_shorter_; }
  int32_t max_token_bytes() const { return max_len_; }
  // Bitmask (bitmask_words() words) of all matchable tokens.
  const std::vector<uint32_t>& matchable_mask() const { return matchable_mask_; }

 private:
  TokenVocabulary() = default;
  static absl::StatusOr<std::shared_ptr<const TokenVocabulary>> Build(
      std::vector<std::string> bytes, absl::Span<const int32_t> stop_ids);

  std::vector<std::string> bytes_;
  std::vector<int32_t> stop_ids_;
  std::vector<int32_t> sorted_;
  std::vector<int32_t> lcp_;
  std::string sorted_bytes_;
  std::vector<uint32_t> sorted_offsets_;
  std::vector<int32_t> next_shorter_;
  std::vector<uint32_t> matchable_mask_;
  int32_t max_len_ = 0;
};

}  // namespace tandem::grammar

#endif  // TANDEM_ENGINE_GRAMMAR_TOKEN_VOCABULARY_H_
