#include "kernels/cpu/thread_pool.h"

#include <atomic>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::kernels {
namespace {

TEST(ThreadPoolTest, EveryIndexExactlyOnceWithStaticChunks) {
  for (int threads : {1, 2, 3, 8}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (int64_t n : {0, 1, 2, 7, 100, 1001}) {
      std::vector<std::atomic<int>> hits(n);
      std::vector<int64_t> chunk_begin(threads, -1);
      pool.ParallelFor(n, [&](int64_t b, int64_t e, int worker) {
        ASSERT_GE(worker, 0);
        ASSERT_LT(worker, threads);
        chunk_begin[worker] = b;
        if (n == 1) {
          // A single index runs inline on the caller.
          EXPECT_EQ(worker, 0);
        } else {
          // Static chunking: participant w gets [n*w/size, n*(w+1)/size).
          EXPECT_EQ(b, n * worker / threads);
          EXPECT_EQ(e, n * (worker + 1) / threads);
        }
        for (int64_t i = b; i < e; ++i) hits[i]++;
      });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << i;
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
