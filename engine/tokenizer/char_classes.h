// Per-code-point character classes used by the K3 pre-tokeniser. The table is
// built once from ICU's Unicode data (general category, script, White_Space).
#ifndef TANDEM_ENGINE_TOKENIZER_CHAR_CLASSES_H_
#define TANDEM_ENGINE_TOKENIZER_CHAR_CLASSES_H_

#include <cstdint>

namespace tandem::tokenizer {

// Bits of a class byte. Names follow the pat_str classes they stand for.
enum CharClassBit : uint8_t {
  kHan = 1 << 0,       // \p{Han} (Script=Han)
  kUpperish = 1 << 1,  // [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]
  kLowerish = 1 << 2,  // [\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]
  kLetter = 1 << 3,    // \p{L}
  kNumber = 1 << 4,    // \p{N}
  kSpace = 1 << 5,     // \s (White_Space)
  kCrLf = 1 << 6,      // [\r\n]
  kPySpace = 1 << 7,   // Python str.isspace() (White_Space plus U+001C..U+001F)
};

class CharClasses {
 public:
  // The process-wide table (built on first use, thread-safe).
  static const CharClasses& Get();

  uint8_t Of(char32_t cp) const {
    if (cp < 0x80) return ascii_[cp];
    if (cp > 0x10FFFF) return 0;
    return blocks_[(static_cast<uint32_t>(index_[cp >> kShift]) << kShift) |
                   (cp & kMask)];
  }

 private:
  static constexpr int kShift = 7;
  static constexpr uint32_t kMask = (1u << kShift) - 1;
  CharClasses();

  uint8_t ascii_[128];
  uint16_t index_[0x110000 >> kShift];
  // Deduplicated blocks of 1 << kShift class bytes.
  uint8_t* blocks_;
};

// Computes the class byte of one code point straight from ICU (used to build
// the table, and by tests).
uint8_t ComputeCharClass(char32_t cp);

}  // namespace tandem::tokenizer

#endif  // TANDEM_ENGINE_TOKENIZER_CHAR_CLASSES_H_
