// Injectable time: production code takes a Clock* so tests drive time by hand
// (FakeClock) instead of sleeping.
#ifndef TANDEM_COMMON_CLOCK_H_
#define TANDEM_COMMON_CLOCK_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace tandem {

class Clock {
 public:
  virtual ~Clock() = default;
  // Wall-clock time (for logs and deadlines carried across processes).
  virtual absl::Time Now() const = 0;
  // Monotonic seconds since an arbitrary origin (for latency measurement).
  virtual double MonotonicSeconds() const = 0;
  // Blocks the caller until `deadline` (FakeClock: until time is advanced past it).
  virtual void SleepUntil(absl::Time deadline) = 0;

  // The process-wide real clock. Not owned by callers; never destroyed.
  static Clock* Real();
};

// A clock that moves only when told to. Thread-safe.
class FakeClock : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::UnixEpoch() + absl::Hours(24 * 365 * 50));
  absl::Time Now() const override;
  double MonotonicSeconds() const override;
  void SleepUntil(absl::Time deadline) override;
  void Advance(absl::Duration d);

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
  const absl::Time start_;
};

}  // namespace tandem

#endif  // TANDEM_COMMON_CLOCK_H_
