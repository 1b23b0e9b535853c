// LibfabricAgent: TransferAgent over libfabric (OFI): FI_EP_RDM endpoints with
// FI_RMA and FI_MSG, one or more endpoints ("rails"), each on a NIC's domain
// (one fabric and domain per NIC chosen, by PCI / NUMA topology: see
// fabric_topology.h) with its own completion queue and address vector; every
// region is registered in every domain (a key per domain in the descriptor). It is an
// AgentCore (agent_core.h: the batch table, pieces through a window, Poll /
// Wait / Cancel, callbacks, the notification fence and queue, peer failures)
// over the libfabric backend in libfabric_agent.cc, which implements only the
// transport primitives. The same code runs on `efa` (AWS; the EFA installer's
// libfabric.so.1 at run time), `tcp` (with ofi_rxm) and `shm`: it uses only the
// provider-neutral API and the capabilities fi_getinfo reports.
//
// → A write: PostWrite checks bounds and queues the batch; pieces of at most
//   `max_op_bytes` go out as fi_writemsg with FI_DELIVERY_COMPLETE (the
//   completion means the bytes are visible at the target), consecutive pieces
//   of the batch gathered into one fi_writemsg of several iovs and rma_iovs (up
//   to the provider's tx iov_limit / rma_iov_limit, `max_iovs_per_op`, and
//   max_op_bytes in all; rma_groups.h), each operation on the next rail; the batch is
//   complete when every piece's completion was read from the rails' CQs by the progress
//   thread. Notify waits for the earlier batches to the peer and sends a message
//   (fi_sendmsg, rail 0) into receive buffers every agent keeps posted; the target's CQ
//   hands it to the notification callback or the PollNotifications queue. Connect reads
//   the peer's agent id over every rail (fi_readmsg of 8 bytes it publishes): an
//   unreachable peer, or an address another agent holds now, fails there.
//
// Memory registration honours the MR modes the provider demands (queried from
// fi_getinfo, with FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
// FI_MR_PROV_KEY offered, which is what EFA requires): local descriptors passed
// with every operation (FI_MR_LOCAL: the notification buffers are registered
// too), remote addresses as virtual addresses or offsets (FI_MR_VIRT_ADDR),
// keys chosen by the provider and published in the descriptor (FI_MR_PROV_KEY)
// or the region id otherwise. FI_HMEM is requested with `want_hmem` where the
// provider reports it (`hmem_supported()`); CUDA memory (MemoryKind::Cuda) is
// then registered with fi_mr_regattr, iface FI_HMEM_CUDA and the device ordinal.
// Without FI_HMEM, registering CUDA memory fails FAILED_PRECONDITION (at the
// worker's start, where its cache is registered).
//
// Failure: an error completion (the tcp provider: connection refused or reset)
// fails the peer (UNAVAILABLE) at once; a peer with operations outstanding and
// no completion for `progress_timeout` (shm: a dead process completes nothing)
// fails the same way. A failed or busy peer is closed by removing its addresses
// from the address vectors and abandoning its outstanding operations (their
// late completions are ignored).
//
// Threading: every libfabric call is made under the agent lock (the domain is
// opened FI_THREAD_DOMAIN). The progress thread reads the CQs in a busy loop
// while anything is in flight and otherwise sleeps on the CQs' wait fds
// (fi_trywait + epoll) where the provider has them, else in short naps
// (`idle_poll_interval`), so
// target-side progress (tcp RMA is carried out by the target's provider) goes on.
#ifndef TANDEM_KVTRANSFER_LIBFABRIC_AGENT_H_
#define TANDEM_KVTRANSFER_LIBFABRIC_AGENT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvtransfer/agent_core.h"

