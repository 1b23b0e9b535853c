// The JSON-lines protocol of the `tokenize` and `detokenize` tools (and of
// tools/node/tiktoken_oracle.mjs):
//   tokenize:   {"text": "..."}  →  {"ids": [...]}
//   detokenize: {"ids": [...]}   →  {"text": "..."}  (invalid UTF-8 → U+FFFD)
// A line that cannot be handled gives {"error": "..."}; processing continues.
#ifndef TANDEM_ENGINE_TOKENIZER_JSONL_TOOLS_H_
#define TANDEM_ENGINE_TOKENIZER_JSONL_TOOLS_H_

#include <istream>
#include <ostream>
#include <string>

#include "absl/strings/string_view.h"
#include "engine/tokenizer/tokenizer.h"

namespace tandem::tokenizer {

// One input line → one output line (without the newline). `*ok` is false when
// the output is an error object.
std::string TokenizeJsonLine(const Tokenizer& tokenizer, absl::string_view line,
                             bool* ok);
std::string DetokenizeJsonLine(const Tokenizer& tokenizer, absl::string_view line,
                               bool* ok);

// Runs a whole stream; returns how many lines failed.
int RunTokenizeJsonl(const Tokenizer& tokenizer, std::istream& in, std::ostream& out);
int RunDetokenizeJsonl(const Tokenizer& tokenizer, std::istream& in, std::ostream& out);

}  // namespace tandem::tokenizer

#endif  // TANDEM_ENGINE_TOKENIZER_JSONL_TOOLS_H_
