// LoopbackAgent: an in-process TransferAgent (memcpy between agents of the same
// process) with the same semantics and errors as UcxAgent, for callers' unit tests.
//
// Agents find each other through a process-wide registry keyed by agent id (the
// descriptor's address). Each agent has one worker thread that copies its posted
// batches in FIFO order, in chunks, checking for cancellation, a paused target
// and a dead target between chunks. Completion and notification callbacks run on
// that worker thread (completions) or on the notifying thread (notifications).
//
// Fault injection for tests of callers:
//   SetPaused(true)  the agent stops accepting bytes: writes into it (and reads
//                    from it) stall, as with a stopped peer process.
//   Kill()           the agent behaves like a dead process: peers' in-flight and new
//                    operations to it fail UNAVAILABLE, Connect fails UNAVAILABLE.
#ifndef TANDEM_KVTRANSFER_LOOPBACK_AGENT_H_
#define TANDEM_KVTRANSFER_LOOPBACK_AGENT_H_

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/transfer_agent.h"

namespace tandem::kvtransfer {

class LoopbackAgent final : public TransferAgent {
 public:
  LoopbackAgent();
  ~LoopbackAgent() override;
  LoopbackAgent(const LoopbackAgent&) = delete;
  LoopbackAgent& operator=(const LoopbackAgent&) = delete;

  absl::StatusOr<RegionId> RegisterMemory(void* base, size_t len) override;
  // Anonymous zero-filled pages (mmap), unmapped by DeregisterMemory or ~LoopbackAgent.
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

  // Fault injection (see the file comment).
  void SetPaused(bool paused);
  void Kill();

 private:
  struct Region {
    uint8_t* base;
    uint64_t length;
    bool owned = false;  // from AllocateMemory: unmapped on deregistration
  };
  struct Peer {
    uint64_t agent_id;
    AgentDescriptor descriptor;
  };
  struct Batch {
    BatchId id;
    PeerId peer;
    uint64_t target_agent;
    bool write;
    std::vector<Segment> segments;
    CompletionCallback on_done;
    size_t next_segment = 0;
    uint64_t next_offset = 0;  // within segments[next_segment]
    bool cancel_requested = false;
    bool ended = false;
    absl::Status status;
  };

  absl::StatusOr<BatchId> Post(PeerId peer, absl::Span<const Segment> segments,
                               bool write, CompletionCallback on_done);
  void WorkerLoop();
  // Copies one chunk of `batch` (worker thread, mu_ not held). Returns false and
  // sets *status when the batch ends with an error; *stalled when the target is paused.
  bool CopyChunk(const Batch& snapshot, Segment* piece, absl::Status* status,
                 bool* stalled);
  void Finish(Batch* batch, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Deliver(Notification n);

  const uint64_t agent_id_;
  std::atomic<bool> paused_{false};
  std::atomic<bool> dead_{false};

  mutable absl::Mutex mu_;
  std::map<RegionId, Region> regions_ ABSL_GUARDED_BY(mu_);
  RegionId next_region_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<PeerId, Peer> peers_ ABSL_GUARDED_BY(mu_);
  PeerId next_peer_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<BatchId, std::unique_ptr<Batch>> batches_ ABSL_GUARDED_BY(mu_);
  std::deque<BatchId> queue_ ABSL_GUARDED_BY(mu_);
  BatchId next_batch_ ABSL_GUARDED_BY(mu_) = 1;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  NotificationCallback notification_callback_ ABSL_GUARDED_BY(mu_);
  std::vector<Notification> notifications_ ABSL_GUARDED_BY(mu_);
  absl::Mutex callback_mu_;  // serialises notification callbacks

  std::thread worker_;
};

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_LOOPBACK_AGENT_H_
