// AgentCore: the TransferAgent bookkeeping, written once over a Backend
// (backend.h). UcxAgent and LoopbackAgent are an AgentCore each with their
// transport's backend.
//
// → A batch:  PostWrite/PostRead: peer and bounds checks (segment_check.h) →
//             the batch table → (small: posted here, else by the progress thread)
//             pieces of <= max_piece_bytes, at most max_inflight_ops pending
//             → fence once all are posted → ended when nothing is pending
//             → completion callback (progress thread, no lock) → Poll/Wait report
//             it once and forget it.
//
//   batch:  POSTING --all pieces posted--> FENCED --nothing pending--> ENDED(OK)
//              |  \--error / Cancel / Disconnect / peer failed--+
//              |                                                 v
//              +--------------------- nothing pending --> ENDED(error)
//
// Notify waits (agent lock released) until every batch posted to the peer
// before it has ended, then the backend fences and sends. Received notifications
// go to the callback (serialised, no agent lock held) or to the
// PollNotifications queue.
//
// Threading: one agent lock (`mu_`) guards every table and every backend call
// (the backends' *Locked methods). One progress thread per agent spins while
// anything is in flight and otherwise sleeps in the backend (Backend::Sleep),
// woken by posts, cancels and waiters. User callbacks run on the progress thread
// (completions, and notifications the backend received) or on a notifying
// thread of this process (in-process delivery, DeliverNotification), never with
// the agent lock held. Batches still live when the agent is destroyed end with
// it; their callbacks are not run.
#ifndef TANDEM_KVTRANSFER_AGENT_CORE_H_
#define TANDEM_KVTRANSFER_AGENT_CORE_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kvtransfer/backend.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/transfer_agent.h"

namespace tandem::kvtransfer {

class AgentCore : public TransferAgent, private BackendHost {
 public:
  ~AgentCore() override;
  AgentCore(const AgentCore&) = delete;
  AgentCore& operator=(const AgentCore&) = delete;

  using TransferAgent::RegisterMemory;
  absl::StatusOr<RegionId> RegisterMemory(void* base, size_t len,
                                          MemoryKind kind) override;
  absl::StatusOr<Allocation> AllocateMemory(size_t len) override;
  absl::Status DeregisterMemory(RegionId region) override;
  size_t NumRegisteredRegions() const override;
  uint64_t AgentId() const override { return agent_id_; }
  absl::StatusOr<std::string> LocalDescriptor(absl::string_view metadata = "") override;
  absl::StatusOr<PeerId> Connect(absl::string_view peer_descriptor) override;
  absl::Status Disconnect(PeerId peer) override;
  size_t NumPeers() const override;
  absl::StatusOr<BatchId> PostWrite(PeerId peer, absl::Span<const Segment> segments,
                                    CompletionCallback on_done = nullptr) override;
  absl::StatusOr<BatchId> PostRead(PeerId peer, absl::Span<const Segment> segments,
                                   CompletionCallback on_done = nullptr) override;
  absl::StatusOr<bool> Poll(BatchId batch) override;
  absl::Status Wait(BatchId batch, absl::Time deadline) override;
  absl::Status Cancel(BatchId batch) override;
  absl::Status Notify(PeerId peer, absl::string_view request_id,
                      absl::string_view payload, absl::Time deadline) override;
  void SetNotificationCallback(NotificationCallback callback) override;
  std::vector<Notification> PollNotifications() override;
  std::string Transport(PeerId peer) override;

  // Number of batches still tracked (ended ones are dropped once reported).
  size_t NumBatchesForTesting() const;

  // Hands `n` to this agent's notification callback on the calling thread (or
  // queues it), for backends that deliver within the process. Thread-safe; the
  // caller holds no agent lock.
  void DeliverNotification(const Notification& n);

 protected:
  // Starts the progress thread. `backend` is owned.
  explicit AgentCore(std::unique_ptr<Backend> backend);

 private:
  struct Region {
    void* base;
    size_t length;
    std::string rkey;
    MemoryKind kind;
  };
  struct Peer {
    AgentDescriptor descriptor;
    absl::Status error;    // the transport lost it (PeerFailedLocked)
    bool closing = false;  // a forced close was started after the failure
  };
  struct Batch : BackendOp {  // the op token of its pieces and fence
    BatchId id;
    PeerId peer;
    bool write;
    std::vector<Segment> segments;
    CompletionCallback on_done;
    size_t next_segment = 0;
    uint64_t next_offset = 0;  // bytes of segments[next_segment] already posted
    uint64_t bytes = 0;        // total of the segments
    int inflight = 0;          // pieces and fence pending in the backend
    bool fence_posted = false;
    bool stalled = false;  // the backend said kRetryLater on the last pass
    bool cancel_requested = false;
    bool ended = false;
    absl::Status status;  // first error
  };
  struct PumpResult {
    bool posted = false;   // bytes went to the backend
    bool live = false;     // a batch is in flight and not stalled
    bool stalled = false;  // a batch waits for its target to take bytes
  };

  absl::StatusOr<BatchId> Post(PeerId peer, absl::Span<const Segment> segments,
                               bool write, CompletionCallback on_done);
  // Posts pieces of `b` until its window is full, it is all posted (then the
  // fence), the backend asks to retry, or `*budget` bytes were posted.
  void PumpLocked(Batch* b, uint64_t* budget) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeEndLocked(Batch* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts closing failed peers, pumps and ends batches.
  PumpResult ServiceLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool PeerIdleLocked(PeerId peer) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ProgressLoop();
  void RunCallbacks();

  // BackendHost.
  void OpDoneLocked(OpToken op, absl::Status status) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PeerFailedLocked(PeerId peer, absl::Status status) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NotificationReceivedLocked(Notification n) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool AwaitLocked(const absl::Condition& cond, absl::Time deadline) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t agent_id_;
  std::unique_ptr<Backend> backend_;
  const BackendLimits limits_;

  mutable absl::Mutex mu_;  // the agent lock
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::map<RegionId, Region> regions_ ABSL_GUARDED_BY(mu_);
  RegionId next_region_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<PeerId, Peer> peers_ ABSL_GUARDED_BY(mu_);
  PeerId next_peer_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<BatchId, std::unique_ptr<Batch>> batches_ ABSL_GUARDED_BY(mu_);
  BatchId next_batch_ ABSL_GUARDED_BY(mu_) = 1;
  int busy_waiters_ ABSL_GUARDED_BY(mu_) = 0;  // threads in AwaitLocked / Notify
  std::vector<std::pair<CompletionCallback, std::pair<BatchId, absl::Status>>>
      done_callbacks_ ABSL_GUARDED_BY(mu_);
  NotificationCallback notification_callback_ ABSL_GUARDED_BY(mu_);
  std::vector<Notification> notifications_ ABSL_GUARDED_BY(mu_);  // for Poll
  std::vector<Notification> to_dispatch_ ABSL_GUARDED_BY(mu_);    // for the callback
  // Serialises notification callbacks. Lock order: callback_mu_, then mu_.
  absl::Mutex callback_mu_;

  std::thread progress_;
};

// A random non-zero agent id.
uint64_t RandomAgentId();

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_AGENT_CORE_H_
