// A fixed pool of worker threads with a blocking parallel-for over claimable chunks.
// The calling thread takes part, so ThreadPool(1) runs everything inline (and so
// does n == 1). One ParallelFor at a time per pool (calls from several threads are
// serialised); nested calls from inside a task run inline.
//
// Chunks are fixed by (n, chunks) alone: chunk c is [n*c/chunks, n*(c+1)/chunks).
// Which participant runs a chunk is NOT fixed: participants claim chunks from an
// atomic counter, so when a worker is descheduled (the machine is shared) the
// caller runs its chunks instead of waiting for it. Kernels therefore must compute
// every output the same way whichever participant, and whichever chunk, holds it
// (they do: results never depend on the split; see docs/ARCHITECTURE.md
// "Numerics").
//
// Waiting: workers spin (with pause) for a short while after each job so that the
// back-to-back kernel calls of one forward pass do not pay a futex wake-up each,
// then block on a condition variable.
//
// Why not OpenMP: the kernels need only static chunks, the pool must be owned by a
// backend object (several backends with different widths in one test process),
// and a plain pool keeps the build free of -fopenmp flags.
#ifndef TANDEM_KERNELS_CPU_THREAD_POOL_H_
#define TANDEM_KERNELS_CPU_THREAD_POOL_H_

#include <atomic>
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

  // Splits [0, n) into `chunks` contiguous chunks of near-equal length (chunks <= 0:
  // size(); capped at n) and calls fn(begin, end, participant) once per chunk,
  // participant in [0, size()) naming the thread that runs it (no two chunks run at
  // the same time with the same participant). Returns when all have finished.
  void ParallelFor(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn,
                   int64_t chunks = 0);

 private:
  void WorkerLoop(int index);
  // Claims and runs chunks of the current job until none is left.
  void RunChunks(int participant);

  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // serialises ParallelFor callers
  std::mutex mu_;       // guards sleeping and waking
  std::condition_variable start_cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> stopping_{false};
  std::atomic<int> sleepers_{0};
  // The current job; written by the caller before epoch_ is bumped, read by the
  // workers between joining (busy_) and leaving it.
  std::atomic<uint64_t> epoch_{0};
  std::atomic<bool> open_{false};
  std::atomic<int> busy_{0};
  std::atomic<int64_t> next_chunk_{0};
  std::atomic<int64_t> done_chunks_{0};
  int64_t n_ = 0;
  int64_t chunks_ = 0;
  const std::function<void(int64_t, int64_t, int)>* fn_ = nullptr;  // not owned
};

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_CPU_THREAD_POOL_H_
