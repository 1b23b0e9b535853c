#include "engine/tokenizer/pretokenizer.h"

#include <unicode/regex.h>
#include <unicode/unistr.h>

#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/tokenizer/char_classes.h"
#include "engine/tokenizer/utf8.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::tokenizer {
namespace {

std::vector<std::string> CorpusTexts() {
  std::ifstream in("tests/data/tokenizer/corpus.jsonl");
  EXPECT_TRUE(in) << "corpus missing";
  std::vector<std::string> texts;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) texts.push_back(nlohmann::json::parse(line)["text"]);
  }
  return texts;
}

// The reference split: ICU's regex engine running the exact pat_str (ICU
// supports the `&&` class intersection; its \s is White_Space like Rust's).
class IcuSplitter {
 public:
  IcuSplitter() {
    UErrorCode status = U_ZERO_ERROR;
    UParseError parse_error;
    pattern_.reset(icu::RegexPattern::compile(icu::UnicodeString::fromUTF8(kK3PatStr),
                                              0, parse_error, status));
    EXPECT_TRUE(U_SUCCESS(status))
        << u_errorName(status) << " at offset " << parse_error.offset;
  }
  std::vector<std::string> Split(const std::string& text) const {
    UErrorCode status = U_ZERO_ERROR;
    icu::UnicodeString u = icu::UnicodeString::fromUTF8(text);
    std::unique_ptr<icu::RegexMatcher> m(pattern_->matcher(u, status));
    std::vector<std::string> out;
    while (m->find(status)) {
      std::string piece;
      m->group(status).toUTF8String(piece);
      out.push_back(piece);
    }
    EXPECT_TRUE(U_SUCCESS(status));
    return out;
  }

 private:
  std::unique_ptr<icu::RegexPattern> pattern_;
};

std::vector<std::string> HandSplitChunk(const std::string& text) {
  PreTokenizerScratch scratch;
  std::vector<std::string> out;
  EXPECT_TRUE(PreTokenizeChunk(text, &scratch, [&](absl::string_view p) {
                out.emplace_back(p);
              }).ok());
  return out;
}

TEST(PreTokenizerTest, PatStrMatchesVendoredFile) {
  std::ifstream in("third_party/kimi_k3_tokenizer/pat_str.json");
  ASSERT_TRUE(in);
  nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(std::string(kK3PatStr), j["pat_str"].get<std::string>());
  EXPECT_EQ(j["max_encode_chars"].get<size_t>(), kMaxEncodeChars);
  EXPECT_EQ(j["max_no_whitespace_run"].get<size_t>(), kMaxRunChars);
}

TEST(PreTokenizerTest, KnownSplit) {
  std::vector<std::string> pieces;
  ASSERT_TRUE(
      PreTokenizeToVector("Hello, world! 你好，世界！  x\n\n  y", &pieces).ok());
  EXPECT_EQ(pieces,
            (std::vector<std::string>{"Hello", ",", " world", "!", " ", "你好", "，",
                                      "世界", "！", " ", " x", "\n\n", " ", " y"}));
  ASSERT_TRUE(PreTokenizeToVector("I'M he's 12345 ab  ", &pieces).ok());
  EXPECT_EQ(pieces,
            (std::vector<std::string>{"I'M", " he's", " ", "123", "45", " ab", "  "}));
}

TEST(PreTokenizerTest, CharClasses) {
  const CharClasses& c = CharClasses::Get();
  EXPECT_EQ(c.Of('A'), kUpperish | kLetter);
  EXPECT_EQ(c.Of('a'), kLowerish | kLetter);
  EXPECT_EQ(c.Of(U'中'), kHan | kLetter);
  EXPECT_EQ(c.Of(0x3007), kHan | kNumber);                  // 〇 Nl, Script=Han
  EXPECT_EQ(c.Of(0x0301), kUpperish | kLowerish);           // combining acute
  EXPECT_EQ(c.Of(U'あ'), kUpperish | kLowerish | kLetter);  // Lo
  EXPECT_EQ(c.Of(0x01C5), kUpperish | kLetter);             // ǅ Lt
  EXPECT_EQ(c.Of('\n'), kSpace | kCrLf | kPySpace);
  EXPECT_EQ(c.Of(0x00A0), kSpace | kPySpace);
  EXPECT_EQ(c.Of(0x001C), kPySpace);  // isspace() only
  EXPECT_EQ(c.Of(0xFEFF), 0);
  EXPECT_EQ(c.Of('7'), kNumber);
  EXPECT_EQ(c.Of('!'), 0);
  // The table agrees with ICU everywhere.
  for (char32_t cp = 0; cp <= 0x10FFFF; ++cp) {
    ASSERT_EQ(c.Of(cp), ComputeCharClass(cp)) << std::hex << static_cast<uint32_t>(cp);
  }
}

