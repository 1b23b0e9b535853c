// The K3 pre-tokeniser: upstream chunking, then the pat_str split, by a
// hand-written matcher equivalent to the regex (README.md explains why and how;
// pretokenizer_test checks it against ICU's regex engine running kK3PatStr).
#ifndef TANDEM_ENGINE_TOKENIZER_PRETOKENIZER_H_
#define TANDEM_ENGINE_TOKENIZER_PRETOKENIZER_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace tandem::tokenizer {

// pat_str of K3's tokenization_kimi.py (Rust fancy-regex syntax).
extern const char kK3PatStr[];

// tokenization_kimi.py: text is cut into slices of at most this many code
// points, and each slice where a run of whitespace / non-whitespace (Python
// str.isspace()) would exceed kMaxRunChars.
inline constexpr size_t kMaxEncodeChars = 400000;
inline constexpr size_t kMaxRunChars = 25000;

// Reusable buffers; one per thread (not thread-safe itself).
struct PreTokenizerScratch {
  std::vector<char32_t> code_points;
  std::vector<uint32_t> offsets;  // byte offset of each code point, plus the end
};

// Splits `text` (must be valid UTF-8 under 4 GiB, else InvalidArgument) into chunks and
// calls `on_chunk(chunk)` for each, in order, with byte ranges of `text`.
absl::Status SplitChunks(absl::string_view text, PreTokenizerScratch* scratch,
                         absl::FunctionRef<void(absl::string_view)> on_chunk);

// Chunks `text` and calls `on_piece(piece)` for each pat_str match, in order.
absl::Status PreTokenize(absl::string_view text, PreTokenizerScratch* scratch,
                         absl::FunctionRef<void(absl::string_view)> on_piece);

// Runs the pat_str split on `chunk` as one whole text (no chunking): what
// tiktoken does to each chunk, or to the text between two special tokens.
absl::Status PreTokenizeChunk(absl::string_view chunk, PreTokenizerScratch* scratch,
                              absl::FunctionRef<void(absl::string_view)> on_piece);

// Convenience for tests: the pieces as strings.
absl::Status PreTokenizeToVector(absl::string_view text,
                                 std::vector<std::string>* pieces);

namespace internal {
// Decodes valid UTF-8 into code points and offsets; false if invalid or if
// the text has 2^32 bytes or more.
bool DecodeCodePoints(absl::string_view text, std::vector<char32_t>* cps,
                      std::vector<uint32_t>* offsets);
// The chunk boundaries (code-point indices, first 0, last cps.size()) of the
// upstream 400,000 / 25,000 chunking.
void ChunkBoundaries(const std::vector<char32_t>& cps, std::vector<size_t>* boundaries);
// Matches pat_str within cps[begin, end) (a chunk: `end` is end of text) at
// position `i`; returns the end of the match, or `i` if nothing matches.
size_t MatchAt(const char32_t* cps, size_t begin, size_t end, size_t i);
}  // namespace internal

}  // namespace tandem::tokenizer

#endif  // TANDEM_ENGINE_TOKENIZER_PRETOKENIZER_H_
