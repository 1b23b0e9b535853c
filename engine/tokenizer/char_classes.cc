#include "engine/tokenizer/char_classes.h"

#include <unicode/uchar.h>
#include <unicode/uscript.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace tandem::tokenizer {

uint8_t ComputeCharClass(char32_t cp) {
  const UChar32 c = static_cast<UChar32>(cp);
  const int8_t gc = u_charType(c);
  UErrorCode err = U_ZERO_ERROR;
  const bool han = uscript_getScript(c, &err) == USCRIPT_HAN && U_SUCCESS(err);
  const bool lu = gc == U_UPPERCASE_LETTER;
  const bool ll = gc == U_LOWERCASE_LETTER;
  const bool lt = gc == U_TITLECASE_LETTER;
  const bool lm = gc == U_MODIFIER_LETTER;
  const bool lo = gc == U_OTHER_LETTER;
  const bool mark = gc == U_NON_SPACING_MARK || gc == U_ENCLOSING_MARK ||
                    gc == U_COMBINING_SPACING_MARK;
  const bool number =
      gc == U_DECIMAL_DIGIT_NUMBER || gc == U_LETTER_NUMBER || gc == U_OTHER_NUMBER;
  const bool space = u_hasBinaryProperty(c, UCHAR_WHITE_SPACE);
  uint8_t bits = 0;
  if (han) bits |= kHan;
  if (!han && (lu || lt || lm || lo || mark)) bits |= kUpperish;
  if (!han && (ll || lm || lo || mark)) bits |= kLowerish;
  if (lu || ll || lt || lm || lo) bits |= kLetter;
  if (number) bits |= kNumber;
  if (space) bits |= kSpace;
  if (cp == '\r' || cp == '\n') bits |= kCrLf;
  if (space || (cp >= 0x1C && cp <= 0x1F)) bits |= kPySpace;
  return bits;
}

const CharClasses& CharClasses::Get() {
  static const CharClasses* const kTable = new CharClasses();
  return *kTable;
}

CharClasses::CharClasses() {
  for (char32_t c = 0; c < 128; ++c) ascii_[c] = ComputeCharClass(c);
  constexpr uint32_t kBlock = 1u << kShift;
  std::vector<uint8_t> unique;  // concatenated distinct blocks
  absl::flat_hash_map<std::string, uint16_t> seen;
  std::string block(kBlock, '\0');
  for (uint32_t b = 0; b < (0x110000u >> kShift); ++b) {
    for (uint32_t k = 0; k < kBlock; ++k) {
      block[k] = static_cast<char>(ComputeCharClass((b << kShift) | k));
    }
    auto [it, inserted] =
        seen.try_emplace(block, static_cast<uint16_t>(unique.size() / kBlock));
    if (inserted) unique.insert(unique.end(), block.begin(), block.end());
    index_[b] = it->second;
  }
  blocks_ = new uint8_t[unique.size()];  // lives as long as the process
  std::memcpy(blocks_, unique.data(), unique.size());
}

}  // namespace tandem::tokenizer
