#include "kernels/cpu/thread_pool.h"

#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TANDEM_PAUSE() _mm_pause()
#else
#define TANDEM_PAUSE() \
  do {                 \
  } while (0)
#endif

namespace tandem::kernels {
namespace {

thread_local bool tls_in_pool_task = false;

// How long an idle worker spins before it blocks, and how long the caller spins
// on unfinished chunks before it yields the core.
constexpr std::chrono::microseconds kWorkerSpin{100};
constexpr int kCallerSpinPolls = 4096;

using SteadyClock = std::chrono::steady_clock;

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
    stopping_.store(true);
  }
  start_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::RunChunks(int participant) {
  const bool nested = tls_in_pool_task;
  tls_in_pool_task = true;
  for (;;) {
    const int64_t c = next_chunk_.fetch_add(1);
    if (c >= chunks_) break;
    const int64_t begin = n_ * c / chunks_, end = n_ * (c + 1) / chunks_;
    if (begin < end) (*fn_)(begin, end, participant);
    done_chunks_.fetch_add(1);
  }
  tls_in_pool_task = nested;
}

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;
  for (;;) {
    // Spin briefly for the next job, then sleep.
    const auto spin_until = SteadyClock::now() + kWorkerSpin;
    int polls = 0;
    while (epoch_.load() == seen && !stopping_.load()) {
      TANDEM_PAUSE();
      if (++polls % 64 == 0 && SteadyClock::now() > spin_until) {
        std::unique_lock<std::mutex> lock(mu_);
        sleepers_.fetch_add(1);
        start_cv_.wait(lock, [&] { return stop_ || epoch_.load() != seen; });
        sleepers_.fetch_sub(1);
        break;
      }
    }
    if (stopping_.load()) return;
    seen = epoch_.load();
    // Join the job only while it is open; the caller waits for busy_ == 0 after
    // closing it, so a late worker never touches a finished (or the next) job.
    busy_.fetch_add(1);
    if (open_.load()) RunChunks(index);
    busy_.fetch_sub(1);
  }
}

void ThreadPool::ParallelFor(int64_t n,
                             const std::function<void(int64_t, int64_t, int)>& fn,
                             int64_t chunks) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1 || tls_in_pool_task) {
    const bool nested = tls_in_pool_task;
    tls_in_pool_task = true;
    fn(0, n, 0);
    tls_in_pool_task = nested;
    return;
  }
  if (chunks <= 0) chunks = size();
  if (chunks > n) chunks = n;
  std::lock_guard<std::mutex> call_lock(call_mu_);
  n_ = n;
  chunks_ = chunks;
  fn_ = &fn;
  next_chunk_.store(0);
  done_chunks_.store(0);
  open_.store(true);
  epoch_.fetch_add(1);
  if (sleepers_.load() > 0) {
    { std::lock_guard<std::mutex> lock(mu_); }
    start_cv_.notify_all();
  }
  RunChunks(0);
  // Chunks claimed by workers may still be running.
  for (int polls = 0; done_chunks_.load() < chunks; ++polls) {
    if (polls < kCallerSpinPolls) {
      TANDEM_PAUSE();
    } else {
      std::this_thread::yield();
    }
  }
  open_.store(false);
  while (busy_.load() > 0) TANDEM_PAUSE();
  fn_ = nullptr;
}

}  // namespace tandem::kernels
