#include "kernels/cpu/thread_pool.h"

namespace tandem::kernels {
namespace {
thread_local bool tls_in_pool_task = false;
}  // namespace

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::thread::hardware_concurrency());
  if (threads <= 0) threads = 1;
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::RunChunk(int index) {
  const int64_t parts = size();
  const int64_t begin = n_ * index / parts, end = n_ * (index + 1) / parts;
  if (begin < end) {
    tls_in_pool_task = true;
    (*fn_)(begin, end, index);
    tls_in_pool_task = false;
  }
}

void ThreadPool::WorkerLoop(int index) {
  int64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    RunChunk(index);
    std::lock_guard<std::mutex> lock(mu_);
    if (--pending_ == 0) done_cv_.notify_one();
  }
}

void ThreadPool::ParallelFor(int64_t n,
                             const std::function<void(int64_t, int64_t, int)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1 || tls_in_pool_task) {
    const bool nested = tls_in_pool_task;
    tls_in_pool_task = true;
    fn(0, n, 0);
    tls_in_pool_task = nested;
    return;
  }
  std::lock_guard<std::mutex> call_lock(call_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    n_ = n;
    fn_ = &fn;
    pending_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  start_cv_.notify_all();
  RunChunk(0);
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  fn_ = nullptr;
}

}  // namespace tandem::kernels
