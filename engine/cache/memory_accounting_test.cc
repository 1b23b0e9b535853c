#include "engine/cache/memory_accounting.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using ::testing::HasSubstr;

// Full-size Kimi K3 (ARCHITECTURE.md): 24 MLA layers, 512 + 64 latent values
// per token in BF16; 69 KDA layers of 96 heads x 128.
MlaCacheLayout K3Mla(int32_t block_size) { return {24, block_size, 576, 2}; }
KdaStateLayout K3Kda() { return {69, 96, 128, 4, 4, 4}; }

TEST(MemoryAccountingTest, K3Figures) {
  EXPECT_EQ(MlaBytesPerToken(K3Mla(64)), 27648);  // "27.6 KB/token"
  EXPECT_EQ(BytesPerBlock(K3Mla(64)), 27648 * 64);
  // ~28 GB for one 1M-token sequence.
  EXPECT_EQ(MlaBytesPerToken(K3Mla(64)) * (1 << 20), 28991029248);
  // Per KDA layer: 6 MiB of state + 3 * 3 * 12288 fp32 conv tails.
  EXPECT_EQ(BytesPerSlot(K3Kda()), 69 * (6 * 1048576 + 9 * 12288 * 4));
}

TEST(MemoryAccountingTest, BlocksAndSlotsForBudget) {
  const MlaCacheLayout mla{2, 4, 8, 2};  // 32 bytes/token, 128 bytes/block
  EXPECT_EQ(BytesPerBlock(mla), 128);
  EXPECT_EQ(BlocksForBudget(1000, mla), 7);
  EXPECT_EQ(BlocksForBudget(127, mla), 0);
  EXPECT_EQ(BlocksForBudget(-5, mla), 0);
  const KdaStateLayout kda{1, 2, 2, 2, 4, 2};  // 2*2*2*4 + 3*1*4*2 = 56
  EXPECT_EQ(BytesPerSlot(kda), 56);
  EXPECT_EQ(SlotsForBudget(200, kda), 3);
}

TEST(MemoryAccountingTest, PlanReservesSlotsThenFillsBlocks) {
  const MlaCacheLayout mla{2, 4, 8, 2};
  const KdaStateLayout kda{1, 2, 2, 2, 4, 2};
  auto plan = PlanCache(1000, mla, kda, 3);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->slot_bytes, 168);
  EXPECT_EQ(plan->num_blocks, (1000 - 168) / 128);
  EXPECT_EQ(plan->block_bytes, plan->num_blocks * 128);
  EXPECT_LE(plan->slot_bytes + plan->block_bytes, 1000);
  EXPECT_THAT(PlanCache(100, mla, kda, 3).status().message(),
              HasSubstr("3 KDA state slots need 168 bytes, the budget is 100"));
  EXPECT_THAT(PlanCache(200, mla, kda, 3).status().message(),
              HasSubstr("no KV block of 128 bytes"));
  EXPECT_EQ(PlanCache(1000, {}, kda, 3).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::engine
