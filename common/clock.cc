#include "common/clock.h"

#include <chrono>

#include "absl/time/clock.h"

namespace tandem {
namespace {

class RealClock : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }
  double MonotonicSeconds() const override {
    return std::chrono::duration<double>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  void SleepUntil(absl::Time deadline) override {
    absl::SleepFor(deadline - absl::Now());
  }
};

}  // namespace

Clock* Clock::Real() {
  static RealClock* clock = new RealClock();
  return clock;
}

FakeClock::FakeClock(absl::Time start) : now_(start), start_(start) {}

absl::Time FakeClock::Now() const {
  absl::MutexLock lock(&mu_);
  return now_;
}

double FakeClock::MonotonicSeconds() const {
  absl::MutexLock lock(&mu_);
  return absl::ToDoubleSeconds(now_ - start_);
}

void FakeClock::SleepUntil(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto reached = [this, deadline]()
                     ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return now_ >= deadline; };
  mu_.Await(absl::Condition(&reached));
}

void FakeClock::Advance(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  now_ += d;
}

}  // namespace tandem
