#include "common/splitmix.h"

#include <gtest/gtest.h>

namespace tandem {
namespace {

// The reference sequence from seed 0 (Vigna's splitmix64.c).
TEST(SplitMix64Test, MatchesTheReferenceSequence) {
  SplitMix64 g(0);
  EXPECT_EQ(g.Next(), 0xe220a8397b1dcdafull);
  EXPECT_EQ(g.Next(), 0x6e789e6aa1b965f4ull);
  EXPECT_EQ(g.Next(), 0x06c45d188009454full);
}

TEST(SplitMix64Test, TheStateDefinesTheStream) {
  SplitMix64 a(42), b(42), c(43);
  for (int i = 0; i < 100; ++i) {
    const uint64_t x = a.Next();
    EXPECT_EQ(x, b.Next());
    EXPECT_NE(x, c.Next());
  }
}

}  // namespace
}  // namespace tandem
