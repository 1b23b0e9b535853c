#include "kvtransfer/libfabric_agent.h"

#include <dlfcn.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kvtransfer/backend.h"
#include "kvtransfer/fabric_topology.h"
#include "kvtransfer/rma_groups.h"

namespace tandem::kvtransfer {
namespace {

// Version 2 of the address (a domain per NIC); version 1's "TKLF" is refused.
constexpr char kAddressMagic[4] = {'T', 'K', 'L', '2'};
constexpr char kAddressMagicV1[4] = {'T', 'K', 'L', 'F'};
constexpr char kMessageMagic[4] = {'T', 'K', 'L', 'N'};
constexpr uint8_t kNotifyMessage = 2;
// A message slot: header + request id + payload (kMaxNotificationBytes together).
constexpr size_t kSlotBytes = 8192;
constexpr int kRecvSlotsPerRail = 32;
constexpr int kSendSlots = 64;
constexpr int kMaxRails = 64;
constexpr int kMaxDomains = 64;
constexpr size_t kMaxRailAddressBytes = 4096;
constexpr int kCqBatch = 32;

void PutLe(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i)
    out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

bool GetLe(const uint8_t*& p, const uint8_t* end, int bytes, uint64_t* v) {
  if (end - p < bytes) return false;
  uint64_t r = 0;
  for (int i = 0; i < bytes; ++i) r |= static_cast<uint64_t>(p[i]) << (8 * i);
  p += bytes;
  *v = r;
  return true;
}

bool GetBytes(const uint8_t*& p, const uint8_t* end, size_t cap, std::string* out) {
  uint64_t n = 0;
  if (!GetLe(p, end, 4, &n) || n > cap || n > static_cast<uint64_t>(end - p)) {
    return false;
  }
  out->assign(reinterpret_cast<const char*>(p), n);
  p += n;
  return true;
}

absl::Status FromFi(int ret, absl::string_view what) {
  const int e = ret < 0 ? -ret : ret;
  const std::string msg = absl::StrCat(what, ": ", fi_strerror(e));
  switch (e) {
    case FI_EINVAL:
    case FI_EBADF:
      return absl::InvalidArgumentError(msg);
    case FI_ENOMEM:
    case FI_ENOSPC:
      return absl::ResourceExhaustedError(msg);
    case FI_ETIMEDOUT:
      return absl::DeadlineExceededError(msg);
    case FI_ECANCELED:
      return absl::CancelledError(msg);
    case FI_ENODATA:
    case FI_ENOSYS:
    case FI_EOPNOTSUPP:
      return absl::FailedPreconditionError(msg);
    default:
      // Refused, reset, unreachable, I/O errors.
      return absl::UnavailableError(msg);
  }
}

// Whether libcuda.so.1 is loaded in this process already (never loads it).
bool CudaDriverLoaded() {
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (h == nullptr) return false;
  dlclose(h);
  return true;
}

// The PCI bus ids of the CUDA devices by ordinal ("0000:3B:00.0"), from the
// CUDA driver when it is already loaded in this process (cuDeviceGetPCIBusId;
// never loads it); empty otherwise or on any error.
std::vector<std::string> CudaPciBusIds() {
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (h == nullptr) return {};
  using InitFn = int (*)(unsigned);
  using CountFn = int (*)(int*);
  using GetFn = int (*)(int*, int);
  using BusIdFn = int (*)(char*, int, int);
  auto init = reinterpret_cast<InitFn>(dlsym(h, "cuInit"));
  auto count = reinterpret_cast<CountFn>(dlsym(h, "cuDeviceGetCount"));
  auto get = reinterpret_cast<GetFn>(dlsym(h, "cuDeviceGet"));
  auto bus_id = reinterpret_cast<BusIdFn>(dlsym(h, "cuDeviceGetPCIBusId"));
  std::vector<std::string> out;
  int n = 0;
  if (init != nullptr && count != nullptr && get != nullptr && bus_id != nullptr &&
      init(0) == 0 && count(&n) == 0) {
    for (int i = 0; i < n; ++i) {
      int device = 0;
      char id[32] = {};
      if (get(&device, i) != 0 || bus_id(id, sizeof(id), device) != 0) {
        out.clear();
        break;
      }
      out.emplace_back(id);
    }
  }
  dlclose(h);
  return out;
}

std::string MrModeString(uint64_t mode) {
  std::string s;
  auto add = [&](uint64_t bit, const char* name) {
    if (mode & bit) absl::StrAppend(&s, s.empty() ? "" : "|", name);
  };
  add(FI_MR_LOCAL, "FI_MR_LOCAL");
  add(FI_MR_VIRT_ADDR, "FI_MR_VIRT_ADDR");
  add(FI_MR_ALLOCATED, "FI_MR_ALLOCATED");
  add(FI_MR_PROV_KEY, "FI_MR_PROV_KEY");
  add(FI_MR_HMEM, "FI_MR_HMEM");
  add(FI_MR_ENDPOINT, "FI_MR_ENDPOINT");
  add(FI_MR_RAW, "FI_MR_RAW");
  return s.empty() ? "none" : s;
}

}  // namespace

// The libfabric transport primitives. Every method but Sleep and Wake runs under
// the agent lock (backend.h), which serialises every libfabric call (the domain
// is FI_THREAD_DOMAIN); completions are read in ProgressLocked.
class LibfabricBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<LibfabricBackend>> Create(
      const LibfabricAgentConfig& config);
  ~LibfabricBackend() override;

  void Start(BackendHost* host, uint64_t agent_id) override {
    host_ = host;
    agent_id_ = agent_id;
    std::memcpy(identity_, &agent_id_, 8);  // what a connecting peer reads
  }
  void ShutdownLocked(absl::Time deadline) override;
  AgentKind Kind() const override { return AgentKind::kLibfabric; }
  absl::string_view Name() const override { return "libfabric"; }
  std::string Address() const override { return address_; }
  BackendLimits Limits() const override {
    BackendLimits l;
    l.max_piece_bytes = max_piece_bytes_;
    l.max_inflight_ops = max_inflight_ops_;
    l.inline_post_bytes = config_.inline_post_bytes;
    return l;
  }

  absl::StatusOr<std::string> RegisterMemoryLocked(RegionId region, void* base,
                                                   size_t len,
                                                   MemoryKind kind) override;
  absl::StatusOr<Allocated> AllocateMemoryLocked(RegionId region, size_t len) override;
  void DeregisterMemoryLocked(RegionId region) override;

  absl::Status ConnectLocked(PeerId peer, const AgentDescriptor& descriptor) override;
  void ClosePeerLocked(PeerId peer, bool graceful, bool wait,
                       absl::Time deadline) override;
  void ForgetPeerLocked(PeerId peer) override;
  std::string TransportLocked(PeerId peer) override;

  absl::StatusOr<PostResult> PostPieceLocked(PeerId peer, bool write,
                                             const Piece& piece, OpToken op) override;
  absl::StatusOr<PostResult> PostFenceLocked(PeerId peer, OpToken op) override;
  absl::Status SendNotificationLocked(PeerId peer, const Notification& n,
                                      absl::Time deadline,
                                      std::function<absl::Status()>* deliver) override;

  bool ProgressLocked() override;
  absl::Duration ArmLocked() override;
  void Sleep(absl::Duration timeout) override;
  void Wake() override;

  const std::string& provider() const { return provider_; }
  std::string fabric_name() const {
    std::vector<std::string> names;
    for (const Fabric& f : fabrics_) names.push_back(f.name);
    return absl::StrJoin(names, ",");
  }
  std::string domain_name() const {
    std::vector<std::string> names;
    for (const Domain& d : domains_) names.push_back(d.name);
    return absl::StrJoin(names, ",");
  }
  std::vector<std::string> Nics() const {
    std::vector<std::string> out;
    for (const Domain& d : domains_) out.push_back(d.placement.Describe());
    return out;
  }
  std::vector<int> RailNics() const {
    std::vector<int> out;
    for (const Rail& r : rails_) out.push_back(r.domain);
    return out;
  }
  size_t NumRails() const { return rails_.size(); }
  bool hmem() const { return hmem_; }
  std::string mr_mode() const { return MrModeString(mr_mode_); }
  size_t NumRegistrations() const { return num_mrs_.load(); }
  std::vector<uint64_t> PiecesPerRail() const {
    std::vector<uint64_t> out;
    for (const auto& n : pieces_per_rail_) out.push_back(n.load());
    return out;
  }
  uint64_t RmaOpsPosted() const { return rma_ops_.load(); }
  const RmaGroupLimits& group_limits() const { return group_limits_; }

