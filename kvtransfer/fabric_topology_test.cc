// SelectNics over fake sysfs trees built in a temporary directory: the PCI
// tree of a node with GPUs and EFA devices under PCI switches, NICs found by
// fi_info's bus attributes, by /sys/class/infiniband (EFA's "-rdm" domains) and
// by /sys/class/net (virtio), NUMA nodes, loopback and shm without a device.
#include "kvtransfer/fabric_topology.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace tandem::kvtransfer {
namespace {

class FakeSysfs {
 public:
  FakeSysfs() {
    const char* tmp = std::getenv("TEST_TMPDIR");
    std::string tmpl = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/sysfsXXXXXX");
    root_ = mkdtemp(tmpl.data());
  }
  ~FakeSysfs() {
    const std::string cmd = absl::StrCat("rm -rf '", root_, "'");
    [[maybe_unused]] int rc = std::system(cmd.c_str());
  }
  const std::string& root() const { return root_; }

  // A PCI device at `path` under devices/ ("pci0000:00/0000:00:01.0/..."), its
  // bus/pci/devices link and numa_node (also written on its parents, as sysfs
  // shows it on bridges).
  void Device(const std::string& path, int numa) {
    std::string dir = absl::StrCat(root_, "/devices");
    for (absl::string_view part : absl::StrSplit(path, '/')) {
      absl::StrAppend(&dir, "/", part);
      MkDirs(dir);
      if (part.substr(0, 3) != "pci") Write(dir + "/numa_node", absl::StrCat(numa));
    }
    const std::string name = path.substr(path.rfind('/') + 1);
    MkDirs(root_ + "/bus/pci/devices");
    Link(dir, absl::StrCat(root_, "/bus/pci/devices/", name));
  }
  // /sys/class/<cls>/<name>/device -> devices/<path>.
  void ClassLink(const std::string& cls, const std::string& name,
                 const std::string& path) {
    const std::string dir = absl::StrCat(root_, "/class/", cls, "/", name);
    MkDirs(dir);
    MkDirs(absl::StrCat(root_, "/devices/", path));
    Link(absl::StrCat(root_, "/devices/", path), dir + "/device");
  }
  void NumaNode(int node, const std::string& cpulist) {
    const std::string dir = absl::StrCat(root_, "/devices/system/node/node", node);
    MkDirs(dir);
    Write(dir + "/cpulist", cpulist + "\n");
  }

 private:
  static void MkDirs(const std::string& dir) {
    std::string at;
    for (absl::string_view part : absl::StrSplit(dir, '/', absl::SkipEmpty())) {
      absl::StrAppend(&at, "/", part);
      mkdir(at.c_str(), 0755);
    }
  }
  static void Write(const std::string& file, const std::string& text) {
    std::ofstream(file) << text;
  }
  static void Link(const std::string& target, const std::string& link) {
    ASSERT_EQ(symlink(target.c_str(), link.c_str()), 0) << link;
  }
  std::string root_;
};

// Two sockets. Socket 0 (node 0), root complex pci0000:00, root port 00:01.0
// with two PCIe switches (01:00.0 -> downstream 02:00.0 and 02:01.0):
//   switch A (02:00.0): GPU0 03:00.0, EFA rdmap4s0 04:00.0, EFA rdmap5s0 05:00.0
//   switch B (02:01.0): GPU1 06:00.0, EFA rdmap7s0 07:00.0
// Root complex pci0000:40, also node 0: EFA rdmap65s0 41:00.0.
// Socket 1 (node 1), pci0000:80: GPU2 81:00.0, EFA rdmap130s0 82:00.0.
class SelectNicsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string sw = "pci0000:00/0000:00:01.0/0000:01:00.0";
    fs_.Device(sw + "/0000:02:00.0/0000:03:00.0", 0);  // GPU0
    fs_.Device(sw + "/0000:02:00.0/0000:04:00.0", 0);
    fs_.Device(sw + "/0000:02:00.0/0000:05:00.0", 0);
    fs_.Device(sw + "/0000:02:01.0/0000:06:00.0", 0);  // GPU1
    fs_.Device(sw + "/0000:02:01.0/0000:07:00.0", 0);
    fs_.Device("pci0000:40/0000:40:01.0/0000:41:00.0", 0);
    fs_.Device("pci0000:80/0000:80:01.0/0000:81:00.0", 1);  // GPU2
    fs_.Device("pci0000:80/0000:80:01.0/0000:82:00.0", 1);
    // The EFA devices as fi_getinfo lists them (order as given), three with
    // their PCI address in the nic attributes, two found through
    // /sys/class/infiniband only.
    candidates_ = {{"rdmap130s0-rdm", "0000:82:00.0"},
                   {"rdmap65s0-rdm", ""},
                   {"rdmap7s0-rdm", "0000:07:00.0"},
                   {"rdmap5s0-rdm", "0000:05:00.0"},
                   {"rdmap4s0-rdm", ""}};
    fs_.ClassLink("infiniband", "rdmap65s0", "pci0000:40/0000:40:01.0/0000:41:00.0");
    fs_.ClassLink("infiniband", "rdmap4s0", sw + "/0000:02:00.0/0000:04:00.0");
  }

  std::vector<std::string> Select(const std::string& gpu, int nics, int numa = -1) {
    TopologyInput in;
    in.sysfs_root = fs_.root();
    in.candidates = candidates_;
    in.gpu_pci_bus_id = gpu;
    in.nics = nics;
    in.process_numa_node = numa;
    auto sel = SelectNics(in);
    EXPECT_TRUE(sel.ok()) << sel.status();
    std::vector<std::string> out;
    if (sel.ok()) {
      for (const NicPlacement& p : *sel) out.push_back(p.Describe());
    }
    return out;
  }

  FakeSysfs fs_;
  std::vector<NicCandidate> candidates_;
};

