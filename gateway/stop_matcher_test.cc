#include "gateway/stop_matcher.h"

#include "gtest/gtest.h"

namespace tandem::gateway {
namespace {

// Feeds `pieces` and returns everything released (and whether it matched).
std::pair<std::string, bool> RunMatcher(std::vector<std::string> stops,
                                        const std::vector<std::string>& pieces) {
  StopMatcher m(std::move(stops));
  std::string out;
  bool matched = false;
  for (const auto& p : pieces) {
    matched = m.Feed(p, &out) || matched;
  }
  if (!matched) m.Flush(&out);
  return {out, matched};
}

TEST(StopMatcherTest, NoStopsPassesThrough) {
  StopMatcher m({});
  std::string out;
  EXPECT_FALSE(m.Feed("abc", &out));
  EXPECT_EQ(out, "abc");
}

TEST(StopMatcherTest, HoldsPossiblePrefixOnly) {
  StopMatcher m({"world"});
  std::string out;
  EXPECT_FALSE(m.Feed("Hello wo", &out));
  EXPECT_EQ(out, "Hello ");
  EXPECT_FALSE(m.Feed("w", &out));  // "wow" cannot start "world" at "wo"; "w" can
  EXPECT_EQ(out, "Hello wo");
  m.Flush(&out);
  EXPECT_EQ(out, "Hello wow");
}

TEST(StopMatcherTest, Table) {
  struct Case {
    std::vector<std::string> stops;
    std::vector<std::string> pieces;
    std::string out;
    bool matched;
  };
  const std::vector<Case> cases = {
      {{"world"}, {"Hello world!"}, "Hello ", true},
      {{"world"}, {"Hello wo", "rld!"}, "Hello ", true},
      {{"world"},
       {"H", "e", "l", "l", "o", " ", "w", "o", "r", "l", "d"},
       "Hello ",
       true},
      {{"world"}, {"Hello word"}, "Hello word", false},
      {{"ab", "b"}, {"xab"}, "x", true},       // earliest match wins
      {{"bc", "abcd"}, {"xabc"}, "xa", true},  // earliest position
      {{"\n\n"}, {"line\n", "\nnext"}, "line", true},
      {{"é"}, {"caf", "é au lait"}, "caf", true},  // multi-byte stop
      {{"stop"}, {"sto"}, "sto", false},           // flushed at the end
      {{""}, {"abc"}, "abc", false},               // empty stops ignored
  };
  for (const Case& c : cases) {
    auto [out, matched] = RunMatcher(c.stops, c.pieces);
    EXPECT_EQ(out, c.out);
    EXPECT_EQ(matched, c.matched);
  }
}

TEST(StopMatcherTest, IgnoresInputAfterMatch) {
  StopMatcher m({"x"});
  std::string out;
  EXPECT_TRUE(m.Feed("axb", &out));
  EXPECT_TRUE(m.Feed("more", &out));
  m.Flush(&out);
  EXPECT_EQ(out, "a");
}

}  // namespace
}  // namespace tandem::gateway
