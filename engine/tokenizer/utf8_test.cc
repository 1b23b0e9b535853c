#include "engine/tokenizer/utf8.h"

#include <string>

#include "gtest/gtest.h"

namespace tandem::tokenizer {
namespace {

TEST(Utf8Test, ReadUtf8) {
  Utf8Step s = ReadUtf8("\xE4\xB8\xAD");  // 中
  EXPECT_EQ(s.kind, Utf8Step::kValid);
  EXPECT_EQ(s.length, 3);
  EXPECT_EQ(s.code_point, 0x4E2Du);
  s = ReadUtf8("\xF0\x9F\x98\x80");  // 😀
  EXPECT_EQ(s.kind, Utf8Step::kValid);
  EXPECT_EQ(s.code_point, 0x1F600u);
  EXPECT_EQ(ReadUtf8("\xF0\x9F\x98").kind, Utf8Step::kIncomplete);
  EXPECT_EQ(ReadUtf8("\xE4").kind, Utf8Step::kIncomplete);
  s = ReadUtf8("\xE4\x41");
  EXPECT_EQ(s.kind, Utf8Step::kInvalid);
  EXPECT_EQ(s.length, 1);
  EXPECT_EQ(ReadUtf8("\xC0\x80").kind, Utf8Step::kInvalid);          // overlong
  EXPECT_EQ(ReadUtf8("\xED\xA0\x80").kind, Utf8Step::kInvalid);      // surrogate
  EXPECT_EQ(ReadUtf8("\xF4\x90\x80\x80").kind, Utf8Step::kInvalid);  // > U+10FFFF
  EXPECT_EQ(ReadUtf8("\x80").kind, Utf8Step::kInvalid);
  EXPECT_EQ(ReadUtf8("\xFF").kind, Utf8Step::kInvalid);
}

TEST(Utf8Test, IsValid) {
  EXPECT_TRUE(IsValidUtf8(""));
  EXPECT_TRUE(IsValidUtf8(std::string(100, 'a') + "中文😀" + std::string(9, 'b')));
  EXPECT_FALSE(IsValidUtf8(std::string(100, 'a') + "\xE4\xB8"));
  EXPECT_FALSE(IsValidUtf8("\xED\xBF\xBF"));
  EXPECT_FALSE(IsValidUtf8(std::string(17, 'a') + "\x80"));
}

// The example of the Unicode Standard (section 3.9, "U+FFFD Substitution of
// Maximal Subparts").
TEST(Utf8Test, ReplaceMaximalSubparts) {
  const std::string fffd = "\xEF\xBF\xBD";
  EXPECT_EQ(ReplaceInvalidUtf8("\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64"),
            "a" + fffd + fffd + fffd + "b" + fffd + "c" + fffd + fffd + "d");
  EXPECT_EQ(ReplaceInvalidUtf8("ok\xF0\x9F\x98"), "ok" + fffd);
  EXPECT_EQ(ReplaceInvalidUtf8("中文"), "中文");
}

TEST(Utf8Test, AppendUtf8RoundTripsEveryScalarValue) {
  for (char32_t cp = 0; cp <= 0x10FFFF; ++cp) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    std::string s;
    AppendUtf8(cp, &s);
    const Utf8Step step = ReadUtf8(s);
    ASSERT_EQ(step.kind, Utf8Step::kValid);
    ASSERT_EQ(step.length, static_cast<int>(s.size()));
    ASSERT_EQ(step.code_point, cp);
  }
}

}  // namespace
}  // namespace tandem::tokenizer