 private:
  struct Fabric {
    std::string name;
    fid_fabric* fabric = nullptr;
  };
  // One NIC: its fi_info, domain, and the message buffers' registration there.
  struct Domain {
    fi_info* info = nullptr;
    int fabric = -1;  // index into fabrics_
    fid_domain* domain = nullptr;
    std::string name;
    NicPlacement placement;
    fid_mr* msg_mr = nullptr;
  };
  struct Rail {
    int domain = 0;  // index into domains_
    fid_ep* ep = nullptr;
    fid_cq* cq = nullptr;
    fid_av* av = nullptr;
    int wait_fd = -1;
    std::string name;
  };
  // An operation handed to libfabric. The fi_context2 comes first (the
  // FI_CONTEXT / FI_CONTEXT2 modes let the provider use it). Freed once the
  // provider is done with it (its completion, or the endpoint closed) and no
  // thread waits on it.
  struct Op {
    fi_context2 fi_ctx;
    enum Kind { kPiece, kProbe, kNotify, kRecv } kind = kPiece;
    OpToken token = nullptr;  // kPiece: the batch
    int pieces = 1;           // kPiece: the agent's pieces this operation carries
    PeerId peer = 0;
    int rail = 0;
    int slot = -1;               // send or receive slot
    bool provider_owned = true;  // no completion yet
    bool waited = false;         // a thread waits on it (kProbe, kNotify)
    bool reported = false;       // kPiece: its end was reported (for every piece)
    bool done = false;           // kProbe, kNotify: completed (or abandoned)
    absl::Status status;
  };
  struct Peer {
    AgentDescriptor descriptor;
    std::vector<fi_addr_t> addrs;  // per local rail
    // Per local rail, the peer's domain (NIC) its paired rail is on.
    std::vector<int> remote_domain;
    std::map<uint32_t, std::vector<uint64_t>> keys;  // per the peer's domain
    std::vector<fi_rma_iov> identity;  // per local rail: the peer's agent id there
    uint64_t next_rail = 0;
    int outstanding = 0;  // pieces the provider holds
    absl::Time last_progress;
    absl::Status error;
    bool removed = false;    // addresses removed from the AVs
    bool forgotten = false;  // the agent forgot it: erase once no thread waits
    int waiters = 0;
    // Pieces handed over (kPending) but not yet posted: consecutive pieces of one
    // batch gathered into one multi-iov fi_writemsg / fi_readmsg (rma_groups.h).
    // Posted when the next piece does not fit, at the batch's fence, or by the
    // progress thread's next pass. `op` is null when nothing is gathered.
    struct Gathered {
      Op* op = nullptr;
      int rail = 0;
      bool write = true;
      RmaGroup group;
    } gathered;
  };
  struct Registration {
    std::vector<fid_mr*> mrs;  // per domain
    void* base = nullptr;
    size_t length = 0;
    MemoryKind kind = MemoryKind::Host();
    bool owned = false;  // from AllocateMemory: unmapped on deregistration
  };

  explicit LibfabricBackend(const LibfabricAgentConfig& config) : config_(config) {}
  absl::Status Init();
  // Picks the NICs from fi_getinfo's list (topology or config_.domain), opens a
  // fabric per fabric name and a domain per NIC, and plans the rails
  // (rail_plan_: a domain per rail; gpu_rails_).
  absl::Status OpenDomains(fi_info* list, bool hmem);
  void CloseDomains();
  absl::Status OpenRail(int index, int domain);
  // Host memory, or CUDA memory (FI_HMEM_CUDA; the domain has FI_HMEM), in
  // every domain.
  absl::StatusOr<std::vector<fid_mr*>> Register(void* base, size_t len, uint64_t access,
                                                uint64_t requested_key,
                                                MemoryKind kind = MemoryKind::Host());
  void CloseMrs(std::vector<fid_mr*>* mrs);
  const Registration* FindLocal(const void* p, uint64_t len) const;
  // The rail the next operation to `p` from memory of `kind` goes on.
  int NextRail(Peer* p, MemoryKind kind);
  Peer* FindPeer(PeerId id);
  Peer* OpenPeer(PeerId id);
  Op* NewOp(Op::Kind kind, PeerId peer, int rail);
  void MaybeFree(Op* op);
  void Complete(Op* op, absl::Status status);
  void FailPeer(PeerId id, Peer* p, absl::Status status);
  // Abandons the peer's outstanding operations (reported as `status`).
  void AbandonOps(PeerId id, const absl::Status& status);
  absl::Status PostRecv(int rail, int slot);
  // Sends a message from a send slot on `rail` and waits for its completion.
  // With `read_from`, reads 8 bytes from there instead (into *read_value).
  absl::Status SendMessageLocked(PeerId id, Peer* p, int rail, Op::Kind kind,
                                 const std::string& bytes, absl::Time deadline,
                                 absl::string_view what,
                                 const fi_rma_iov* read_from = nullptr,
                                 uint64_t* read_value = nullptr);
  void OnMessage(const uint8_t* data, size_t len);
  int DrainCq(int rail);
  // Reports `op`'s end for each piece it carries (once).
  void ReportPieces(Op* op, const absl::Status& status);
  // Posts the peer's gathered pieces as one operation. OK with the group gone
  // (posted, or failed and its pieces reported with the error, which is returned
  // when it is `token`'s); OK with it still there when the queue is full
  // (EAGAIN: try again later).
  absl::Status PostGatheredLocked(PeerId id, Peer* p, OpToken token = nullptr);

  const LibfabricAgentConfig config_;
  BackendHost* host_ = nullptr;  // not owned: the agent
  uint64_t agent_id_ = 0;
  std::vector<Fabric> fabrics_;
  std::vector<Domain> domains_;
  std::vector<int> rail_plan_;  // the domain of each rail to open
  // Per CUDA ordinal (config_.gpu_pci_bus_ids), the rails nearest that GPU.
  std::vector<std::vector<int>> gpu_rails_;
  size_t mr_key_size_ = 8;  // the smallest of the domains'
  std::vector<Rail> rails_;
  std::string provider_;
  uint64_t mr_mode_ = 0;
  bool want_hmem_ = false;  // FI_HMEM asked for (config, or CUDA loaded)
  bool hmem_ = false;
  bool delivery_complete_in_info_ = false;
  bool wait_fds_ = false;
  uint64_t max_piece_bytes_ = 0;
  RmaGroupLimits group_limits_;
  std::atomic<uint64_t> rma_ops_{0};  // fi_writemsg / fi_readmsg of pieces posted
  uint64_t key_salt_ = (RandomAgentId() >> 1) & 0x7fffffff;
  int max_inflight_ops_ = 1;
  std::string address_;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  // Message buffers: rails * kRecvSlotsPerRail receive slots, then kSendSlots
  // send slots, one registration.
  uint8_t* msg_buf_ = nullptr;
  size_t msg_buf_len_ = 0;
  uint8_t* identity_ = nullptr;  // last slot of msg_buf_: this agent's id
  bool msg_registered_ = false;  // domains_[*].msg_mr
  std::vector<Op*> recv_ops_;
  std::vector<int> free_send_slots_;
  std::atomic<size_t> num_mrs_{0};
  std::vector<std::atomic<uint64_t>> pieces_per_rail_ =
      std::vector<std::atomic<uint64_t>>(kMaxRails);
  std::map<RegionId, Registration> regs_;          // agent lock
  std::map<uintptr_t, RegionId> by_address_;       // agent lock: base → region
  std::map<PeerId, std::unique_ptr<Peer>> peers_;  // agent lock
  std::map<Op*, std::unique_ptr<Op>> ops_;         // agent lock: every live Op
};

absl::StatusOr<std::unique_ptr<LibfabricBackend>> LibfabricBackend::Create(
    const LibfabricAgentConfig& config) {
  std::unique_ptr<LibfabricBackend> backend(new LibfabricBackend(config));
  absl::Status st = backend->Init();
  if (!st.ok()) return st;
  return backend;
}

