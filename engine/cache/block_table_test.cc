#include "engine/cache/block_table.h"

#include <map>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(BlockTableTest, BlocksForTokensTable) {
  struct Case {
    int64_t tokens;
    int32_t block_size;
    int64_t blocks;
  } cases[] = {{0, 16, 0},  {1, 16, 1},           {16, 16, 1},         {17, 16, 2},
               {-3, 16, 0}, {1048576, 64, 16384}, {1048577, 64, 16385}};
  for (const Case& c : cases) {
    EXPECT_EQ(BlocksForTokens(c.tokens, c.block_size), c.blocks) << c.tokens;
  }
}

TEST(BlockTableTest, GrowsShrinksAndReleases) {
  BlockAllocator a(8);
  BlockTable t(4);
  EXPECT_EQ(t.BlocksNeededToAppend(5), 2);
  ASSERT_TRUE(t.Append(5, &a).ok());
  EXPECT_THAT(t.blocks(), ElementsAre(0, 1));
  EXPECT_EQ(t.BlocksNeededToAppend(3), 0);  // fills the partial block
  ASSERT_TRUE(t.Append(3, &a).ok());
  EXPECT_EQ(t.blocks().size(), 2u);
  ASSERT_TRUE(t.Append(1, &a).ok());
  EXPECT_EQ(t.num_tokens(), 9);
  EXPECT_EQ(a.num_free(), 5);
  // Speculative rollback: 9 -> 5 tokens frees the third block only.
  ASSERT_TRUE(t.Truncate(5, &a).ok());
  EXPECT_EQ(t.blocks().size(), 2u);
  EXPECT_EQ(a.num_free(), 6);
  EXPECT_THAT(t.Truncate(6, &a).message(),
              HasSubstr("cannot truncate a table of 5 tokens to 6"));
  ASSERT_TRUE(t.Release(&a).ok());
  EXPECT_EQ(t.num_tokens(), 0);
  EXPECT_TRUE(t.blocks().empty());
  EXPECT_EQ(a.num_free(), 8);
  EXPECT_TRUE(a.CheckInvariants().ok());
}

TEST(BlockTableTest, FailedAppendChangesNothing) {
  BlockAllocator a(2);
  BlockTable t(4);
  ASSERT_TRUE(t.Append(6, &a).ok());
  EXPECT_EQ(t.Append(3, &a).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(t.num_tokens(), 6);
  EXPECT_EQ(t.blocks().size(), 2u);
  ASSERT_TRUE(t.Append(2, &a).ok());  // still fits the partial block
}

TEST(BlockTableTest, SharedPrefixIsRefCounted) {
  BlockAllocator a(4);
  BlockTable owner(4), sharer(4);
  ASSERT_TRUE(owner.Append(8, &a).ok());
  ASSERT_TRUE(sharer.AdoptShared(owner.blocks(), 8, &a).ok());
  EXPECT_EQ(a.ref_count(owner.blocks()[0]), 2);
  ASSERT_TRUE(sharer.Append(1, &a).ok());  // its own third block
  EXPECT_EQ(a.num_free(), 1);
  ASSERT_TRUE(owner.Release(&a).ok());
  EXPECT_EQ(a.num_free(), 1);  // still held by the sharer
  ASSERT_TRUE(sharer.Release(&a).ok());
  EXPECT_EQ(a.num_free(), 4);
  BlockTable bad(4);
  EXPECT_THAT(bad.AdoptShared({0}, 8, &a).message(),
              HasSubstr("8 tokens do not fill 1 blocks of 4"));
  EXPECT_EQ(bad.AdoptShared({0}, 3, &a).code(),
            absl::StatusCode::kFailedPrecondition);  // block 0 is free
  EXPECT_TRUE(a.CheckInvariants().ok());
}

// Random appends, truncations, releases and shares over several tables: the
// allocator never leaks or double-hands a block, every block's ref count equals
// the number of tables holding it, and each table holds exactly the blocks
// its token count needs.
TEST(BlockTableTest, RandomOperationsNeverLeak) {
  constexpr int kBlocks = 64;
  constexpr int kTables = 6;
  BlockAllocator a(kBlocks);
  std::vector<BlockTable> tables(kTables, BlockTable(4));
  std::mt19937 rng(7);
  for (int step = 0; step < 20000; ++step) {
    BlockTable& t = tables[rng() % kTables];
    switch (rng() % 5) {
      case 0:
      case 1: {
        const int64_t n = rng() % 12;
        const int32_t before = a.num_free();
        const int64_t need = t.BlocksNeededToAppend(n);
        const absl::Status s = t.Append(n, &a);
        EXPECT_EQ(s.ok(), need <= before);
        break;
      }
      case 2:
        ASSERT_TRUE(
            t.Truncate(t.num_tokens() == 0 ? 0 : rng() % (t.num_tokens() + 1), &a)
                .ok());
        break;
      case 3:
        if (rng() % 4 == 0) {
          ASSERT_TRUE(t.Release(&a).ok());
        }
        break;
      case 4: {
        // Share another table's full blocks into an empty table.
        const BlockTable& src = tables[rng() % kTables];
        if (t.num_tokens() == 0 && &src != &t && src.num_tokens() >= 4) {
          const int64_t full = src.num_tokens() / 4;
          std::vector<BlockId> prefix(src.blocks().begin(),
                                      src.blocks().begin() + full);
          ASSERT_TRUE(t.AdoptShared(prefix, full * 4, &a).ok());
        }
        break;
      }
    }
    ASSERT_TRUE(a.CheckInvariants().ok()) << a.CheckInvariants();
    std::map<BlockId, int> holders;
    for (const BlockTable& bt : tables) {
      ASSERT_EQ(static_cast<int64_t>(bt.blocks().size()),
                BlocksForTokens(bt.num_tokens(), 4));
      for (BlockId id : bt.blocks()) ++holders[id];
    }
    int used = 0;
    for (int id = 0; id < kBlocks; ++id) {
      const int h = holders.count(id) ? holders[id] : 0;
      ASSERT_EQ(a.ref_count(id), h) << "block " << id;
      used += h > 0;
    }
    ASSERT_EQ(used + a.num_free(), kBlocks);
  }
  for (BlockTable& t : tables) ASSERT_TRUE(t.Release(&a).ok());
  EXPECT_EQ(a.num_free(), kBlocks);
}

}  // namespace
}  // namespace tandem::engine
