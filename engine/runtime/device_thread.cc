#include "engine/runtime/device_thread.h"

#include <utility>

#include "common/status.h"

namespace tandem::engine {

DeviceThread::DeviceThread() : thread_([this] { Loop(); }) {}

DeviceThread::~DeviceThread() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  thread_.join();
}

std::shared_ptr<DeviceThread::Job> DeviceThread::Submit(std::function<void()> fn) {
  auto job = std::make_shared<Job>();
  job->fn_ = std::move(fn);
  absl::MutexLock l(&mu_);
  queue_.push_back(job);
  return job;
}

absl::Status DeviceThread::Wait(const Job& job, absl::Time deadline) {
  absl::MutexLock l(&job.mu_);
  if (!job.mu_.AwaitWithDeadline(absl::Condition(&job.done_), deadline)) {
    return DeadlineExceeded("the device thread's step did not finish by its deadline");
  }
  return absl::OkStatus();
}

void DeviceThread::Loop() {
  while (true) {
    std::shared_ptr<Job> job;
    {
      absl::MutexLock l(&mu_);
      // Jobs still queued at stop run first: their submitters may wait on them.
      mu_.Await(absl::Condition(
          +[](DeviceThread* t) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return t->stop_ || !t->queue_.empty();
          },
          this));
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    job->fn_();
    job->fn_ = nullptr;
    absl::MutexLock l(&job->mu_);
    job->done_ = true;
  }
}

}  // namespace tandem::engine
