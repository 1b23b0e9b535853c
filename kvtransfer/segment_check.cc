#include "kvtransfer/segment_check.h"

#include "absl/strings/str_cat.h"

namespace tandem::kvtransfer {
namespace {

bool Inside(uint64_t offset, uint64_t length, uint64_t region_length) {
  return offset <= region_length && length <= region_length - offset;
}

}  // namespace

absl::Status CheckSegments(absl::Span<const Segment> segments,
                           const LocalRegionLength& local,
                           const AgentDescriptor& remote) {
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    if (s.length == 0)
      return absl::InvalidArgumentError(absl::StrCat("segment ", i, " is empty"));
    const uint64_t local_len = local(s.local_region);
    if (local_len == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "segment ", i, ": local region ", s.local_region, " is not registered"));
    }
    if (!Inside(s.local_offset, s.length, local_len)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "segment ", i, ": local [", s.local_offset, ", +", s.length,
          ") outside region ", s.local_region, " of ", local_len, " bytes"));
    }
    const RegionDescriptor* r = remote.FindRegion(s.remote_region);
    if (r == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("segment ", i, ": peer has no region ", s.remote_region));
    }
    if (!Inside(s.remote_offset, s.length, r->length)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "segment ", i, ": remote [", s.remote_offset, ", +", s.length,
          ") outside region ", s.remote_region, " of ", r->length, " bytes"));
    }
  }
  return absl::OkStatus();
}

uint64_t TotalBytes(absl::Span<const Segment> segments) {
  uint64_t total = 0;
  for (const Segment& s : segments) total += s.length;
  return total;
}

}  // namespace tandem::kvtransfer
