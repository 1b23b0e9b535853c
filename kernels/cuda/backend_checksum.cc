// GpuBackend: ChunkHashes (kernels in checksum.cu). The segment table and the
// hashes are device memory; the kernel walks the table and records a table that
// does not cover total_bytes contiguously in error_word() for Synchronize().
#include <cstddef>
#include <cstdint>

#include "common/status.h"
#include "kernels/cuda/checksum.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/op_checks.h"

namespace tandem::kernels::cuda {

static_assert(sizeof(HashSegment) == sizeof(ByteSegment) &&
                  offsetof(HashSegment, data) == offsetof(ByteSegment, data) &&
                  offsetof(HashSegment, offset) == offsetof(ByteSegment, offset) &&
                  offsetof(HashSegment, bytes) == offsetof(ByteSegment, bytes),
              "checksum.h's HashSegment must mirror kernels::ByteSegment");

absl::Status GpuBackend::ChunkHashes(const ChunkHashArgs& a) {
  TANDEM_RETURN_IF_ERROR(CheckChunkHashShape(a));
  if (a.total_bytes == 0) return absl::OkStatus();
  const int64_t chunks = NumHashChunks(a);
  TANDEM_RETURN_IF_ERROR(CheckResident(
      a.segments, static_cast<size_t>(a.num_segments) * sizeof(ByteSegment),
      "chunk hashes segment table"));
  TANDEM_RETURN_IF_ERROR(CheckResident(
      a.hashes, static_cast<size_t>(chunks) * sizeof(uint64_t), "chunk hashes out"));
  const char* e = LaunchChunkHashes(
      reinterpret_cast<const HashSegment*>(a.segments), a.num_segments, a.total_bytes,
      a.chunk_bytes, a.hashes, error_word(),
      a.stream != nullptr ? a.stream->native() : stream());
  if (e != nullptr) return Internal(name(), ": launching chunk hashes failed: ", e);
  return Launched("chunk hashes");
}

}  // namespace tandem::kernels::cuda
