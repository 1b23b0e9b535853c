// One thread that runs jobs one at a time, in the order they were submitted:
// the engine's overlapped steps (EngineOptions::overlap_steps) run their
// forward and device sampling here while the engine's thread plans the next
// step and turns the previous step's tokens into text.
//
//   DeviceThread t;
//   std::shared_ptr<DeviceThread::Job> j = t.Submit([] { ... });
//   absl::Status s = t.Wait(*j, absl::Now() + absl::Seconds(10));
//
// Wait's deadline bounds the caller's wait only: a job that overruns it keeps
// running (a forward cannot be cut short), and the destructor waits for every
// job submitted.
#ifndef TANDEM_ENGINE_RUNTIME_DEVICE_THREAD_H_
#define TANDEM_ENGINE_RUNTIME_DEVICE_THREAD_H_

#include <deque>
#include <functional>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace tandem::engine {

class DeviceThread {
 public:
  class Job {
   public:
    bool done() const ABSL_LOCKS_EXCLUDED(mu_) {
      absl::MutexLock l(&mu_);
      return done_;
    }

   private:
    friend class DeviceThread;
    std::function<void()> fn_;
    mutable absl::Mutex mu_;
    bool done_ ABSL_GUARDED_BY(mu_) = false;
  };

  DeviceThread();
  ~DeviceThread();
  DeviceThread(const DeviceThread&) = delete;
  DeviceThread& operator=(const DeviceThread&) = delete;

  // Queues `fn` behind the jobs already submitted.
  std::shared_ptr<Job> Submit(std::function<void()> fn) ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks until `job` has run (OK) or `deadline` passes (DeadlineExceeded;
  // the job goes on).
  static absl::Status Wait(const Job& job, absl::Time deadline);

 private:
  void Loop();

  absl::Mutex mu_;
  std::deque<std::shared_ptr<Job>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_RUNTIME_DEVICE_THREAD_H_
