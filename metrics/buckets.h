// Histogram bucket bounds: validation and the two usual generators.
#ifndef TANDEM_METRICS_BUCKETS_H_
#define TANDEM_METRICS_BUCKETS_H_

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::metrics {

// Bounds must be non-empty, finite and strictly increasing. +Inf is implicit and
// must not be listed.
absl::Status ValidateBuckets(const std::vector<double>& bounds);

// start, start*factor, start*factor^2, ... (`count` bounds). Requires start > 0,
// factor > 1, count >= 1 and every bound finite.
absl::StatusOr<std::vector<double>> ExponentialBuckets(double start, double factor,
                                                       int count);

// start, start+width, start+2*width, ... (`count` bounds). Requires width > 0,
// count >= 1 and every bound finite. Bound i is start + i*width (no accumulated
// rounding error).
absl::StatusOr<std::vector<double>> LinearBuckets(double start, double width,
                                                  int count);

}  // namespace tandem::metrics

#endif  // TANDEM_METRICS_BUCKETS_H_
