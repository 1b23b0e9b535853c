#include "rpc/deadline.h"

#include <algorithm>

namespace tandem::rpc {

absl::Time FromGrpcDeadline(std::chrono::system_clock::time_point deadline) {
  if (deadline == std::chrono::system_clock::time_point::max()) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(deadline);
}

absl::Time ContextDeadline(const grpc::ServerContextBase& context) {
  return FromGrpcDeadline(context.deadline());
}

std::chrono::system_clock::time_point ToGrpcDeadline(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) {
    return std::chrono::system_clock::time_point::max();
  }
  return absl::ToChronoTime(deadline);
}

absl::Time WithUnixMillis(absl::Time deadline, int64_t deadline_unix_ms) {
  if (deadline_unix_ms <= 0) return deadline;
  return std::min(deadline, absl::FromUnixMillis(deadline_unix_ms));
}

int64_t ToUnixMillisOrZero(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return 0;
  return absl::ToUnixMillis(deadline);
}

}  // namespace tandem::rpc
