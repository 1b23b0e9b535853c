#include "common/clock.h"

#include <thread>

#include "gtest/gtest.h"

namespace tandem {
namespace {

TEST(FakeClockTest, MovesOnlyWhenAdvanced) {
  FakeClock clock;
  absl::Time t0 = clock.Now();
  EXPECT_EQ(clock.MonotonicSeconds(), 0.0);
  clock.Advance(absl::Milliseconds(1500));
  EXPECT_EQ(clock.Now() - t0, absl::Milliseconds(1500));
  EXPECT_DOUBLE_EQ(clock.MonotonicSeconds(), 1.5);
}

TEST(FakeClockTest, SleepUntilWakesWhenTimePasses) {
  FakeClock clock;
  absl::Time deadline = clock.Now() + absl::Seconds(10);
  std::thread sleeper([&] { clock.SleepUntil(deadline); });
  clock.Advance(absl::Seconds(4));
  clock.Advance(absl::Seconds(6));
  sleeper.join();  // would hang if SleepUntil missed the wake-up
  EXPECT_GE(clock.Now(), deadline);
}

TEST(RealClockTest, MonotonicNeverGoesBack) {
  Clock* c = Clock::Real();
  double a = c->MonotonicSeconds();
  double b = c->MonotonicSeconds();
  EXPECT_LE(a, b);
}

}  // namespace
}  // namespace tandem
