// Deadlines across the gRPC boundary: one conversion each way between gRPC's
// chrono deadlines (time_point::max() = none) and absl::Time (InfiniteFuture()
// = none), and the request-level deadline a hand-off message may carry.
#ifndef TANDEM_RPC_DEADLINE_H_
#define TANDEM_RPC_DEADLINE_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>

#include "absl/time/time.h"

namespace tandem::rpc {

// gRPC -> absl: a context's deadline (InfiniteFuture when the call has none).
absl::Time FromGrpcDeadline(std::chrono::system_clock::time_point deadline);
absl::Time ContextDeadline(const grpc::ServerContextBase& context);

// absl -> gRPC: for ClientContext::set_deadline (time_point::max() when none).
std::chrono::system_clock::time_point ToGrpcDeadline(absl::Time deadline);

// The earlier of `deadline` and a message's `deadline_unix_ms` (0: none).
absl::Time WithUnixMillis(absl::Time deadline, int64_t deadline_unix_ms);

// For a message's deadline_unix_ms field: 0 when `deadline` is InfiniteFuture.
int64_t ToUnixMillisOrZero(absl::Time deadline);

}  // namespace tandem::rpc

#endif  // TANDEM_RPC_DEADLINE_H_
