// TransferAgent: moves a request's KV cache and KDA state between workers with
// one-sided writes (or reads) into registered memory, never hanging.
//
// → Life of a hand-off (prefill side = initiator, decode side = target):
//   target:    RegisterMemory(pool) → LocalDescriptor() → (router) → initiator
//   initiator: RegisterMemory(pool) → Connect(descriptor) → PostWrite(peer, segments)
//              → Wait(batch, deadline) → Notify(peer, request_id, payload)
//   target:    notification callback / PollNotifications() sees request_id; every
//              byte written before the Notify is visible by then.
//
// Every wait takes an absolute deadline. Errors are absl::Status:
//   UNAVAILABLE        the peer cannot be reached or died mid-transfer
//   DEADLINE_EXCEEDED  the deadline passed first
//   CANCELLED          Cancel() was called on the batch
//   INVALID_ARGUMENT   bad descriptor, unknown region, segment out of bounds
//   NOT_FOUND          unknown peer / batch handle
//   FAILED_PRECONDITION region still used by an in-flight batch
//
// Implementations: UcxAgent (ucx_agent.h) and LoopbackAgent (loopback_agent.h, in
// process), each an AgentCore (agent_core.h) over its transport's backend. Both
// are thread-safe; see docs/kvtransfer.md for the threading model.
#ifndef TANDEM_KVTRANSFER_TRANSFER_AGENT_H_
#define TANDEM_KVTRANSFER_TRANSFER_AGENT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace tandem::kvtransfer {

// A registered memory region of an agent. Ids are small integers assigned by the
// agent that registered the memory; a peer names them as they appear in that
// agent's descriptor.
using RegionId = uint32_t;
// A connected peer, as returned by Connect().
using PeerId = uint64_t;
// A posted batch of segments.
using BatchId = uint64_t;

// One contiguous piece of a transfer. For a write, bytes go from
// local[local_offset, +length) to remote[remote_offset, +length); for a read, the
// other way round.
struct Segment {
  RegionId local_region = 0;
  uint64_t local_offset = 0;
  RegionId remote_region = 0;
  uint64_t remote_offset = 0;
  uint64_t length = 0;

  friend bool operator==(const Segment&, const Segment&) = default;
};

// What kind of memory a registered region is. Host memory is ordinary process
// memory (also the emulated device memory of the cuda_sim backend, which the host
// addresses); CUDA memory is one GPU's device memory (cudaMalloc'd), which only
// transports that understand it may touch (UCX's cuda_copy / cuda_ipc / RDMA with
// GPUDirect, libfabric with FI_HMEM). An agent that cannot move a kind refuses to
// register it (FAILED_PRECONDITION), so a worker fails at start-up, not at its
// first transfer.
struct MemoryKind {
  enum class Type { kHost, kCuda };
  Type type = Type::kHost;
  int device = 0;  // the CUDA device ordinal (kCuda only)

  static MemoryKind Host() { return MemoryKind{}; }
  static MemoryKind Cuda(int device) { return MemoryKind{Type::kCuda, device}; }
  bool is_host() const { return type == Type::kHost; }
  friend bool operator==(const MemoryKind&, const MemoryKind&) = default;
};

// "host", "cuda:0": for messages.
inline std::string MemoryKindName(const MemoryKind& kind) {
  return kind.is_host() ? std::string("host") : absl::StrCat("cuda:", kind.device);
}

// Memory allocated and registered by an agent (AllocateMemory).
struct Allocation {
  RegionId region = 0;
  void* base = nullptr;
};

// A small message delivered to the target after every prior write to it landed.
struct Notification {
  // The sending agent's id (from its descriptor).
  uint64_t sender_agent_id = 0;
  std::string request_id;
  std::string payload;
  // The sender wrote the state straight into this agent's device memory (the
  // host staging's device IPC, host_staging_agent.h): nothing to stage in.
  bool on_device = false;
};

// Called once when a batch ends (OK or with its error), on the agent's progress
// thread with no agent lock held; not called for batches still live when the agent
// is destroyed. Must not block and must not call back into the agent's waits.
using CompletionCallback = std::function<void(BatchId, const absl::Status&)>;
// Called for each received notification, same rules; on the progress thread
// (UcxAgent) or the notifying thread (LoopbackAgent), one at a time.
using NotificationCallback = std::function<void(const Notification&)>;

// Largest request_id + payload accepted by Notify().
inline constexpr size_t kMaxNotificationBytes = 4096;

class TransferAgent {
 public:
  virtual ~TransferAgent() = default;

