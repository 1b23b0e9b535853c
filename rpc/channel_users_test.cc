#include "rpc/channel_users.h"

#include <thread>
#include <utility>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace tandem::rpc {
namespace {

TEST(ChannelUsers, CountsUsesUntilTheyAreDestroyed) {
  ChannelUsers users;
  EXPECT_EQ(users.count(), 0);
  {
    ChannelUsers::Use a = users.Enter();
    ChannelUsers::Use b = users.Enter();
    EXPECT_EQ(users.count(), 2);
    ChannelUsers::Use moved = std::move(a);  // a move is not a new user
    EXPECT_EQ(users.count(), 2);
    b = std::move(moved);  // b's own use ends; moved's passes to b
    EXPECT_EQ(users.count(), 1);
    ChannelUsers copy = users;  // copies share the count
    ChannelUsers::Use c = copy.Enter();
    EXPECT_EQ(users.count(), 2);
  }
  EXPECT_EQ(users.count(), 0);
  ChannelUsers::Use none;  // a default Use counts nothing
  EXPECT_EQ(users.count(), 0);
}

TEST(ChannelUsers, WaitIdleWaitsForTheLastUseOrTimesOut) {
  ChannelUsers users;
  EXPECT_TRUE(users.WaitIdle(absl::ZeroDuration()));
  auto use = std::make_unique<ChannelUsers::Use>(users.Enter());
  const absl::Time start = absl::Now();
  EXPECT_FALSE(users.WaitIdle(absl::Milliseconds(50)));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(50));
  std::thread t([&] {
    absl::SleepFor(absl::Milliseconds(50));
    use.reset();
  });
  EXPECT_TRUE(users.WaitIdle(absl::Seconds(10)));
  EXPECT_EQ(users.count(), 0);
  t.join();
}

TEST(ChannelUsers, AUseOutlivingItsChannelUsersIsSafe) {
  ChannelUsers::Use use;
  {
    ChannelUsers users;
    use = users.Enter();
  }
  // The count lives as long as a Use does: destroying it now reads no freed
  // memory (./tandem test runs //rpc/... under ASan, which would catch it).
  EXPECT_NO_FATAL_FAILURE(use = ChannelUsers::Use());
}

}  // namespace
}  // namespace tandem::rpc
