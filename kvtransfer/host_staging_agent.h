// HostStagingAgent: the KV hand-off from and into device memory that the
// transport cannot register (Debian's UCX and most distribution builds have no
// CUDA support; a libfabric provider without FI_HMEM), staged through host
// memory. vLLM's NIXL connector offers the same choice as kv_buffer_device=cpu;
// UCX's own cuda_copy transport does it inside UCX.
//
// A *staged* region is device memory [device_base, +len) paired with a host
// shadow of the same size and layout: anonymous memory reserved, not committed
// (MAP_NORESERVE), so only the pages whose bytes are in flight take memory. The
// shadow is what the inner agent registers and what the descriptor publishes
// (its region id, base and key), so a peer's plan computes the same offsets as
// for the device memory itself and the protocol does not change.
//
//   sender    PostWrite copies each segment's bytes of a staged local region
//             device -> shadow, then posts the segments on the inner agent as
//             they are. When the batch ends, the shadow pages no other batch in
//             flight still reads are given back (MADV_DONTNEED).
//   receiver  a peer's writes land in the shadow. Once the owner is notified
//             that a request's state landed, it calls StageIn(ranges) with the
//             byte ranges it reserved for the request: shadow -> device, then
//             the pages wholly inside those ranges are given back (a page that
//             also holds another request's bytes stays: they may be landing).
//
// Device to device between processes of one host (IPC). Where the copier can
// share device memory (StagingCopier::ExportIpc: CUDA IPC; the emulator's
// memfd mapping), each staged region's device memory is also published in the
// descriptor (extension kExtensionDeviceIpc: region id, length, handle). A
// sender whose Connect can map every one of a peer's published regions
// (OpenIpc: same host, a GPU that reaches the peer's) writes into them
// directly: device -> peer device (StagingCopier::ToPeer), or host -> peer
// device for a host region, enqueued together and waited for once before
// PostWrite returns; the inner agent then carries only the ordering (an empty
// batch) and the notification. The notification is marked, and the receiver's
// agent hands it on with Notification::on_device set: its owner skips StageIn
// for that request (the shadow never saw its bytes). A peer with nothing
// published, on another host, or whose regions cannot all be mapped is staged
// as above: a peer is direct for every write or for none, so a request never
// lands half in the shadow.
//
// Regions registered with RegisterMemory / AllocateMemory pass through
// untouched, as does everything else (descriptors, connections, waits,
// notifications): over host memory this agent is its inner agent.
//
// Shadows are mapped with transparent huge pages where the kernel allows
// (madvise), so their pages fault in 2 MiB at a time. Page release
// (HostStagingOptions::release_pages) trades speed for memory: each transfer
// through released pages faults them in again (2.6x slower on the emulator
// here). It must be off where the transport pins registered memory (RDMA
// verbs, EFA): the NIC would go on writing the pinned physical page after the
// process dropped it. The workers turn it on only where the shadows are large
// against the host's memory and the host has no RDMA device
// (worker::ChooseStagingPageRelease).
//
// Reads (PostRead) into a staged region are refused (UNIMPLEMENTED): the
// hand-off only writes. Thread-safe; the copier is called from the threads that
// call PostWrite and StageIn.
#ifndef TANDEM_KVTRANSFER_HOST_STAGING_AGENT_H_
#define TANDEM_KVTRANSFER_HOST_STAGING_AGENT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/plan.h"
#include "kvtransfer/transfer_agent.h"

