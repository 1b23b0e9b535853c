#include "kernels/cpu/chunk_hash.h"

#include <xxhash.h>

#include <algorithm>
#include <memory>

#include "common/status.h"
#include "kernels/op_checks.h"

namespace tandem::kernels {
namespace {

struct StateDeleter {
  void operator()(XXH64_state_t* s) const { XXH64_freeState(s); }
};

}  // namespace

absl::Status HostChunkHashes(const ChunkHashArgs& a) {
  TANDEM_RETURN_IF_ERROR(CheckChunkHashes(a));
  if (a.total_bytes == 0) return absl::OkStatus();
  std::unique_ptr<XXH64_state_t, StateDeleter> state(XXH64_createState());
  if (state == nullptr) return Internal("chunk hashes: XXH64_createState failed");
  int64_t chunk = 0, filled = 0;  // bytes of the current chunk hashed so far
  XXH64_reset(state.get(), 0);
  for (int64_t i = 0; i < a.num_segments; ++i) {
    const ByteSegment& s = a.segments[i];
    int64_t pos = 0;
    while (pos < s.bytes) {
      const int64_t n = std::min(s.bytes - pos, a.chunk_bytes - filled);
      XXH64_update(state.get(), s.data + pos, static_cast<size_t>(n));
      pos += n;
      filled += n;
      if (filled == a.chunk_bytes) {
        a.hashes[chunk++] = XXH64_digest(state.get());
        XXH64_reset(state.get(), 0);
        filled = 0;
      }
    }
  }
  if (filled > 0) a.hashes[chunk++] = XXH64_digest(state.get());
  return absl::OkStatus();
}

}  // namespace tandem::kernels