TEST_F(SelectNicsTest, NearestToAGpuByPciSwitchThenRootThenNumaNode) {
  struct Case {
    std::string gpu;
    int nics;
    std::vector<std::string> want;
  } cases[] = {
      // GPU0: its switch's two NICs (2 hops; fi_getinfo's order between them),
      // then switch B's (4 hops: up to 01:00.0 and down), then the other root
      // complex on node 0, then node 1.
      {"0000:03:00.0",
       1,
       {"rdmap5s0-rdm pci=0000:05:00.0 numa=0 pci_hops=2 same_pci_root"}},
      {"0000:03:00.0",
       0,
       {"rdmap5s0-rdm pci=0000:05:00.0 numa=0 pci_hops=2 same_pci_root",
        "rdmap4s0-rdm pci=0000:04:00.0 numa=0 pci_hops=2 same_pci_root"}},
      {"0000:03:00.0",
       5,
       {"rdmap5s0-rdm pci=0000:05:00.0 numa=0 pci_hops=2 same_pci_root",
        "rdmap4s0-rdm pci=0000:04:00.0 numa=0 pci_hops=2 same_pci_root",
        "rdmap7s0-rdm pci=0000:07:00.0 numa=0 pci_hops=4 same_pci_root",
        "rdmap65s0-rdm pci=0000:41:00.0 numa=0 same_numa_node",
        "rdmap130s0-rdm pci=0000:82:00.0 numa=1 other_numa_node"}},
      // GPU1: the one NIC under switch B, then switch A's.
      {"0000:06:00.0",
       0,
       {"rdmap7s0-rdm pci=0000:07:00.0 numa=0 pci_hops=2 same_pci_root"}},
      {"0000:06:00.0",
       3,
       {"rdmap7s0-rdm pci=0000:07:00.0 numa=0 pci_hops=2 same_pci_root",
        "rdmap5s0-rdm pci=0000:05:00.0 numa=0 pci_hops=4 same_pci_root",
        "rdmap4s0-rdm pci=0000:04:00.0 numa=0 pci_hops=4 same_pci_root"}},
      // GPU2 on socket 1 (cudaDeviceGetPCIBusId's spelling); more NICs wanted
      // than there are: all of them.
      {"0000:81:00.0",
       1,
       {"rdmap130s0-rdm pci=0000:82:00.0 numa=1 pci_hops=2 same_pci_root"}},
      {"00000000:81:00.0", 9, {}},
  };
  for (const Case& c : cases) {
    const std::vector<std::string> got = Select(c.gpu, c.nics);
    if (c.want.empty()) {
      EXPECT_EQ(got.size(), 5u) << c.gpu;
      EXPECT_EQ(got.front(),
                "rdmap130s0-rdm pci=0000:82:00.0 numa=1 pci_hops=2 same_pci_root");
      EXPECT_EQ(got.back(), "rdmap4s0-rdm pci=0000:04:00.0 numa=0 other_numa_node");
      continue;
    }
    EXPECT_EQ(got, c.want) << c.gpu << " nics=" << c.nics;
  }
}

TEST_F(SelectNicsTest, WithoutAGpuByTheProcessNumaNode) {
  // Node 1: its one NIC first, then node 0's in fi_getinfo order.
  EXPECT_EQ(Select("", 1, 1),
            std::vector<std::string>{
                "rdmap130s0-rdm pci=0000:82:00.0 numa=1 same_numa_node"});
  EXPECT_EQ(Select("", 0, 0),
            (std::vector<std::string>{
                "rdmap65s0-rdm pci=0000:41:00.0 numa=0 same_numa_node",
                "rdmap7s0-rdm pci=0000:07:00.0 numa=0 same_numa_node",
                "rdmap5s0-rdm pci=0000:05:00.0 numa=0 same_numa_node",
                "rdmap4s0-rdm pci=0000:04:00.0 numa=0 same_numa_node"}));
  const std::vector<std::string> two = Select("", 2, 0);
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[1], "rdmap7s0-rdm pci=0000:07:00.0 numa=0 same_numa_node");
  // The process spans both nodes (unknown): fi_getinfo's order.
  const std::vector<std::string> any = Select("", 2, -1);
  ASSERT_EQ(any.size(), 2u);
  EXPECT_EQ(any[0], "rdmap130s0-rdm pci=0000:82:00.0 numa=1 numa_unknown");
  EXPECT_EQ(any[1], "rdmap65s0-rdm pci=0000:41:00.0 numa=0 numa_unknown");
}

