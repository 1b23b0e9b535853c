#include "engine/cache/prefix_events.h"

#include <algorithm>
#include <utility>

namespace tandem::engine {

const char* PrefixEventKindName(PrefixEvent::Kind kind) {
  switch (kind) {
    case PrefixEvent::Kind::kStored:
      return "stored";
    case PrefixEvent::Kind::kRemoved:
      return "removed";
    case PrefixEvent::Kind::kCleared:
      return "cleared";
  }
  return "unknown";
}

PrefixEventQueue::PrefixEventQueue(int64_t capacity)
    : capacity_(std::max<int64_t>(1, capacity)) {}

void PrefixEventQueue::Push(const PrefixEvent& event,
                            const std::function<std::vector<PrefixEvent>()>& resync) {
  absl::MutexLock lock(&mu_);
  if (static_cast<int64_t>(pending_.size()) < capacity_) {
    pending_.push_back(event);
    return;
  }
  // The consumer fell behind: what it missed is summarised by the current state.
  ++overflows_;
  pending_ = resync();
}

std::vector<PrefixEvent> PrefixEventQueue::Take() {
  absl::MutexLock lock(&mu_);
  std::vector<PrefixEvent> out;
  out.swap(pending_);
  return out;
}

int64_t PrefixEventQueue::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(pending_.size());
}

int64_t PrefixEventQueue::overflows() const {
  absl::MutexLock lock(&mu_);
  return overflows_;
}

}  // namespace tandem::engine
