// UcxAgent: TransferAgent over UCX (UCP): one context (RMA + AM + WAKEUP), one
// worker, one progress thread per agent.
//
// → A write: PostWrite checks bounds and queues the batch; a small one (at most
//   `inline_post_bytes`) it posts itself, a large one the progress thread posts in
//   `max_op_bytes` pieces (ucp_put_nbx with MULTI_SEND, at most
//   `max_inflight_ops` outstanding), then ucp_ep_flush_nbx; the batch is
//   complete when the flush completes (remote visibility). Over shared memory a
//   put into a peer region from AllocateMemory is a memcpy inside ucp_put_nbx.
//   Notify waits for the earlier batches to the peer, flushes the endpoint again
//   and sends an active message (ucp_am_send_nbx, eager); the target's AM handler
//   hands it to the notification callback or the PollNotifications queue.
//
// Threading: every UCP call is made under `mu_` (worker created with
// UCS_THREAD_MODE_SERIALIZED). The progress thread calls ucp_worker_progress in
// a busy loop while any batch, flush or notification is in flight, and otherwise
// sleeps on the worker's event fd (ucp_worker_arm + epoll) so an idle agent costs
// no CPU yet still serves peers whose transport needs target-side progress (tcp).
// Public methods may be called from any thread. UCX callbacks run inside
// ucp_worker_progress under `mu_` and only record state; user callbacks
// (completion, notification) run on the progress thread with no lock held.
//
// Failure: endpoints use UCP_ERR_HANDLING_MODE_PEER; a dead peer fails every
// outstanding operation (UNAVAILABLE) and the endpoint is force-closed by the
// progress thread. Keep-alive interval is configurable (UCX_KEEPALIVE_INTERVAL).
#ifndef TANDEM_KVTRANSFER_UCX_AGENT_H_
#define TANDEM_KVTRANSFER_UCX_AGENT_H_

#include <ucp/api/ucp.h>

#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/transfer_agent.h"

namespace tandem::kvtransfer {

struct UcxAgentConfig {
  // UCX_TLS for this agent's context, e.g. "tcp", "posix,cma,self", "rc,ud,sm";
  // empty lets UCX choose (shared memory on one host, RDMA where present).
  std::string tls;
  // UCX_NET_DEVICES, e.g. "mlx5_0:1"; empty: all.
  std::string net_devices;
  // How often UCX probes peers for liveness (UCX_KEEPALIVE_INTERVAL).
  absl::Duration keepalive_interval = absl::Seconds(1);
  // UCP_ERR_HANDLING_MODE_PEER on endpoints: a dead peer fails operations
  // (UNAVAILABLE) instead of leaving them to the deadline. UCX 1.13 then uses only
  // transports with keep-alive (tcp, RDMA), not shared memory (posix/sysv/cma);
  // false lets it use shared memory on one host, and peer death surfaces as
  // DEADLINE_EXCEEDED (or an error from cma) instead.
  bool peer_failure_detection = true;
  // Connect() completes the wire-up within this time or fails UNAVAILABLE.
  absl::Duration connect_timeout = absl::Seconds(10);
  // Operations of one batch handed to UCX at a time.
  int max_inflight_ops = 128;
  // Largest put/get handed to UCX; longer segments are posted in pieces. Over
  // shared memory UCX copies inline, under the agent lock, so this bounds how
  // late a Wait deadline, a Cancel or another batch is served (8 MiB: ~1-3 ms).
  uint64_t max_op_bytes = 8 << 20;
  // A batch of at most this many bytes is posted by PostWrite/PostRead itself
  // (small-transfer latency); larger ones by the progress thread, so the caller
  // returns at once (prefill keeps computing while its layers stream out).
  uint64_t inline_post_bytes = 256 << 10;
  // Posts puts and gets with UCP_OP_ATTR_FLAG_MULTI_SEND, so UCX selects its
  // protocols for bandwidth rather than single-operation latency. With UCX 1.13
  // over shared memory this is what turns a put into a UCX-allocated peer region
  // into a direct copy (without it: software emulation above 32 KiB).
  bool bandwidth_protocols = true;
  // Use UCX's v2 protocols (UCX_PROTO_ENABLE=y) unless the environment sets
  // UCX_PROTO_ENABLE. Over shared memory, puts into memory UCX did not allocate
  // are emulated with active messages under either (v2's emulation was ~10x
  // v1's); into AllocateMemory'd memory both give the direct copy (see
  // docs/kvtransfer.md, "Bandwidth over shared memory").
  bool use_proto_v2 = true;
  // Other UCX configuration pairs (name without the UCX_ prefix, value).
  std::vector<std::pair<std::string, std::string>> ucx_options;
  // Worker name, for UCX logs.
  std::string name = "tandem-kv";
};

class UcxAgent final : public TransferAgent {
 public:
  static absl::StatusOr<std::unique_ptr<UcxAgent>> Create(const UcxAgentConfig& config);
  ~UcxAgent() override;
  UcxAgent(const UcxAgent&) = delete;
  UcxAgent& operator=(const UcxAgent&) = delete;

