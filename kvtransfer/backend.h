// Backend: the transport primitives under an AgentCore (agent_core.h). A backend
// moves bytes and messages; the agent keeps everything else once: regions and
// their ids, peers and their failures, the batch table, posting in pieces through
// a window, completion, Poll / Wait / Cancel, callbacks, the notification fence
// and the notification queue (the split NIXL makes between its agent and its
// backend engines).
//
//   AgentCore (bookkeeping)                    Backend (transport)
//   ---------------------------------------    -------------------------------------
//   RegisterMemory / AllocateMemory ids   ->   RegisterMemoryLocked /
//   AllocateMemoryLocked Connect(descriptor) parse, kind check ->   ConnectLocked(peer,
//   descriptor) batch: pieces <= max_piece_bytes      ->   PostPieceLocked (done |
//   pending | retry)
//          all posted                     ->   PostFenceLocked (bytes visible remotely)
//   progress thread                       ->   ProgressLocked / ArmLocked / Sleep /
//   Wake Notify after earlier batches ended    ->   SendNotificationLocked failed peer
//   <-   host->PeerFailedLocked pending op ended                      <-
//   host->OpDoneLocked message arrived                       <-
//   host->NotificationReceivedLocked
//
// Locking: every method whose name ends in Locked is called with the agent lock
// held (one lock per agent; the backend needs none of its own for state touched
// only there), and the host's *Locked methods may be called only from inside
// them. A backend waits for its own operations with host->AwaitLocked, which
// releases the agent lock and keeps the progress thread spinning. Backends never
// run user callbacks.
#ifndef TANDEM_KVTRANSFER_BACKEND_H_
#define TANDEM_KVTRANSFER_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/transfer_agent.h"

namespace tandem::kvtransfer {

class BackendHost;

// A posted piece's or fence's batch as a backend sees it: where to report its end
// (ReportOpDone). Owned by the agent; stable while the operation is pending, so a
// transport can carry it as its completion's user data.
struct BackendOp {
  BackendHost* host = nullptr;
};
using OpToken = BackendOp*;

// What an AgentCore offers its backend.
class BackendHost {
 public:
  // A piece or fence for which PostPieceLocked / PostFenceLocked returned
  // kPending has ended (`status` is the transport's, the agent adds the batch).
  // Backends call it through ReportOpDone.
  virtual void OpDoneLocked(OpToken op, absl::Status status) = 0;
  // The transport lost `peer` (UNAVAILABLE): the agent fails its batches, posts
  // and notifies, and asks the backend to force-close it.
  virtual void PeerFailedLocked(PeerId peer, absl::Status status) = 0;
  // A notification arrived (inside ProgressLocked); the agent hands it to the
  // callback on its progress thread, or queues it for PollNotifications.
  virtual void NotificationReceivedLocked(Notification n) = 0;
  // Waits until `cond` holds or `deadline` passes, with the agent lock released
  // meanwhile and the progress thread spinning (so pending operations complete).
  // Returns whether `cond` holds.
  virtual bool AwaitLocked(const absl::Condition& cond, absl::Time deadline) = 0;

 protected:
  ~BackendHost() = default;
};

// How the agent drives a backend.
struct BackendLimits {
  // Largest piece handed to PostPieceLocked; longer segments are cut.
  uint64_t max_piece_bytes = 4 << 20;
  // Pieces of one batch pending at a time.
  int max_inflight_ops = 1;
  // A batch of at most this many bytes is posted by PostWrite/PostRead itself;
  // larger ones by the progress thread (0: always the progress thread).
  uint64_t inline_post_bytes = 0;
  // Keep the progress thread spinning while a caller waits (AwaitLocked, Notify's
  // fence): the transport completes operations only when progressed (UCX). False
  // where waits end by other means (loopback copies complete when posted).
  bool spin_while_waiting = true;
};

// Called by a backend (agent lock held) when a pending piece or fence ended.
inline void ReportOpDone(OpToken op, absl::Status status) {
  op->host->OpDoneLocked(op, std::move(status));
}

class Backend {
 public:
  enum class PostResult {
    kDone,        // complete already (e.g. copied inline)
    kPending,     // host->OpDoneLocked(op, ...) follows
    kRetryLater,  // nothing posted now (the target cannot take bytes); try again
  };
  // One piece of a segment: local bytes and where they go (or come from) remotely.
  struct Piece {
    void* local = nullptr;
    const RegionDescriptor* remote = nullptr;  // the peer's region, from its descriptor
    uint64_t remote_offset = 0;
    uint64_t length = 0;
    MemoryKind local_memory;  // what `local` is (its region's kind)
  };

