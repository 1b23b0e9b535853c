#include "engine/tokenizer/pretokenizer.h"

#include "common/status.h"
#include "engine/tokenizer/char_classes.h"
#include "engine/tokenizer/utf8.h"

namespace tandem::tokenizer {

const char kK3PatStr[] =
    R"([\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*)"
    R"([\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+)"
    R"([\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

namespace internal {

bool DecodeCodePoints(absl::string_view text, std::vector<char32_t>* cps,
                      std::vector<uint32_t>* offsets) {
  cps->clear();
  offsets->clear();
  if (text.size() >= UINT32_MAX) return false;  // offsets are 32-bit
  cps->reserve(text.size());
  offsets->reserve(text.size() + 1);
  const auto* p = reinterpret_cast<const uint8_t*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    if (p[i] < 0x80) {
      cps->push_back(p[i]);
      offsets->push_back(static_cast<uint32_t>(i));
      ++i;
      continue;
    }
    const Utf8Step step = ReadUtf8(text.substr(i));
    if (step.kind != Utf8Step::kValid) return false;
    cps->push_back(step.code_point);
    offsets->push_back(static_cast<uint32_t>(i));
    i += step.length;
  }
  offsets->push_back(static_cast<uint32_t>(n));
  return true;
}

void ChunkBoundaries(const std::vector<char32_t>& cps,
                     std::vector<size_t>* boundaries) {
  const CharClasses& classes = CharClasses::Get();
  boundaries->clear();
  boundaries->push_back(0);
  for (size_t base = 0; base < cps.size(); base += kMaxEncodeChars) {
    const size_t end = std::min(cps.size(), base + kMaxEncodeChars);
    // _split_whitespaces_or_nonwhitespaces on cps[base, end).
    size_t run_len = 0;
    bool run_is_space = (classes.Of(cps[base]) & kPySpace) != 0;
    for (size_t i = base; i < end; ++i) {
      const bool is_space = (classes.Of(cps[i]) & kPySpace) != 0;
      if (is_space != run_is_space) {
        run_len = 1;
        run_is_space = is_space;
      } else if (++run_len > kMaxRunChars) {
        boundaries->push_back(i);
        run_len = 1;
      }
    }
    boundaries->push_back(end);
  }
}

namespace {

// (?i:'s|'t|'re|'ve|'m|'ll|'d)? at position w; returns the new end.
inline size_t MatchContraction(const char32_t* c, size_t w, size_t end) {
  if (w + 1 >= end || c[w] != '\'') return w;
  // Simple case folding: 's' also folds with U+017F LATIN SMALL LETTER LONG S.
  auto fold = [](char32_t x) -> char32_t {
    if (x >= 'A' && x <= 'Z') return x + ('a' - 'A');
    if (x == 0x17F) return 's';
    return x;
  };
  const char32_t a = fold(c[w + 1]);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return w + 2;
  if (w + 2 < end) {
    const char32_t b = fold(c[w + 2]);
    if ((a == 'r' || a == 'v') && b == 'e') return w + 3;
    if (a == 'l' && b == 'l') return w + 3;
  }
  return w;
}

}  // namespace

size_t MatchAt(const char32_t* c, size_t begin, size_t end, size_t i) {
  (void)begin;
  const CharClasses& classes = CharClasses::Get();
  auto cls = [&](size_t k) { return classes.Of(c[k]); };
  const uint8_t c0 = cls(i);

  // [\p{Han}]+
  if (c0 & kHan) {
    size_t j = i + 1;
    while (j < end && (cls(j) & kHan)) ++j;
    return j;
  }

  // The optional prefix [^\r\n\p{L}\p{N}]?
  const bool has_prefix = (c0 & (kCrLf | kLetter | kNumber)) == 0;

  // Alternative 2: prefix? Upperish* Lowerish+ contraction?
  // Upperish* is greedy and backs off until Lowerish+ can start.
  auto alt2 = [&](size_t p) -> size_t {
    size_t u = p;
    while (u < end && (cls(u) & kUpperish)) ++u;
    size_t j = u;
    while (!(j < end && (cls(j) & kLowerish))) {
      if (j == p) return 0;
      --j;
    }
    size_t w = j + 1;
    while (w < end && (cls(w) & kLowerish)) ++w;
    return MatchContraction(c, w, end);
  };
  if (has_prefix && i + 1 < end) {
    if (size_t r = alt2(i + 1)) return r;
  }
  if (size_t r = alt2(i)) return r;

  // Alternative 3: prefix? Upperish+ Lowerish* contraction?
  auto alt3 = [&](size_t p) -> size_t {
    if (p >= end || !(cls(p) & kUpperish)) return 0;
    size_t u = p + 1;
    while (u < end && (cls(u) & kUpperish)) ++u;
    while (u < end && (cls(u) & kLowerish)) ++u;
    return MatchContraction(c, u, end);
  };
  if (has_prefix) {
    if (size_t r = alt3(i + 1)) return r;
  }
  if (size_t r = alt3(i)) return r;

  // \p{N}{1,3}
  if (c0 & kNumber) {
    size_t j = i + 1;
    while (j < end && j < i + 3 && (cls(j) & kNumber)) ++j;
    return j;
  }

  // " ?[^\s\p{L}\p{N}]+[\r\n]*"
  {
    constexpr uint8_t kNotPunct = kSpace | kLetter | kNumber;
    const size_t p = c[i] == ' ' ? i + 1 : i;
    if (p < end && !(cls(p) & kNotPunct)) {
      size_t j = p + 1;
      while (j < end && !(cls(j) & kNotPunct)) ++j;
      while (j < end && (cls(j) & kCrLf)) ++j;
      return j;
    }
  }

  if (c0 & kSpace) {
    size_t s = i + 1;
    while (s < end && (cls(s) & kSpace)) ++s;
    // \s*[\r\n]+ : up to and including the last CR/LF of the run.
    for (size_t k = s; k > i; --k) {
      if (cls(k - 1) & kCrLf) return k;
    }
    // \s+(?!\S)
    if (s == end) return end;
    if (s - i >= 2) return s - 1;
    // \s+
    return s;
  }
  return i;
}

}  // namespace internal

