#include "common/route_hash.h"

#include <xxhash.h>

#include <cstring>
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

// Text-only hashes are what they were before images entered the route hash
// (values of the token-only chain, computed at 0654674): workers and routers of
// either version agree on text prompts.
TEST(RouteHashTest, TextOnlyHashesAreUnchanged) {
  const auto t = Tokens(200, 11);
  const std::vector<uint64_t> want = {0xa1e43eeb69149de7ull, 0x79a4ac4fd21073ddull,
                                      0x7185c5987ac1e6c5ull};
  EXPECT_EQ(RouteBlockHashes(t, "tenant"), want);
  EXPECT_EQ(RouteBlockHashes(t, "tenant", {}), want);
  // An image past the last full block (192..199) changes no full block.
  const RouteMedia tail[] = {{.position = 195, .hash = 42}};
  EXPECT_EQ(RouteBlockHashes(t, "tenant", tail), want);
  EXPECT_EQ(RoutePrefixHash(t, 128, "tenant"), want[1]);
}

// The block holding an image's first placeholder hashes its token ids followed
// by (position, hash) as two uint64s: the layout of the engine's block keys
// (engine/cache ChainedBlockHashes).
TEST(RouteHashTest, AnImageIsMixedIntoTheBlockHoldingItsFirstPlaceholder) {
  auto t = Tokens(256, 2);
  for (int i = 70; i < 90; ++i) t[i] = 7;  // the placeholders of one image
  const RouteMedia image[] = {{.position = 70, .hash = 0x1234567890abcdefull}};
  const auto h = RouteBlockHashes(t, "", image);
  const auto text = RouteBlockHashes(t, "");
  ASSERT_EQ(h.size(), 4u);
  EXPECT_EQ(h[0], text[0]);  // before the image: the text's
  std::vector<uint8_t> bytes(64 * sizeof(int32_t) + 2 * sizeof(uint64_t));
  std::memcpy(bytes.data(), t.data() + 64, 64 * sizeof(int32_t));
  const uint64_t pair[2] = {70, 0x1234567890abcdefull};
  std::memcpy(bytes.data() + 64 * sizeof(int32_t), pair, sizeof(pair));
  EXPECT_EQ(h[1], XXH3_64bits_withSeed(bytes.data(), bytes.size(), h[0]));
  EXPECT_NE(h[1], text[1]);
  // The chain carries it: later blocks differ from the text's too.
  EXPECT_EQ(h[2], XXH3_64bits_withSeed(t.data() + 128, 64 * sizeof(int32_t), h[1]));
  EXPECT_NE(h[3], text[3]);
  EXPECT_EQ(RoutePrefixHash(t, 192, "", image), h[2]);
}

TEST(RouteHashTest, EqualImagesMatchAndOtherImagesDoNot) {
  auto t = Tokens(320, 4);
  for (int i = 70; i < 90; ++i) t[i] = 7;
  for (int i = 200; i < 208; ++i) t[i] = 7;
  const RouteMedia ab[] = {{.position = 70, .hash = 0xa},
                           {.position = 200, .hash = 0xb}};
  const RouteMedia ab_again[] = {{.position = 70, .hash = 0xa},
                                 {.position = 200, .hash = 0xb}};
  const RouteMedia ba_listed[] = {{.position = 200, .hash = 0xb},
                                  {.position = 70, .hash = 0xa}};
  const RouteMedia other_b[] = {{.position = 70, .hash = 0xa},
                                {.position = 200, .hash = 0xc}};
  const RouteMedia other_a[] = {{.position = 70, .hash = 0xd},
                                {.position = 200, .hash = 0xb}};
  const RouteMedia moved_a[] = {{.position = 71, .hash = 0xa},
                                {.position = 200, .hash = 0xb}};
  const auto h = RouteBlockHashes(t, "s", ab);
  EXPECT_EQ(RouteBlockHashes(t, "s", ab_again), h);
  EXPECT_EQ(RouteBlockHashes(t, "s", ba_listed), h);  // the order given does not matter
  const auto hb = RouteBlockHashes(t, "s", other_b);
  const auto ha = RouteBlockHashes(t, "s", other_a);
  const auto hm = RouteBlockHashes(t, "s", moved_a);
  ASSERT_EQ(h.size(), 5u);
  // Another B (block 3): equal up to 192, different from 256 on.
  EXPECT_EQ(hb[0], h[0]);
  EXPECT_EQ(hb[1], h[1]);
  EXPECT_EQ(hb[2], h[2]);
  EXPECT_NE(hb[3], h[3]);
  EXPECT_NE(hb[4], h[4]);
  // Another A, or A's hash at another position (block 1): equal up to 64 only.
  for (const auto* other : {&ha, &hm}) {
    EXPECT_EQ((*other)[0], h[0]);
    for (size_t i = 1; i < h.size(); ++i) EXPECT_NE((*other)[i], h[i]) << i;
  }
  // No image at all is not the same as an image either.
  EXPECT_NE(RouteBlockHashes(t, "s")[1], h[1]);
}

}  // namespace
}  // namespace tandem
