#include "engine/cache/block_allocator.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(BlockAllocatorTest, AllocatesEveryBlockOnceThenRunsOut) {
  BlockAllocator a(3);
  EXPECT_EQ(a.num_free(), 3);
  std::vector<BlockId> got;
  for (int i = 0; i < 3; ++i) got.push_back(*a.Allocate());
  EXPECT_THAT(got, ElementsAre(0, 1, 2));  // deterministic order
  EXPECT_EQ(a.num_free(), 0);
  EXPECT_EQ(a.num_used(), 3);
  EXPECT_EQ(a.Allocate().status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(a.CheckInvariants().ok());
}

TEST(BlockAllocatorTest, AllocateNIsAllOrNothing) {
  BlockAllocator a(4);
  std::vector<BlockId> out;
  ASSERT_TRUE(a.AllocateN(3, &out).ok());
  const absl::Status s = a.AllocateN(2, &out);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("need 2 KV blocks, 1 free of 4"));
  EXPECT_EQ(out.size(), 3u);
  EXPECT_EQ(a.num_free(), 1);
}

TEST(BlockAllocatorTest, RefCountsKeepSharedBlocksUntilTheLastFree) {
  BlockAllocator a(2);
  const BlockId b = *a.Allocate();
  ASSERT_TRUE(a.IncRef(b).ok());
  EXPECT_EQ(a.ref_count(b), 2);
  ASSERT_TRUE(a.Free(b).ok());
  EXPECT_EQ(a.ref_count(b), 1);
  EXPECT_EQ(a.num_free(), 1);
  ASSERT_TRUE(a.Free(b).ok());
  EXPECT_EQ(a.num_free(), 2);
  EXPECT_TRUE(a.CheckInvariants().ok());
}

TEST(BlockAllocatorTest, MisuseIsAnErrorNotACorruption) {
  BlockAllocator a(2);
  EXPECT_THAT(a.Free(0).message(), HasSubstr("block 0 is already free"));
  EXPECT_THAT(a.Free(7).message(), HasSubstr("outside [0, 2)"));
  EXPECT_THAT(a.IncRef(1).message(), HasSubstr("is free"));
  EXPECT_EQ(a.num_free(), 2);
  EXPECT_TRUE(a.CheckInvariants().ok());
}

}  // namespace
}  // namespace tandem::engine
