// Bounds checks shared by every TransferAgent: each segment must lie inside a live
// local registration and inside a region of the peer's descriptor.
#ifndef TANDEM_KVTRANSFER_SEGMENT_CHECK_H_
#define TANDEM_KVTRANSFER_SEGMENT_CHECK_H_

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/transfer_agent.h"

namespace tandem::kvtransfer {

// Length of the local region `id`, or 0 when it is not registered.
using LocalRegionLength = std::function<uint64_t(RegionId id)>;

// INVALID_ARGUMENT naming the first bad segment (zero length, unknown region,
// or [offset, offset + length) outside the region on either side). No segments
// at all is a valid batch (it only fences).
absl::Status CheckSegments(absl::Span<const Segment> segments,
                           const LocalRegionLength& local,
                           const AgentDescriptor& remote);

// Sum of segment lengths.
uint64_t TotalBytes(absl::Span<const Segment> segments);

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_SEGMENT_CHECK_H_