absl::Status LibfabricBackend::Init() {
  if (config_.rails < 0 || config_.rails > kMaxRails) {
    return absl::InvalidArgumentError(absl::StrCat("rails must be in [0, ", kMaxRails,
                                                   "] (0: the nearest NICs), got ",
                                                   config_.rails));
  }
  std::string prov = config_.provider;
  if (prov.empty()) {
    const char* env = std::getenv("FI_PROVIDER");
    prov = (env != nullptr && *env != '\0') ? env : "tcp";
  }
  // Offered: the MR modes EFA requires; the provider returns the subset it
  // demands. FI_HMEM (with FI_MR_HMEM) first where wanted, then without.
  const uint64_t offered_mr =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
  int ret = -FI_ENODATA;
  absl::Status open_error;
  want_hmem_ = config_.want_hmem || (config_.hmem_if_cuda_loaded && CudaDriverLoaded());
  for (int attempt = 0; attempt < 4 && domains_.empty(); ++attempt) {
    const bool hmem = (attempt < 2) && want_hmem_;
    const bool dc = (attempt % 2) == 0;
    if (attempt < 2 && !want_hmem_) continue;
    fi_info* hints = fi_allocinfo();
    if (hints == nullptr) return absl::ResourceExhaustedError("fi_allocinfo");
    hints->caps = FI_RMA | FI_MSG | FI_READ | FI_WRITE | FI_REMOTE_READ |
                  FI_REMOTE_WRITE | FI_SEND | FI_RECV;
    if (hmem) hints->caps |= FI_HMEM;
    hints->ep_attr->type = FI_EP_RDM;
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode = offered_mr | (hmem ? FI_MR_HMEM : 0);
    hints->domain_attr->threading = FI_THREAD_DOMAIN;
    if (dc) hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
    hints->fabric_attr->prov_name = strdup(prov.c_str());
    fi_info* list = nullptr;
    ret = fi_getinfo(FI_VERSION(1, 14), nullptr, nullptr, 0, hints, &list);
    fi_freeinfo(hints);
    if (ret != 0) continue;
    absl::Status st = OpenDomains(list, hmem);
    fi_freeinfo(list);
    if (!st.ok()) {
      CloseDomains();
      if (hmem && absl::IsFailedPrecondition(st)) return st;
      if (absl::IsInvalidArgument(st)) return st;  // a bad domain list or GPU id
      open_error = st;
      continue;
    }
    hmem_ = hmem;
    delivery_complete_in_info_ = dc;
  }
  if (domains_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "libfabric: no provider \"", prov,
        "\" with FI_EP_RDM, FI_RMA and FI_MSG (fi_getinfo / fi_domain: ",
        open_error.ok() ? fi_strerror(-ret) : std::string(open_error.message()),
        "); providers on this host: fi_info -l"));
  }
  const fi_info* info0 = domains_[0].info;
  provider_ = info0->fabric_attr->prov_name;
  mr_mode_ = info0->domain_attr->mr_mode;
  uint64_t max_msg = std::numeric_limits<uint64_t>::max();
  size_t iov_limit = std::numeric_limits<size_t>::max();
  size_t rma_iov_limit = std::numeric_limits<size_t>::max();
  for (const Domain& d : domains_) {
    // One address layout and one key scheme for the agent: the NICs of one
    // provider demand the same MR modes (EFA devices do).
    if (d.info->domain_attr->mr_mode != mr_mode_) {
      return absl::FailedPreconditionError(
          absl::StrCat("libfabric domains ", domains_[0].name, " and ", d.name,
                       " demand different MR modes (", MrModeString(mr_mode_), " vs ",
                       MrModeString(d.info->domain_attr->mr_mode),
                       "): name one with --kv_transport"));
    }
    mr_key_size_ = std::min(mr_key_size_, d.info->domain_attr->mr_key_size);
    max_msg = std::min<uint64_t>(max_msg, d.info->ep_attr->max_msg_size);
    iov_limit = std::min(iov_limit, d.info->tx_attr->iov_limit);
    rma_iov_limit = std::min(rma_iov_limit, d.info->tx_attr->rma_iov_limit);
  }
  if (mr_mode_ & ~(offered_mr | FI_MR_HMEM)) {
    return absl::FailedPreconditionError(
        absl::StrCat("libfabric provider ", provider_,
                     " demands MR modes not handled: ", MrModeString(mr_mode_)));
  }
  max_piece_bytes_ = std::min<uint64_t>(config_.max_op_bytes, max_msg);
  if (max_piece_bytes_ == 0) max_piece_bytes_ = 1;
  // One operation carries as many of a batch's pieces as the provider's iov
  // limits let it (tcp and shm: 4 each), up to max_piece_bytes in all.
  const size_t iovs = config_.max_iovs_per_op > 0
                          ? static_cast<size_t>(config_.max_iovs_per_op)
                          : std::numeric_limits<size_t>::max();
  group_limits_.iov_limit = std::max<size_t>(1, std::min<size_t>(iovs, iov_limit));
  group_limits_.rma_iov_limit =
      std::max<size_t>(1, std::min<size_t>(iovs, rma_iov_limit));
  group_limits_.max_bytes = max_piece_bytes_;
  int tx_slots = 0;
  for (int d : rail_plan_)
    tx_slots += static_cast<int>(domains_[d].info->tx_attr->size);
  max_inflight_ops_ =
      std::max<int>(1, std::min<int>(config_.max_inflight_ops, tx_slots));

  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (wake_fd_ < 0 || epoll_fd_ < 0) {
    return absl::InternalError(absl::StrCat("eventfd/epoll: ", std::strerror(errno)));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake_fd_;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev) != 0) {
    return absl::InternalError(absl::StrCat("epoll_ctl: ", std::strerror(errno)));
  }

  wait_fds_ = true;
  for (size_t r = 0; r < rail_plan_.size(); ++r) {
    absl::Status st = OpenRail(static_cast<int>(r), rail_plan_[r]);
    if (!st.ok()) return st;
  }
  if (wait_fds_) {
    for (const Rail& rail : rails_) {
      epoll_event e{};
      e.events = EPOLLIN;
      e.data.fd = rail.wait_fd;
      if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, rail.wait_fd, &e) != 0) {
        return absl::InternalError(absl::StrCat("epoll_ctl: ", std::strerror(errno)));
      }
    }
  }

  // Message buffers, registered in every domain (FI_MR_LOCAL needs descriptors
  // for sends and receives), receive slots posted.
  // ... and one slot holding the agent id, which a connecting peer reads.
  const size_t nrails = rails_.size();
  msg_buf_len_ = kSlotBytes * (nrails * kRecvSlotsPerRail + kSendSlots + 1);
  void* p = mmap(nullptr, msg_buf_len_, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return absl::ResourceExhaustedError("mmap of message buffers");
  msg_buf_ = static_cast<uint8_t*>(p);
  std::memset(msg_buf_, 0, msg_buf_len_);  // FI_MR_ALLOCATED: backed pages
  identity_ = msg_buf_ + msg_buf_len_ - kSlotBytes;
  auto mrs =
      Register(msg_buf_, msg_buf_len_, FI_SEND | FI_RECV | FI_READ | FI_REMOTE_READ,
               mr_key_size_ >= 8 ? key_salt_ << 32 : 0);
  if (!mrs.ok()) return mrs.status();
  for (size_t d = 0; d < domains_.size(); ++d) domains_[d].msg_mr = (*mrs)[d];
  msg_registered_ = true;
  for (int s = 0; s < kSendSlots; ++s) free_send_slots_.push_back(s);
  recv_ops_.assign(nrails * kRecvSlotsPerRail, nullptr);
  for (size_t r = 0; r < nrails; ++r) {
    for (int s = 0; s < kRecvSlotsPerRail; ++s) {
      absl::Status st =
          PostRecv(static_cast<int>(r), static_cast<int>(r) * kRecvSlotsPerRail + s);
      if (!st.ok()) return st;
    }
  }

  // Address: magic, provider; per domain its fabric name and the key of the
  // message buffers there; per rail its domain and endpoint name; where the
  // agent id can be read in the message buffers (remote address).
  address_.assign(kAddressMagic, 4);
  PutLe(&address_, provider_.size(), 4);
  address_.append(provider_);
  PutLe(&address_, domains_.size(), 4);
  for (const Domain& d : domains_) {
    const std::string& fabric = fabrics_[d.fabric].name;
    PutLe(&address_, fabric.size(), 4);
    address_.append(fabric);
    PutLe(&address_, fi_mr_key(d.msg_mr), 8);
  }
  PutLe(&address_, rails_.size(), 4);
  for (const Rail& rail : rails_) {
    PutLe(&address_, rail.domain, 4);
    PutLe(&address_, rail.name.size(), 4);
    address_.append(rail.name);
  }
  PutLe(&address_,
        (mr_mode_ & FI_MR_VIRT_ADDR) ? reinterpret_cast<uint64_t>(identity_)
                                     : static_cast<uint64_t>(identity_ - msg_buf_),
        8);
  return absl::OkStatus();
}