  virtual ~Backend() = default;

  // Called once by the agent, before its progress thread starts.
  virtual void Start(BackendHost* host, uint64_t agent_id) = 0;
  // Called by the agent's destructor first, without the lock: stop serving peers
  // (they fail from now on) and wait out peers already inside this agent.
  virtual void Detach() {}
  // Called by the agent's destructor after its progress thread stopped, every
  // peer was closed and before the backend is destroyed.
  virtual void ShutdownLocked(absl::Time deadline) = 0;

  virtual AgentKind Kind() const = 0;
  // "UCX", "loopback": for messages.
  virtual absl::string_view Name() const = 0;
  // The endpoint address published in this agent's descriptor.
  virtual std::string Address() const = 0;
  virtual BackendLimits Limits() const = 0;
  // UNAVAILABLE when this agent can no longer transfer at all (loopback Kill);
  // checked by Connect, PostWrite/PostRead and Notify. Thread-safe.
  virtual absl::Status Usable() const { return absl::OkStatus(); }

  // Memory. `region` is the id the agent assigned; the result is the packed
  // remote key published in the descriptor. FAILED_PRECONDITION for a `kind`
  // the transport cannot move (TransferAgent::RegisterMemory).
  virtual absl::StatusOr<std::string> RegisterMemoryLocked(RegionId region, void* base,
                                                           size_t len,
                                                           MemoryKind kind) = 0;
  struct Allocated {
    void* base = nullptr;
    std::string rkey;
    bool zeroed = false;  // false: the agent clears it (without the lock)
  };
  virtual absl::StatusOr<Allocated> AllocateMemoryLocked(RegionId region,
                                                         size_t len) = 0;
  // No live batch uses the region locally (the agent checked).
  virtual void DeregisterMemoryLocked(RegionId region) = 0;

  // Peers. The agent parsed `descriptor` and checked its kind.
  virtual absl::Status ConnectLocked(PeerId peer,
                                     const AgentDescriptor& descriptor) = 0;
  // Starts closing the peer's connection: gracefully when `graceful` (healthy and
  // idle), else forced so that its pending operations fail; with `wait`, drives
  // the close until done or `deadline`. May be called again (waits for the close).
  virtual void ClosePeerLocked(PeerId peer, bool graceful, bool wait,
                               absl::Time deadline) = 0;
  // The agent forgot the peer (after ClosePeerLocked); release what is left once
  // its close completed.
  virtual void ForgetPeerLocked(PeerId peer) = 0;
  virtual std::string TransportLocked(PeerId peer) = 0;

  // Data. `op` identifies the piece's batch in OpDoneLocked. Errors end the batch.
  virtual absl::StatusOr<PostResult> PostPieceLocked(PeerId peer, bool write,
                                                     const Piece& piece,
                                                     OpToken op) = 0;
  // After a batch's last piece: kDone or kPending once every byte posted to the
  // peer so far is visible there.
  virtual absl::StatusOr<PostResult> PostFenceLocked(PeerId peer, OpToken op) = 0;

  // Delivers `n` to the peer after every byte written to it so far is visible
  // there, by `deadline` (the agent already waited for its earlier batches). A
  // transport that delivers by calling into the receiving agent in this process
  // sets `*deliver` instead; the agent runs it after releasing its lock.
  virtual absl::Status SendNotificationLocked(
      PeerId peer, const Notification& n, absl::Time deadline,
      std::function<absl::Status()>* deliver) = 0;

  // Progress thread. ProgressLocked drives the transport (completions, messages,
  // closes); true when something happened. BusyLocked: keep spinning even with no
  // batch in flight (closes in progress). ArmLocked: about to sleep; the longest
  // sleep, or zero to spin again at once. Sleep waits (lock released) until an
  // event, Wake or `timeout`. Wake is thread-safe.
  virtual bool ProgressLocked() = 0;
  virtual bool BusyLocked() { return false; }
  virtual absl::Duration ArmLocked() = 0;
  virtual void Sleep(absl::Duration timeout) = 0;
  virtual void Wake() = 0;
};

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_BACKEND_H_
