// Byte-level BPE over tiktoken ranks: loading a `tiktoken.model` file and the
// tiktoken merge rule (repeatedly merge the adjacent pair whose concatenation
// has the lowest rank, leftmost on ties).
#ifndef TANDEM_ENGINE_TOKENIZER_BPE_H_
#define TANDEM_ENGINE_TOKENIZER_BPE_H_

#include <cstdint>
#include <string>
#include <vector>

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
  int Rank(absl::string_view bytes) const { return Find(bytes.data(), bytes.size()); }
  // The bytes of rank `r` (0 <= r < size()).
  absl::string_view Bytes(int r) const {
    return absl::string_view(arena_).substr(offsets_[r], offsets_[r + 1] - offsets_[r]);
  }
  int size() const { return static_cast<int>(offsets_.size()) - 1; }

 private:
  BytePairEncoder() = default;
  void MergeSmall(absl::string_view piece, std::vector<int>* out) const;
  void MergeLarge(absl::string_view piece, std::vector<int>* out) const;

  // The rank table: open addressing, linear probing, power-of-two size. A slot
  // holds a rank (kEmpty if none) and the top 32 bits of its key's hash, so a
  // miss rarely touches the token bytes.
  struct Slot {
    uint32_t rank;
    uint32_t tag;
  };
  static constexpr uint32_t kEmpty = 0xFFFFFFFFu;
  static uint64_t Hash(const char* p, size_t n);
  int Find(const char* p, size_t n) const {
    const uint64_t h = Hash(p, n);
    const uint32_t tag = static_cast<uint32_t>(h >> 32);
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot s = slots_[i];
      if (s.rank == kEmpty) return -1;
      if (s.tag == tag && offsets_[s.rank + 1] - offsets_[s.rank] == n &&
          __builtin_memcmp(arena_.data() + offsets_[s.rank], p, n) == 0) {
        return static_cast<int>(s.rank);
      }
    }
  }
  // Inserts rank r; returns the rank already holding the same bytes, or -1.
  int Insert(uint32_t r);

  std::string arena_;              // token bytes, in rank order
  std::vector<uint32_t> offsets_;  // rank r spans [offsets_[r], offsets_[r+1])
  std::vector<Slot> slots_;
  size_t mask_ = 0;
  int byte_rank_[256];
  // Rank of every two-byte string (b0 << 8 | b1), -1 if none: the first
  // round of every merge looks up only pairs of bytes.
  std::vector<int> pair_rank_;
  int PairRank(const char* p) const {
    return pair_rank_[(static_cast<uint8_t>(p[0]) << 8) | static_cast<uint8_t>(p[1])];
  }
};

}  // namespace tandem::tokenizer

#endif  // TANDEM_ENGINE_TOKENIZER_BPE_H_