absl::Status LibfabricBackend::OpenDomains(fi_info* list, bool hmem) {
  // The distinct domains (NICs) in fi_getinfo's order, the first entry of each
  // (tcp lists a domain per interface and address family: eth0's IPv4 first).
  std::vector<fi_info*> entries;
  std::vector<NicCandidate> candidates;
  for (fi_info* i = list; i != nullptr; i = i->next) {
    const std::string name =
        i->domain_attr->name != nullptr ? i->domain_attr->name : "";
    bool seen = false;
    for (const NicCandidate& c : candidates) seen |= c.domain == name;
    if (seen) continue;
    NicCandidate c;
    c.domain = name;
    if (i->nic != nullptr && i->nic->bus_attr != nullptr &&
        i->nic->bus_attr->bus_type == FI_BUS_PCI) {
      const fi_pci_attr& pci = i->nic->bus_attr->attr.pci;
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%04x:%02x:%02x.%x", pci.domain_id, pci.bus_id,
                    pci.device_id, pci.function_id);
      c.pci_address = buf;
    }
    candidates.push_back(c);
    entries.push_back(i);
  }
  // The GPUs: as configured, else those of the CUDA driver already loaded in
  // the process (a worker on a CUDA backend), by ordinal.
  std::vector<std::string> gpus = config_.gpu_pci_bus_ids;
  const bool gpus_from_cuda = gpus.empty() && config_.gpus_from_cuda;
  if (gpus_from_cuda) gpus = CudaPciBusIds();
  // Which NICs, and for each GPU which of them (the rails are planned below);
  // an empty list: a GPU the driver named and sysfs does not show (its memory
  // then goes over every rail).
  std::vector<std::vector<NicPlacement>> per_gpu;  // one list without GPUs
  if (!config_.domain.empty()) {
    std::vector<NicPlacement> named;
    for (absl::string_view want :
         absl::StrSplit(config_.domain, ',', absl::SkipEmpty())) {
      int found = -1;
      for (size_t c = 0; c < candidates.size(); ++c) {
        if (candidates[c].domain == want) found = static_cast<int>(c);
      }
      if (found < 0) {
        std::vector<std::string> names;
        for (const NicCandidate& c : candidates) names.push_back(c.domain);
        return absl::InvalidArgumentError(
            absl::StrCat("libfabric: no domain \"", want, "\" for provider ",
                         entries[0]->fabric_attr->prov_name,
                         " (it has: ", absl::StrJoin(names, ", "), ")"));
      }
      NicPlacement placement;
      placement.candidate = found;
      placement.domain = candidates[found].domain;
      placement.pci_address = candidates[found].pci_address;
      named.push_back(placement);
    }
    if (named.empty())
      return absl::InvalidArgumentError("libfabric: empty domain list");
    per_gpu.assign(std::max<size_t>(1, gpus.size()), named);
  } else {
    TopologyInput in;
    in.sysfs_root = config_.sysfs_root;
    in.candidates = candidates;
    in.nics = config_.rails;
    in.process_numa_node = ProcessNumaNode(config_.sysfs_root, AllowedCpus());
    bool any = false;
    for (const std::string& gpu : gpus) {
      in.gpu_pci_bus_id = gpu;
      auto sel = SelectNics(in);
      if (!sel.ok() && !gpus_from_cuda) return sel.status();
      per_gpu.push_back(sel.ok() ? *std::move(sel) : std::vector<NicPlacement>());
      any |= !per_gpu.back().empty();
    }
    if (!any) {  // no GPU, or none that sysfs shows: by the process's NUMA node
      in.gpu_pci_bus_id.clear();
      auto sel = SelectNics(in);
      if (!sel.ok()) return sel.status();
      per_gpu.push_back(*std::move(sel));
      gpus.clear();
    }
  }
  // The rails: for each GPU (or the one list) max(rails, its NICs) endpoints,
  // its i-th on NIC i % n; an endpoint (NIC, k-th on it) is shared between GPUs.
  std::map<int, int> domain_of;                // candidate -> index into domains_
  std::map<std::pair<int, int>, int> rail_of;  // (domain, k) -> rail
  for (const std::vector<NicPlacement>& sel : per_gpu) {
    std::vector<int> rails;
    const size_t n = sel.size();
    const size_t endpoints =
        n == 0 ? 0 : std::max<size_t>(n, static_cast<size_t>(config_.rails));
    for (size_t i = 0; i < endpoints; ++i) {
      const NicPlacement& nic = sel[i % n];
      auto d = domain_of.find(nic.candidate);
      if (d == domain_of.end()) {
        if (static_cast<int>(domains_.size()) >= kMaxDomains) {
          return absl::InvalidArgumentError("libfabric: too many NICs");
        }
        Domain dom;
        dom.info = fi_dupinfo(entries[nic.candidate]);
        if (dom.info == nullptr) return absl::ResourceExhaustedError("fi_dupinfo");
        dom.name = nic.domain;
        dom.placement = nic;
        domains_.push_back(dom);
        d = domain_of.emplace(nic.candidate, static_cast<int>(domains_.size()) - 1)
                .first;
      }
      const std::pair<int, int> key{d->second, static_cast<int>(i / n)};
      auto r = rail_of.find(key);
      if (r == rail_of.end()) {
        if (static_cast<int>(rail_plan_.size()) >= kMaxRails) {
          return absl::InvalidArgumentError(
              absl::StrCat("libfabric: more than ", kMaxRails, " rails"));
        }
        rail_plan_.push_back(d->second);
        r = rail_of.emplace(key, static_cast<int>(rail_plan_.size()) - 1).first;
      }
      rails.push_back(r->second);
    }
    if (!gpus.empty()) gpu_rails_.push_back(rails);
  }
  // A fabric per fabric name, a domain per NIC.
  for (Domain& d : domains_) {
    const std::string fabric =
        d.info->fabric_attr->name != nullptr ? d.info->fabric_attr->name : "";
    for (size_t f = 0; f < fabrics_.size(); ++f) {
      if (fabrics_[f].name == fabric) d.fabric = static_cast<int>(f);
    }
    if (d.fabric < 0) {
      Fabric f;
      f.name = fabric;
      const int ret = fi_fabric(d.info->fabric_attr, &f.fabric, nullptr);
      if (ret != 0) return FromFi(ret, absl::StrCat("fi_fabric ", fabric));
      fabrics_.push_back(f);
      d.fabric = static_cast<int>(fabrics_.size()) - 1;
    }
    const int ret = fi_domain(fabrics_[d.fabric].fabric, d.info, &d.domain, nullptr);
    if (ret != 0) {
      d.domain = nullptr;
      if (hmem) {
        // Seen with shm on a host without a GPU runtime: fi_getinfo lists
        // FI_HMEM, fi_domain refuses it, and a later plain fi_domain in the
        // process fails too. Say so rather than fall back.
        return absl::FailedPreconditionError(
            absl::StrCat("libfabric provider ", d.info->fabric_attr->prov_name,
                         " lists FI_HMEM but fi_domain refuses it (", fi_strerror(-ret),
                         "); run without want_hmem (and hmem_if_cuda_loaded)"));
      }
      return FromFi(ret, absl::StrCat("fi_domain ", d.name));
    }
  }
  return absl::OkStatus();
}

void LibfabricBackend::CloseDomains() {
  for (Domain& d : domains_) {
    if (d.domain != nullptr) fi_close(&d.domain->fid);
    if (d.info != nullptr) fi_freeinfo(d.info);
  }
  for (Fabric& f : fabrics_) {
    if (f.fabric != nullptr) fi_close(&f.fabric->fid);
  }
  domains_.clear();
  fabrics_.clear();
  rail_plan_.clear();
  gpu_rails_.clear();
}

absl::Status LibfabricBackend::OpenRail(int index, int domain) {
  Rail rail;
  rail.domain = domain;
  fid_domain* const dom = domains_[domain].domain;
  const fi_info* const info = domains_[domain].info;
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_DATA;
  cq_attr.size = 0;  // provider default
  cq_attr.wait_obj = wait_fds_ ? FI_WAIT_FD : FI_WAIT_NONE;
  int ret = fi_cq_open(dom, &cq_attr, &rail.cq, nullptr);
  if (ret != 0 && wait_fds_) {
    // No wait fd from this provider: every rail polls (1 ms naps when idle).
    wait_fds_ = false;
    for (Rail& r : rails_) {
      r.wait_fd = -1;
    }
    cq_attr.wait_obj = FI_WAIT_NONE;
    ret = fi_cq_open(dom, &cq_attr, &rail.cq, nullptr);
  }
  if (ret != 0) return FromFi(ret, "fi_cq_open");
  if (wait_fds_) {
    ret = fi_control(&rail.cq->fid, FI_GETWAIT, &rail.wait_fd);
    if (ret != 0) {
      wait_fds_ = false;
      rail.wait_fd = -1;
    }
  }
  fi_av_attr av_attr{};
  av_attr.type = info->domain_attr->av_type == FI_AV_UNSPEC
                     ? FI_AV_TABLE
                     : info->domain_attr->av_type;
  ret = fi_av_open(dom, &av_attr, &rail.av, nullptr);
  if (ret != 0) {
    fi_close(&rail.cq->fid);
    return FromFi(ret, "fi_av_open");
  }
  // String addresses (shm's "fi_shm://<pid>") would give every endpoint of the
  // process the same name: each rail of each agent gets its own.
  fi_info* ep_info = fi_dupinfo(info);
  if (ep_info == nullptr) return absl::ResourceExhaustedError("fi_dupinfo");
  if (ep_info->addr_format == FI_ADDR_STR && ep_info->src_addr != nullptr) {
    static std::atomic<uint64_t> counter{0};
    const std::string name =
        absl::StrCat(static_cast<const char*>(info->src_addr), "_",
                     absl::Hex(RandomAgentId() & 0xffffff), "_", counter++, "_", index);
    free(ep_info->src_addr);
    ep_info->src_addr = strdup(name.c_str());
    ep_info->src_addrlen = name.size() + 1;
  }
  ret = fi_endpoint(dom, ep_info, &rail.ep, nullptr);
  fi_freeinfo(ep_info);
  if (ret == 0) ret = fi_ep_bind(rail.ep, &rail.av->fid, 0);
  if (ret == 0) ret = fi_ep_bind(rail.ep, &rail.cq->fid, FI_TRANSMIT | FI_RECV);
  if (ret == 0) ret = fi_enable(rail.ep);
  if (ret == 0) {
    char name[kMaxRailAddressBytes];
    size_t len = sizeof(name);
    ret = fi_getname(&rail.ep->fid, name, &len);
    if (ret == 0) rail.name.assign(name, len);
  }
  rails_.push_back(rail);  // closed by the destructor whatever happened
  if (ret != 0) return FromFi(ret, absl::StrCat("opening endpoint of rail ", index));
  return absl::OkStatus();
}

LibfabricBackend::~LibfabricBackend() {
  for (Rail& r : rails_) {
    if (r.ep != nullptr) fi_close(&r.ep->fid);
  }
  ops_.clear();  // no endpoint holds an operation any more
  if (msg_registered_) {
    for (Domain& d : domains_) {
      if (d.msg_mr != nullptr) fi_close(&d.msg_mr->fid);
    }
    --num_mrs_;
  }
  for (auto& [id, reg] : regs_) {
    CloseMrs(&reg.mrs);
    if (reg.owned) munmap(reg.base, reg.length);
  }
  for (Rail& r : rails_) {
    if (r.av != nullptr) fi_close(&r.av->fid);
    if (r.cq != nullptr) fi_close(&r.cq->fid);
  }
  CloseDomains();
  if (msg_buf_ != nullptr) munmap(msg_buf_, msg_buf_len_);
  if (wake_fd_ >= 0) close(wake_fd_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
}

void LibfabricBackend::ShutdownLocked(absl::Time /*deadline*/) {
  // The agent closed and forgot its peers and deregistered its regions; the
  // endpoints go first, so nothing reads or writes memory after this.
  for (Rail& r : rails_) {
    if (r.ep != nullptr) fi_close(&r.ep->fid);
    r.ep = nullptr;
  }
  ops_.clear();
  recv_ops_.clear();
  peers_.clear();
}

void LibfabricBackend::Wake() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));
}