namespace tandem::kvtransfer {

// Where a worker's KV cache meets the transport (--kv_buffer):
//   kDevice  registered where it lives (device memory needs a transport that
//            can register it: UCX built with CUDA, libfabric with FI_HMEM);
//   kHost    staged through host memory (this agent), any transport;
//   kAuto    kDevice where the agent accepts the device memory, else kHost.
// A cache in host memory (CPU backends) is registered as it is in every mode.
enum class KvBuffer { kAuto, kDevice, kHost };
// "auto", "device", "host".
absl::StatusOr<KvBuffer> ParseKvBuffer(absl::string_view spec);
const char* KvBufferName(KvBuffer buffer);

// One copy between a device and the host.
struct StagingCopy {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
};

// Copies between one device's memory and the host. Each call takes a batch
// (a request's pieces: thousands for a long prompt), so that an
// implementation can enqueue them all and wait once; every byte is at its
// destination when the call returns.
class StagingCopier {
 public:
  virtual ~StagingCopier() = default;
  virtual absl::Status ToHost(absl::Span<const StagingCopy> copies) = 0;
  virtual absl::Status ToDevice(absl::Span<const StagingCopy> copies) = 0;
  // The device, for messages ("cuda:0").
  virtual std::string DeviceName() const = 0;

  // Device memory shared between processes of one host (IPC); UNIMPLEMENTED
  // where the device has none. A handle (opaque bytes) for [device_base, +len)
  // of this device's memory, which another process's copier maps (OpenIpc)
  // into its own device's address space until CloseIpc. Copies into a mapping:
  // ToPeer from this device's memory, ToDevice from the host.
  virtual absl::StatusOr<std::string> ExportIpc(const void* device_base, size_t len) {
    return absl::UnimplementedError(
        absl::StrCat(DeviceName(), " shares no device memory between processes"));
  }
  virtual absl::StatusOr<void*> OpenIpc(absl::string_view handle) {
    return absl::UnimplementedError(
        absl::StrCat(DeviceName(), " shares no device memory between processes"));
  }
  virtual void CloseIpc(void* mapped) {}
  // Device -> device copies (dst may be an OpenIpc mapping), as ToHost.
  virtual absl::Status ToPeer(absl::Span<const StagingCopy> copies) {
    return absl::UnimplementedError(
        absl::StrCat(DeviceName(), " shares no device memory between processes"));
  }
};

struct HostStagingOptions {
  KvBuffer buffer = KvBuffer::kAuto;  // what the worker's RegisterCache does
  // Publish staged regions' device memory for IPC and write straight into a
  // peer's where it can be mapped (above). Off: every byte goes through the
  // shadows.
  bool device_ipc = true;
  // Give shadow pages back once their bytes reached the peer / the device
  // (set_release_pages changes it later). Off, a shadow keeps the pages that
  // bytes once went through: faster (no fault on the next transfer through
  // them), but its resident part grows towards its size.
  bool release_pages = true;
};

struct HostStagingStats {
  uint64_t bytes_to_host = 0;    // sender: device -> shadow
  uint64_t bytes_to_device = 0;  // receiver: shadow -> device
  uint64_t copy_micros = 0;      // time spent in the copier
  uint64_t pages_released = 0;   // pages given back (MADV_DONTNEED)
  size_t staged_regions = 0;
  uint64_t shadow_bytes = 0;  // the staged regions' size (address space)
  // Device to device between processes (IPC): bytes written straight into
  // peers' device memory, staged regions published, peers written directly,
  // peers that published regions this agent could not map (staged instead).
  uint64_t bytes_direct = 0;
  size_t exported_regions = 0;
  size_t direct_peers = 0;
  uint64_t direct_refused_peers = 0;
};

class HostStagingAgent final : public TransferAgent {
 public:
  explicit HostStagingAgent(std::unique_ptr<TransferAgent> inner,
                            HostStagingOptions options = {});
  ~HostStagingAgent() override;
  HostStagingAgent(const HostStagingAgent&) = delete;
  HostStagingAgent& operator=(const HostStagingAgent&) = delete;