  // Registers [base, base + len) of memory `kind` for remote access. Regions may
  // not be empty. FAILED_PRECONDITION when this agent's transports cannot move
  // memory of that kind (the message says what is missing).
  virtual absl::StatusOr<RegionId> RegisterMemory(void* base, size_t len,
                                                  MemoryKind kind) = 0;
  // Host memory.
  absl::StatusOr<RegionId> RegisterMemory(void* base, size_t len) {
    return RegisterMemory(base, len, MemoryKind::Host());
  }
  // Allocates `len` zero-filled bytes suited to this agent's transports and
  // registers them (as RegisterMemory); DeregisterMemory frees them. A receiver's
  // cache allocated this way is the fastest to write into: UcxAgent gets it from
  // UCX, which on one host backs it with shared memory that the peer maps, so the
  // peer's puts are plain memory copies (docs/kvtransfer.md, "Bandwidth").
  // UNIMPLEMENTED unless the agent overrides it (UcxAgent and LoopbackAgent do).
  virtual absl::StatusOr<Allocation> AllocateMemory(size_t len) {
    return absl::UnimplementedError("AllocateMemory");
  }
  // Releases a registration. FAILED_PRECONDITION while a live batch uses it.
  // Descriptors published earlier still name the region; peers writing to it
  // fail (INVALID_ARGUMENT / UNAVAILABLE), never corrupt other memory.
  virtual absl::Status DeregisterMemory(RegionId region) = 0;
  // Number of live registrations (for leak checks).
  virtual size_t NumRegisteredRegions() const = 0;

  // This agent's id (random, in the descriptor).
  virtual uint64_t AgentId() const = 0;
  // Serialised descriptor: the endpoint address and every live region (id, base,
  // length, remote key). `metadata` is carried verbatim (e.g. cache geometry).
  virtual absl::StatusOr<std::string> LocalDescriptor(
      absl::string_view metadata = "") = 0;

  // Connects to the agent described by `peer_descriptor`. INVALID_ARGUMENT for a
  // malformed descriptor or a different agent kind; UNAVAILABLE when unreachable.
  virtual absl::StatusOr<PeerId> Connect(absl::string_view peer_descriptor) = 0;
  // Closes the connection; in-flight batches to the peer end with CANCELLED.
  virtual absl::Status Disconnect(PeerId peer) = 0;
  // Number of connected peers (for leak checks).
  virtual size_t NumPeers() const = 0;

  // Posts all `segments` as one batch: local → remote (write) or remote → local
  // (read). Every segment is checked against the local registration and the
  // peer's descriptor before anything moves (INVALID_ARGUMENT otherwise). The
  // batch is complete when all bytes are visible at the destination. A batch
  // without segments moves nothing and completes after a fence towards the
  // peer (the host staging posts one after writing a peer's device memory
  // itself, so that Poll, Wait and the callback stay the inner agent's).
  virtual absl::StatusOr<BatchId> PostWrite(PeerId peer,
                                            absl::Span<const Segment> segments,
                                            CompletionCallback on_done = nullptr) = 0;
  virtual absl::StatusOr<BatchId> PostRead(PeerId peer,
                                           absl::Span<const Segment> segments,
                                           CompletionCallback on_done = nullptr) = 0;

  // Non-blocking: true when the batch completed OK, false while it runs, its error
  // once it failed. A batch is forgotten once Poll or Wait has reported its end
  // (NOT_FOUND afterwards).
  virtual absl::StatusOr<bool> Poll(BatchId batch) = 0;
  // Blocks until the batch ends or `deadline`: OK, its error, or DEADLINE_EXCEEDED
  // (the batch keeps running; wait again, Cancel or Disconnect).
  virtual absl::Status Wait(BatchId batch, absl::Time deadline) = 0;
  // Stops posting the batch's remaining segments; the batch ends CANCELLED once the
  // operations already handed to the transport have drained. OK if already ended.
  virtual absl::Status Cancel(BatchId batch) = 0;

  // Delivers (request_id, payload) to the peer after every batch posted to it
  // before this call has ended and its bytes are visible there (blocks until sent
  // or deadline). Callers notify only after their batches succeeded (Wait), so
  // the target is never told about a partial state.
  virtual absl::Status Notify(PeerId peer, absl::string_view request_id,
                              absl::string_view payload, absl::Time deadline) = 0;
  // Registers the callback for received notifications (nullptr: queue them for
  // PollNotifications). Queued ones are handed to a new callback at once.
  virtual void SetNotificationCallback(NotificationCallback callback) = 0;
  // Returns and clears notifications received while no callback was set.
  virtual std::vector<Notification> PollNotifications() = 0;

  // Transport(s) in use towards the peer, e.g. "cma", "tcp", "posix", "loopback";
  // "" when unknown.
  virtual std::string Transport(PeerId peer) = 0;
};

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_TRANSFER_AGENT_H_