absl::StatusOr<std::vector<fid_mr*>> LibfabricBackend::Register(void* base, size_t len,
                                                                uint64_t access,
                                                                uint64_t requested_key,
                                                                MemoryKind kind) {
  std::vector<fid_mr*> mrs;
  // FI_MR_PROV_KEY: the provider picks the key (requested_key is ignored).
  const uint64_t key = (mr_mode_ & FI_MR_PROV_KEY) ? 0 : requested_key;
  for (Domain& d : domains_) {
    fid_mr* mr = nullptr;
    int ret = 0;
    if (kind.is_host()) {
      ret = fi_mr_reg(d.domain, base, len, access, 0, key, 0, &mr, nullptr);
    } else {
      // Device memory: the provider reads and writes it with its HMEM interface
      // (GPUDirect RDMA on EFA / verbs, cudaMemcpy in shm).
      iovec iov{base, len};
      fi_mr_attr attr{};
      attr.mr_iov = &iov;
      attr.iov_count = 1;
      attr.access = access;
      attr.requested_key = key;
      attr.iface = FI_HMEM_CUDA;
      attr.device.cuda = kind.device;
      ret = fi_mr_regattr(d.domain, &attr, 0, &mr);
    }
    if (ret != 0) {
      CloseMrs(&mrs);
      return FromFi(ret, absl::StrCat("fi_mr_reg in domain ", d.name));
    }
    mrs.push_back(mr);
  }
  ++num_mrs_;
  return mrs;
}

void LibfabricBackend::CloseMrs(std::vector<fid_mr*>* mrs) {
  for (fid_mr* mr : *mrs) fi_close(&mr->fid);
  mrs->clear();
}

absl::StatusOr<std::string> LibfabricBackend::RegisterMemoryLocked(RegionId region,
                                                                   void* base,
                                                                   size_t len,
                                                                   MemoryKind kind) {
  if (!kind.is_host() && !hmem_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "libfabric provider ", provider_, " cannot register ", MemoryKindName(kind),
        " memory: ",
        want_hmem_ ? "the provider does not report FI_HMEM"
                   : "the agent was created without want_hmem (FI_HMEM) and no CUDA "
                     "driver was loaded"));
  }
  // Key 0 is the message buffers'; region ids start at 1. Where we choose keys
  // (no FI_MR_PROV_KEY) and they are 8 bytes, a random salt in the high half,
  // so a stale descriptor that reaches another agent at a reused address names
  // no key there (the access fails) instead of that agent's region.
  const uint64_t key = mr_key_size_ >= 8 ? (key_salt_ << 32) | region : region;
  auto mrs = Register(base, len, FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE,
                      key, kind);
  if (!mrs.ok()) return mrs.status();
  // The remote key: the key in each domain, in domain order.
  std::string rkey;
  for (fid_mr* mr : *mrs) PutLe(&rkey, fi_mr_key(mr), 8);
  Registration reg;
  reg.mrs = *std::move(mrs);
  reg.base = base;
  reg.length = len;
  reg.kind = kind;
  regs_[region] = std::move(reg);
  by_address_[reinterpret_cast<uintptr_t>(base)] = region;
  return rkey;
}

absl::StatusOr<Backend::Allocated> LibfabricBackend::AllocateMemoryLocked(
    RegionId region, size_t len) {
  void* p =
      mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("mmap of ", len, " bytes failed"));
  }
  auto rkey = RegisterMemoryLocked(region, p, len, MemoryKind::Host());
  if (!rkey.ok()) {
    munmap(p, len);
    return rkey.status();
  }
  regs_[region].owned = true;
  Allocated a;
  a.base = p;
  a.rkey = *std::move(rkey);
  a.zeroed = true;  // anonymous mmap
  return a;
}

void LibfabricBackend::DeregisterMemoryLocked(RegionId region) {
  auto it = regs_.find(region);
  if (it == regs_.end()) return;
  CloseMrs(&it->second.mrs);
  --num_mrs_;
  auto a = by_address_.find(reinterpret_cast<uintptr_t>(it->second.base));
  if (a != by_address_.end() && a->second == region) by_address_.erase(a);
  if (it->second.owned) munmap(it->second.base, it->second.length);
  regs_.erase(it);
}

const LibfabricBackend::Registration* LibfabricBackend::FindLocal(const void* p,
                                                                  uint64_t len) const {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  auto covers = [&](const Registration& r) {
    const auto b = reinterpret_cast<uintptr_t>(r.base);
    return addr >= b && addr + len <= b + r.length;
  };
  auto it = by_address_.upper_bound(addr);
  if (it != by_address_.begin()) {
    --it;
    auto r = regs_.find(it->second);
    if (r != regs_.end() && covers(r->second)) return &r->second;
  }
  for (const auto& [id, r] : regs_) {  // overlapping registrations
    if (covers(r)) return &r;
  }
  return nullptr;
}

int LibfabricBackend::NextRail(Peer* p, MemoryKind kind) {
  const uint64_t n = p->next_rail++;
  if (!kind.is_host() && kind.device >= 0 &&
      static_cast<size_t>(kind.device) < gpu_rails_.size() &&
      !gpu_rails_[kind.device].empty()) {
    const std::vector<int>& near = gpu_rails_[kind.device];
    return near[n % near.size()];
  }
  return static_cast<int>(n % rails_.size());
}

LibfabricBackend::Peer* LibfabricBackend::FindPeer(PeerId id) {
  auto it = peers_.find(id);
  return it == peers_.end() ? nullptr : it->second.get();
}

LibfabricBackend::Peer* LibfabricBackend::OpenPeer(PeerId id) {
  Peer* p = FindPeer(id);
  if (p == nullptr || p->removed) return nullptr;
  return p;
}

LibfabricBackend::Op* LibfabricBackend::NewOp(Op::Kind kind, PeerId peer, int rail) {
  auto op = std::make_unique<Op>();
  std::memset(&op->fi_ctx, 0, sizeof(op->fi_ctx));
  op->kind = kind;
  op->peer = peer;
  op->rail = rail;
  Op* raw = op.get();
  ops_[raw] = std::move(op);
  return raw;
}

void LibfabricBackend::MaybeFree(Op* op) {
  if (!op->provider_owned && !op->waited) ops_.erase(op);
}

absl::Status LibfabricBackend::PostRecv(int rail, int slot) {
  Op* op = NewOp(Op::kRecv, 0, rail);
  op->slot = slot;
  recv_ops_[slot] = op;
  iovec iov{msg_buf_ + static_cast<size_t>(slot) * kSlotBytes, kSlotBytes};
  void* desc = fi_mr_desc(domains_[rails_[rail].domain].msg_mr);
  fi_msg msg{};
  msg.msg_iov = &iov;
  msg.desc = &desc;
  msg.iov_count = 1;
  msg.addr = FI_ADDR_UNSPEC;
  msg.context = &op->fi_ctx;
  ssize_t ret = -FI_EAGAIN;
  for (int tries = 0; tries < 100 && ret == -FI_EAGAIN; ++tries) {
    ret = fi_recvmsg(rails_[rail].ep, &msg, FI_COMPLETION);
  }
  if (ret != 0) {
    op->provider_owned = false;
    recv_ops_[slot] = nullptr;
    MaybeFree(op);
    return FromFi(static_cast<int>(ret), "fi_recvmsg");
  }
  return absl::OkStatus();
}

