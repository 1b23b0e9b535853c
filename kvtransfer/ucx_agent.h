// UcxAgent: TransferAgent over UCX (UCP): one context (RMA + AM + WAKEUP), one
// worker, one progress thread per agent. It is an AgentCore (agent_core.h: the
// batch table, posting in pieces through a window, Poll / Wait / Cancel,
// callbacks, the notification fence and queue, peer failures) over the UCX
// backend in ucx_agent.cc, which implements only the transport primitives
// (memory registration, endpoints, put/get, flush, active messages, progress).
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
// Threading: every UCP call is made under the agent lock (worker created with
// UCS_THREAD_MODE_SERIALIZED). The progress thread calls ucp_worker_progress in
// a busy loop while any batch, flush or notification is in flight, and otherwise
// sleeps on the worker's event fd (ucp_worker_arm + epoll) so an idle agent costs
// no CPU yet still serves peers whose transport needs target-side progress (tcp).
// Public methods may be called from any thread. UCX callbacks run inside
// ucp_worker_progress under the agent lock and only record state; user callbacks
// (completion, notification) run on the progress thread with no lock held.
//
// Failure: endpoints use UCP_ERR_HANDLING_MODE_PEER; a dead peer fails every
// outstanding operation (UNAVAILABLE) and the endpoint is force-closed by the
// progress thread. Keep-alive interval is configurable (UCX_KEEPALIVE_INTERVAL).
// Without it (shared memory on one host: UCX 1.13 has no keep-alive there) and
// as a backstop with it, a peer that holds operations and completes none for
// `progress_timeout` is failed the same way (a killed or stopped process
// completes nothing), and a forced close ends the operations still outstanding
// at once (their late completions ignored), so no batch outlives its peer.
#ifndef TANDEM_KVTRANSFER_UCX_AGENT_H_
#define TANDEM_KVTRANSFER_UCX_AGENT_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kvtransfer/agent_core.h"

namespace tandem::kvtransfer {

// What UCX chose for one peer's endpoint, once its wire-up completed: UCX picks
// transports per peer, after start, so a cluster configured for RDMA can still
// land on TCP for a peer (issue 19's silent fallback). Every connection is
// logged ("KV transfer peer connected", a WARNING when it is TCP only) and
// handed to UcxAgentConfig::on_peer_connected, refused ones too (`refused`).
struct UcxPeerTransport {
  uint64_t peer_agent_id = 0;
  std::string transports;  // "tcp", "posix,cma", "rc_mlx5,ud_mlx5" (Transport(peer))
  std::string lanes;       // DescribeUcxLanes: "tcp/eth0 (am am_bw rma_bw)"
  bool tcp_only = false;   // UcxTransportsAreTcpOnly(transports)
  // CheckUcxPeerTransport refused it (TCP only where RDMA is required): the
  // connection is dropped and the transfer that tried fails.
  bool refused = false;
};

// Whether a peer UCX connects over TCP only is refused (issue 19 item 3: the
// silent fallback from RDMA to TCP is the bug). Shared memory (sysv, posix, cma)
// and RDMA lanes always pass; only a peer whose every lane is tcp is judged.
enum class UcxRdmaRequirement {
  // Refused when this agent's context opened an RDMA resource (rc_mlx5/mlx5_0:1,
  // ...): the host has RDMA, so TCP to this peer is the fallback, not a choice.
  // A host without RDMA (a laptop, CI, ./tandem up with --kv-tcp) or UCX_TLS=tcp
  // (the context then opens no RDMA) runs over TCP, logged and counted.
  kAuto,
  // Always refused: every peer must have an RDMA or shared-memory lane (the
  // RDMA clusters' manifests, --kv_require_rdma=true).
  kRequired,
  // Never refused: logged and counted only (--kv_require_rdma=false).
  kNotRequired,
};

// "auto" | "true" | "false" (also 1/0, yes/no; any case); INVALID_ARGUMENT
// otherwise.
absl::StatusOr<UcxRdmaRequirement> ParseUcxRdmaRequirement(absl::string_view spec);

// OK when `peer` may carry KV under `requirement`, this agent's context having
// opened `resources` (UcxAgent::resources()); else FAILED_PRECONDITION naming
// the peer agent, its transports and lanes, and what to change.
absl::Status CheckUcxPeerTransport(const UcxPeerTransport& peer,
                                   UcxRdmaRequirement requirement,
                                   const std::vector<std::string>& resources);

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
  // A connected peer with operations outstanding (puts, gets, flushes, the
  // notification) and none of them completed for this long is failed
  // UNAVAILABLE, its outstanding operations ended: how a dead peer is noticed
  // without peer-failure detection, where a put emulated with active messages
  // (into memory UCX did not allocate) never completes. A put into a dead
  // peer's AllocateMemory region is a copy into shared memory that stays
  // mapped: it completes, and the death is noticed by the router instead.
  // InfiniteDuration(): off.
  absl::Duration progress_timeout = absl::Seconds(10);
  // Whether a peer connected over TCP only is refused: Connect fails
  // FAILED_PRECONDITION (CheckUcxPeerTransport) after logging and reporting the
  // connection to on_peer_connected, and no connection is kept.
  UcxRdmaRequirement require_rdma = UcxRdmaRequirement::kAuto;
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
  // Called for every peer connected (with the agent's lock held: record it,
  // do not call the agent), e.g. to count connections by transport.
  std::function<void(const UcxPeerTransport&)> on_peer_connected;
};

