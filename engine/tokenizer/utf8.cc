#include "engine/tokenizer/utf8.h"

namespace tandem::tokenizer {
namespace {

inline bool InRange(uint8_t b, uint8_t lo, uint8_t hi) { return b >= lo && b <= hi; }

}  // namespace

Utf8Step ReadUtf8(absl::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  const uint8_t b0 = p[0];
  if (b0 < 0x80) return {Utf8Step::kValid, 1, b0};
  int need;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  char32_t cp;
  if (InRange(b0, 0xC2, 0xDF)) {
    need = 1;
    cp = b0 & 0x1F;
  } else if (InRange(b0, 0xE0, 0xEF)) {
    need = 2;
    cp = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (InRange(b0, 0xF0, 0xF4)) {
    need = 3;
    cp = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return {Utf8Step::kInvalid, 1, 0};
  }
  for (int k = 1; k <= need; ++k) {
    if (static_cast<size_t>(k) >= n) return {Utf8Step::kIncomplete, k, 0};
    const uint8_t b = p[k];
    const bool ok = k == 1 ? InRange(b, lo, hi) : InRange(b, 0x80, 0xBF);
    if (!ok) return {Utf8Step::kInvalid, k, 0};
    cp = (cp << 6) | (b & 0x3F);
  }
  return {Utf8Step::kValid, need + 1, cp};
}

bool IsValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    // ASCII fast path, eight bytes at a time.
    while (i + 8 <= s.size()) {
      uint64_t w;
      __builtin_memcpy(&w, s.data() + i, 8);
      if (w & 0x8080808080808080ULL) break;
      i += 8;
    }
    if (i >= s.size()) break;
    if (static_cast<uint8_t>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const Utf8Step step = ReadUtf8(s.substr(i));
    if (step.kind != Utf8Step::kValid) return false;
    i += step.length;
  }
  return true;
}

std::string ReplaceInvalidUtf8(absl::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const Utf8Step step = ReadUtf8(s.substr(i));
    if (step.kind == Utf8Step::kValid) {
      out.append(s.data() + i, step.length);
    } else {
      out.append(kReplacementChar.data(), kReplacementChar.size());
    }
    i += step.length;
  }
  return out;
}

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace tandem::tokenizer