absl::Status LibfabricBackend::ConnectLocked(PeerId id,
                                             const AgentDescriptor& descriptor) {
  const auto* p = reinterpret_cast<const uint8_t*>(descriptor.address.data());
  const uint8_t* end = p + descriptor.address.size();
  if (descriptor.address.size() >= 4 && std::memcmp(p, kAddressMagicV1, 4) == 0) {
    return absl::InvalidArgumentError(
        "descriptor's libfabric address is version 1 (one domain per agent): the peer "
        "runs an older Tandem");
  }
  if (descriptor.address.size() < 4 || std::memcmp(p, kAddressMagic, 4) != 0) {
    return absl::InvalidArgumentError("descriptor has no libfabric address");
  }
  p += 4;
  std::string prov;
  if (!GetBytes(p, end, 256, &prov)) {
    return absl::InvalidArgumentError("libfabric address: bad provider");
  }
  if (prov != provider_) {
    return absl::InvalidArgumentError(
        absl::StrCat("descriptor's libfabric provider is \"", prov,
                     "\", this agent's is \"", provider_, "\""));
  }
  uint64_t ndomains = 0;
  if (!GetLe(p, end, 4, &ndomains) || ndomains == 0 || ndomains > kMaxDomains) {
    return absl::InvalidArgumentError("libfabric address: bad domain count");
  }
  std::vector<std::string> remote_fabrics(ndomains);
  std::vector<uint64_t> identity_keys(ndomains);
  for (uint64_t d = 0; d < ndomains; ++d) {
    if (!GetBytes(p, end, 1024, &remote_fabrics[d]) ||
        !GetLe(p, end, 8, &identity_keys[d])) {
      return absl::InvalidArgumentError("libfabric address: truncated domain");
    }
  }
  uint64_t nrails = 0;
  if (!GetLe(p, end, 4, &nrails) || nrails == 0 || nrails > kMaxRails) {
    return absl::InvalidArgumentError("libfabric address: bad rail count");
  }
  std::vector<std::string> names(nrails);
  std::vector<int> rail_domains(nrails);
  for (uint64_t r = 0; r < nrails; ++r) {
    uint64_t d = 0;
    if (!GetLe(p, end, 4, &d) || d >= ndomains) {
      return absl::InvalidArgumentError("libfabric address: bad rail domain");
    }
    rail_domains[r] = static_cast<int>(d);
    if (!GetBytes(p, end, kMaxRailAddressBytes, &names[r]) || names[r].empty()) {
      return absl::InvalidArgumentError("libfabric address: truncated rail address");
    }
  }
  uint64_t identity_addr = 0;
  if (!GetLe(p, end, 8, &identity_addr)) {
    return absl::InvalidArgumentError("libfabric address: truncated identity");
  }
  if (p != end) return absl::InvalidArgumentError("libfabric address: trailing bytes");
  auto peer = std::make_unique<Peer>();
  peer->descriptor = descriptor;
  for (const RegionDescriptor& r : descriptor.regions) {
    const auto* k = reinterpret_cast<const uint8_t*>(r.rkey.data());
    if (r.rkey.size() != 8 * ndomains) {
      return absl::InvalidArgumentError(
          absl::StrCat("remote key of region ", r.id, " is not a libfabric key (",
                       r.rkey.size(), " bytes for ", ndomains, " domains)"));
    }
    std::vector<uint64_t>& keys = peer->keys[r.id];
    for (uint64_t d = 0; d < ndomains; ++d) {
      uint64_t key = 0;
      GetLe(k, k + 8, 8, &key);
      keys.push_back(key);
    }
  }
  // Our rail r talks to a peer rail on the same fabric (tcp: the same subnet;
  // EFA devices all share one), the k-th of ours there to its k % n-th; where
  // the peer has none on that fabric, to its rail r % its rails.
  std::map<std::string, int> seen_on_fabric;
  for (size_t r = 0; r < rails_.size(); ++r) {
    const std::string& fabric = fabrics_[domains_[rails_[r].domain].fabric].name;
    std::vector<int> same;
    for (uint64_t q = 0; q < nrails; ++q) {
      if (remote_fabrics[rail_domains[q]] == fabric)
        same.push_back(static_cast<int>(q));
    }
    const int k = seen_on_fabric[fabric]++;
    const int q = same.empty() ? static_cast<int>(r % nrails) : same[k % same.size()];
    fi_addr_t addr = FI_ADDR_NOTAVAIL;
    const int n = fi_av_insert(rails_[r].av, names[q].data(), 1, &addr, 0, nullptr);
    if (n != 1) {
      for (size_t o = 0; o < peer->addrs.size(); ++o)
        fi_av_remove(rails_[o].av, &peer->addrs[o], 1, 0);
      return absl::UnavailableError(absl::StrCat(
          "libfabric peer ", absl::Hex(descriptor.agent_id), ": fi_av_insert of rail ",
          r, " failed (", n < 0 ? fi_strerror(-n) : "address not inserted", ")"));
    }
    peer->addrs.push_back(addr);
    peer->remote_domain.push_back(rail_domains[q]);
    fi_rma_iov identity{};
    identity.addr = identity_addr;
    identity.len = 8;
    identity.key = identity_keys[rail_domains[q]];
    peer->identity.push_back(identity);
  }
  Peer* raw = peer.get();
  peers_[id] = std::move(peer);
  // On every rail, read the peer's agent id: an unreachable peer fails here,
  // not mid-transfer, and so does an address now held by another agent (a
  // stale descriptor whose port or name was reused).
  const absl::Time deadline = absl::Now() + config_.connect_timeout;
  for (size_t r = 0; r < rails_.size(); ++r) {
    uint64_t seen = 0;
    absl::Status st =
        SendMessageLocked(id, raw, static_cast<int>(r), Op::kProbe, "", deadline,
                          "connecting", &raw->identity[r], &seen);
    if (st.ok() && seen != descriptor.agent_id) {
      st = absl::UnavailableError(absl::StrCat(
          "libfabric peer ", absl::Hex(descriptor.agent_id), ": its address (rail ", r,
          ") now belongs to agent ", absl::Hex(seen), ": a stale descriptor"));
    }
    if (!st.ok()) {
      ClosePeerLocked(id, /*graceful=*/false, /*wait=*/false, deadline);
      if (raw->waiters == 0) peers_.erase(id);
      return absl::UnavailableError(st.message());
    }
  }
  raw->last_progress = absl::Now();
  return absl::OkStatus();
}

void LibfabricBackend::AbandonOps(PeerId id, const absl::Status& status) {
  for (auto it = ops_.begin(); it != ops_.end();) {
    Op* op = (it++)->first;
    if (op->peer != id || op->kind == Op::kRecv) continue;
    if (op->kind == Op::kPiece) {
      ReportPieces(op, status);
    } else if (!op->done) {
      op->done = true;
      op->status = status;
    }
  }
  if (Peer* p = FindPeer(id)) {
    p->outstanding = 0;
    if (Op* g = p->gathered.op) {  // never handed to the provider
      p->gathered.op = nullptr;
      p->gathered.group.Clear();
      g->provider_owned = false;
      MaybeFree(g);
    }
  }
}

void LibfabricBackend::ClosePeerLocked(PeerId id, bool graceful, bool /*wait*/,
                                       absl::Time /*deadline*/) {
  Peer* p = FindPeer(id);
  if (p == nullptr || p->removed) return;
  // Forced (or busy): outstanding operations end now, CANCELLED or the
  // peer's error; the provider's late completions for them are ignored.
  if (!graceful || p->outstanding > 0 || p->gathered.op != nullptr) {
    AbandonOps(id,
               p->error.ok() ? absl::CancelledError("peer disconnected") : p->error);
  }
  for (size_t r = 0; r < p->addrs.size(); ++r)
    fi_av_remove(rails_[r].av, &p->addrs[r], 1, 0);
  p->removed = true;
}

void LibfabricBackend::ForgetPeerLocked(PeerId id) {
  auto it = peers_.find(id);
  if (it == peers_.end()) return;
  if (!it->second->removed) ClosePeerLocked(id, false, false, absl::Now());
  it->second->forgotten = true;
  if (it->second->waiters == 0) peers_.erase(it);
}

std::string LibfabricBackend::TransportLocked(PeerId id) {
  if (OpenPeer(id) == nullptr) return "";
  std::string t = provider_;
  if (rails_.size() > 1) absl::StrAppend(&t, " x", rails_.size(), " rails");
  if (domains_.size() > 1) absl::StrAppend(&t, " on ", domain_name());
  return t;
}

absl::StatusOr<Backend::PostResult> LibfabricBackend::PostPieceLocked(
    PeerId id, bool write, const Piece& piece, OpToken token) {
  Peer* p = OpenPeer(id);
  if (p == nullptr) return absl::CancelledError("peer disconnected");
  if (!p->error.ok()) return p->error;
  auto key = p->keys.find(piece.remote->id);
  if (key == p->keys.end()) {
    return absl::InternalError("no remote key for a checked region");
  }
  if (piece.length == 0) return PostResult::kDone;
  const Registration* local = FindLocal(piece.local, piece.length);
  // The piece as rail `rail` carries it: our MR in that rail's domain, the
  // peer's key in the domain of the rail it pairs with.
  auto on_rail = [&](int rail) {
    RmaPiece rp;
    rp.local = reinterpret_cast<uintptr_t>(piece.local);
    rp.desc = local != nullptr ? fi_mr_desc(local->mrs[rails_[rail].domain]) : nullptr;
    rp.remote = (mr_mode_ & FI_MR_VIRT_ADDR) ? piece.remote->base + piece.remote_offset
                                             : piece.remote_offset;
    rp.key = key->second[p->remote_domain[rail]];
    rp.length = piece.length;
    return rp;
  };
  Peer::Gathered& g = p->gathered;
  if (g.op != nullptr) {
    if (g.op->token == token && g.write == write &&
        AppendToRmaGroup(group_limits_, on_rail(g.rail), &g.group)) {
      ++g.op->pieces;
      return PostResult::kPending;
    }
    // Full (or another batch's): post it first.
    absl::Status st = PostGatheredLocked(id, p, token);
    if (!st.ok()) return st;
    if (g.op != nullptr) return PostResult::kRetryLater;  // the queue is full
    if (p->removed || !p->error.ok()) {
      return p->error.ok() ? absl::CancelledError("peer disconnected") : p->error;
    }
  }
  Op* op = NewOp(Op::kPiece, id, -1);
  op->token = token;
  op->pieces = 1;
  g.op = op;
  g.rail = NextRail(p, local != nullptr ? local->kind : MemoryKind::Host());
  g.write = write;
  g.group.Clear();
  // An empty group takes any piece.
  AppendToRmaGroup(group_limits_, on_rail(g.rail), &g.group);
  return PostResult::kPending;
}