TEST(PreTokenizerTest, MatchesIcuRegexOnCorpus) {
  IcuSplitter icu;
  int n = 0;
  for (const std::string& text : CorpusTexts()) {
    ASSERT_EQ(HandSplitChunk(text), icu.Split(text)) << "text: " << text;
    ++n;
  }
  EXPECT_GT(n, 300);
}

TEST(PreTokenizerTest, MatchesIcuRegexOnRandomStrings) {
  // Code points chosen to exercise every branch: case classes, Lm/Lo/Lt,
  // marks (incl. a Han-script mark), Han non-letters, digits of several kinds,
  // every kind of space, CR/LF, apostrophes and the contraction letters.
  const std::vector<char32_t> alphabet = {
      'a',    'B',    's',    'S',    't',    'T',     'r',    'R',     'e',
      'E',    'v',    'm',    'l',    'L',    'd',     'D',    0x17F,   '\'',
      ' ',    ' ',    '\t',   '\n',   '\r',   0x0B,    0x0C,   0x85,    0xA0,
      0x3000, 0x2028, 0x1C,   0x200B, 0xFEFF, '1',     '2',    0x663,   0x2162,
      0xBD,   '!',    '.',    '-',    '"',    0x301,   0x20DD, 0x93F,   0x16FF0,
      0x2E80, 0x3005, 0x3007, U'中',  U'文',  U'あ',   U'ア',  0x2B0,   0x1C5,
      0x3A9,  0x3C9,  0x416,  0x436,  U'한',  0x1F600, 0x200D, 0x1F1FA, 0xFE0F};
  IcuSplitter icu;
  std::mt19937 rng(7);
  for (int iter = 0; iter < 20000; ++iter) {
    const int len = 1 + static_cast<int>(rng() % 32);
    std::string text;
    for (int k = 0; k < len; ++k) AppendUtf8(alphabet[rng() % alphabet.size()], &text);
    ASSERT_EQ(HandSplitChunk(text), icu.Split(text)) << "text: " << text;
  }
}

TEST(PreTokenizerTest, ChunkBoundaries) {
  auto bounds = [](const std::u32string& s) {
    std::vector<char32_t> cps(s.begin(), s.end());
    std::vector<size_t> b;
    internal::ChunkBoundaries(cps, &b);
    return b;
  };
  EXPECT_EQ(bounds(U""), (std::vector<size_t>{0}));
  EXPECT_EQ(bounds(std::u32string(25000, 'a')), (std::vector<size_t>{0, 25000}));
  EXPECT_EQ(bounds(std::u32string(25001, 'a')), (std::vector<size_t>{0, 25000, 25001}));
  EXPECT_EQ(bounds(std::u32string(50001, ' ')),
            (std::vector<size_t>{0, 25000, 50000, 50001}));
  // Alternating runs reset the count; U+001C counts as space (str.isspace()).
  EXPECT_EQ(bounds(std::u32string(25000, 'a') + std::u32string(25000, 0x1C)),
            (std::vector<size_t>{0, 50000}));
  EXPECT_EQ(bounds(std::u32string(24999, 'a') + U"\uFEFF" + U"b"),
            (std::vector<size_t>{0, 25000, 25001}));
  // 400,000-code-point slices, each split on its own.
  std::u32string big;
  while (big.size() < 400010) big += U"ab ";
  big.resize(400010);
  EXPECT_EQ(bounds(big), (std::vector<size_t>{0, 400000, 400010}));
}

TEST(PreTokenizerTest, ChunkingChangesTheSplit) {
  // 25,001 letters: upstream encodes 25,000 then 1, so two pieces.
  std::vector<std::string> pieces;
  ASSERT_TRUE(PreTokenizeToVector(std::string(25001, 'a'), &pieces).ok());
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_EQ(pieces[0].size(), 25000u);
  EXPECT_EQ(pieces[1], "a");
  // A trailing space run followed by a letter, split at a chunk edge: the
  // space run ends the chunk so \s+(?!\S) takes all of it.
  ASSERT_TRUE(PreTokenizeToVector(std::string(25001, ' ') + "x", &pieces).ok());
  EXPECT_EQ(pieces, (std::vector<std::string>{std::string(25000, ' '), " x"}));
}

TEST(PreTokenizerTest, RejectsInvalidUtf8) {
  std::vector<std::string> pieces;
  EXPECT_EQ(PreTokenizeToVector("abc\xC3", &pieces).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PreTokenizeToVector("\xED\xA0\x80", &pieces).code(),  // surrogate
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(PreTokenizeToVector("", &pieces).ok());
  EXPECT_TRUE(pieces.empty());
}

}  // namespace
}  // namespace tandem::tokenizer
