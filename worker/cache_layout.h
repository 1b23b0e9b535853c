// How a worker's engine::KvCache looks to kvtransfer: its buffers registered with
// a TransferAgent (one region per MLA layer buffer, one for the KDA slot buffer),
// the KvLayout proto, and a kvtransfer::RankLayout for one sequence (block ids +
// slot), so plan.h and checksum.h work on the cache directly.
#ifndef TANDEM_WORKER_CACHE_LAYOUT_H_
#define TANDEM_WORKER_CACHE_LAYOUT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "engine/runtime/kv_cache.h"
#include "kernels/device.h"
#include "kvtransfer/checksum.h"
#include "kvtransfer/host_staging_agent.h"
#include "kvtransfer/plan.h"
#include "kvtransfer/transfer_agent.h"
#include "proto/worker.pb.h"

namespace tandem::worker {

// The cache's regions in an agent.
struct CacheRegions {
  std::vector<kvtransfer::RegionId> mla;  // one per MLA layer
  kvtransfer::RegionId kda = 0;
  // Staged through host memory (kvtransfer::HostStagingAgent): a receiver
  // copies what landed to the device with StageIn (LandedRanges).
  bool staged = false;
};

// Copies between a device's memory and the host for the host staging of the KV
// (--kv_buffer=host, or auto on a transport without device memory), on a
// stream of its own, so that a copy never waits for, or breaks the capture of,
// the compute stream. The stream is made at Create (which may change the
// calling thread's current device); the copies never touch the current device
// (CUDA runs a copy issued to another device's stream), so a TP rank's copy
// made on rank 0's thread in the middle of its forward leaves that thread's
// launches where they were. Synchronous; thread-safe.
class DeviceStagingCopier : public kvtransfer::StagingCopier {
 public:
  static absl::StatusOr<std::shared_ptr<DeviceStagingCopier>> Create(
      kernels::Device* device);
  // Every copy enqueued on the stream as one batch, then one wait.
  absl::Status ToHost(absl::Span<const kvtransfer::StagingCopy> copies) override;
  absl::Status ToDevice(absl::Span<const kvtransfer::StagingCopy> copies) override;
  std::string DeviceName() const override;
  // IPC through the device's shareable memory (kernels::Device::
  // ExportShareable / OpenShared / CloseShared); ToPeer is CopyOnDevice into
  // the mapping, on this copier's stream.
  absl::StatusOr<std::string> ExportIpc(const void* device_base, size_t len) override;
  absl::StatusOr<void*> OpenIpc(absl::string_view handle) override;
  void CloseIpc(void* mapped) override;
  absl::Status ToPeer(absl::Span<const kvtransfer::StagingCopy> copies) override;

 private:
  DeviceStagingCopier(kernels::Device* device, std::unique_ptr<kernels::Stream> stream)
      : device_(device), stream_(std::move(stream)) {}
  // The copies as one batch on the stream (Device::CopyBatchAsync), then one
  // wait.
  absl::Status Copy(kernels::CopyKind kind,
                    absl::Span<const kvtransfer::StagingCopy> copies);
  kernels::Device* const device_;  // not owned
  absl::Mutex mu_;
  const std::unique_ptr<kernels::Stream> stream_;
};

// The KvLayout of `cache` (its TP rank and size, BF16 latents).
tandem::v1::KvLayout KvLayoutOf(engine::KvCache& cache);

// The checksums of a TP group's state from each rank's (rank order): the
// per-layer lists concatenated rank after rank (rank 0's MLA layers, rank 1's,
// ...; the same for KDA) and the total over the result. One rank: unchanged.
tandem::v1::StateChecksums MergeRankChecksums(
    absl::Span<const tandem::v1::StateChecksums> ranks);

// Cache buffers allocated by a transfer agent (TransferAgent::AllocateMemory):
// on one host UCX backs them with shared memory the peer maps, so a prefill
// worker's puts into a decode worker's engine cache are plain memory copies
// instead of UCX's emulated puts (docs/kvtransfer.md, "Bandwidth").
//
//   AgentAllocations a(agent);
//   engine_options.cache_allocator = a.Allocator();  // every rank's KvCache
//   RegisterCache(agent, cache, &a);     // reuses the allocations' regions
//
// When the agent cannot allocate (UNIMPLEMENTED, /dev/shm full), the buffer
// comes from the heap with a warning and RegisterCache registers it as usual.
// The agent must outlive every cache allocated through this object, and this
// object must outlive them too. Thread-safe.
class AgentAllocations {
 public:
  explicit AgentAllocations(kvtransfer::TransferAgent* agent) : agent_(agent) {}
  AgentAllocations(const AgentAllocations&) = delete;
  AgentAllocations& operator=(const AgentAllocations&) = delete;

  engine::KvCacheAllocator Allocator();
  // The region of a buffer this object allocated through the agent, if any.
  std::optional<kvtransfer::RegionId> RegionOf(const void* base) const;
  // Buffers currently held from the agent / from the heap fallback.
  size_t num_agent_buffers() const;
  size_t num_heap_buffers() const;

 private:
  absl::StatusOr<void*> Allocate(size_t bytes);
  void Release(void* p);

