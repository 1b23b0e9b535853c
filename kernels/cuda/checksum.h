// Launchers of the checksum kernels (checksum.cu): XXH64 per fixed-size chunk of a
// byte stream scattered over device memory (Backend::ChunkHashes, the KV-transfer
// checksums of kvtransfer/checksum.h). Plain C++ types; device pointers; `stream`
// is the native stream handle; each returns nullptr on success or the launch error.
#ifndef TANDEM_KERNELS_CUDA_CHECKSUM_H_
#define TANDEM_KERNELS_CUDA_CHECKSUM_H_

#include <cstdint>

namespace tandem::kernels::cuda {

// The layout of kernels::ByteSegment (backend.h), which nvcc does not see.
struct HashSegment {
  const uint8_t* data;
  int64_t offset;  // start in the stream
  int64_t bytes;
};

// hashes[c] = XXH64(bytes [c * chunk_bytes, min(total, (c + 1) * chunk_bytes)) of
// the stream, seed 0) for c < ceil(total_bytes / chunk_bytes). The stream is the
// concatenation of segments[0..num_segments) (a device table). A table whose
// offsets do not run contiguously from 0 to total_bytes records
// kBadSegmentTable in error_word (the hashes are then unspecified).
// Four threads per chunk (XXH64's four lanes), 32 chunks per block.
const char* LaunchChunkHashes(const HashSegment* segments, int64_t num_segments,
                              int64_t total_bytes, int64_t chunk_bytes,
                              uint64_t* hashes, int32_t* error_word, void* stream);

}  // namespace tandem::kernels::cuda

#endif  // TANDEM_KERNELS_CUDA_CHECKSUM_H_