  const HostStagingOptions& options() const { return options_; }
  bool release_pages() const { return release_pages_.load(); }
  // Turning it on also maps the shadows with 4 KiB pages from then on
  // (MADV_NOHUGEPAGE): a receiver gives back only the pages wholly inside a
  // request's ranges, and the kernel would fill a partly given-back huge page
  // again (khugepaged).
  void set_release_pages(bool release);
  TransferAgent* inner() { return inner_.get(); }
  // Off: staged regions registered from now on are not published for IPC
  // (a sender's: nobody maps them); peers' published memory is still mapped
  // (device_ipc). On by default.
  void set_publish_device_ipc(bool publish) { publish_ipc_.store(publish); }
  bool publish_device_ipc() const { return publish_ipc_.load(); }

  // Registers device memory [device_base, +len) through a host shadow (above).
  // INVALID_ARGUMENT for an empty or null region or a null copier; the inner
  // agent's error when it cannot register the shadow.
  absl::StatusOr<RegionId> RegisterStaged(void* device_base, size_t len,
                                          std::shared_ptr<StagingCopier> copier);
  bool IsStaged(RegionId region) const;
  // True when writes to `peer` go straight into its device memory (IPC).
  bool IsDirect(PeerId peer) const;
  // OK when every staged region's device memory is published for IPC (or
  // device_ipc is off, or nothing is staged); else why the first was not.
  absl::Status ipc_export_status() const;
  // Why the last peer that published device memory is staged instead (OK:
  // none was refused).
  absl::Status last_direct_refusal() const;
  // Receiver: copies `ranges` (of staged regions) shadow -> device and gives
  // back the pages wholly inside them. INVALID_ARGUMENT for a range outside a
  // staged region (nothing is copied then); the copier's error otherwise.
  absl::Status StageIn(absl::Span<const ByteRange> ranges);
  // Receiver: gives back the pages wholly inside `ranges` without copying (a
  // reservation freed without its state staged in: a failed or abandoned
  // transfer's bytes, or late writes during its quarantine), when pages are
  // released at all (release_pages). INVALID_ARGUMENT as StageIn.
  absl::Status Discard(absl::Span<const ByteRange> ranges);
  HostStagingStats stats() const;

  // TransferAgent.
  absl::StatusOr<RegionId> RegisterMemory(void* base, size_t len,
                                          MemoryKind kind) override;
  using TransferAgent::RegisterMemory;
  absl::StatusOr<Allocation> AllocateMemory(size_t len) override;
  absl::Status DeregisterMemory(RegionId region) override;
  size_t NumRegisteredRegions() const override;
  uint64_t AgentId() const override;
  absl::StatusOr<std::string> LocalDescriptor(absl::string_view metadata) override;
  absl::StatusOr<PeerId> Connect(absl::string_view peer_descriptor) override;
  absl::Status Disconnect(PeerId peer) override;
  size_t NumPeers() const override;
  absl::StatusOr<BatchId> PostWrite(PeerId peer, absl::Span<const Segment> segments,
                                    CompletionCallback on_done) override;
  absl::StatusOr<BatchId> PostRead(PeerId peer, absl::Span<const Segment> segments,
                                   CompletionCallback on_done) override;
  absl::StatusOr<bool> Poll(BatchId batch) override;
  absl::Status Wait(BatchId batch, absl::Time deadline) override;
  absl::Status Cancel(BatchId batch) override;
  absl::Status Notify(PeerId peer, absl::string_view request_id,
                      absl::string_view payload, absl::Time deadline) override;
  void SetNotificationCallback(NotificationCallback callback) override;
  std::vector<Notification> PollNotifications() override;
  std::string Transport(PeerId peer) override;

  // Granule of the sender's in-flight accounting (bytes; a multiple of the
  // page size).
  static constexpr uint64_t kGranule = 2 << 20;

