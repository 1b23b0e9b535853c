// The Kimi K3 tokenizer: tiktoken byte-level BPE (163,584 ranks) behind the K3
// pre-tokeniser, plus 256 reserved special slots (163,584..163,839).
//
//   text → SplitChunks (400k / 25k) → pat_str pieces → BPE ranks → ids
//   ids  → token bytes (specials by spelling) → concatenated bytes
//
// Thread-safe after Load: every method is const.
#ifndef TANDEM_ENGINE_TOKENIZER_TOKENIZER_H_
#define TANDEM_ENGINE_TOKENIZER_TOKENIZER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/tokenizer/bpe.h"

namespace tandem::tokenizer {

inline constexpr int kNumBaseTokens = 163584;
inline constexpr int kNumReservedSpecialTokens = 256;
inline constexpr int kVocabSize = kNumBaseTokens + kNumReservedSpecialTokens;

// Named special ids of K3 (tokenizer_config.json's added_tokens_decoder).
inline constexpr int kBosId = 163584;       // [BOS]
inline constexpr int kEosId = 163585;       // [EOS]
inline constexpr int kEndOfMsgId = 163586;  // <|end_of_msg|>
inline constexpr int kOpenId = 163587;      // <|open|>   (special: false)
inline constexpr int kCloseId = 163588;     // <|close|>  (special: false)
inline constexpr int kSepId = 163589;       // <|sep|>    (special: false)
inline constexpr int kUnkId = 163838;       // [UNK]
inline constexpr int kPadId = 163839;       // [PAD]

class Tokenizer {
 public:
  // Loads `dir`/tiktoken.model and `dir`/tokenizer_config.json.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& dir);
  // Same, from explicit paths.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> LoadFiles(
      const std::string& model_path, const std::string& config_path);
  // From already-read file contents (tests).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromContents(
      absl::string_view model_contents, absl::string_view config_json);

  // Ordinary text: special-token spellings are plain text. `text` must be
  // valid UTF-8 (InvalidArgument otherwise).
  absl::StatusOr<std::vector<int>> Encode(absl::string_view text) const;
  // Appends to `ids`; on error `ids` may hold a prefix.
  absl::Status EncodeTo(absl::string_view text, std::vector<int>* ids) const;
  // As tiktoken's encode(allowed_special=allowed): within each chunk, the
  // spellings in `allowed` become their special id; others stay plain text.
  absl::StatusOr<std::vector<int>> EncodeWithSpecial(
      absl::string_view text, const absl::flat_hash_set<std::string>& allowed) const;

  // Concatenated token bytes (may be invalid UTF-8 when a character is split).
  // Ids outside [0, vocab_size()) are InvalidArgument. With
  // `skip_special_tokens`, ids for which IsSpecial() holds are left out.
  absl::StatusOr<std::string> Decode(absl::Span<const int> ids,
                                     bool skip_special_tokens = false) const;
  // Appends the bytes of one id (no range check beyond IsValidId).
  absl::Status AppendTokenBytes(int id, std::string* out) const;

  // The token of `id`: raw bytes for a base id, the spelling for a special.
  absl::StatusOr<std::string> IdToken(int id) const;
  // The id of a special spelling, or of a base token's exact bytes.
  absl::StatusOr<int> TokenId(absl::string_view token) const;
  // True for special slots whose config entry says "special": true (reserved
  // slots without an entry count as special).
  bool IsSpecial(int id) const {
    return id >= kNumBaseTokens && id < kVocabSize &&
           special_flag_[id - kNumBaseTokens];
  }
  bool IsValidId(int id) const { return id >= 0 && id < kVocabSize; }
  // All 256 special spellings.
  absl::flat_hash_set<std::string> AllSpecialTokens() const;

  int vocab_size() const { return kVocabSize; }
  int bos_id() const { return kBosId; }
  int eos_id() const { return kEosId; }
  // Generation stops at either: [EOS] (tokenizer_config) and <|end_of_msg|>
  // (generation_config).
  std::vector<int> stop_ids() const { return {kEosId, kEndOfMsgId}; }
  const BytePairEncoder& bpe() const { return bpe_; }

 private:
  explicit Tokenizer(BytePairEncoder bpe) : bpe_(std::move(bpe)) {}
  absl::Status ParseConfig(absl::string_view config_json);

  BytePairEncoder bpe_;
  std::vector<std::string> special_names_;  // index id - kNumBaseTokens
  std::vector<bool> special_flag_;
  absl::flat_hash_map<std::string, int> special_ids_;
};

}  // namespace tandem::tokenizer

#endif  // TANDEM_ENGINE_TOKENIZER_TOKENIZER_H_
