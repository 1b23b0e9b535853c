// Differential fuzzer: the hand-written pat_str matcher against ICU's regex
// engine running kK3PatStr, plus UTF-8 helper invariants.
#include <unicode/regex.h>
#include <unicode/unistr.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "engine/tokenizer/pretokenizer.h"
#include "engine/tokenizer/utf8.h"

namespace {

using tandem::tokenizer::IsValidUtf8;
using tandem::tokenizer::kK3PatStr;
using tandem::tokenizer::PreTokenizeChunk;
using tandem::tokenizer::PreTokenizerScratch;
using tandem::tokenizer::ReplaceInvalidUtf8;

const icu::RegexPattern& Pattern() {
  static icu::RegexPattern* pattern = [] {
    UErrorCode status = U_ZERO_ERROR;
    UParseError pe;
    auto* p = icu::RegexPattern::compile(icu::UnicodeString::fromUTF8(kK3PatStr), 0, pe,
                                         status);
    if (U_FAILURE(status)) std::abort();
    return p;
  }();
  return *pattern;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const std::string fixed = ReplaceInvalidUtf8(input);
  if (!IsValidUtf8(fixed)) std::abort();
  if (IsValidUtf8(input) && fixed != input) std::abort();

  std::vector<std::string> mine;
  PreTokenizerScratch scratch;
  if (!PreTokenizeChunk(fixed, &scratch, [&](absl::string_view p) {
         mine.emplace_back(p.data(), p.size());
       }).ok()) {
    std::abort();
  }
  std::string joined;
  for (const std::string& p : mine) joined += p;
  if (joined != fixed) std::abort();  // every code point is in some piece

  UErrorCode status = U_ZERO_ERROR;
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(fixed);
  std::unique_ptr<icu::RegexMatcher> m(Pattern().matcher(u, status));
  size_t k = 0;
  while (m->find(status)) {
    std::string piece;
    m->group(status).toUTF8String(piece);
    if (k >= mine.size() || mine[k] != piece) std::abort();
    ++k;
  }
  if (k != mine.size()) std::abort();
  return 0;
}