 private:
  struct Staged {
    uint8_t* device = nullptr;
    uint8_t* shadow = nullptr;
    size_t len = 0;
    size_t mapped = 0;  // len rounded up to the page size
    std::shared_ptr<StagingCopier> copier;
    std::string ipc_handle;  // ExportIpc's, empty when not published
  };
  // A region registered through (RegisterMemory / AllocateMemory): what a
  // direct write reads it as.
  struct PassThrough {
    uint8_t* base = nullptr;
    size_t len = 0;
    MemoryKind kind;
  };
  // A peer written directly: its published regions mapped through each of
  // this agent's copiers (one per local device: a TP rank's rows are copied by
  // its own device, into that device's mapping), closed again when the last
  // holder lets go (Disconnect while a PostWrite copies keeps them until it
  // returns).
  struct Mapped {
    uint8_t* base = nullptr;
    uint64_t len = 0;
  };
  struct PeerMapping {
    std::shared_ptr<StagingCopier> copier;
    absl::flat_hash_map<RegionId, Mapped> regions;
    PeerMapping() = default;
    PeerMapping(const PeerMapping&) = delete;
    PeerMapping& operator=(const PeerMapping&) = delete;
    ~PeerMapping();
  };
  struct DirectPeer {
    absl::flat_hash_map<StagingCopier*, std::unique_ptr<PeerMapping>> by_copier;
    PeerMapping* first = nullptr;  // for host sources
    // Every region of the peer's descriptor: its length (segments are checked
    // whole before anything moves).
    absl::flat_hash_map<RegionId, uint64_t> lengths;
  };
  // Maps every region of a peer's kExtensionDeviceIpc extension through each
  // of `copiers`; the error of the first that fails (nothing stays mapped).
  // The extension must list at least one region, each one of the descriptor's
  // with its length.
  static absl::StatusOr<std::shared_ptr<DirectPeer>> MapPeer(
      const AgentDescriptor& descriptor, absl::string_view extension,
      const std::vector<std::shared_ptr<StagingCopier>>& copiers);
  // PostWrite to a direct peer; to any other (staged local regions copied to
  // their shadows first).
  absl::StatusOr<BatchId> PostDirect(PeerId peer, absl::Span<const Segment> segments,
                                     CompletionCallback on_done);
  absl::StatusOr<BatchId> PostStaged(PeerId peer, absl::Span<const Segment> segments,
                                     CompletionCallback on_done);
  // A local region's length (staged or passed through); 0: unknown.
  uint64_t LocalLengthLocked(RegionId region) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // (region, granule index) of a sender's batch in flight.
  using GranuleKey = std::pair<RegionId, uint64_t>;

  // Runs `copies` grouped by copier, counting the regions busy meanwhile
  // (DeregisterMemory refuses a busy region: its shadow is being read or
  // written). Returns the bytes copied.
  struct PendingCopy {
    RegionId region;
    StagingCopy copy;
  };
  absl::StatusOr<uint64_t> RunCopies(std::vector<PendingCopy> copies, bool to_device);
  // Gives back the pages wholly inside `ranges` (merged), except in granules a
  // sender's batch still reads; nothing unless release_pages.
  void DropRanges(absl::Span<const ByteRange> ranges);
  // Drops the granules' counts taken by a batch; gives back those at zero.
  void ReleaseGranules(const std::vector<GranuleKey>& granules);
  // MADV_DONTNEED over [begin, end) of `s`'s shadow (page-aligned inside).
  void DropPages(const Staged& s, uint64_t begin, uint64_t end)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::unique_ptr<TransferAgent> inner_;  // reset first by the destructor
  const HostStagingOptions options_;
  std::atomic<bool> release_pages_;
  std::atomic<bool> publish_ipc_{true};
  const uint64_t page_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<RegionId, Staged> staged_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<GranuleKey, int> in_flight_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<RegionId, int> busy_ ABSL_GUARDED_BY(mu_);  // copies running
  absl::flat_hash_map<RegionId, PassThrough> pass_through_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<PeerId, std::shared_ptr<DirectPeer>> direct_ ABSL_GUARDED_BY(mu_);
  absl::Status last_direct_refusal_ ABSL_GUARDED_BY(mu_);
  absl::Status export_status_ ABSL_GUARDED_BY(mu_);
  HostStagingStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_HOST_STAGING_AGENT_H_
