#include "common/route_hash.h"

#include <xxhash.h>

#include <vector>

#include "gtest/gtest.h"

namespace tandem {
namespace {

std::vector<int32_t> Tokens(int n, int32_t seed) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = (seed * 7919 + i * 31) % 1000;
  return t;
}

TEST(RouteHashTest, ChainedOverFullBlocksOnly) {
  const auto t = Tokens(200, 1);
  const auto h = RouteBlockHashes(t, "");
  ASSERT_EQ(h.size(), 3u);  // 200 / 64: the partial tail is not hashed
  // Block 0 by hand: seeded by the hash of the empty salt.
  const uint64_t root = XXH3_64bits("", 0);
  EXPECT_EQ(h[0], XXH3_64bits_withSeed(t.data(), 64 * sizeof(int32_t), root));
  EXPECT_EQ(h[1], XXH3_64bits_withSeed(t.data() + 64, 64 * sizeof(int32_t), h[0]));
}

TEST(RouteHashTest, PrefixesAgreeAndDivergeAfterAChange) {
  auto a = Tokens(256, 1);
  auto b = a;
  b[130] += 1;  // block 2
  const auto ha = RouteBlockHashes(a, "");
  const auto hb = RouteBlockHashes(b, "");
  EXPECT_EQ(ha[0], hb[0]);
  EXPECT_EQ(ha[1], hb[1]);
  EXPECT_NE(ha[2], hb[2]);
  EXPECT_NE(ha[3], hb[3]);  // the chain carries the change
}

TEST(RouteHashTest, SaltSeparatesTenants) {
  const auto t = Tokens(128, 3);
  EXPECT_NE(RouteBlockHashes(t, "a")[0], RouteBlockHashes(t, "b")[0]);
  EXPECT_NE(RouteBlockHashes(t, "a")[0], RouteBlockHashes(t, "")[0]);
}

TEST(RouteHashTest, PrefixHashIsTheChainEntry) {
  const auto t = Tokens(300, 5);
  const auto h = RouteBlockHashes(t, "s");
  EXPECT_EQ(RoutePrefixHash(t, 64, "s"), h[0]);
  EXPECT_EQ(RoutePrefixHash(t, 256, "s"), h[3]);
  EXPECT_EQ(RoutePrefixHash(t, 0, "s"), 0u);
  EXPECT_EQ(RoutePrefixHash(t, 100, "s"), 0u);  // not on the grid
  EXPECT_EQ(RoutePrefixHash(t, 320, "s"), 0u);  // past the end
}

}  // namespace
}  // namespace tandem