void LibfabricBackend::ReportPieces(Op* op, const absl::Status& status) {
  if (op->reported) return;
  op->reported = true;
  for (int i = 0; i < op->pieces; ++i) ReportOpDone(op->token, status);
}

absl::Status LibfabricBackend::PostGatheredLocked(PeerId id, Peer* p, OpToken token) {
  Peer::Gathered& g = p->gathered;
  Op* op = g.op;
  if (op == nullptr) return absl::OkStatus();
  if (op->reported || p->removed) {  // abandoned meanwhile
    g.op = nullptr;
    g.group.Clear();
    op->provider_owned = false;
    MaybeFree(op);
    return absl::OkStatus();
  }
  const int rail = g.rail;
  std::vector<iovec> iov(g.group.local.size());
  std::vector<void*> desc(g.group.local.size());
  for (size_t i = 0; i < g.group.local.size(); ++i) {
    iov[i].iov_base = reinterpret_cast<void*>(g.group.local[i].addr);
    iov[i].iov_len = g.group.local[i].length;
    desc[i] = g.group.local[i].desc;
  }
  std::vector<fi_rma_iov> rma(g.group.remote.size());
  for (size_t i = 0; i < g.group.remote.size(); ++i) {
    rma[i].addr = g.group.remote[i].addr;
    rma[i].len = g.group.remote[i].length;
    rma[i].key = g.group.remote[i].key;
  }
  fi_msg_rma msg{};
  msg.msg_iov = iov.data();
  msg.desc = desc.data();
  msg.iov_count = iov.size();
  msg.addr = p->addrs[rail];
  msg.rma_iov = rma.data();
  msg.rma_iov_count = rma.size();
  msg.context = &op->fi_ctx;
  // Writes complete when their bytes are visible at the target.
  const uint64_t flags = FI_COMPLETION | (g.write ? FI_DELIVERY_COMPLETE : 0);
  ssize_t ret = 0;
  for (int tries = 0; tries < 64; ++tries) {
    ret = g.write ? fi_writemsg(rails_[rail].ep, &msg, flags)
                  : fi_readmsg(rails_[rail].ep, &msg, flags);
    if (ret != -FI_EAGAIN) break;
    DrainCq(rail);  // the queue is full: completions free slots
  }
  if (ret == -FI_EAGAIN) return absl::OkStatus();  // still gathered: later
  const bool write = g.write;
  g.op = nullptr;
  g.group.Clear();
  if (ret != 0) {
    op->provider_owned = false;
    const absl::Status st =
        FromFi(static_cast<int>(ret), write ? "fi_writemsg" : "fi_readmsg");
    const bool own = op->token == token;
    ReportPieces(op, st);
    MaybeFree(op);
    return own ? st : absl::OkStatus();
  }
  op->rail = rail;
  if (p->outstanding++ == 0) p->last_progress = absl::Now();
  pieces_per_rail_[rail] += op->pieces;
  ++rma_ops_;
  return absl::OkStatus();
}

absl::StatusOr<Backend::PostResult> LibfabricBackend::PostFenceLocked(PeerId id,
                                                                      OpToken) {
  // Every write is posted FI_DELIVERY_COMPLETE and every read completes when its
  // bytes are here: the batch's own completions are the fence. Its last pieces
  // go out now (or, the queue being full, on the progress thread's next pass;
  // the batch ends only once they completed).
  Peer* p = OpenPeer(id);
  if (p == nullptr) return absl::CancelledError("peer disconnected");
  if (p->error.ok()) {
    absl::Status st = PostGatheredLocked(id, p);
    if (!st.ok()) return st;
  }
  return PostResult::kDone;
}

absl::Status LibfabricBackend::SendMessageLocked(
    PeerId id, Peer* p, int rail, Op::Kind kind, const std::string& bytes,
    absl::Time deadline, absl::string_view what, const fi_rma_iov* read_from,
    uint64_t* read_value) {
  if (bytes.size() > kSlotBytes) return absl::InvalidArgumentError("message too long");
  ++p->waiters;  // keeps `p` alive while the agent lock is released
  struct SlotArgs {
    std::vector<int>* free;
    Peer* p;
  } slot_args{&free_send_slots_, p};
  if (free_send_slots_.empty()) {
    host_->AwaitLocked(absl::Condition(
                           +[](SlotArgs* a) {
                             return !a->free->empty() || !a->p->error.ok() ||
                                    a->p->removed;
                           },
                           &slot_args),
                       deadline);
  }
  if (free_send_slots_.empty() || !p->error.ok() || p->removed) {
    --p->waiters;
    if (!p->error.ok()) return p->error;
    if (p->removed) return absl::CancelledError(absl::StrCat(what, ": disconnected"));
    return absl::DeadlineExceededError(
        absl::StrCat(what, ": no send slot by the deadline"));
  }
  const int slot = free_send_slots_.back();
  free_send_slots_.pop_back();
  uint8_t* buf =
      msg_buf_ +
      (static_cast<size_t>(rails_.size()) * kRecvSlotsPerRail + slot) * kSlotBytes;
  std::memcpy(buf, bytes.data(), bytes.size());
  if (read_from != nullptr) std::memset(buf, 0, 8);
  Op* op = NewOp(kind, id, rail);
  op->slot = slot;
  op->waited = true;
  iovec iov{buf, read_from != nullptr ? 8 : bytes.size()};
  void* desc = fi_mr_desc(domains_[rails_[rail].domain].msg_mr);
  fi_msg msg{};
  msg.msg_iov = &iov;
  msg.desc = &desc;
  msg.iov_count = 1;
  msg.addr = p->addrs[rail];
  msg.context = &op->fi_ctx;
  ssize_t ret = 0;
  // EAGAIN: the queue is full or (rxm) the connection is being set up; both
  // need progress.
  // Between tries the agent lock is released for up to 1 ms (the progress
  // thread reads the CQs meanwhile), so a slow connection does not hold it.
  struct FailedArgs {
    Peer* p;
  } failed_args{p};
  fi_msg_rma rmsg{};
  rmsg.msg_iov = &iov;
  rmsg.desc = &desc;
  rmsg.iov_count = 1;
  rmsg.addr = p->addrs[rail];
  rmsg.rma_iov = read_from;
  rmsg.rma_iov_count = 1;
  rmsg.context = &op->fi_ctx;
  while (true) {
    ret = read_from != nullptr
              ? fi_readmsg(rails_[rail].ep, &rmsg, FI_COMPLETION)
              : fi_sendmsg(rails_[rail].ep, &msg, FI_COMPLETION | FI_DELIVERY_COMPLETE);
    if (ret != -FI_EAGAIN || absl::Now() >= deadline) break;
    DrainCq(rail);
    host_->AwaitLocked(
        absl::Condition(
            +[](FailedArgs* a) { return !a->p->error.ok() || a->p->removed; },
            &failed_args),
        std::min(deadline, absl::Now() + absl::Milliseconds(1)));
    if (!p->error.ok() || p->removed) break;
  }
  absl::Status st;
  if (ret != 0) {
    op->provider_owned = false;
    st =
        ret == -FI_EAGAIN
            ? (!p->error.ok() ? p->error
               : p->removed ? absl::CancelledError(absl::StrCat(what, ": disconnected"))
                            : absl::DeadlineExceededError(absl::StrCat(
                                  what, ": could not send by the deadline")))
            : FromFi(static_cast<int>(ret),
                     absl::StrCat(what, read_from ? ": fi_readmsg" : ": fi_sendmsg"));
  } else {
    struct Args {
      Op* op;
      Peer* p;
    } args{op, p};
    host_->AwaitLocked(
        absl::Condition(
            +[](Args* a) { return a->op->done || !a->p->error.ok(); }, &args),
        deadline);
    if (op->done) {
      st = op->status;
      if (st.ok() && read_value != nullptr && !op->provider_owned) {
        std::memcpy(read_value, buf, 8);
      }
    } else if (!p->error.ok()) {
      st = p->error;
    } else {
      st = absl::DeadlineExceededError(
          absl::StrCat(what, ": message not delivered by the deadline"));
    }
  }
  // The slot is reused only once the provider let go of it.
  if (!op->provider_owned) free_send_slots_.push_back(slot);
  op->waited = false;
  MaybeFree(op);
  --p->waiters;
  return st;
}

absl::Status LibfabricBackend::SendNotificationLocked(PeerId id, const Notification& n,
                                                      absl::Time deadline,
                                                      std::function<absl::Status()>*) {
  Peer* p = FindPeer(id);
  if (p == nullptr) return absl::NotFoundError(absl::StrCat("unknown peer ", id));
  if (p->removed)
    return absl::CancelledError(absl::StrCat("peer ", id, " disconnected"));
  if (!p->error.ok()) return p->error;
  // The agent waited for every earlier batch to the peer: their completions
  // (FI_DELIVERY_COMPLETE) mean their bytes are visible, so the message may go.
  std::string m(kMessageMagic, 4);
  m.push_back(static_cast<char>(kNotifyMessage));
  PutLe(&m, n.sender_agent_id, 8);
  PutLe(&m, n.request_id.size(), 4);
  m.append(n.request_id);
  PutLe(&m, n.payload.size(), 4);
  m.append(n.payload);
  absl::Status st =
      SendMessageLocked(id, p, 0, Op::kNotify, m, deadline, "sending notification");
  return st;  // a peer forgotten meanwhile is erased by ProgressLocked
}

