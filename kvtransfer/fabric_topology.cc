#include "kvtransfer/fabric_topology.h"

#include <dirent.h>
#include <sched.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <fstream>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace tandem::kvtransfer {
namespace {

bool IsHex(absl::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!absl::ascii_isxdigit(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

// "DDDD:BB:DD.F" exactly (what sysfs names PCI devices).
bool IsSysfsPciName(absl::string_view s) {
  return s.size() == 12 && s[4] == ':' && s[7] == ':' && s[10] == '.' &&
         IsHex(s.substr(0, 4)) && IsHex(s.substr(5, 2)) && IsHex(s.substr(8, 2)) &&
         IsHex(s.substr(11, 1));
}

std::string RealPath(const std::string& path) {
  char buf[PATH_MAX];
  if (realpath(path.c_str(), buf) == nullptr) return "";
  return buf;
}

// The PCI device at or above `path` (a sysfs device directory, resolved): its
// resolved path, or "" when no component from the end back is a PCI address.
std::string PciDeviceAtOrAbove(std::string path) {
  while (!path.empty() && path != "/") {
    const size_t slash = path.rfind('/');
    if (slash == std::string::npos) return "";
    if (IsSysfsPciName(absl::string_view(path).substr(slash + 1))) return path;
    path = path.substr(0, slash);
  }
  return "";
}

int ReadNumaNode(const std::string& device) {
  std::ifstream f(device + "/numa_node");
  int node = -1;
  if (!(f >> node)) return -1;
  return node < 0 ? -1 : node;
}

// Path components from the PCI root ("pci0000:00") down to the device.
std::vector<std::string> PciChain(const std::string& device) {
  std::vector<std::string> chain;
  bool in_tree = false;
  for (absl::string_view part : absl::StrSplit(device, '/', absl::SkipEmpty())) {
    if (!in_tree && absl::StartsWith(part, "pci") && part.size() > 3 &&
        part.find(':') != absl::string_view::npos) {
      in_tree = true;
    }
    if (in_tree) chain.emplace_back(part);
  }
  return chain;
}

// The NIC's PCI device: from fi_info's bus attributes, else the RDMA device
// (EFA's domain "rdmap16s27-rdm" is device "rdmap16s27"), else the network
// interface of that name.
std::string NicDevice(const std::string& root, const NicCandidate& c) {
  if (!c.pci_address.empty()) {
    const std::string id = NormalizePciBusId(c.pci_address);
    if (!id.empty()) {
      const std::string p = RealPath(absl::StrCat(root, "/bus/pci/devices/", id));
      if (!p.empty()) return PciDeviceAtOrAbove(p);
    }
  }
  std::string base = c.domain;
  for (absl::string_view suffix : {"-rdm", "-dgrm", "-xrc", "-msg"}) {
    if (absl::EndsWith(base, suffix)) {
      base.resize(base.size() - suffix.size());
      break;
    }
  }
  for (const std::string& link :
       {absl::StrCat(root, "/class/infiniband/", base, "/device"),
        absl::StrCat(root, "/class/net/", c.domain, "/device")}) {
    const std::string p = RealPath(link);
    if (!p.empty()) return PciDeviceAtOrAbove(p);
  }
  return "";
}

struct Ranked {
  NicPlacement placement;
  int order;  // fi_getinfo's
};

bool Nearer(const Ranked& a, const Ranked& b) {
  if (a.placement.distance != b.placement.distance) {
    return a.placement.distance < b.placement.distance;
  }
  if (a.placement.pci_hops != b.placement.pci_hops) {
    return a.placement.pci_hops < b.placement.pci_hops;
  }
  return a.order < b.order;
}

bool SamePlace(const NicPlacement& a, const NicPlacement& b) {
  return a.distance == b.distance && a.pci_hops == b.pci_hops;
}

}  // namespace

absl::string_view NicDistanceName(NicDistance d) {
  switch (d) {
    case NicDistance::kSameRootComplex:
      return "same_pci_root";
    case NicDistance::kSameNumaNode:
      return "same_numa_node";
    case NicDistance::kUnknownNumaNode:
      return "numa_unknown";
    case NicDistance::kOther:
      return "other_numa_node";
    case NicDistance::kNoDevice:
      return "no_pci_device";
  }
  return "?";
}

std::string NicPlacement::Describe() const {
  std::string s = domain;
  if (!pci_address.empty()) absl::StrAppend(&s, " pci=", pci_address);
  absl::StrAppend(&s, " numa=", numa_node);
  if (pci_hops >= 0) absl::StrAppend(&s, " pci_hops=", pci_hops);
  absl::StrAppend(&s, " ", NicDistanceName(distance));
  return s;
}

std::string NormalizePciBusId(absl::string_view id) {
  const std::string lower = absl::AsciiStrToLower(absl::StripAsciiWhitespace(id));
  const std::vector<absl::string_view> parts = absl::StrSplit(lower, ':');
  absl::string_view domain = "0000", bus, rest;
  if (parts.size() == 3) {
    domain = parts[0];
    bus = parts[1];
    rest = parts[2];
  } else if (parts.size() == 2) {
    bus = parts[0];
    rest = parts[1];
  } else {
    return "";
  }
  // An 8-digit domain (nvidia-smi) has only zeros above the 16 bits sysfs shows.
  if (domain.size() == 8 && absl::StartsWith(domain, "0000")) domain.remove_prefix(4);
  const std::vector<absl::string_view> df = absl::StrSplit(rest, '.');
  if (domain.size() != 4 || bus.size() != 2 || df.size() != 2 || df[0].size() != 2 ||
      df[1].size() != 1) {
    return "";
  }
  const std::string out = absl::StrCat(domain, ":", bus, ":", df[0], ".", df[1]);
  return IsSysfsPciName(out) ? out : "";
}

absl::StatusOr<std::vector<NicPlacement>> SelectNics(const TopologyInput& in) {
  if (in.candidates.empty()) {
    return absl::InvalidArgumentError("no NIC (libfabric domain) to choose from");
  }
  if (in.nics < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("NICs wanted must be >= 0 (0: all the nearest), got ", in.nics));
  }
  std::vector<std::string> gpu_chain;
  int gpu_numa = -1;
  if (!in.gpu_pci_bus_id.empty()) {
    const std::string id = NormalizePciBusId(in.gpu_pci_bus_id);
    if (id.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("GPU PCI bus id \"", in.gpu_pci_bus_id,
                       "\" is not one (expected e.g. 0000:3b:00.0)"));
    }
    const std::string dev = PciDeviceAtOrAbove(
        RealPath(absl::StrCat(in.sysfs_root, "/bus/pci/devices/", id)));
    if (dev.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "GPU PCI bus id ", id, " is not in ", in.sysfs_root, "/bus/pci/devices"));
    }
    gpu_chain = PciChain(dev);
    gpu_numa = ReadNumaNode(dev);
  }
  std::vector<Ranked> ranked;
  bool any_device = false;
  for (size_t i = 0; i < in.candidates.size(); ++i) {
    Ranked r;
    r.order = static_cast<int>(i);
    NicPlacement& p = r.placement;
    p.candidate = static_cast<int>(i);
    p.domain = in.candidates[i].domain;
    const std::string dev = NicDevice(in.sysfs_root, in.candidates[i]);
    if (dev.empty()) {
      p.distance = NicDistance::kNoDevice;
    } else {
      any_device = true;
      p.pci_address = dev.substr(dev.rfind('/') + 1);
      p.numa_node = ReadNumaNode(dev);
      if (!gpu_chain.empty()) {
        const std::vector<std::string> chain = PciChain(dev);
        size_t common = 0;
        while (common < chain.size() && common < gpu_chain.size() &&
               chain[common] == gpu_chain[common]) {
          ++common;
        }
        if (common > 0) {  // the same root ("pci0000:00") at least
          p.distance = NicDistance::kSameRootComplex;
          p.pci_hops =
              static_cast<int>((chain.size() - common) + (gpu_chain.size() - common));
        } else if (gpu_numa >= 0 && p.numa_node == gpu_numa) {
          p.distance = NicDistance::kSameNumaNode;
        } else {
          p.distance = NicDistance::kOther;
        }
      } else if (in.process_numa_node < 0 || p.numa_node < 0) {
        p.distance = NicDistance::kUnknownNumaNode;
      } else {
        p.distance = p.numa_node == in.process_numa_node ? NicDistance::kSameNumaNode
                                                         : NicDistance::kOther;
      }
    }
    ranked.push_back(std::move(r));
  }
  if (any_device) {
    ranked.erase(std::remove_if(ranked.begin(), ranked.end(),
                                [](const Ranked& r) {
                                  return r.placement.distance == NicDistance::kNoDevice;
                                }),
                 ranked.end());
  }
  std::stable_sort(ranked.begin(), ranked.end(), Nearer);
  std::vector<NicPlacement> out;
  for (const Ranked& r : ranked) {
    if (in.nics > 0 && static_cast<int>(out.size()) >= in.nics) break;
    if (in.nics == 0 && !out.empty() && !SamePlace(out.front(), r.placement)) break;
    out.push_back(r.placement);
  }
  return out;
}

