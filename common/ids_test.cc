#include "common/ids.h"

#include <set>

#include "gtest/gtest.h"

namespace tandem {
namespace {

TEST(IdsTest, SeededGeneratorIsDeterministic) {
  IdGenerator a(7), b(7), c(8);
  std::string x = a.Next("req-");
  EXPECT_EQ(x, b.Next("req-"));
  EXPECT_NE(x, c.Next("req-"));
  EXPECT_EQ(x.size(), 4u + 32u);
  EXPECT_TRUE(IsValidId(x));
}

TEST(IdsTest, UnseededIdsAreUnique) {
  IdGenerator g;
  std::set<std::string> seen;
  for (int i = 0; i < 1000; ++i) EXPECT_TRUE(seen.insert(g.Next()).second);
}

TEST(IdsTest, Validation) {
  EXPECT_TRUE(IsValidId("chatcmpl-abc_1.2:3"));
  EXPECT_FALSE(IsValidId(""));
  EXPECT_FALSE(IsValidId("has space"));
  EXPECT_FALSE(IsValidId("new\nline"));
  EXPECT_FALSE(IsValidId(std::string(129, 'a')));
  EXPECT_TRUE(IsValidId(std::string(128, 'a')));
}

}  // namespace
}  // namespace tandem