void LibfabricBackend::OnMessage(const uint8_t* data, size_t len) {
  const uint8_t* p = data;
  const uint8_t* end = data + len;
  if (len < 5 || std::memcmp(p, kMessageMagic, 4) != 0) return;
  const uint8_t type = p[4];
  p += 5;
  if (type != kNotifyMessage) return;
  Notification n;
  if (!GetLe(p, end, 8, &n.sender_agent_id)) return;
  if (!GetBytes(p, end, kMaxNotificationBytes, &n.request_id)) return;
  if (!GetBytes(p, end, kMaxNotificationBytes, &n.payload)) return;
  host_->NotificationReceivedLocked(std::move(n));
}

void LibfabricBackend::Complete(Op* op, absl::Status status) {
  op->provider_owned = false;
  if (op->kind == Op::kPiece) {
    Peer* p = FindPeer(op->peer);
    if (p != nullptr && !op->reported) {
      if (p->outstanding > 0) --p->outstanding;
      p->last_progress = absl::Now();
    }
    ReportPieces(op, status);
  } else if (op->kind == Op::kProbe || op->kind == Op::kNotify) {
    if (!op->done) {
      op->done = true;
      op->status = std::move(status);
    }
    if (!op->waited) free_send_slots_.push_back(op->slot);  // waiter gone
  }
  MaybeFree(op);
}

void LibfabricBackend::FailPeer(PeerId id, Peer* p, absl::Status status) {
  if (p == nullptr || !p->error.ok()) return;
  p->error = std::move(status);
  host_->PeerFailedLocked(id, p->error);
}

int LibfabricBackend::DrainCq(int rail) {
  fid_cq* cq = rails_[rail].cq;
  int total = 0;
  for (int round = 0; round < 8; ++round) {
    fi_cq_data_entry entries[kCqBatch];
    const ssize_t n = fi_cq_read(cq, entries, kCqBatch);
    if (n == -FI_EAGAIN) break;
    if (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      if (fi_cq_readerr(cq, &err, 0) != 1) break;
      ++total;
      auto* op = static_cast<Op*>(err.op_context);
      if (op == nullptr || ops_.count(op) == 0) continue;
      if (op->kind == Op::kRecv) {
        // Cancelled at close, or truncated: re-post while the endpoint lives.
        const int slot = op->slot;
        op->provider_owned = false;
        recv_ops_[slot] = nullptr;
        MaybeFree(op);
        if (err.err != FI_ECANCELED && rails_[rail].ep != nullptr)
          (void)PostRecv(rail, slot);
        continue;
      }
      char buf[256];
      const char* detail =
          fi_cq_strerror(cq, err.prov_errno, err.err_data, buf, sizeof(buf));
      Peer* p = FindPeer(op->peer);
      const absl::Status st = absl::UnavailableError(absl::StrCat(
          "libfabric peer ", absl::Hex(p != nullptr ? p->descriptor.agent_id : 0),
          " failed: ", fi_strerror(err.err), " (", detail != nullptr ? detail : "",
          ")"));
      // An error completion means the connection is gone (or a remote access
      // was refused): the peer fails, like a UCX endpoint error.
      if (p != nullptr && !op->reported && !(op->kind != Op::kPiece && op->done)) {
        FailPeer(op->peer, p, st);
      }
      Complete(op, st);
      continue;
    }
    if (n <= 0) break;
    total += static_cast<int>(n);
    for (ssize_t i = 0; i < n; ++i) {
      auto* op = static_cast<Op*>(entries[i].op_context);
      if (op == nullptr || ops_.count(op) == 0) continue;
      if (op->kind == Op::kRecv) {
        const int slot = op->slot;
        op->provider_owned = false;
        recv_ops_[slot] = nullptr;
        MaybeFree(op);
        if (entries[i].flags & FI_RECV) {
          OnMessage(msg_buf_ + static_cast<size_t>(slot) * kSlotBytes,
                    std::min<size_t>(entries[i].len, kSlotBytes));
        }
        (void)PostRecv(rail, slot);
        continue;
      }
      Complete(op, absl::OkStatus());
    }
    if (n < kCqBatch) break;
  }
  return total;
}

bool LibfabricBackend::ProgressLocked() {
  bool progressed = false;
  // Pieces gathered by the last pass go out first.
  for (auto& [id, p] : peers_) {
    if (p->gathered.op == nullptr || p->removed || !p->error.ok()) continue;
    (void)PostGatheredLocked(id, p.get());  // errors reach the pieces' batch
    if (p->gathered.op == nullptr) progressed = true;
  }
  for (size_t r = 0; r < rails_.size(); ++r) {
    if (rails_[r].ep != nullptr && DrainCq(static_cast<int>(r)) > 0) progressed = true;
  }
  // A peer that holds operations and completes none for progress_timeout is
  // treated as dead (shm: a killed process completes nothing; tcp: a stopped one).
  const absl::Time now = absl::Now();
  for (auto it = peers_.begin(); it != peers_.end();) {
    if (it->second->forgotten && it->second->waiters == 0) {
      it = peers_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto& [id, p] : peers_) {
    if (p->outstanding > 0 && p->error.ok() && !p->removed &&
        now - p->last_progress > config_.progress_timeout) {
      FailPeer(
          id, p.get(),
          absl::UnavailableError(absl::StrCat(
              "libfabric peer ", absl::Hex(p->descriptor.agent_id),
              ": no completion for ", absl::FormatDuration(config_.progress_timeout),
              " (", p->outstanding, " operations outstanding)")));
    }
  }
  return progressed;
}

absl::Duration LibfabricBackend::ArmLocked() {
  // No wait fd (Debian's shm: "CQ wait not yet supported"): nap briefly, since
  // the target's provider carries out incoming RMA (shm's CMA/SAR protocols)
  // only when progressed and nothing wakes it.
  if (!wait_fds_) return config_.idle_poll_interval;
  // fi_trywait per fabric, over the CQs of the rails on it.
  for (size_t f = 0; f < fabrics_.size(); ++f) {
    std::vector<fid*> fids;
    for (Rail& r : rails_) {
      if (domains_[r.domain].fabric == static_cast<int>(f)) fids.push_back(&r.cq->fid);
    }
    if (fids.empty()) continue;
    const int ret =
        fi_trywait(fabrics_[f].fabric, fids.data(), static_cast<int>(fids.size()));
    if (ret == -FI_EAGAIN) return absl::ZeroDuration();
    if (ret != 0) return absl::Milliseconds(1);
  }
  // Bounds how late the progress timeout is checked when idle.
  return absl::Milliseconds(100);
}

void LibfabricBackend::Sleep(absl::Duration timeout) {
  epoll_event events[kMaxRails + 1];
  const int64_t us = std::max<int64_t>(1, absl::ToInt64Microseconds(timeout));
  const timespec ts{static_cast<time_t>(us / 1000000),
                    static_cast<long>((us % 1000000) * 1000)};
  if (epoll_pwait2(epoll_fd_, events, kMaxRails + 1, &ts, nullptr) < 0 &&
      errno == ENOSYS) {  // kernels before 5.11: millisecond resolution
    epoll_wait(epoll_fd_, events, kMaxRails + 1,
               std::max<int>(1, static_cast<int>(us / 1000)));
  }
  uint64_t drained;
  [[maybe_unused]] ssize_t n = read(wake_fd_, &drained, sizeof(drained));
}

LibfabricAgent::LibfabricAgent(std::unique_ptr<LibfabricBackend> backend)
    : AgentCore(std::unique_ptr<Backend>(backend.get())),
      backend_(backend.release()),
      provider_(backend_->provider()),
      fabric_name_(backend_->fabric_name()),
      domain_name_(backend_->domain_name()),
      rails_(static_cast<int>(backend_->NumRails())),
      nics_(backend_->Nics()),
      rail_nics_(backend_->RailNics()),
      iov_limit_(backend_->group_limits().iov_limit),
      rma_iov_limit_(backend_->group_limits().rma_iov_limit),
      hmem_(backend_->hmem()),
      mr_mode_(backend_->mr_mode()) {}

size_t LibfabricAgent::NumLibfabricRegistrationsForTesting() const {
  return backend_->NumRegistrations();
}

uint64_t LibfabricAgent::RmaOpsPostedForTesting() const {
  return backend_->RmaOpsPosted();
}

std::vector<uint64_t> LibfabricAgent::PiecesPerRailForTesting() const {
  std::vector<uint64_t> all = backend_->PiecesPerRail();
  all.resize(backend_->NumRails());
  return all;
}

absl::StatusOr<std::unique_ptr<LibfabricAgent>> LibfabricAgent::Create(
    const LibfabricAgentConfig& config) {
  if (config.max_inflight_ops < 1) {
    return absl::InvalidArgumentError("max_inflight_ops must be >= 1");
  }
  if (config.max_op_bytes < 1) {
    return absl::InvalidArgumentError("max_op_bytes must be >= 1");
  }
  if (config.max_iovs_per_op < 0) {
    return absl::InvalidArgumentError("max_iovs_per_op must be >= 0");
  }
  auto backend = LibfabricBackend::Create(config);
  if (!backend.ok()) return backend.status();
  return std::unique_ptr<LibfabricAgent>(new LibfabricAgent(*std::move(backend)));
}

}  // namespace tandem::kvtransfer
