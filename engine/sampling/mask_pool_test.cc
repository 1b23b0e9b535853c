#include "engine/sampling/mask_pool.h"

#include <atomic>
#include <memory>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using State = MaskPool::TaskState;

TEST(MaskPoolTest, EveryTaskRunsOnceAndWaitSeesAllDone) {
  MaskPool pool(3);
  for (int round = 0; round < 20; ++round) {
    auto counts = std::make_shared<std::vector<std::atomic<int>>>(50);
    std::vector<std::function<void()>> tasks;
    for (int i = 0; i < 50; ++i) {
      tasks.push_back([counts, i] { (*counts)[i].fetch_add(i + 1); });
    }
    auto batch = pool.Start(std::move(tasks));
    std::vector<State> st = pool.Wait(batch.get(), absl::Now() + absl::Seconds(30));
    ASSERT_EQ(st.size(), 50u);
    for (int i = 0; i < 50; ++i) {
      EXPECT_EQ(st[i], State::kDone) << i;
      EXPECT_EQ((*counts)[i].load(), i + 1) << i;  // exactly once
    }
  }
}

TEST(MaskPoolTest, AnEmptyBatchIsDoneAtOnce) {
  MaskPool pool(1);
  auto batch = pool.Start({});
  EXPECT_TRUE(pool.Wait(batch.get(), absl::Now()).empty());
}

TEST(MaskPoolTest, PastTheDeadlineQueuedTasksAreCancelledAndNeverRun) {
  MaskPool pool(1);
  auto release = std::make_shared<absl::Notification>();
  auto started = std::make_shared<absl::Notification>();
  auto ran = std::make_shared<std::atomic<int>>(0);
  std::vector<std::function<void()>> tasks;
  // The one worker blocks in task 0 (bounded: the test releases it), so tasks
  // 1 and 2 are still queued at the deadline.
  tasks.push_back([release, started, ran] {
    started->Notify();
    release->WaitForNotificationWithTimeout(absl::Seconds(30));
    ran->fetch_add(1);
  });
  for (int i = 0; i < 2; ++i) tasks.push_back([ran] { ran->fetch_add(100); });
  auto batch = pool.Start(std::move(tasks));
  ASSERT_TRUE(started->WaitForNotificationWithTimeout(absl::Seconds(30)));
  std::vector<State> st = pool.Wait(batch.get(), absl::Now() + absl::Milliseconds(20));
  EXPECT_EQ(st[0], State::kRunning);
  EXPECT_EQ(st[1], State::kCancelled);
  EXPECT_EQ(st[2], State::kCancelled);
  release->Notify();
  // The running task still finishes; the cancelled ones never run. A later
  // batch goes through the same worker after them.
  auto next = pool.Start({[ran] { ran->fetch_add(1000); }});
  std::vector<State> st2 = pool.Wait(next.get(), absl::Now() + absl::Seconds(30));
  EXPECT_EQ(st2[0], State::kDone);
  EXPECT_EQ(ran->load(), 1001);
  EXPECT_EQ(pool.Wait(batch.get(), absl::Now() + absl::Seconds(30))[0], State::kDone);
}

TEST(MaskPoolTest, DestructionWithQueuedTasksDropsThem) {
  auto ran = std::make_shared<std::atomic<int>>(0);
  auto started = std::make_shared<absl::Notification>();
  std::shared_ptr<MaskPool::Batch> batch;
  {
    MaskPool pool(1);
    std::vector<std::function<void()>> tasks;
    tasks.push_back([started, ran] {
      started->Notify();
      absl::SleepFor(absl::Milliseconds(500));  // a long task, not a sync
      ran->fetch_add(1);
    });
    for (int i = 0; i < 5; ++i) tasks.push_back([ran] { ran->fetch_add(10); });
    batch = pool.Start(std::move(tasks));
    ASSERT_TRUE(started->WaitForNotificationWithTimeout(absl::Seconds(30)));
  }  // joins the worker: the running task ends, the queued ones are dropped
  EXPECT_EQ(ran->load(), 1);
}

}  // namespace
}  // namespace tandem::engine
