// Byte-level BPE over tiktoken ranks: loading a `tiktoken.model` file and the
// tiktoken merge rule (repeatedly merge the adjacent pair whose concatenation
// has the lowest rank, leftmost on ties).
#ifndef TANDEM_ENGINE_TOKENIZER_BPE_H_
#define TANDEM_ENGINE_TOKENIZER_BPE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::tokenizer {

class BytePairEncoder {
 public:
  // Parses tiktoken.model text: one "base64(token) rank" per line. Ranks must be
  // exactly 0..expected_count-1, each once; tokens distinct; every single byte
  // must be a token. `source` names the file in error messages.
  static absl::StatusOr<BytePairEncoder> Parse(absl::string_view contents,
                                               int expected_count,
                                               absl::string_view source);
  static absl::StatusOr<BytePairEncoder> Load(const std::string& path,
                                              int expected_count);

  BytePairEncoder(BytePairEncoder&&) = default;
  BytePairEncoder& operator=(BytePairEncoder&&) = default;

  // Appends the ranks of `piece` (non-empty) to `out`.
  void Encode(absl::string_view piece, std::vector<int>* out) const;

  // The rank of exactly these bytes, or -1.
  int Rank(absl::string_view bytes) const {
    auto it = ranks_.find(bytes);
    return it == ranks_.end() ? -1 : it->second;
  }
  // The bytes of rank `r` (0 <= r < size()).
  absl::string_view Bytes(int r) const {
    return absl::string_view(arena_).substr(offsets_[r], offsets_[r + 1] - offsets_[r]);
  }
  int size() const { return static_cast<int>(offsets_.size()) - 1; }

 private:
  BytePairEncoder() = default;
  void MergeSmall(absl::string_view piece, std::vector<int>* out) const;
  void MergeLarge(absl::string_view piece, std::vector<int>* out) const;

  std::string arena_;              // token bytes, in rank order
  std::vector<uint32_t> offsets_;  // rank r spans [offsets_[r], offsets_[r+1])
  absl::flat_hash_map<absl::string_view, int> ranks_;  // views into arena_
  int byte_rank_[256];
};

}  // namespace tandem::tokenizer

#endif  // TANDEM_ENGINE_TOKENIZER_BPE_H_
