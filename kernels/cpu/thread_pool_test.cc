#include "kernels/cpu/thread_pool.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::kernels {
namespace {

TEST(ThreadPoolTest, EveryIndexExactlyOnceWithFixedChunks) {
  for (int threads : {1, 2, 3, 8}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (int64_t chunks : {0, 1, 5, 64}) {
      for (int64_t n : {0, 1, 2, 7, 100, 1001}) {
        std::vector<std::atomic<int>> hits(n);
        std::vector<std::atomic<int>> running(threads);
        std::mutex mu;
        std::set<std::pair<int64_t, int64_t>> ranges;
        pool.ParallelFor(
            n,
            [&](int64_t b, int64_t e, int worker) {
              ASSERT_GE(worker, 0);
              ASSERT_LT(worker, threads);
              // A participant runs one chunk at a time.
              EXPECT_EQ(running[worker]++, 0);
              {
                std::lock_guard<std::mutex> lock(mu);
                ranges.insert({b, e});
              }
              for (int64_t i = b; i < e; ++i) hits[i]++;
              running[worker]--;
            },
            chunks);
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << i;
        if (n <= 1) continue;
        // The chunks depend on (n, chunks) only, whoever ran them.
        int64_t c = chunks <= 0 ? threads : chunks;
        if (c > n) c = n;
        if (threads == 1) c = 1;
        std::set<std::pair<int64_t, int64_t>> want;
        for (int64_t i = 0; i < c; ++i) {
          if (n * i / c < n * (i + 1) / c) want.insert({n * i / c, n * (i + 1) / c});
        }
        EXPECT_EQ(ranges, want) << "threads " << threads << " n " << n;
      }
    }
  }
}

TEST(ThreadPoolTest, ManyCallsAndNestedCallsRunInline) {
  ThreadPool pool(4);
  std::atomic<int64_t> sum{0};
  for (int rep = 0; rep < 200; ++rep) {
    pool.ParallelFor(64, [&](int64_t b, int64_t e, int) {
      pool.ParallelFor(e - b, [&](int64_t ib, int64_t ie, int w) {
        EXPECT_EQ(w, 0);  // nested: inline on the calling participant
        sum += ie - ib;
      });
    });
  }
  EXPECT_EQ(sum.load(), 200 * 64);
}

}  // namespace
}  // namespace tandem::kernels

namespace tandem::kernels {
namespace {

// A caller that finds the workers busy or asleep still finishes every job.
TEST(ThreadPoolTest, BackToBackJobsAfterIdleSleep) {
  ThreadPool pool(2);
  int64_t total = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::atomic<int64_t> sum{0};
    for (int i = 0; i < 1000; ++i) {
      pool.ParallelFor(
          10, [&](int64_t b, int64_t e, int) { sum += e - b; }, 10);
    }
    total += sum.load();
    // Long enough for the worker to stop spinning and block.
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_EQ(total, 3 * 1000 * 10);
}

}  // namespace
}  // namespace tandem::kernels
