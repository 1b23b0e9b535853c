#include "metrics/buckets.h"

#include <cmath>

#include "common/status.h"

namespace tandem::metrics {

absl::Status ValidateBuckets(const std::vector<double>& bounds) {
  if (bounds.empty()) {
    return InvalidArgument("histogram needs at least one finite bucket bound");
  }
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i])) {
      return InvalidArgument("bucket bound ", i, " is ", bounds[i],
                             "; bounds must be finite (+Inf is implicit)");
    }
    if (i > 0 && !(bounds[i] > bounds[i - 1])) {
      return InvalidArgument("bucket bounds must be strictly increasing: bound ", i,
                             " (", bounds[i], ") <= bound ", i - 1, " (", bounds[i - 1],
                             ")");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<double>> ExponentialBuckets(double start, double factor,
                                                       int count) {
  if (!(start > 0) || !std::isfinite(start)) {
    return InvalidArgument("ExponentialBuckets: start must be finite and > 0, got ",
                           start);
  }
  if (!(factor > 1) || !std::isfinite(factor)) {
    return InvalidArgument("ExponentialBuckets: factor must be finite and > 1, got ",
                           factor);
  }
  if (count < 1) {
    return InvalidArgument("ExponentialBuckets: count must be >= 1, got ", count);
  }
  std::vector<double> bounds;
  bounds.reserve(count);
  double bound = start;
  for (int i = 0; i < count; ++i) {
    bounds.push_back(bound);
    bound *= factor;
  }
  TANDEM_RETURN_IF_ERROR(ValidateBuckets(bounds));
  return bounds;
}

absl::StatusOr<std::vector<double>> LinearBuckets(double start, double width,
                                                  int count) {
  if (!std::isfinite(start)) {
    return InvalidArgument("LinearBuckets: start must be finite, got ", start);
  }
  if (!(width > 0) || !std::isfinite(width)) {
    return InvalidArgument("LinearBuckets: width must be finite and > 0, got ", width);
  }
  if (count < 1) {
    return InvalidArgument("LinearBuckets: count must be >= 1, got ", count);
  }
  std::vector<double> bounds;
  bounds.reserve(count);
  for (int i = 0; i < count; ++i) bounds.push_back(start + i * width);
  // Catches overflow to +Inf and widths too small to move a large start.
  TANDEM_RETURN_IF_ERROR(ValidateBuckets(bounds));
  return bounds;
}

}  // namespace tandem::metrics