namespace tandem::kvtransfer {

class LibfabricBackend;

struct LibfabricAgentConfig {
  // Provider name for fi_getinfo: "efa", "tcp" (= "tcp;ofi_rxm" for RDM),
  // "shm", ... Empty: $FI_PROVIDER if set, else "tcp".
  std::string provider;
  // fi_getinfo domain names to use, comma-separated, in rail order
  // ("rdmap16s27-rdm,rdmap32s27-rdm" for two EFA devices; "eth0", "eth0,lo" for
  // tcp). Empty: chosen by topology (fabric_topology.h): the NICs nearest each
  // GPU of `gpu_pci_bus_ids`, else those on the process's NUMA node.
  std::string domain;
  // Endpoints ("rails") a batch's pieces are striped over, each on its own NIC
  // (fabric, domain, endpoint, CQ, AV) where fi_getinfo lists enough distinct
  // NICs: the `rails` nearest ones; with fewer NICs, several endpoints per NIC
  // (round-robin). With `gpu_pci_bus_ids`, per GPU. 0: every NIC tied for the
  // nearest place (at least one endpoint). A peer's rail is paired with ours
  // by fabric name (tcp: the subnet), else rail r with its rail r % its rails.
  int rails = 1;
  // The PCI bus ids of the GPUs whose memory this agent registers, by CUDA
  // ordinal ("0000:3b:00.0"; cudaDeviceGetPCIBusId's spelling is accepted). A
  // region of MemoryKind::Cuda(n) is then carried by the rails nearest GPU n;
  // host memory by every rail. Empty: those of the CUDA driver when it is
  // loaded in this process and `gpus_from_cuda` (cuDeviceGetPCIBusId per
  // ordinal; a GPU sysfs does not show is skipped), else rails by the
  // process's NUMA node.
  std::vector<std::string> gpu_pci_bus_ids;
  bool gpus_from_cuda = true;
  // Where sysfs is (tests point it at a fake tree).
  std::string sysfs_root = "/sys";
  // Largest fi_writemsg / fi_readmsg; longer segments are posted in pieces.
  uint64_t max_op_bytes = 8 << 20;
  // Local iovs and remote rma_iovs one operation may carry (consecutive pieces
  // of a batch gathered into one fi_writemsg / fi_readmsg), at most the
  // provider's tx_attr iov_limit / rma_iov_limit. 0: those limits; 1: one
  // operation per piece.
  int max_iovs_per_op = 0;
  // Pieces of one batch outstanding at a time (all rails together).
  int max_inflight_ops = 64;
  // A batch of at most this many bytes is posted by PostWrite/PostRead itself.
  uint64_t inline_post_bytes = 256 << 10;
  // Connect() delivers a probe message to the peer within this time or fails
  // UNAVAILABLE.
  absl::Duration connect_timeout = absl::Seconds(10);
  // A peer with operations outstanding and no completion from it for this long
  // is failed (UNAVAILABLE).
  absl::Duration progress_timeout = absl::Seconds(10);
  // How long an idle progress thread naps where the provider's CQs have no wait
  // fd (Debian's shm): the target-side work of incoming RMA waits up to this.
  absl::Duration idle_poll_interval = absl::Microseconds(100);
  // Ask for FI_HMEM (device memory registration) and use it when the provider
  // reports it. Off by default: with Debian's shm provider on a host without a
  // GPU runtime fi_getinfo lists FI_HMEM that fi_domain then refuses (Create
  // fails, saying so).
  bool want_hmem = false;
  // Ask for FI_HMEM also when the CUDA driver (libcuda.so.1) is already loaded
  // in this process: a worker on a CUDA backend creates its agent after loading
  // the model, and then registers its device-resident cache (MemoryKind::Cuda),
  // which needs FI_HMEM (EFA: GPUDirect RDMA).
  bool hmem_if_cuda_loaded = true;
};

class LibfabricAgent final : public AgentCore {
 public:
  static absl::StatusOr<std::unique_ptr<LibfabricAgent>> Create(
      const LibfabricAgentConfig& config);
  ~LibfabricAgent() override = default;

  // What fi_getinfo gave (for logs and metric labels): the provider
  // ("tcp;ofi_rxm", "shm", "efa"), the fabrics and domains opened (the NICs:
  // "rdmap16s27-rdm" on EFA, "eth0" or "lo" for tcp; comma-separated when there
  // are several), and the endpoints opened.
  const std::string& provider() const { return provider_; }
  const std::string& fabric_name() const { return fabric_name_; }
  const std::string& domain_name() const { return domain_name_; }
  int rails() const { return rails_; }
  // One line per NIC opened, nearest first: its domain, PCI address, NUMA node
  // and why it was chosen (NicPlacement::Describe), for the start-up log.
  const std::vector<std::string>& nics() const { return nics_; }
  // For each rail, the index in nics() of the NIC it is on.
  const std::vector<int>& rail_nics() const { return rail_nics_; }
  // Local iovs / remote rma_iovs one operation carries at most (provider limits
  // and max_iovs_per_op).
  size_t iov_limit() const { return iov_limit_; }
  size_t rma_iov_limit() const { return rma_iov_limit_; }
  bool hmem_supported() const { return hmem_; }
  // The MR mode bits the provider demands, as fi_tostr prints them.
  const std::string& mr_mode() const { return mr_mode_; }
  // Memory registrations held by libfabric now (regions + internal buffers).
  size_t NumLibfabricRegistrationsForTesting() const;
  // Pieces posted on each rail since the agent started.
  std::vector<uint64_t> PiecesPerRailForTesting() const;
  // fi_writemsg / fi_readmsg of data posted since the agent started (each
  // carries one or more pieces).
  uint64_t RmaOpsPostedForTesting() const;

 private:
  explicit LibfabricAgent(std::unique_ptr<LibfabricBackend> backend);

  const LibfabricBackend* const backend_;  // not owned: the AgentCore's
  const std::string provider_;
  const std::string fabric_name_;
  const std::string domain_name_;
  const int rails_;
  const std::vector<std::string> nics_;
  const std::vector<int> rail_nics_;
  const size_t iov_limit_;
  const size_t rma_iov_limit_;
  const bool hmem_;
  const std::string mr_mode_;
};

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_LIBFABRIC_AGENT_H_
