// Which NICs (libfabric domains) a LibfabricAgent's rails use: the ones nearest
// a GPU in the PCI tree, or on the process's NUMA node, read from sysfs.
//
// A p6-b300 (or p5) node has many EFA devices, each under a PCI switch shared
// with some of the GPUs; a GPU's KV written through a NIC under another switch,
// or on the other socket, crosses the root complex or the inter-socket link.
// fi_getinfo lists one fi_info per EFA device (domain "rdmapXsY-rdm", with its
// PCI address in the nic's bus attributes where the provider fills them in);
// tcp lists one per interface ("eth0", "lo"). SelectNics ranks those domains:
//
//   with a GPU's PCI bus id:  same PCI root complex first, by the hops between
//                             the two through their deepest common ancestor
//                             (2: the same switch); then another root complex
//                             on the GPU's NUMA node; then the rest
//   without one:              the process's NUMA node first, then NICs whose
//                             node is unknown, then the other nodes
//
// NICs with no PCI device (loopback, shm) are used only when no NIC has one.
// Ties keep fi_getinfo's order. Pure but for reading the sysfs tree at
// `sysfs_root` (tests build fake trees in a temporary directory).
#ifndef TANDEM_KVTRANSFER_FABRIC_TOPOLOGY_H_
#define TANDEM_KVTRANSFER_FABRIC_TOPOLOGY_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::kvtransfer {

// One distinct domain from fi_getinfo's list.
struct NicCandidate {
  std::string domain;       // fi_info's domain name: "rdmap16s27-rdm", "eth0", "shm"
  std::string pci_address;  // from fi_info's nic bus attributes, "0000:10:1b.0"; or ""
};

// Lower is nearer.
enum class NicDistance {
  kSameRootComplex = 0,  // GPU given: under one PCI root; `pci_hops` apart
  kSameNumaNode = 1,     // GPU: another root on its node; no GPU: the process's node
  kUnknownNumaNode = 2,  // no GPU, and the NIC's or the process's node is unknown
  kOther = 3,            // another NUMA node (or the GPU's node unknown)
  kNoDevice = 4,         // no PCI device (loopback, shm)
};
absl::string_view NicDistanceName(NicDistance d);

struct NicPlacement {
  int candidate = -1;  // index into TopologyInput::candidates
  std::string domain;
  std::string pci_address;  // resolved from sysfs; "" when it has no PCI device
  int numa_node = -1;       // sysfs numa_node (-1: unknown)
  int pci_hops = -1;        // GPU given and under one root complex; else -1
  NicDistance distance = NicDistance::kNoDevice;
  // "eth0 pci=0000:00:03.0 numa=0 same_numa_node" (for the start-up log).
  std::string Describe() const;
};

struct TopologyInput {
  std::string sysfs_root = "/sys";
  std::vector<NicCandidate> candidates;
  // The GPU whose KV the rails carry: "0000:3b:00.0" (cudaDeviceGetPCIBusId's
  // "0000:3B:00.0" and nvidia-smi's "00000000:3B:00.0" are accepted). Empty:
  // by NUMA node.
  std::string gpu_pci_bus_id;
  int process_numa_node = -1;  // ProcessNumaNode(); -1: unknown
  // NICs wanted: the nearest `nics` (all of them when there are fewer); 0: every
  // NIC tied for the nearest place.
  int nics = 1;
};

// The chosen NICs, nearest first; INVALID_ARGUMENT for no candidates, a
// negative count, or a GPU bus id that is malformed or not in sysfs.
absl::StatusOr<std::vector<NicPlacement>> SelectNics(const TopologyInput& in);

// "0000:3b:00.0" from any PCI bus id spelling (domain of 4 or 8 hex digits or
// none, any case); "" if it is not one.
std::string NormalizePciBusId(absl::string_view id);

// The NUMA node holding every CPU in `cpus` (sysfs_root/devices/system/node/
// node*/cpulist), or -1 when they span several nodes or sysfs says nothing.
int ProcessNumaNode(const std::string& sysfs_root, const std::vector<int>& cpus);
// This process's allowed CPUs (sched_getaffinity).
std::vector<int> AllowedCpus();

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_FABRIC_TOPOLOGY_H_
