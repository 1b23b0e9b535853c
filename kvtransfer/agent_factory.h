// The transfer agent a worker runs, chosen by configuration (--kv_transport):
// UCX (InfiniBand/RoCE, MI355X, shared memory or TCP on one host) or libfabric
// (EFA on AWS; tcp and shm providers anywhere). Never falls back from one to the
// other: a transport or provider that cannot be opened is an error, so a cluster
// configured for RDMA does not silently run over TCP.
#ifndef TANDEM_KVTRANSFER_AGENT_FACTORY_H_
#define TANDEM_KVTRANSFER_AGENT_FACTORY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvtransfer/libfabric_agent.h"
#include "kvtransfer/transfer_agent.h"
#include "kvtransfer/ucx_agent.h"

namespace tandem::kvtransfer {

enum class KvTransport { kUcx, kLibfabric };

struct AgentFactoryConfig {
  KvTransport transport = KvTransport::kUcx;
  UcxAgentConfig ucx;              // for kUcx
  LibfabricAgentConfig libfabric;  // for kLibfabric
};

// Parses a --kv_transport value into `config` (other fields untouched):
//   "ucx"                          UCX
//   "libfabric"                    libfabric, provider from $FI_PROVIDER (else tcp)
//   "libfabric:<provider>"         e.g. libfabric:efa, libfabric:shm
//   "libfabric:<provider>:<rails>" e.g. libfabric:efa:4 (endpoints to stripe over,
//                                  each on its own NIC where there are enough:
//                                  the nearest by PCI / NUMA topology)
//   "libfabric:<provider>:auto"    every NIC tied for the nearest place
// INVALID_ARGUMENT otherwise.
absl::Status ParseKvTransport(absl::string_view spec, AgentFactoryConfig* config);

// What carries the KV, as opened (not as asked for): the worker logs it at start
// and exports it as tandem_worker_kv_transport_info{agent, provider, rails}.
struct TransportInfo {
  std::string agent;     // "ucx" | "libfabric"
  std::string provider;  // libfabric: fi_info's provider ("tcp;ofi_rxm", "shm",
                         // "efa"); ucx: UCX_TLS as configured (--ucx_tls, else
                         // $UCX_TLS), or "auto" (the transports UCX picked per
                         // peer: Transport(peer))
  std::string fabric;    // libfabric: fi_info's fabric name
  std::string domain;    // libfabric: fi_info's domains (the NICs, "rdmap16s27-rdm";
                         // comma-separated when several); ucx: the context's
                         // resources ("tcp/eth0,tcp/lo,sysv/memory,...")
  int rails = 1;         // endpoints a batch is striped over
  // libfabric: one line per NIC opened, nearest first (domain, PCI address, NUMA
  // node, why: NicPlacement::Describe), for the start-up log.
  std::vector<std::string> nics;
};

struct CreatedAgent {
  std::unique_ptr<TransferAgent> agent;
  // "ucx" or "libfabric/<provider actually opened>[ x<rails> rails]": for the
  // start-up log and metric labels.
  std::string description;
  TransportInfo info;
};

// Refuses (FAILED_PRECONDITION) a UCX whose transport list `tls` (UCX_TLS)
// names an RDMA transport (rc, dc, ud, srd, ...) when none of the `resources`
// its context opened (UcxAgent::resources()) is one: UCX would carry on over
// what else the list allows (tcp) with only a warning.
absl::Status CheckUcxRdma(absl::string_view tls,
                          const std::vector<std::string>& resources);

absl::StatusOr<CreatedAgent> CreateTransferAgent(const AgentFactoryConfig& config);

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_AGENT_FACTORY_H_
