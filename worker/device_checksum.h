// State checksums (kvtransfer/checksum.h) computed where a worker's KV cache
// lives: a kvtransfer::ChunkHasher over the rank's kernels::Backend, which runs
// Backend::ChunkHashes on the device, so only the chunk hashes (8 bytes per
// 4 KiB) come back to the host, never the cache's bytes.
//
//   BackendChunkHasher hasher(backend);          // the rank's backend, not owned
//   kvtransfer::ChecksumMemory m = CacheChecksumMemory(cache, regions, &hasher,
//                                                      backend->device());
//   kvtransfer::ComputeChecksums(side, n, m);
//
// The prefill and decode services take one hasher per TP rank in their options
// (PrefillServiceOptions / DecodeServiceOptions::chunk_hashers); without one, a
// cache the host cannot address fails its checksums with FAILED_PRECONDITION.
#ifndef TANDEM_WORKER_DEVICE_CHECKSUM_H_
#define TANDEM_WORKER_DEVICE_CHECKSUM_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/kv_cache.h"
#include "kernels/backend.h"
#include "kvtransfer/checksum.h"
#include "worker/cache_layout.h"

namespace tandem::worker {

// ChunkHashes on `backend`'s device, every stream of a call in one round trip:
// the segment tables go up in one copy, one launch per stream, the hashes come
// back in one copy (which waits for the launches), all on a stream of its own
// (created on first use), not the engine's compute stream: a call from another
// thread (the decode service) never joins a CUDA graph the engine is capturing,
// and never waits for the engine's queued steps. So the bytes must be final when
// it is called: the prefill worker calls it after the step's results came back,
// the decode worker after the transfer landed. The pieces must be memory of the
// backend's device (device addresses; a host-addressable device's memory too).
// Thread-safe (calls are serialised); the backend must outlive it.
//
// The copy back waits on its stream, not Backend::Synchronize(), so the
// engine's own device errors stay the engine's to read; a broken segment table
// (which this class never builds) would surface at the engine's next
// Synchronize().
class BackendChunkHasher final : public kvtransfer::ChunkHasher {
 public:
  explicit BackendChunkHasher(kernels::Backend* backend) : backend_(backend) {}

  absl::StatusOr<std::vector<std::vector<uint64_t>>> HashChunks(
      absl::Span<const kvtransfer::ByteStream> streams, int64_t chunk_bytes) override;

 private:
  kernels::Backend* const backend_;  // not owned
  absl::Mutex mu_;
  std::unique_ptr<kernels::Stream> stream_ ABSL_GUARDED_BY(mu_);
  kernels::DeviceBuffer tables_ ABSL_GUARDED_BY(mu_);  // grown, never shrunk
  kernels::DeviceBuffer hashes_ ABSL_GUARDED_BY(mu_);
};

// `cache`'s regions as checksum memory on `device` (the device its buffers were
// allocated from): spans of the buffers' addresses (read by `hasher` only when
// the device is not host-addressable), hashed by `hasher` (may be null: the host
// hashes, host-addressable memory only).
kvtransfer::ChecksumMemory CacheChecksumMemory(engine::KvCache* cache,
                                               const CacheRegions& regions,
                                               kvtransfer::ChunkHasher* hasher,
                                               const kernels::Device& device);

// What the workers pass as Prefill/DecodeServiceOptions::checksum_backends: each
// TP rank's backend (rank order) when the engine runs on a device backend (whose
// caches live in the device's memory), none on host backends (host caches: the
// host hashes them). Call before the engine moves into its EngineLoop.
std::vector<kernels::Backend*> DeviceChecksumBackends(engine::Engine& engine);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_DEVICE_CHECKSUM_H_
