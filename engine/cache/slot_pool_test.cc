#include "engine/cache/slot_pool.h"

#include <random>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using ::testing::HasSubstr;

TEST(SlotPoolTest, AcquireReleaseAndExhaustion) {
  SlotPool pool(2);
  const SlotId a = *pool.Acquire();
  const SlotId b = *pool.Acquire();
  EXPECT_NE(a, b);
  EXPECT_TRUE(pool.in_use(a));
  EXPECT_EQ(pool.Acquire().status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(pool.Release(a).ok());
  EXPECT_FALSE(pool.in_use(a));
  EXPECT_THAT(pool.Release(a).message(), HasSubstr("already free"));
  EXPECT_THAT(pool.Release(-1).message(), HasSubstr("outside"));
  EXPECT_EQ(*pool.Acquire(), a);  // LIFO
  EXPECT_TRUE(pool.CheckInvariants().ok());
}

TEST(SlotPoolTest, RandomOperationsKeepInvariants) {
  SlotPool pool(16);
  std::mt19937 rng(1);
  std::set<SlotId> held;
  for (int step = 0; step < 5000; ++step) {
    if (rng() % 2 == 0) {
      auto s = pool.Acquire();
      if (held.size() == 16) {
        EXPECT_FALSE(s.ok());
      } else {
        ASSERT_TRUE(s.ok());
        EXPECT_TRUE(held.insert(*s).second) << "slot handed out twice";
      }
    } else if (!held.empty()) {
      auto it = held.begin();
      std::advance(it, rng() % held.size());
      ASSERT_TRUE(pool.Release(*it).ok());
      held.erase(it);
    }
    ASSERT_EQ(pool.num_used(), static_cast<int32_t>(held.size()));
    ASSERT_TRUE(pool.CheckInvariants().ok());
  }
}

}  // namespace
}  // namespace tandem::engine
