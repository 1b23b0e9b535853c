// Status helpers shared by every library: absl::Status across library and RPC
// boundaries, no exceptions on the data path (docs/ARCHITECTURE.md, "Errors").
#ifndef TANDEM_COMMON_STATUS_H_
#define TANDEM_COMMON_STATUS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define TANDEM_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::absl::Status tandem_status_ = (expr);          \
    if (!tandem_status_.ok()) return tandem_status_; \
  } while (0)

#define TANDEM_STATUS_CONCAT_INNER_(a, b) a##b
#define TANDEM_STATUS_CONCAT_(a, b) TANDEM_STATUS_CONCAT_INNER_(a, b)

// `TANDEM_ASSIGN_OR_RETURN(auto x, StatusOrExpr());` assigns the value or returns
// the error from the enclosing function.
#define TANDEM_ASSIGN_OR_RETURN(lhs, expr) \
  TANDEM_ASSIGN_OR_RETURN_IMPL_(TANDEM_STATUS_CONCAT_(tandem_or_, __LINE__), lhs, expr)
#define TANDEM_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return std::move(tmp).status();      \
  lhs = std::move(tmp).value()

namespace tandem {

// Prefixes the message of a non-OK status with `context` ("context: message"),
// keeping the code. OK stays OK.
absl::Status Annotate(const absl::Status& status, absl::string_view context);

// Shorthands that read like the error they build, e.g.
// `return InvalidArgument("temperature must be >= 0, got ", t);`.
template <typename... Args>
absl::Status InvalidArgument(const Args&... args) {
  return absl::InvalidArgumentError(absl::StrCat(args...));
}
template <typename... Args>
absl::Status FailedPrecondition(const Args&... args) {
  return absl::FailedPreconditionError(absl::StrCat(args...));
}
template <typename... Args>
absl::Status NotFound(const Args&... args) {
  return absl::NotFoundError(absl::StrCat(args...));
}
template <typename... Args>
absl::Status Internal(const Args&... args) {
  return absl::InternalError(absl::StrCat(args...));
}
template <typename... Args>
absl::Status Unimplemented(const Args&... args) {
  return absl::UnimplementedError(absl::StrCat(args...));
}
template <typename... Args>
absl::Status OutOfRange(const Args&... args) {
  return absl::OutOfRangeError(absl::StrCat(args...));
}
template <typename... Args>
absl::Status DataLoss(const Args&... args) {
  return absl::DataLossError(absl::StrCat(args...));
}
template <typename... Args>
absl::Status ResourceExhausted(const Args&... args) {
  return absl::ResourceExhaustedError(absl::StrCat(args...));
}
template <typename... Args>
absl::Status Unavailable(const Args&... args) {
  return absl::UnavailableError(absl::StrCat(args...));
}
template <typename... Args>
absl::Status DeadlineExceeded(const Args&... args) {
  return absl::DeadlineExceededError(absl::StrCat(args...));
}

}  // namespace tandem

#endif  // TANDEM_COMMON_STATUS_H_
