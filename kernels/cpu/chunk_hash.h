// ChunkHashes (kernels/backend.h) on host memory with libxxhash: what the CPU
// backends run, and the value every other implementation must equal.
#ifndef TANDEM_KERNELS_CPU_CHUNK_HASH_H_
#define TANDEM_KERNELS_CPU_CHUNK_HASH_H_

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace tandem::kernels {

// Checks `a` (CheckChunkHashes) and writes its chunk hashes. Host memory only.
absl::Status HostChunkHashes(const ChunkHashArgs& a);

}  // namespace tandem::kernels

#endif  // TANDEM_KERNELS_CPU_CHUNK_HASH_H_