TEST(SelectNics, LoopbackIsUsedOnlyWhenNoNicHasADevice) {
  FakeSysfs fs;
  // tcp on this kind of VM: eth0 is a virtio device on PCI 00:03.0, lo is none.
  fs.Device("pci0000:00/0000:00:03.0", -1);
  fs.ClassLink("net", "eth0", "pci0000:00/0000:00:03.0/virtio2");
  TopologyInput in;
  in.sysfs_root = fs.root();
  in.candidates = {{"lo", ""}, {"eth0", ""}};
  in.nics = 0;
  auto sel = SelectNics(in);
  ASSERT_TRUE(sel.ok()) << sel.status();
  ASSERT_EQ(sel->size(), 1u);
  EXPECT_EQ((*sel)[0].Describe(), "eth0 pci=0000:00:03.0 numa=-1 numa_unknown");
  EXPECT_EQ((*sel)[0].candidate, 1);
  // Two rails wanted, one NIC with a device: just it (the agent puts both
  // endpoints on it).
  in.nics = 2;
  sel = SelectNics(in);
  ASSERT_TRUE(sel.ok());
  EXPECT_EQ(sel->size(), 1u);
  // shm (or a host with only lo): no device anywhere, all kept in order.
  in.candidates = {{"shm", ""}, {"lo", ""}};
  sel = SelectNics(in);
  ASSERT_TRUE(sel.ok());
  ASSERT_EQ(sel->size(), 2u);
  EXPECT_EQ((*sel)[0].Describe(), "shm numa=-1 no_pci_device");
  EXPECT_EQ((*sel)[1].domain, "lo");
  in.nics = 0;  // tied: both
  sel = SelectNics(in);
  ASSERT_TRUE(sel.ok());
  EXPECT_EQ(sel->size(), 2u);
  // A GPU on a host whose NICs have no device: still chosen, nothing nearer.
  fs.Device("pci0000:00/0000:00:04.0", -1);
  in.gpu_pci_bus_id = "0000:00:04.0";
  in.nics = 1;
  sel = SelectNics(in);
  ASSERT_TRUE(sel.ok());
  EXPECT_EQ((*sel)[0].domain, "shm");
}

TEST(SelectNics, BadInputIsRefused) {
  FakeSysfs fs;
  TopologyInput in;
  in.sysfs_root = fs.root();
  EXPECT_TRUE(absl::IsInvalidArgument(SelectNics(in).status()));  // no candidates
  in.candidates = {{"eth0", ""}};
  in.nics = -1;
  EXPECT_TRUE(absl::IsInvalidArgument(SelectNics(in).status()));
  in.nics = 1;
  in.gpu_pci_bus_id = "gpu0";
  auto st = SelectNics(in).status();
  EXPECT_TRUE(absl::IsInvalidArgument(st));
  EXPECT_NE(st.message().find("not one"), std::string::npos) << st;
  in.gpu_pci_bus_id = "0000:3b:00.0";  // well formed, not on this "host"
  st = SelectNics(in).status();
  EXPECT_TRUE(absl::IsInvalidArgument(st));
  EXPECT_NE(st.message().find("not in"), std::string::npos) << st;
}

TEST(NormalizePciBusId, Spellings) {
  const std::pair<std::string, std::string> cases[] = {
      {"0000:3b:00.0", "0000:3b:00.0"},
      {"0000:3B:00.0", "0000:3b:00.0"},
      {"00000000:3B:00.0", "0000:3b:00.0"},
      {"3b:00.0", "0000:3b:00.0"},
      {" 0001:82:1f.7\n", "0001:82:1f.7"},
      {"0000:3b:00", ""},
      {"0000:3g:00.0", ""},
      {"12345678:3b:00.0", ""},
      {"", ""},
      {"0000:3b:00.0.1", ""},
  };
  for (const auto& [in, want] : cases) EXPECT_EQ(NormalizePciBusId(in), want) << in;
}

TEST(ProcessNumaNode, TheNodeHoldingEveryCpu) {
  FakeSysfs fs;
  fs.NumaNode(0, "0-3,8-11");
  fs.NumaNode(1, "4-7,12-15");
  EXPECT_EQ(ProcessNumaNode(fs.root(), {0, 1, 9}), 0);
  EXPECT_EQ(ProcessNumaNode(fs.root(), {4, 13}), 1);
  EXPECT_EQ(ProcessNumaNode(fs.root(), {3, 4}), -1);  // both nodes
  EXPECT_EQ(ProcessNumaNode(fs.root(), {}), -1);      // none
  EXPECT_EQ(ProcessNumaNode(fs.root(), {99}), -1);    // not in sysfs
  EXPECT_EQ(ProcessNumaNode(fs.root() + "/none", {0}), -1);
  EXPECT_FALSE(AllowedCpus().empty());
}

}  // namespace
}  // namespace tandem::kvtransfer