  absl::StatusOr<RegionId> RegisterMemory(void* base, size_t len) override;
  // ucp_mem_map with UCP_MEM_MAP_ALLOCATE: on one host UCX backs the memory with
  // shared memory (sysv/posix) that a peer maps, so the peer's puts into it are
  // memory copies by the sender (what ucx_perftest's own buffers get); puts into
  // plain process memory are emulated with active messages by UCX 1.13.
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

 private:
  struct Region {
    void* base;
    size_t length;
    ucp_mem_h memh;
    std::string rkey;
  };
  struct Peer;
  struct Batch;
  struct PendingOp;

  explicit UcxAgent(const UcxAgentConfig& config);
  absl::Status Init();
  absl::StatusOr<BatchId> Post(PeerId peer, absl::Span<const Segment> segments,
                               bool write, CompletionCallback on_done);
  void ProgressLoop();
  void Wake();
  // Posts operations of `b` until its window is full, it is all posted (then the
  // flush), or `*budget` bytes were posted (decremented).
  void PumpLocked(Batch* b, uint64_t* budget) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeEndLocked(Batch* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes failed peers, pumps and ends batches; true when it posted bytes.
  bool ServiceLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ClosePeerLocked(Peer* p, bool wait, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleasePeerLocked(Peer* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AwaitOpLocked(PendingOp* op, Peer* p, absl::Time deadline,
                             absl::string_view what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunCallbacks();

  static void OnBatchOp(void* request, ucs_status_t status, void* user_data);
  static void OnPendingOp(void* request, ucs_status_t status, void* user_data);
  static void OnPeerError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static ucs_status_t OnActiveMessage(void* arg, const void* header,
                                      size_t header_length, void* data, size_t length,
                                      const ucp_am_recv_param_t* param);

  const UcxAgentConfig config_;
  const uint64_t agent_id_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;  // UCX worker's
  int wake_fd_ = -1;   // eventfd to interrupt the progress thread's sleep
  int epoll_fd_ = -1;
  std::string worker_address_;

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::map<RegionId, Region> regions_ ABSL_GUARDED_BY(mu_);
  RegionId next_region_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<PeerId, std::unique_ptr<Peer>> peers_ ABSL_GUARDED_BY(mu_);
  PeerId next_peer_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<BatchId, std::unique_ptr<Batch>> batches_ ABSL_GUARDED_BY(mu_);
  BatchId next_batch_ ABSL_GUARDED_BY(mu_) = 1;
  int busy_waiters_ ABSL_GUARDED_BY(mu_) = 0;  // threads waiting on UCX ops
  std::vector<std::pair<CompletionCallback, std::pair<BatchId, absl::Status>>>
      done_callbacks_ ABSL_GUARDED_BY(mu_);
  NotificationCallback notification_callback_ ABSL_GUARDED_BY(mu_);
  std::vector<Notification> notifications_ ABSL_GUARDED_BY(mu_);  // for Poll
  std::vector<Notification> to_dispatch_ ABSL_GUARDED_BY(mu_);    // for the callback
  absl::Mutex callback_mu_;  // serialises notification callback invocations

  std::thread progress_;
};

// "tcp", "cma,posix" ...: transports named in ucp_ep_print_info output (exposed for
// tests).
std::string ParseUcxTransports(absl::string_view ep_info);

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_UCX_AGENT_H_
