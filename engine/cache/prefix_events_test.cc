#include "engine/cache/prefix_events.h"

#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using Kind = PrefixEvent::Kind;

PrefixEvent Stored(int64_t p, uint64_t h) { return {Kind::kStored, p, h}; }

TEST(PrefixEventQueueTest, TakeDrainsInOrder) {
  PrefixEventQueue q(8);
  auto never = []() -> std::vector<PrefixEvent> {
    ADD_FAILURE() << "no overflow expected";
    return {};
  };
  q.Push(Stored(64, 1), never);
  q.Push({Kind::kRemoved, 64, 1}, never);
  q.Push({Kind::kCleared, 0, 0}, never);
  EXPECT_EQ(q.size(), 3);
  const std::vector<PrefixEvent> got = q.Take();
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0], Stored(64, 1));
  EXPECT_EQ(got[1], (PrefixEvent{Kind::kRemoved, 64, 1}));
  EXPECT_EQ(got[2].kind, Kind::kCleared);
  EXPECT_TRUE(q.Take().empty());
  EXPECT_EQ(q.overflows(), 0);
}

TEST(PrefixEventQueueTest, OverflowReplacesWithResync) {
  PrefixEventQueue q(2);
  auto resync = [] {
    return std::vector<PrefixEvent>{{Kind::kCleared, 0, 0}, Stored(128, 7)};
  };
  q.Push(Stored(64, 1), resync);
  q.Push(Stored(128, 7), resync);
  q.Push({Kind::kRemoved, 64, 1}, resync);  // full: the resync replaces all three
  EXPECT_EQ(q.overflows(), 1);
  const std::vector<PrefixEvent> got = q.Take();
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].kind, Kind::kCleared);
  EXPECT_EQ(got[1], Stored(128, 7));
}

TEST(PrefixEventQueueTest, ConcurrentTakeLosesNothing) {
  PrefixEventQueue q(1 << 20);
  constexpr int kEvents = 20000;
  std::vector<PrefixEvent> taken;
  std::thread consumer([&] {
    while (static_cast<int>(taken.size()) < kEvents) {
      for (const PrefixEvent& e : q.Take()) taken.push_back(e);
    }
  });
  for (int i = 0; i < kEvents; ++i)
    q.Push(Stored(64 * (i + 1), i), [] { return std::vector<PrefixEvent>{}; });
  consumer.join();
  ASSERT_EQ(static_cast<int>(taken.size()), kEvents);
  for (int i = 0; i < kEvents; ++i) EXPECT_EQ(taken[i].route_hash, uint64_t(i));
}

TEST(PrefixEventQueueTest, KindNames) {
  EXPECT_STREQ(PrefixEventKindName(Kind::kStored), "stored");
  EXPECT_STREQ(PrefixEventKindName(Kind::kRemoved), "removed");
  EXPECT_STREQ(PrefixEventKindName(Kind::kCleared), "cleared");
}

}  // namespace
}  // namespace tandem::engine
