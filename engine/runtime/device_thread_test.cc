// DeviceThread: jobs run one at a time in submission order, on one thread
// that is not the caller's; Wait's deadline bounds the wait and leaves a slow
// job running; the destructor runs every job submitted.
#include "engine/runtime/device_thread.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

TEST(DeviceThread, RunsJobsInOrderOnItsOwnThread) {
  std::vector<int> order;  // written only by the device thread
  std::thread::id ran_on;
  std::vector<std::shared_ptr<DeviceThread::Job>> jobs;
  {
    DeviceThread t;
    for (int i = 0; i < 50; ++i) {
      jobs.push_back(t.Submit([&order, &ran_on, i] {
        order.push_back(i);
        ran_on = std::this_thread::get_id();
      }));
    }
    ASSERT_TRUE(DeviceThread::Wait(*jobs.back(), absl::Now() + absl::Seconds(30)).ok());
    // In order: the last one done means every earlier one is.
    for (const auto& j : jobs) EXPECT_TRUE(j->done());
    EXPECT_NE(ran_on, std::this_thread::get_id());
  }
  ASSERT_EQ(order.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[i], i);
}

TEST(DeviceThread, WaitHasADeadlineAndTheJobGoesOn) {
  absl::Notification release;
  std::atomic<bool> finished{false};
  std::shared_ptr<DeviceThread::Job> slow, after;
  {
    DeviceThread t;
    slow = t.Submit([&] {
      release.WaitForNotification();
      finished = true;
    });
    after = t.Submit([] {});
    const absl::Time t0 = absl::Now();
    absl::Status st = DeviceThread::Wait(*slow, t0 + absl::Milliseconds(50));
    EXPECT_TRUE(absl::IsDeadlineExceeded(st)) << st;
    EXPECT_GE(absl::Now() - t0, absl::Milliseconds(50));
    EXPECT_FALSE(slow->done());
    EXPECT_FALSE(after->done());  // queued behind it
    release.Notify();
    // The destructor runs what was submitted.
  }
  EXPECT_TRUE(finished);
  EXPECT_TRUE(slow->done());
  EXPECT_TRUE(after->done());
}

}  // namespace
}  // namespace tandem::engine
