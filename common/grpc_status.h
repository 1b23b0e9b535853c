// Conversions between absl::Status and grpc::Status. The canonical codes are the
// same numbers in both, so the mapping is one to one.
#ifndef TANDEM_COMMON_GRPC_STATUS_H_
#define TANDEM_COMMON_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace tandem {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace tandem

#endif  // TANDEM_COMMON_GRPC_STATUS_H_