absl::Status SplitChunks(absl::string_view text, PreTokenizerScratch* scratch,
                         absl::FunctionRef<void(absl::string_view)> on_chunk) {
  if (!internal::DecodeCodePoints(text, &scratch->code_points, &scratch->offsets)) {
    return InvalidArgument("text is not valid UTF-8 (or is 4 GiB or more)");
  }
  std::vector<size_t> bounds;
  internal::ChunkBoundaries(scratch->code_points, &bounds);
  const auto& off = scratch->offsets;
  for (size_t k = 0; k + 1 < bounds.size(); ++k) {
    on_chunk(text.substr(off[bounds[k]], off[bounds[k + 1]] - off[bounds[k]]));
  }
  return absl::OkStatus();
}

namespace {

void MatchRange(absl::string_view text, const std::vector<char32_t>& cps,
                const std::vector<uint32_t>& off, size_t b, size_t e,
                absl::FunctionRef<void(absl::string_view)> on_piece) {
  size_t i = b;
  while (i < e) {
    const size_t j = internal::MatchAt(cps.data(), b, e, i);
    if (j == i) {  // unmatched code point: find_iter skips it
      ++i;
      continue;
    }
    on_piece(text.substr(off[i], off[j] - off[i]));
    i = j;
  }
}

}  // namespace

absl::Status PreTokenizeChunk(absl::string_view chunk, PreTokenizerScratch* scratch,
                              absl::FunctionRef<void(absl::string_view)> on_piece) {
  if (!internal::DecodeCodePoints(chunk, &scratch->code_points, &scratch->offsets)) {
    return InvalidArgument("text is not valid UTF-8 (or is 4 GiB or more)");
  }
  MatchRange(chunk, scratch->code_points, scratch->offsets, 0,
             scratch->code_points.size(), on_piece);
  return absl::OkStatus();
}

absl::Status PreTokenize(absl::string_view text, PreTokenizerScratch* scratch,
                         absl::FunctionRef<void(absl::string_view)> on_piece) {
  if (!internal::DecodeCodePoints(text, &scratch->code_points, &scratch->offsets)) {
    return InvalidArgument("text is not valid UTF-8 (or is 4 GiB or more)");
  }
  const std::vector<char32_t>& cps = scratch->code_points;
  const std::vector<uint32_t>& off = scratch->offsets;
  if (cps.empty()) return absl::OkStatus();
  size_t begin = 0;
  auto run_chunk = [&](size_t b, size_t e) {
    MatchRange(text, cps, off, b, e, on_piece);
  };
  // Chunking inline (same as ChunkBoundaries, without the vector).
  const CharClasses& classes = CharClasses::Get();
  for (size_t base = 0; base < cps.size(); base += kMaxEncodeChars) {
    const size_t end = std::min(cps.size(), base + kMaxEncodeChars);
    size_t run_len = 0;
    bool run_is_space = (classes.Of(cps[base]) & kPySpace) != 0;
    begin = base;
    for (size_t i = base; i < end; ++i) {
      const bool is_space = (classes.Of(cps[i]) & kPySpace) != 0;
      if (is_space != run_is_space) {
        run_len = 1;
        run_is_space = is_space;
      } else if (++run_len > kMaxRunChars) {
        run_chunk(begin, i);
        begin = i;
        run_len = 1;
      }
    }
    run_chunk(begin, end);
  }
  return absl::OkStatus();
}

absl::Status PreTokenizeToVector(absl::string_view text,
                                 std::vector<std::string>* pieces) {
  PreTokenizerScratch scratch;
  pieces->clear();
  return PreTokenize(text, &scratch,
                     [&](absl::string_view piece) { pieces->emplace_back(piece); });
}

}  // namespace tandem::tokenizer
