#include "engine/sampling/mask_pool.h"

#include <utility>

namespace tandem::engine {
namespace {

constexpr int kQueued = static_cast<int>(MaskPool::TaskState::kQueued);
constexpr int kRunning = static_cast<int>(MaskPool::TaskState::kRunning);
constexpr int kDone = static_cast<int>(MaskPool::TaskState::kDone);
constexpr int kCancelled = static_cast<int>(MaskPool::TaskState::kCancelled);

}  // namespace

MaskPool::MaskPool(int threads) {
  if (threads < 1) threads = 1;
  for (int t = 0; t < threads; ++t) workers_.emplace_back([this] { WorkerLoop(); });
}

MaskPool::~MaskPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    queue_.clear();  // queued tasks never run (their owners hold no waits)
  }
  for (std::thread& w : workers_) w.join();
}

std::shared_ptr<MaskPool::Batch> MaskPool::Start(
    std::vector<std::function<void()>> tasks) {
  auto batch = std::make_shared<Batch>();
  batch->tasks_ = std::move(tasks);
  const int n = batch->size();
  batch->state_ = std::make_unique<std::atomic<int>[]>(n);
  for (int i = 0; i < n; ++i) batch->state_[i].store(kQueued);
  absl::MutexLock lock(&mu_);
  for (int i = 0; i < n; ++i) queue_.emplace_back(batch, i);
  return batch;
}

void MaskPool::WorkerLoop() {
  while (true) {
    std::shared_ptr<Batch> batch;
    int i = 0;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](MaskPool* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) {
            return p->stop_ || !p->queue_.empty();
          },
          this));
      if (stop_) return;
      batch = std::move(queue_.front().first);
      i = queue_.front().second;
      queue_.pop_front();
    }
    int expected = kQueued;
    // A task cancelled by Wait (deadline) is skipped.
    if (!batch->state_[i].compare_exchange_strong(expected, kRunning)) continue;
    batch->tasks_[i]();
    batch->tasks_[i] = nullptr;  // drop what it captured now
    batch->state_[i].store(kDone);
    absl::MutexLock lock(&batch->mu_);
    ++batch->finished_;
  }
}

std::vector<MaskPool::TaskState> MaskPool::Wait(Batch* batch, absl::Time deadline) {
  const int n = batch->size();
  {
    absl::MutexLock lock(&batch->mu_);
    batch->mu_.AwaitWithDeadline(absl::Condition(
                                     +[](Batch* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(
                                          b->mu_) { return b->finished_ == b->size(); },
                                     batch),
                                 deadline);
    // Past the deadline: what has not started never will.
    for (int i = 0; i < n && batch->finished_ < n; ++i) {
      int expected = kQueued;
      if (batch->state_[i].compare_exchange_strong(expected, kCancelled)) {
        ++batch->finished_;
      }
    }
  }
  std::vector<TaskState> out(n);
  for (int i = 0; i < n; ++i) out[i] = static_cast<TaskState>(batch->state_[i].load());
  return out;
}

}  // namespace tandem::engine
