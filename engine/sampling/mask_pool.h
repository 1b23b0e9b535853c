// The structured-output mask pool: a few threads of the engine's own on which
// the masks of a step's constrained rows are filled while the engine thread
// runs the step's forward (issue #21: "the mask for step t+1 is computed while
// step t's forward runs").
//
//   Engine::Step: PlanStep → MaskPool::Start(one task per constrained row)
//                 → ForwardStep (the tasks run meanwhile) → MaskPool::Wait
//                 (deadline) → SampleStep reads the filled masks
//
// A task is a closure; it must own (shared_ptr) everything it touches, so that
// a task the caller stopped waiting for (deadline passed) finishes harmlessly
// after the caller moved on. Wait cancels the tasks that had not started by
// the deadline (they never run: the caller does their work itself) and reports
// the ones still running (the caller must not touch their state again).
//
// Why not kernels::ThreadPool (the engine's sampling pool): its ParallelFor
// blocks its caller and is one job at a time; here the caller (the engine
// thread) is busy in the forward while the tasks run.
//
// Thread-safe. The destructor waits for running tasks (each a bounded mask
// computation) and drops queued ones.
#ifndef TANDEM_ENGINE_SAMPLING_MASK_POOL_H_
#define TANDEM_ENGINE_SAMPLING_MASK_POOL_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace tandem::engine {

class MaskPool {
 public:
  enum class TaskState { kQueued, kRunning, kDone, kCancelled };

  // A batch of tasks started together.
  class Batch {
   public:
    int size() const { return static_cast<int>(tasks_.size()); }

   private:
    friend class MaskPool;
    std::vector<std::function<void()>> tasks_;
    std::unique_ptr<std::atomic<int>[]> state_;  // TaskState per task
    absl::Mutex mu_;
    int finished_ ABSL_GUARDED_BY(mu_) = 0;  // done + cancelled
  };

  // threads >= 1.
  explicit MaskPool(int threads);
  ~MaskPool();
  MaskPool(const MaskPool&) = delete;
  MaskPool& operator=(const MaskPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()); }

  // Queues the tasks (in order) and returns at once.
  std::shared_ptr<Batch> Start(std::vector<std::function<void()>> tasks);
  // Blocks until every task of `batch` ran or `deadline` passed; then cancels
  // the tasks that have not started. Returns each task's state: kDone, or
  // (only when the deadline passed) kCancelled or kRunning.
  std::vector<TaskState> Wait(Batch* batch, absl::Time deadline);

 private:
  void WorkerLoop();

  absl::Mutex mu_;
  std::deque<std::pair<std::shared_ptr<Batch>, int>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_SAMPLING_MASK_POOL_H_
