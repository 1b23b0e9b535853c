#include "gateway/auth.h"

#include "gtest/gtest.h"

namespace tandem::gateway {
namespace {

TEST(ConstantTimeEqualsTest, Table) {
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_TRUE(ConstantTimeEquals("secret", "secret"));
  EXPECT_FALSE(ConstantTimeEquals("secret", "secreT"));
  EXPECT_FALSE(ConstantTimeEquals("secret", "secret2"));
  EXPECT_FALSE(ConstantTimeEquals("secret2", "secret"));
  EXPECT_FALSE(ConstantTimeEquals("", "a"));
  EXPECT_FALSE(ConstantTimeEquals("a", ""));
  // A prefix padded with NULs must not compare equal to the shorter string.
  EXPECT_FALSE(ConstantTimeEquals(absl::string_view("ab\0", 3), "ab"));
  EXPECT_TRUE(
      ConstantTimeEquals(absl::string_view("a\0b", 3), absl::string_view("a\0b", 3)));
}

TEST(AuthorizationMatchesTest, Table) {
  EXPECT_TRUE(AuthorizationMatches("", ""));         // no key configured
  EXPECT_TRUE(AuthorizationMatches("garbage", ""));  // no key configured
  EXPECT_TRUE(AuthorizationMatches("Bearer k1", "k1"));
  EXPECT_TRUE(AuthorizationMatches("bearer k1", "k1"));
  EXPECT_TRUE(AuthorizationMatches("  BEARER   k1  ", "k1"));
  EXPECT_FALSE(AuthorizationMatches("", "k1"));
  EXPECT_FALSE(AuthorizationMatches("Bearer", "k1"));
  EXPECT_FALSE(AuthorizationMatches("Bearer ", "k1"));
  EXPECT_FALSE(AuthorizationMatches("Basic k1", "k1"));
  EXPECT_FALSE(AuthorizationMatches("k1", "k1"));
  EXPECT_FALSE(AuthorizationMatches("Bearer k2", "k1"));
  EXPECT_FALSE(AuthorizationMatches("Bearer k1x", "k1"));
  EXPECT_FALSE(AuthorizationMatches("Bearerk1", "k1"));
}

}  // namespace
}  // namespace tandem::gateway
