// One device's compute-stream capture, as seen by the device's other threads.
//
// A CUDA graph is captured on one thread (cudaStreamCaptureModeThreadLocal);
// other threads of the process keep working on the device meanwhile (the decode
// service hashing a landed hand-off, a sender staging KV). Some of their calls
// would join or break the capture: a stream-ordered allocation or free on the
// compute stream becomes a node of the graph (or is refused, failing the
// capture), a synchronisation of the capturing stream invalidates it, and a copy
// enqueued on it is recorded into the graph. So, on a device whose compute stream
// captures:
//
//   capturing thread: BeginCapture → Begin() (exclusive) … EndCapture → End()
//   any other thread: Pass pass(gate); → waits until the capture ended, then
//                     does its allocation / free / synchronisation / copy
//   the capturing thread's own such calls: refused as before (HeldByMe())
//
// A capture enqueues work and never waits on another thread, so a wait here lasts
// at most one capture (milliseconds on a GPU).
#ifndef TANDEM_KERNELS_CAPTURE_GATE_H_
#define TANDEM_KERNELS_CAPTURE_GATE_H_

#include <algorithm>
#include <atomic>
#include <iterator>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace tandem::kernels {

// A readers-writer gate kept as state rather than as a held lock: no mutex is
// held across a capture or a pass, so code run inside either may take its own
// locks in any order.
class CaptureGate {
 public:
  // The calling thread starts capturing (false: it already is). Waits for the
  // passes in progress; new passes wait for the capture.
  bool Begin() {
    absl::MutexLock l(&mu_);
    if (owner_ == std::this_thread::get_id()) return false;
    ++waiting_;
    mu_.Await(absl::Condition(this, &CaptureGate::Free));
    --waiting_;
    owner_ = std::this_thread::get_id();
    held_.store(true);
    return true;
  }
  // The capture Begin() started on this thread has ended.
  void End() {
    absl::MutexLock l(&mu_);
    if (owner_ != std::this_thread::get_id()) return;
    owner_ = std::thread::id();
    held_.store(false);
  }
  // True on the thread that is capturing.
  bool HeldByMe() const {
    if (!held_.load()) return false;
    absl::MutexLock l(&mu_);
    return owner_ == std::this_thread::get_id();
  }

  // Another thread's device call: waits out a capture in progress, or about to
  // start (not for use on the capturing thread: HeldByMe() first).
  class Pass {
   public:
    explicit Pass(CaptureGate& gate) : gate_(gate) {
      // Nested on this thread: the outer pass already keeps captures out (and
      // waiting behind a waiting Begin() would deadlock against it).
      const bool nested =
          std::find(Held().begin(), Held().end(), &gate_) != Held().end();
      absl::MutexLock l(&gate_.mu_);
      if (!nested) gate_.mu_.Await(absl::Condition(&gate_, &CaptureGate::Open));
      ++gate_.passes_;
      Held().push_back(&gate_);
    }
    ~Pass() {
      auto it = std::find(Held().rbegin(), Held().rend(), &gate_);
      if (it != Held().rend()) Held().erase(std::next(it).base());
      absl::MutexLock l(&gate_.mu_);
      --gate_.passes_;
    }
    Pass(const Pass&) = delete;
    Pass& operator=(const Pass&) = delete;

   private:
    static std::vector<const CaptureGate*>& Held() {
      thread_local std::vector<const CaptureGate*> held;  // this thread's passes
      return held;
    }
    CaptureGate& gate_;
  };

 private:
  bool Free() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return owner_ == std::thread::id() && passes_ == 0;
  }
  bool Open() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return owner_ == std::thread::id() && waiting_ == 0;
  }

  mutable absl::Mutex mu_;
  std::thread::id owner_ ABSL_GUARDED_BY(mu_);
  int passes_ ABSL_GUARDED_BY(mu_) = 0;
  int waiting_ ABSL_GUARDED_BY(mu_) = 0;  // Begin() calls waiting for passes
  std::atomic<bool> held_{false};         // owner_ is set (a cheap first test)
};

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_CAPTURE_GATE_H_
