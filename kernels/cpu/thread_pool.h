// A fixed pool of worker threads with a blocking, statically chunked parallel-for.
// The calling thread takes part, so ThreadPool(1) runs everything inline (and so
// does n == 1). One
// ParallelFor at a time per pool (calls from several threads are serialised);
// nested calls from inside a task run inline.
//
// Why not OpenMP: the kernels need only static chunking, the pool must be owned by
// a backend object (several backends with different widths in one test process),
// and a plain pool keeps the build free of -fopenmp flags.
#ifndef TANDEM_KERNELS_CPU_THREAD_POOL_H_
#define TANDEM_KERNELS_CPU_THREAD_POOL_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"

namespace tandem::kernels {

class ThreadPool {
 public:
  // threads <= 0: std::thread::hardware_concurrency().
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Splits [0, n) into size() contiguous chunks of near-equal length (chunk i goes
  // to participant i; empty chunks are skipped) and calls fn(begin, end, worker)
  // for each, worker in [0, size()). Returns when all have finished.
  void ParallelFor(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn);

 private:
  void WorkerLoop(int index);
  void RunChunk(int index);

  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // serialises ParallelFor callers
  std::mutex mu_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int pending_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // The current job; written under mu_ before generation_ is bumped.
  int64_t n_ = 0;
  const std::function<void(int64_t, int64_t, int)>* fn_ = nullptr;  // not owned
};

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_CPU_THREAD_POOL_H_
