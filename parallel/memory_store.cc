#include "parallel/memory_store.h"

#include "common/status.h"

namespace tandem::parallel {

absl::Status MemoryStore::Set(absl::string_view key, absl::string_view value) {
  absl::MutexLock lock(&mu_);
  values_[key] = std::string(value);
  return absl::OkStatus();
}

absl::StatusOr<std::string> MemoryStore::Get(absl::string_view key,
                                             absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto present = [&]()
                     ABSL_SHARED_LOCKS_REQUIRED(mu_) { return values_.contains(key); };
  if (!mu_.AwaitWithTimeout(absl::Condition(&present), timeout)) {
    return DeadlineExceeded("rendezvous key '", key, "' not set within ",
                            absl::FormatDuration(timeout));
  }
  return values_.at(key);
}

}  // namespace tandem::parallel
