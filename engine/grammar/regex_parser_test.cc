#include "engine/grammar/regex_parser.h"

#include <random>
#include <string>
#include <vector>

#include "engine/grammar/automaton.h"
#include "gtest/gtest.h"
#include "re2/re2.h"

namespace tandem::grammar {
namespace {

absl::StatusOr<Dfa> Compile(absl::string_view pattern) {
  RegexOptions o;
  auto r = ParseRegex(pattern, o);
  if (!r.ok()) return r.status();
  CompileLimits limits;
  CompileBudget budget(limits);
  return BuildDfa(*r->expr, &budget);
}

// Random strings over a small alphabet: the DFA and RE2 (full match) agree.
TEST(RegexParserTest, AgreesWithRe2OnRandomStrings) {
  const std::vector<std::string> patterns = {
      "a*b",   "(ab|a)*",      "[a-c]{2,4}",      "a?b+c*",  "(a|b|c){3}", "[^a]b",
      "a{2,}", "(?:ab){0,2}c", "\\d+\\.\\d{1,2}", "[\\w-]+", "a.c",        "(a|)b",
      "[-a]+", "x{0}y",        "[a\\-c]",         "\\x61b",  "(?P<n>ab)+",
  };
  const std::string alphabet = "abc1.-_x\n";
  std::mt19937 rng(1234);
  for (const std::string& p : patterns) {
    auto dfa = Compile(p);
    ASSERT_TRUE(dfa.ok()) << p << ": " << dfa.status();
    RE2 re(p);
    ASSERT_TRUE(re.ok()) << p;
    for (int i = 0; i < 400; ++i) {
      std::string s;
      int len = rng() % 7;
      for (int k = 0; k < len; ++k) s += alphabet[rng() % alphabet.size()];
      EXPECT_EQ(dfa->Matches(s), RE2::FullMatch(s, re)) << p << " on '" << s << "'";
    }
  }
}

TEST(RegexParserTest, AnchorsAtTheEndsAreRecorded) {
  RegexOptions o;
  auto r = ParseRegex("^ab$", o);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->anchored_start);
  EXPECT_TRUE(r->anchored_end);
  auto s = ParseRegex("ab\\$", o);
  ASSERT_TRUE(s.ok());
  EXPECT_FALSE(s->anchored_end);
}

TEST(RegexParserTest, UnsupportedFeaturesAreNamed) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"(?=a)b", "lookaround"},     {"(a)\\1", "backreferences"},
      {"\\bword", "word boundary"}, {"\\p{L}", "Unicode property"},
      {"(?i)abc", "inline flags"},  {"a^b", "anchor inside"},
      {"[[:alpha:]]", "POSIX"},
  };
  RegexOptions o;
  for (const auto& [pattern, feature] : cases) {
    auto r = ParseRegex(pattern, o);
    ASSERT_FALSE(r.ok()) << pattern;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(feature), std::string::npos)
        << pattern << ": " << r.status();
  }
}

TEST(RegexParserTest, SyntaxErrorsGiveTheOffset) {
  RegexOptions o;
  for (const char* p : {"(ab", "ab)", "[ab", "*a", "a{3,1}", "a**"}) {
    auto r = ParseRegex(p, o);
    ASSERT_FALSE(r.ok()) << p;
    EXPECT_NE(r.status().message().find("offset"), std::string::npos) << r.status();
  }
}

TEST(RegexParserTest, DeepNestingIsResourceExhausted) {
  RegexOptions o;
  o.max_depth = 10;
  std::string p = std::string(20, '(') + "a" + std::string(20, ')');
  auto r = ParseRegex(p, o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(RegexParserTest, UniverseRestrictsClasses) {
  RegexOptions o;
  o.universe = {{'a', 'b'}};
  auto r = ParseRegex("[a-z]+", o);
  ASSERT_TRUE(r.ok());
  CompileLimits limits;
  CompileBudget budget(limits);
  auto dfa = BuildDfa(*r->expr, &budget);
  ASSERT_TRUE(dfa.ok());
  EXPECT_TRUE(dfa->Matches("abba"));
  EXPECT_FALSE(dfa->Matches("abc"));
}

}  // namespace
}  // namespace tandem::grammar
