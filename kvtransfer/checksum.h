// Integrity of a sequence's transferred state: XXH3-64 per layer, computed from a
// side's layout over the bytes in token order, so sender and receiver agree
// whatever their block sizes and placements.
//   MLA layer l: over tokens [0, n) of its cached latents, token order.
//   KDA layer l: over the recurrent state followed by the conv tails.
//   total:       XXH3-64 of the per-layer checksums (MLA layers, then KDA layers)
//                as little-endian u64s.
#ifndef TANDEM_KVTRANSFER_CHECKSUM_H_
#define TANDEM_KVTRANSFER_CHECKSUM_H_

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvtransfer/plan.h"
#include "proto/kv_state.pb.h"

namespace tandem::kvtransfer {

// Bytes of a region by id (the side's own memory); an empty span when unknown.
using RegionBytes = std::function<absl::Span<const uint8_t>(RegionId)>;

// Checksum of one layer (per-layer streaming).
absl::StatusOr<uint64_t> LayerChecksum(const RankLayout& side, LayerRef layer,
                                       int64_t num_tokens, const RegionBytes& regions);
// All layers and the total.
absl::StatusOr<tandem::v1::StateChecksums> ComputeChecksums(const RankLayout& side,
                                                            int64_t num_tokens,
                                                            const RegionBytes& regions);
// The total over already computed per-layer checksums.
uint64_t TotalChecksum(const tandem::v1::StateChecksums& sums);
// OK when equal; DATA_LOSS naming the first mismatching layer (or a layer-count
// difference) otherwise.
absl::Status Verify(const tandem::v1::StateChecksums& expected,
                    const tandem::v1::StateChecksums& actual);

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_CHECKSUM_H_
