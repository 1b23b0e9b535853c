// Integrity of a sequence's transferred state, computed from a side's layout over
// the bytes in token order, so sender and receiver agree whatever their block
// sizes and placements, and whether the bytes are in host or device memory.
//
// A layer's logical byte stream:
//   MLA layer l: tokens [0, n) of its cached latents, token order;
//   KDA layer l: the recurrent state followed by the conv tails.
// The stream is cut into chunks of kChecksumChunkBytes (the last one shorter) and
//   chunk c:  XXH64(chunk bytes, seed 0)
//   layer:    XXH64(the chunk hashes as little-endian u64s, seed 0)
//             (XXH64 of the empty input for an empty stream)
//   total:    XXH3-64 of the per-layer checksums (MLA layers, then KDA layers) as
//             little-endian u64s.
// Chunks hash independently, so a GPU computes them in parallel where the cache
// lives (kernels::Backend::ChunkHashes, through a ChunkHasher) and only the
// chunk hashes (8 bytes per 4 KiB) reach the host. The host computes the same
// values with libxxhash. (Until the device path, layers were XXH3-64 over the
// whole stream; both ends of a transfer run this code, docs/kvtransfer.md.)
#ifndef TANDEM_KVTRANSFER_CHECKSUM_H_
#define TANDEM_KVTRANSFER_CHECKSUM_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvtransfer/plan.h"
#include "proto/kv_state.pb.h"

namespace tandem::kvtransfer {

// 4 KiB: small enough that one MLA layer of a 4k-token K3 prompt (4.7 MB) is
// ~1150 chunks (x 4 threads: enough parallel work for a GPU per layer), large
// enough that the hashes copied back are 0.2% of the bytes. On the host the
// per-chunk reset and digest cost ~25% against one XXH64 pass in cache
// (docs/benchmarks.md, "checksum").
inline constexpr int64_t kChecksumChunkBytes = 4096;

// Bytes of a region by id (the side's own memory); an empty span when unknown.
// The span's addresses may be device memory: only a ChunkHasher reads those.
using RegionBytes = std::function<absl::Span<const uint8_t>(RegionId)>;

// One logical byte stream: the concatenation of its pieces.
using ByteStream = std::vector<absl::Span<const uint8_t>>;

// Hashes chunks where the memory lives (a GPU): implemented by the worker over
// its kernels::Backend (worker/device_checksum.h); kvtransfer never depends on
// the engine or the kernels.
class ChunkHasher {
 public:
  virtual ~ChunkHasher() = default;
  // Per stream, XXH64 (seed 0) of each `chunk_bytes` piece of the stream (the
  // last shorter; none for an empty stream), in order. The pieces are this
  // hasher's memory; the caller never reads them.
  virtual absl::StatusOr<std::vector<std::vector<uint64_t>>> HashChunks(
      absl::Span<const ByteStream> streams, int64_t chunk_bytes) = 0;
};

// Where a side's regions live and who may read them.
struct ChecksumMemory {
  RegionBytes regions;
  // Whether the host may read the regions' spans (host memory, cuda_sim).
  bool host_addressable = true;
  // Hashes the chunks on the device (used whenever set); null: the host does.
  ChunkHasher* hasher = nullptr;  // not owned
};

// Checksum of one layer (per-layer streaming).
absl::StatusOr<uint64_t> LayerChecksum(const RankLayout& side, LayerRef layer,
                                       int64_t num_tokens, const RegionBytes& regions);
// All layers and the total. Host memory (RegionBytes) or the memory `memory`
// describes: FAILED_PRECONDITION when it is not host-addressable and has no
// hasher (the host never reads device memory); INVALID_ARGUMENT when a range
// lies outside its region.
absl::StatusOr<tandem::v1::StateChecksums> ComputeChecksums(const RankLayout& side,
                                                            int64_t num_tokens,
                                                            const RegionBytes& regions);
absl::StatusOr<tandem::v1::StateChecksums> ComputeChecksums(
    const RankLayout& side, int64_t num_tokens, const ChecksumMemory& memory);
// A layer's checksum from its chunk hashes (the definition above).
uint64_t LayerFromChunkHashes(absl::Span<const uint64_t> chunk_hashes);
// The total over already computed per-layer checksums.
uint64_t TotalChecksum(const tandem::v1::StateChecksums& sums);
// OK when equal; DATA_LOSS naming the first mismatching layer (or a layer-count
// difference) otherwise.
absl::Status Verify(const tandem::v1::StateChecksums& expected,
                    const tandem::v1::StateChecksums& actual);

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_CHECKSUM_H_