  kvtransfer::TransferAgent* const agent_;  // not owned
  mutable absl::Mutex mu_;
  absl::flat_hash_map<const void*, kvtransfer::RegionId> regions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<const void*> heap_ ABSL_GUARDED_BY(mu_);
};

// How a device buffer meets a transfer agent, by --kv_buffer's rule: where
// `agent` is a kvtransfer::HostStagingAgent its KvBuffer decides (kHost: staged
// through host memory; kAuto: in place where the agent takes the device
// memory, else staged; kDevice: in place), otherwise in place. Host memory is
// registered as it is. Used by RegisterCache for each cache buffer, and by
// `./tandem bench kvdevice` for its buffers. Not thread-safe.
class KvBufferRegistrar {
 public:
  static absl::StatusOr<std::unique_ptr<KvBufferRegistrar>> Create(
      kvtransfer::TransferAgent* agent, kernels::Device* device);
  absl::StatusOr<kvtransfer::RegionId> Register(void* base, size_t len);
  // Some buffer went through host staging (they share one copier).
  bool staged() const { return copier_ != nullptr; }
  // What the agent said when it refused the device memory (auto); "" if not.
  const std::string& refused() const { return refused_; }
  kvtransfer::MemoryKind kind() const { return kind_; }

 private:
  KvBufferRegistrar(kvtransfer::TransferAgent* agent, kernels::Device* device,
                    kvtransfer::MemoryKind kind);
  absl::StatusOr<kvtransfer::RegionId> Staged(void* base, size_t len);
  kvtransfer::TransferAgent* const agent_;
  kernels::Device* const device_;
  const kvtransfer::MemoryKind kind_;
  kvtransfer::HostStagingAgent* const staging_;
  const kvtransfer::KvBuffer mode_;
  std::shared_ptr<kvtransfer::StagingCopier> copier_;
  std::string refused_;
};

// The transfer memory kind of memory on `device` (null: the host), as
// CacheMemoryKind says.
absl::StatusOr<kvtransfer::MemoryKind> DeviceMemoryKind(const kernels::Device* device);

// The transfer memory kind of `cache`'s buffers: host memory for a host cache and
// for cuda_sim (emulated device memory is host memory the host addresses), CUDA
// memory of device N for "cuda:N". UNIMPLEMENTED for another device the host
// cannot address.
absl::StatusOr<kvtransfer::MemoryKind> CacheMemoryKind(const engine::KvCache& cache);

// Registers every buffer of `cache` with `agent` (both not owned; the cache must
// outlive the registration), as the memory kind CacheMemoryKind says: a device
// cache's buffers are registered where they live, as device memory, so the
// hand-off reads and writes them in place (FAILED_PRECONDITION from an agent
// whose transports cannot move that memory). Where `agent` is a
// kvtransfer::HostStagingAgent its KvBuffer decides instead: kHost stages
// every device buffer through host memory, kAuto does so where the agent
// refuses the device memory (logged), kDevice registers in place. A host
// cache is registered as it is in every mode. Buffers `allocations` (may be
// null) took from the agent are already registered: their regions are reused.
absl::StatusOr<CacheRegions> RegisterCache(
    kvtransfer::TransferAgent* agent, engine::KvCache* cache,
    const AgentAllocations* allocations = nullptr);

// The layout of one sequence held in `cache` at `block_ids` and `slot`.
kvtransfer::RankLayout CacheRankLayout(engine::KvCache& cache,
                                       const CacheRegions& regions,
                                       absl::Span<const int32_t> block_ids,
                                       int32_t slot);

// The byte ranges of `cache` that a hand-off into `block_ids` / `slot` writes:
// the MLA rows [held_tokens, prompt_tokens) of every layer (the rows before
// are a decode-side prefix hit, not sent) and the KDA slot whole; what a
// receiver with staged regions copies to the device once the state landed.
absl::StatusOr<std::vector<kvtransfer::ByteRange>> LandedRanges(
    engine::KvCache& cache, const CacheRegions& regions,
    absl::Span<const int32_t> block_ids, int32_t slot, int64_t prompt_tokens,
    int64_t held_tokens);

// Region id → the cache's bytes (for kvtransfer checksums on the host). A cache
// on a device the host cannot address (CUDA) has no host bytes: every region
// maps to an empty span (checksums then fail INVALID_ARGUMENT instead of the
// host reading device pointers); its checksums are computed on the device.
kvtransfer::RegionBytes CacheRegionBytes(engine::KvCache* cache,
                                         const CacheRegions& regions);

// The pool geometry of `side` (regions, offsets, strides, counts; not the
// sequence) as the metadata a decode worker publishes in its agent descriptor.
std::string PoolsMetadata(const kvtransfer::RankLayout& side);
// The receiver's layout from a KvTarget rank: pools from the descriptor's
// metadata, layout, block ids and slot from the message. INVALID_ARGUMENT on a
// malformed descriptor or metadata.
absl::StatusOr<kvtransfer::RankLayout> TargetRankLayout(
    const tandem::v1::RankTarget& target);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_CACHE_LAYOUT_H_