int ProcessNumaNode(const std::string& sysfs_root, const std::vector<int>& cpus) {
  const std::string dir = absl::StrCat(sysfs_root, "/devices/system/node");
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return -1;
  std::set<int> nodes;
  const std::set<int> wanted(cpus.begin(), cpus.end());
  while (dirent* e = readdir(d)) {
    absl::string_view name = e->d_name;
    int node = -1;
    if (!absl::ConsumePrefix(&name, "node") || !absl::SimpleAtoi(name, &node)) continue;
    std::ifstream f(absl::StrCat(dir, "/", e->d_name, "/cpulist"));
    std::string list;
    std::getline(f, list);
    for (absl::string_view range :
         absl::StrSplit(absl::StripAsciiWhitespace(list), ',', absl::SkipEmpty())) {
      const std::vector<absl::string_view> ends = absl::StrSplit(range, '-');
      int lo = 0, hi = 0;
      if (!absl::SimpleAtoi(ends[0], &lo)) continue;
      hi = lo;
      if (ends.size() == 2 && !absl::SimpleAtoi(ends[1], &hi)) continue;
      for (auto it = wanted.lower_bound(lo); it != wanted.end() && *it <= hi; ++it) {
        nodes.insert(node);
      }
    }
  }
  closedir(d);
  return nodes.size() == 1 ? *nodes.begin() : -1;
}

std::vector<int> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

}  // namespace tandem::kvtransfer