class UcxAgent final : public AgentCore {
 public:
  static absl::StatusOr<std::unique_ptr<UcxAgent>> Create(const UcxAgentConfig& config);
  ~UcxAgent() override = default;

  // AllocateMemory: ucp_mem_map with UCP_MEM_MAP_ALLOCATE: on one host UCX backs
  // the memory with shared memory (sysv/posix) that a peer maps, so the peer's
  // puts into it are memory copies by the sender (what ucx_perftest's own buffers
  // get); puts into plain process memory are emulated with active messages by
  // UCX 1.13.

  // Whether this UCX build moves CUDA device memory (ucp_context_query's memory
  // types include CUDA: UCX built --with-cuda, the cuda_copy / cuda_ipc
  // transports loaded). Without it, RegisterMemory of MemoryKind::Cuda fails
  // FAILED_PRECONDITION saying so; with it, CUDA memory is mapped with
  // UCS_MEMORY_TYPE_CUDA and puts / gets from it name that memory type.
  bool cuda_memory_supported() const { return cuda_memory_; }

  // The transport/device resources UCX's context opened, as
  // ucp_context_print_info lists them: "tcp/eth0", "tcp/lo", "sysv/memory",
  // "rc_mlx5/mlx5_0:1". What UCX may use per peer; UCX_TLS=rc,tcp on a host
  // without RDMA leaves only tcp here (UCX itself only warns).
  const std::vector<std::string>& resources() const { return resources_; }

 private:
  UcxAgent(std::unique_ptr<Backend> backend, bool cuda_memory,
           std::vector<std::string> resources);
  const bool cuda_memory_;
  const std::vector<std::string> resources_;
};

// "tcp", "cma,posix" ...: transports named in ucp_ep_print_info output (exposed for
// tests).
std::string ParseUcxTransports(absl::string_view ep_info);
// Each lane of ucp_ep_print_info output, its transport/device and what it
// carries: "tcp/eth0.0 (am am_bw keepalive wireup); cma/memory.0 (rma_bw)".
std::string DescribeUcxLanes(absl::string_view ep_info);
// True when every transport in a ParseUcxTransports list is tcp (the KV then
// moves over TCP sockets: fine on one host by choice, the fallback to refuse
// between RDMA hosts).
bool UcxTransportsAreTcpOnly(absl::string_view transports);
// The resources ("tcp/eth0") of ucp_context_print_info output.
std::vector<std::string> ParseUcxContextResources(absl::string_view context_info);
// rc*, dc*, ud* (InfiniBand / RoCE verbs and mlx5), srd, ib, gga: the RDMA
// transports and aliases of UCX_TLS.
bool IsUcxRdmaTransport(absl::string_view tl);

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_UCX_AGENT_H_
