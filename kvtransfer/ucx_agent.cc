#include "kvtransfer/ucx_agent.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"
#include "kvtransfer/backend.h"

namespace tandem::kvtransfer {
namespace {

constexpr unsigned kNotifyAmId = 0x7a;
constexpr char kNotifyMagic[4] = {'T', 'K', 'V', 'N'};

absl::Status FromUcs(ucs_status_t s, absl::string_view what) {
  const std::string msg = what.empty() ? std::string(ucs_status_string(s))
                                       : absl::StrCat(what, ": ", ucs_status_string(s));
  switch (s) {
    case UCS_OK:
      return absl::OkStatus();
    case UCS_ERR_CANCELED:
      return absl::CancelledError(msg);
    case UCS_ERR_INVALID_PARAM:
      return absl::InvalidArgumentError(msg);
    case UCS_ERR_NO_MEMORY:
      return absl::ResourceExhaustedError(msg);
    case UCS_ERR_TIMED_OUT:
      return absl::DeadlineExceededError(msg);
    default:
      // Endpoint timeouts, resets, unreachable destinations, I/O errors.
      return absl::UnavailableError(msg);
  }
}

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

}  // namespace

// The UCX transport primitives. Every method but Sleep and Wake runs under the
// agent lock (backend.h), which serialises every UCP call; so do the UCX
// callbacks, which run inside ucp_worker_progress.
class UcxBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<UcxBackend>> Create(
      const UcxAgentConfig& config);
  ~UcxBackend() override;

  void Start(BackendHost* host, uint64_t agent_id) override {
    host_ = host;
    agent_id_ = agent_id;
  }
  void ShutdownLocked(absl::Time deadline) override;
  AgentKind Kind() const override { return AgentKind::kUcx; }
  bool cuda_memory() const {
    return (memory_types_ & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  }
  const std::vector<std::string>& resources() const { return resources_; }
  absl::string_view Name() const override { return "UCX"; }
  std::string Address() const override { return worker_address_; }
  BackendLimits Limits() const override {
    BackendLimits l;
    l.max_piece_bytes = config_.max_op_bytes;
    l.max_inflight_ops = config_.max_inflight_ops;
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
  bool BusyLocked() override;
  absl::Duration ArmLocked() override;
  void Sleep(absl::Duration timeout) override;
  void Wake() override;

 private:
  // A piece or fence handed to UCX: its completion's user data. `op` is nulled
  // when the operation is abandoned (the peer failed or was closed by force):
  // its batch was told then, and the late completion, if any, is ignored.
  // Freed by the completion, or with the backend.
  struct DataOp {
    UcxBackend* backend;
    PeerId peer;
    OpToken op;
  };
  // An endpoint to another agent plus the remote keys of its regions. Kept after
  // the agent forgot it until its close completed and no caller waits on it.
  struct Peer {
    UcxBackend* backend;
    PeerId id;
    ucp_ep_h ep = nullptr;
    AgentDescriptor descriptor;
    std::map<uint32_t, ucp_rkey_h> rkeys;
    absl::Status error;  // set once the endpoint failed
    void* close_request = nullptr;
    bool closed = false;     // ep released
    bool forgotten = false;  // the agent forgot it: erase once closed
    int waiters = 0;         // threads in AwaitOpLocked on it
    std::string transport;
    std::set<DataOp*> ops;  // pieces and fences outstanding
    // When an operation to it last completed, or one was posted to it idle:
    // the progress timeout counts from here.
    absl::Time last_progress = absl::InfinitePast();
  };
  // A flush or active message that a caller thread waits for. Heap-allocated: when
  // the caller gives up at its deadline, the completion callback frees it.
  struct PendingOp {
    bool done = false;
    bool abandoned = false;
    ucs_status_t status = UCS_OK;
    std::string buffer;
  };

  explicit UcxBackend(const UcxAgentConfig& config) : config_(config) {}
  absl::Status Init();
  // The packed remote key of `memh`; on failure `memh` is unmapped.
  absl::StatusOr<std::string> PackRkeyOrUnmap(ucp_mem_h memh);
  Peer* FindPeer(PeerId id);
  // The peer if operations may be posted to it (known, not closing), else null.
  Peer* OpenPeer(PeerId id);
  // A DataOp for `op` to `p` (starting its progress clock if `p` was idle), and
  // the callback parameters reporting to it (OnOp).
  DataOp* NewDataOp(Peer* p, OpToken op);
  static ucp_request_param_t OpParam(DataOp* d);
  // The operation completed at once or failed to post: no callback follows.
  void DropDataOp(Peer* p, DataOp* d);
  // Ends every operation outstanding to `p` with `status` (their batches are
  // told now; late completions are ignored).
  void AbandonOpsLocked(Peer* p, const absl::Status& status);
  // Marks `p` failed (UNAVAILABLE `status`), tells the agent, ends its
  // operations.
  void FailPeer(Peer* p, const absl::Status& status);
  // Whether anything to `p` is outstanding (operations or waiters).
  static bool Outstanding(const Peer& p) { return !p.ops.empty() || p.waiters > 0; }
  void ClosePeer(Peer* p, bool graceful, bool wait, absl::Time deadline);
  void ReleaseRkeys(Peer* p);
  // Logs the transports UCX chose for `p`; caches them as p->transport and
  // returns them (the caller reports them to config_.on_peer_connected once it
  // has judged them).
  UcxPeerTransport LogPeerTransport(Peer* p);
  // Waits (agent lock released) for `op` or the peer's failure, by `deadline`.
  absl::Status AwaitOpLocked(PendingOp* op, Peer* p, absl::Time deadline,
                             absl::string_view what);
  // Posts a flush or active message tracked by a PendingOp and waits for it.
  absl::Status FlushAndWaitLocked(Peer* p, absl::Time deadline, absl::string_view what);

  static void OnOp(void* request, ucs_status_t status, void* user_data);
  static void OnPendingOp(void* request, ucs_status_t status, void* user_data);
  static void OnPeerError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static ucs_status_t OnActiveMessage(void* arg, const void* header,
                                      size_t header_length, void* data, size_t length,
                                      const ucp_am_recv_param_t* param);

  const UcxAgentConfig config_;
  BackendHost* host_ = nullptr;  // not owned: the agent
  uint64_t agent_id_ = 0;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;  // UCX worker's
  int wake_fd_ = -1;   // eventfd to interrupt the progress thread's sleep
  int epoll_fd_ = -1;
  std::string worker_address_;
  // UCS_BIT(ucs_memory_type_t) of the memory types this UCX build's transports
  // support (ucp_context_query); host only where UCX was built without CUDA.
  uint64_t memory_types_ = UCS_BIT(UCS_MEMORY_TYPE_HOST);
  std::vector<std::string> resources_;             // ucp_context_print_info's resources
  std::map<RegionId, ucp_mem_h> memh_;             // agent lock
  std::map<PeerId, std::unique_ptr<Peer>> peers_;  // agent lock
  std::set<DataOp*> data_ops_;  // every DataOp not yet freed (agent lock)
};

namespace {

// The body of a ucp_ep_print_info lane line after "lane[i]:", leading blanks
// stripped ("3:cma/memory.0 md[3] ..."); nullopt for any other line.
std::optional<absl::string_view> LaneBody(absl::string_view line) {
  const size_t lane = line.find("lane[");
  if (lane == absl::string_view::npos) return std::nullopt;
  absl::string_view rest = line.substr(lane);
  const size_t colon = rest.find("]:");
  if (colon == absl::string_view::npos) return std::nullopt;
  return absl::StripLeadingAsciiWhitespace(rest.substr(colon + 2));
}

}  // namespace

std::string ParseUcxTransports(absl::string_view ep_info) {
  // Lane lines look like "#   lane[1]:  3:cma/memory.0 md[3] ... rma_bw#0".
  std::vector<std::string> found;
  for (absl::string_view line : absl::StrSplit(ep_info, '\n')) {
    const std::optional<absl::string_view> body = LaneBody(line);
    if (!body.has_value()) continue;
    const absl::string_view rest = *body;
    // After the resource index ("3:").
    const size_t idx = rest.find(':');
    const size_t slash = rest.find('/');
    if (idx == absl::string_view::npos || slash == absl::string_view::npos ||
        slash < idx)
      continue;
    const std::string tl(rest.substr(idx + 1, slash - idx - 1));
    if (tl.empty()) continue;
    bool seen = false;
    for (const std::string& f : found) seen |= (f == tl);
    if (!seen) found.push_back(tl);
  }
  return absl::StrJoin(found, ",");
}

std::string DescribeUcxLanes(absl::string_view ep_info) {
  // "#   lane[0]:  1:tcp/lo.0 md[0]   -> md[0]/tcp/sysdev[255] am am_bw#0 wireup"
  std::vector<std::string> lanes;
  for (absl::string_view line : absl::StrSplit(ep_info, '\n')) {
    const std::optional<absl::string_view> body = LaneBody(line);
    if (!body.has_value()) continue;
    const absl::string_view rest = *body;
    const size_t idx = rest.find(':');
    const size_t space = rest.find(' ');
    if (idx == absl::string_view::npos || space == absl::string_view::npos ||
        space < idx)
      continue;
    const absl::string_view resource = rest.substr(idx + 1, space - idx - 1);
    // The roles follow the remote resource ("-> md[0]/tcp/sysdev[255]").
    std::vector<std::string> roles;
    const size_t arrow = rest.find("->");
    if (arrow != absl::string_view::npos) {
      std::vector<absl::string_view> words =
          absl::StrSplit(rest.substr(arrow + 2), ' ', absl::SkipEmpty());
      for (size_t i = 1; i < words.size(); ++i) {
        absl::string_view w = words[i];
        const size_t hash = w.find('#');
        if (hash != absl::string_view::npos) w = w.substr(0, hash);
        roles.emplace_back(w);
      }
    }
    // A lane with no role listed serves the RMA protocols UCX selects per
    // operation (rkeys / memory domains), e.g. sysv and posix over shared memory.
    lanes.push_back(roles.empty()
                        ? std::string(resource)
                        : absl::StrCat(resource, " (", absl::StrJoin(roles, " "), ")"));
  }
  return absl::StrJoin(lanes, "; ");
}

std::vector<std::string> ParseUcxContextResources(absl::string_view context_info) {
  // "#      resource 0  :  md 0  dev 0  flags -- tcp/eth0"
  std::vector<std::string> out;
  for (absl::string_view line : absl::StrSplit(context_info, '\n')) {
    if (line.find("resource") == absl::string_view::npos) continue;
    const size_t flags = line.find("flags ");
    if (flags == absl::string_view::npos) continue;
    std::vector<absl::string_view> words =
        absl::StrSplit(line.substr(flags), ' ', absl::SkipEmpty());
    if (words.size() < 3) continue;
    const absl::string_view resource = words.back();
    if (resource.find('/') == absl::string_view::npos) continue;
    out.emplace_back(resource);
  }
  return out;
}

bool IsUcxRdmaTransport(absl::string_view tl) {
  for (absl::string_view prefix : {"rc", "dc", "ud", "srd", "ib", "gga"}) {
    if (absl::StartsWith(tl, prefix)) return true;
  }
  return false;
}

bool UcxTransportsAreTcpOnly(absl::string_view transports) {
  if (transports.empty()) return false;
  for (absl::string_view t : absl::StrSplit(transports, ',', absl::SkipEmpty())) {
    if (t != "tcp") return false;
  }
  return true;
}

absl::StatusOr<UcxRdmaRequirement> ParseUcxRdmaRequirement(absl::string_view spec) {
  const std::string v = absl::AsciiStrToLower(absl::StripAsciiWhitespace(spec));
  if (v == "auto") return UcxRdmaRequirement::kAuto;
  if (v == "true" || v == "1" || v == "yes") return UcxRdmaRequirement::kRequired;
  if (v == "false" || v == "0" || v == "no") return UcxRdmaRequirement::kNotRequired;
  return absl::InvalidArgumentError(absl::StrCat(
      "--kv_require_rdma must be auto, true or false, got \"", spec, "\""));
}

absl::Status CheckUcxPeerTransport(const UcxPeerTransport& peer,
                                   UcxRdmaRequirement requirement,
                                   const std::vector<std::string>& resources) {
  if (!peer.tcp_only || requirement == UcxRdmaRequirement::kNotRequired) {
    return absl::OkStatus();
  }
  std::vector<std::string> rdma;
  for (const std::string& r : resources) {
    if (IsUcxRdmaTransport(absl::string_view(r).substr(0, r.find('/')))) {
      rdma.push_back(r);
    }
  }
  if (requirement == UcxRdmaRequirement::kAuto && rdma.empty()) {
    return absl::OkStatus();
  }
  const std::string why =
      requirement == UcxRdmaRequirement::kRequired
          ? std::string("--kv_require_rdma=true")
          : absl::StrCat("this host has RDMA (", absl::StrJoin(rdma, ", "),
                         ") and --kv_require_rdma=auto");
  return absl::FailedPreconditionError(absl::StrCat(
      "KV peer agent ", absl::Hex(peer.peer_agent_id),
      " connected over TCP only (transports ", peer.transports, "; lanes ",
      peer.lanes.empty() ? std::string("unknown") : peer.lanes, ") but ", why,
      " refuses TCP: UCX found no RDMA or shared-memory transport in common with "
      "that peer (its RDMA device, link or UCX_TLS/UCX_NET_DEVICES; EFA: "
      "--kv_transport=libfabric:efa; one host: --ucx_peer_failure_detection=false "
      "for shared memory); --kv_require_rdma=false or --ucx_tls=tcp run over TCP "
      "on purpose"));
}

absl::StatusOr<std::unique_ptr<UcxBackend>> UcxBackend::Create(
    const UcxAgentConfig& config) {
  std::unique_ptr<UcxBackend> backend(new UcxBackend(config));
  absl::Status st = backend->Init();
  if (!st.ok()) return st;
  return backend;
}

absl::Status UcxBackend::Init() {
  ucp_config_t* cfg = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &cfg);
  if (s != UCS_OK) return FromUcs(s, "ucp_config_read");
  std::vector<std::pair<std::string, std::string>> options;
  // Over shared memory UCX 1.13 emulates a put into process memory it did not
  // allocate with active messages (UCX_PROTO_INFO=y: "software emulation"): the
  // data goes through the sysv FIFO and the target copies it out in its progress
  // loop. The v2 protocols' emulation measured ~10x the v1 one; a put into memory
  // from AllocateMemory is a direct copy under both (with MULTI_SEND). An explicit
  // UCX_PROTO_ENABLE in the environment or in ucx_options still wins.
  if (config_.use_proto_v2 && std::getenv("UCX_PROTO_ENABLE") == nullptr)
    options.emplace_back("PROTO_ENABLE", "y");
  options.insert(options.end(), config_.ucx_options.begin(), config_.ucx_options.end());
  if (!config_.tls.empty()) options.emplace_back("TLS", config_.tls);
  if (!config_.net_devices.empty())
    options.emplace_back("NET_DEVICES", config_.net_devices);
  options.emplace_back(
      "KEEPALIVE_INTERVAL",
      absl::StrCat(absl::ToInt64Milliseconds(config_.keepalive_interval), "ms"));
  for (const auto& [name, value] : options) {
    s = ucp_config_modify(cfg, name.c_str(), value.c_str());
    if (s != UCS_OK) {
      ucp_config_release(cfg);
      return absl::InvalidArgumentError(
          absl::StrCat("UCX option ", name, "=", value, ": ", ucs_status_string(s)));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.name = config_.name.c_str();
  s = ucp_init(&params, cfg, &context_);
  ucp_config_release(cfg);
  if (s != UCS_OK) return FromUcs(s, "ucp_init");

  // Which memory types the transports can move: CUDA needs a UCX built with CUDA
  // (the cuda_copy / cuda_ipc transports, gdr_copy, and RDMA with GPUDirect).
  ucp_context_attr_t ca{};
  ca.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(context_, &ca) == UCS_OK) memory_types_ = ca.memory_types;
  // The transports and devices the context opened (what UCX_TLS and the host
  // left): for the start-up log, and to refuse RDMA asked for and not there.
  {
    char* buf = nullptr;
    size_t size = 0;
    if (FILE* f = open_memstream(&buf, &size)) {
      ucp_context_print_info(context_, f);
      fclose(f);
      resources_ = ParseUcxContextResources(absl::string_view(buf, size));
      free(buf);
    }
  }

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  s = ucp_worker_create(context_, &wp, &worker_);
  if (s != UCS_OK) return FromUcs(s, "ucp_worker_create");

  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  s = ucp_worker_get_address(worker_, &addr, &addr_len);
  if (s != UCS_OK) return FromUcs(s, "ucp_worker_get_address");
  worker_address_.assign(reinterpret_cast<const char*>(addr), addr_len);
  ucp_worker_release_address(worker_, addr);

  ucp_am_handler_param_t am{};
  am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                  UCP_AM_HANDLER_PARAM_FIELD_ARG;
  am.id = kNotifyAmId;
  am.cb = &UcxBackend::OnActiveMessage;
  am.arg = this;
  s = ucp_worker_set_am_recv_handler(worker_, &am);
  if (s != UCS_OK) return FromUcs(s, "ucp_worker_set_am_recv_handler");

  s = ucp_worker_get_efd(worker_, &event_fd_);
  if (s != UCS_OK) return FromUcs(s, "ucp_worker_get_efd");
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (wake_fd_ < 0 || epoll_fd_ < 0) {
    return absl::InternalError(absl::StrCat("eventfd/epoll: ", std::strerror(errno)));
  }
  for (int fd : {event_fd_, wake_fd_}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
      return absl::InternalError(absl::StrCat("epoll_ctl: ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

UcxBackend::~UcxBackend() {
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  // Operations UCX never completed (abandoned to a dead peer): no callback can
  // run once the worker is gone.
  for (DataOp* d : data_ops_) delete d;
  data_ops_.clear();
  if (context_ != nullptr) ucp_cleanup(context_);
  if (wake_fd_ >= 0) close(wake_fd_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
}

void UcxBackend::ShutdownLocked(absl::Time deadline) {
  // The agent closed and forgot its peers; endpoints still closing are waited
  // for (forced), then keys, registrations and the worker go.
  for (auto& [id, p] : peers_)
    ClosePeer(p.get(), /*graceful=*/false, /*wait=*/true, deadline);
  for (auto& [id, p] : peers_) ReleaseRkeys(p.get());
  peers_.clear();
  for (auto& [id, memh] : memh_) ucp_mem_unmap(context_, memh);
  memh_.clear();
  ucp_worker_destroy(worker_);
  worker_ = nullptr;
}

void UcxBackend::Wake() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));
}

absl::StatusOr<std::string> UcxBackend::RegisterMemoryLocked(RegionId region,
                                                             void* base, size_t len,
                                                             MemoryKind kind) {
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                  UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  mp.address = base;
  mp.length = len;
  mp.memory_type = UCS_MEMORY_TYPE_HOST;
  if (!kind.is_host()) {
    // Refused here, where a worker registers its cache at start-up, rather than
    // failing (or, worse, host-copying device pointers) at the first transfer.
    if ((memory_types_ & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot register ", MemoryKindName(kind), " memory with UCX ",
          ucp_get_version_string(),
          ": this UCX build has no CUDA memory support (no cuda_copy / cuda_ipc "
          "transports; ucx_info -d lists them). Install a UCX built --with-cuda "
          "(and gdrcopy, nvidia-peermem for GPUDirect RDMA), or serve from a host "
          "backend (--backend cpu)"));
    }
    mp.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  ucp_mem_h memh = nullptr;
  ucs_status_t s = ucp_mem_map(context_, &mp, &memh);
  if (s != UCS_OK) return FromUcs(s, "ucp_mem_map");
  auto rkey = PackRkeyOrUnmap(memh);
  if (rkey.ok()) memh_[region] = memh;
  return rkey;
}

absl::StatusOr<std::string> UcxBackend::PackRkeyOrUnmap(ucp_mem_h memh) {
  void* rkey_buf = nullptr;
  size_t rkey_len = 0;
  const ucs_status_t s = ucp_rkey_pack(context_, memh, &rkey_buf, &rkey_len);
  if (s != UCS_OK) {
    ucp_mem_unmap(context_, memh);
    return FromUcs(s, "ucp_rkey_pack");
  }
  std::string rkey(static_cast<const char*>(rkey_buf), rkey_len);
  ucp_rkey_buffer_release(rkey_buf);
  return rkey;
}

absl::StatusOr<Backend::Allocated> UcxBackend::AllocateMemoryLocked(RegionId region,
                                                                    size_t len) {
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                  UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  mp.address = nullptr;
  mp.length = len;
  mp.flags = UCP_MEM_MAP_ALLOCATE;
  ucp_mem_h memh = nullptr;
  ucs_status_t s = ucp_mem_map(context_, &mp, &memh);
  if (s != UCS_OK) return FromUcs(s, "ucp_mem_map(ALLOCATE)");
  ucp_mem_attr_t attr{};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  s = ucp_mem_query(memh, &attr);
  if (s != UCS_OK || attr.address == nullptr || attr.length < len) {
    ucp_mem_unmap(context_, memh);
    return absl::InternalError("ucp_mem_query on an allocated region failed");
  }
  auto rkey = PackRkeyOrUnmap(memh);
  if (!rkey.ok()) return rkey.status();
  Allocated a;
  a.base = attr.address;
  a.rkey = *std::move(rkey);
  a.zeroed = false;  // UCX does not promise zeroed memory
  memh_[region] = memh;
  return a;
}

void UcxBackend::DeregisterMemoryLocked(RegionId region) {
  auto it = memh_.find(region);
  if (it == memh_.end()) return;
  ucp_mem_unmap(context_, it->second);
  memh_.erase(it);
}

UcxBackend::Peer* UcxBackend::FindPeer(PeerId id) {
  auto it = peers_.find(id);
  return it == peers_.end() ? nullptr : it->second.get();
}

UcxBackend::Peer* UcxBackend::OpenPeer(PeerId id) {
  Peer* p = FindPeer(id);
  if (p == nullptr || p->forgotten || p->closed || p->close_request != nullptr) {
    return nullptr;
  }
  return p;
}

absl::Status UcxBackend::ConnectLocked(PeerId id, const AgentDescriptor& descriptor) {
  if (descriptor.address.empty())
    return absl::InvalidArgumentError("descriptor has no worker address");
  auto peer = std::make_unique<Peer>();
  peer->backend = this;
  peer->id = id;
  peer->descriptor = descriptor;
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                  UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(peer->descriptor.address.data());
  ep.err_mode = config_.peer_failure_detection ? UCP_ERR_HANDLING_MODE_PEER
                                               : UCP_ERR_HANDLING_MODE_NONE;
  ep.err_handler.cb = &UcxBackend::OnPeerError;
  ep.err_handler.arg = peer.get();
  ucs_status_t s = ucp_ep_create(worker_, &ep, &peer->ep);
  if (s != UCS_OK) {
    // A garbled address that still passed the descriptor checksum, or a peer
    // with no transport in common.
    return absl::UnavailableError(
        absl::StrCat("ucp_ep_create: ", ucs_status_string(s)));
  }
  // A half-built connection is closed (waiting a little) and kept until closed.
  auto abandon = [&](absl::Status st) {
    ReleaseRkeys(peer.get());
    ClosePeer(peer.get(), /*graceful=*/false, /*wait=*/true,
              absl::Now() + absl::Seconds(2));
    if (!peer->closed) {
      peer->forgotten = true;
      peers_[id] = std::move(peer);
    }
    return st;
  };
  for (const RegionDescriptor& r : peer->descriptor.regions) {
    ucp_rkey_h rkey = nullptr;
    s = ucp_ep_rkey_unpack(peer->ep, r.rkey.data(), &rkey);
    if (s != UCS_OK) {
      return abandon(absl::InvalidArgumentError(
          absl::StrCat("remote key of region ", r.id, ": ", ucs_status_string(s))));
    }
    peer->rkeys[r.id] = rkey;
  }
  // Complete the wire-up now (the flush needs every lane connected): an
  // unreachable peer fails here, and no half-built connection is left behind.
  absl::Status st = FlushAndWaitLocked(
      peer.get(), absl::Now() + config_.connect_timeout, "connecting");
  if (!st.ok()) {
    if (st.code() != absl::StatusCode::kUnavailable)
      st = absl::UnavailableError(st.message());
    return abandon(st);
  }
  // What UCX chose for this peer: logged and reported (counted) whether or not
  // it is allowed, then refused if it is TCP only where RDMA is required.
  UcxPeerTransport t = LogPeerTransport(peer.get());
  const absl::Status refused =
      CheckUcxPeerTransport(t, config_.require_rdma, resources_);
  t.refused = !refused.ok();
  if (config_.on_peer_connected) config_.on_peer_connected(t);
  if (!refused.ok()) {
    TLOG(ERROR, "KV transfer peer refused: TCP only")
        .Kv("agent", "ucx")
        .Kv("peer_agent", absl::StrCat(absl::Hex(t.peer_agent_id)))
        .Kv("transports", t.transports)
        .Kv("lanes", t.lanes)
        .Kv("error", refused.message());
    return abandon(refused);
  }
  peers_[id] = std::move(peer);
  return absl::OkStatus();
}

UcxPeerTransport UcxBackend::LogPeerTransport(Peer* p) {
  // The lanes UCX chose for this peer: what actually carries its KV.
  char* buf = nullptr;
  size_t size = 0;
  UcxPeerTransport t;
  t.peer_agent_id = p->descriptor.agent_id;
  FILE* f = open_memstream(&buf, &size);
  if (f == nullptr) return t;
  ucp_ep_print_info(p->ep, f);
  fclose(f);
  const absl::string_view info(buf, size);
  t.transports = p->transport = ParseUcxTransports(info);
  t.lanes = DescribeUcxLanes(info);
  free(buf);
  t.tcp_only = UcxTransportsAreTcpOnly(t.transports);
  if (t.tcp_only) {
    TLOG(WARNING, "KV transfer peer connected over TCP only")
        .Kv("agent", "ucx")
        .Kv("peer_agent", absl::StrCat(absl::Hex(t.peer_agent_id)))
        .Kv("transports", t.transports)
        .Kv("lanes", t.lanes)
        .Kv("peer_failure_detection", config_.peer_failure_detection)
        .Kv("hint",
            "one host: --ucx_peer_failure_detection=false (shared memory); between "
            "hosts UCX found no RDMA transport in common (UCX 1.13 has none for EFA: "
            "--kv_transport=libfabric:efa)");
  } else {
    TLOG(INFO, "KV transfer peer connected")
        .Kv("agent", "ucx")
        .Kv("peer_agent", absl::StrCat(absl::Hex(t.peer_agent_id)))
        .Kv("transports", t.transports)
        .Kv("lanes", t.lanes);
  }
  return t;
}

void UcxBackend::ReleaseRkeys(Peer* p) {
  for (auto& [id, rkey] : p->rkeys) ucp_rkey_destroy(rkey);
  p->rkeys.clear();
}

void UcxBackend::ClosePeerLocked(PeerId peer, bool graceful, bool wait,
                                 absl::Time deadline) {
  if (Peer* p = FindPeer(peer)) ClosePeer(p, graceful, wait, deadline);
}

void UcxBackend::ClosePeer(Peer* p, bool graceful, bool wait, absl::Time deadline) {
  if (p->ep != nullptr && p->close_request == nullptr && !p->closed) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    // A healthy, idle endpoint closes gracefully (the peer releases its side);
    // a failed one, or one with operations still in flight, is forced.
    param.flags = (graceful && p->error.ok()) ? 0 : UCP_EP_CLOSE_FLAG_FORCE;
    void* req = ucp_ep_close_nbx(p->ep, &param);
    if (req == nullptr || UCS_PTR_IS_ERR(req)) {
      p->closed = true;
    } else {
      p->close_request = req;
    }
  }
  if (wait) {
    while (p->close_request != nullptr && absl::Now() < deadline) {
      ucp_worker_progress(worker_);
      if (ucp_request_check_status(p->close_request) != UCS_INPROGRESS) {
        ucp_request_free(p->close_request);
        p->close_request = nullptr;
        p->closed = true;
      }
    }
  }
  // A forced close is supposed to complete the outstanding requests
  // (UCS_ERR_CANCELED); without peer-failure detection UCX 1.13 leaves those to
  // a dead peer pending for ever (active-message puts), so what is left ends
  // here and its batches with it.
  if (!graceful || !p->error.ok()) {
    AbandonOpsLocked(p, p->error.ok() ? absl::CancelledError(absl::StrCat(
                                            "peer ", absl::Hex(p->descriptor.agent_id),
                                            " closed with operations outstanding"))
                                      : p->error);
  }
}

void UcxBackend::ForgetPeerLocked(PeerId peer) {
  auto it = peers_.find(peer);
  if (it == peers_.end()) return;
  Peer* p = it->second.get();
  ReleaseRkeys(p);
  p->forgotten = true;
  AbandonOpsLocked(p, absl::CancelledError("peer disconnected"));
  if (p->closed && p->waiters == 0) peers_.erase(it);  // else ProgressLocked erases it
}

absl::StatusOr<Backend::PostResult> UcxBackend::PostPieceLocked(PeerId peer, bool write,
                                                                const Piece& piece,
                                                                OpToken op) {
  Peer* p = OpenPeer(peer);
  if (p == nullptr) return absl::CancelledError("peer disconnected");
  DataOp* d = NewDataOp(p, op);
  ucp_request_param_t bulk = OpParam(d);
  // Data operations may use bandwidth-oriented protocols (the fence does not).
  if (config_.bandwidth_protocols) bulk.op_attr_mask |= UCP_OP_ATTR_FLAG_MULTI_SEND;
  if (!piece.local_memory.is_host()) {
    // The local side is device memory: say so rather than have UCX detect it.
    bulk.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    bulk.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  const uint64_t remote = piece.remote->base + piece.remote_offset;
  ucp_rkey_h rkey = p->rkeys.at(piece.remote->id);
  ucs_status_ptr_t req =
      write ? ucp_put_nbx(p->ep, piece.local, piece.length, remote, rkey, &bulk)
            : ucp_get_nbx(p->ep, piece.local, piece.length, remote, rkey, &bulk);
  if (UCS_PTR_IS_ERR(req) || req == nullptr) DropDataOp(p, d);
  if (UCS_PTR_IS_ERR(req)) return FromUcs(UCS_PTR_STATUS(req), "");
  return req == nullptr ? PostResult::kDone : PostResult::kPending;
}

absl::StatusOr<Backend::PostResult> UcxBackend::PostFenceLocked(PeerId peer,
                                                                OpToken op) {
  Peer* p = OpenPeer(peer);
  if (p == nullptr) return absl::CancelledError("peer disconnected");
  // Completion of a put is local; the flush makes the bytes visible at the target.
  DataOp* d = NewDataOp(p, op);
  const ucp_request_param_t param = OpParam(d);
  ucs_status_ptr_t req = ucp_ep_flush_nbx(p->ep, &param);
  if (UCS_PTR_IS_ERR(req) || req == nullptr) DropDataOp(p, d);
  if (UCS_PTR_IS_ERR(req)) return FromUcs(UCS_PTR_STATUS(req), "");
  return req == nullptr ? PostResult::kDone : PostResult::kPending;
}

UcxBackend::DataOp* UcxBackend::NewDataOp(Peer* p, OpToken op) {
  if (!Outstanding(*p)) p->last_progress = absl::Now();
  auto* d = new DataOp{this, p->id, op};
  p->ops.insert(d);
  data_ops_.insert(d);
  return d;
}

void UcxBackend::DropDataOp(Peer* p, DataOp* d) {
  p->ops.erase(d);
  data_ops_.erase(d);
  delete d;
}

ucp_request_param_t UcxBackend::OpParam(DataOp* d) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &UcxBackend::OnOp;
  param.user_data = d;
  return param;
}

void UcxBackend::OnOp(void* request, ucs_status_t status, void* user_data) {
  auto* d = static_cast<DataOp*>(user_data);
  ucp_request_free(request);
  UcxBackend* self = d->backend;
  if (d->op != nullptr) {  // else abandoned: its batch was told already
    if (Peer* p = self->FindPeer(d->peer)) {
      p->ops.erase(d);
      p->last_progress = absl::Now();
    }
    ReportOpDone(d->op, status == UCS_OK ? absl::OkStatus() : FromUcs(status, ""));
  }
  self->data_ops_.erase(d);
  delete d;
}

void UcxBackend::AbandonOpsLocked(Peer* p, const absl::Status& status) {
  for (DataOp* d : p->ops) {
    ReportOpDone(d->op, status);
    d->op = nullptr;
  }
  p->ops.clear();
}

void UcxBackend::FailPeer(Peer* p, const absl::Status& status) {
  if (!p->error.ok()) return;
  p->error = status;
  host_->PeerFailedLocked(p->id, p->error);
  AbandonOpsLocked(p, p->error);
}

bool UcxBackend::ProgressLocked() {
  bool progressed = false;
  for (int i = 0; i < 64; ++i) {
    if (ucp_worker_progress(worker_) == 0) break;
    progressed = true;
  }
  for (auto it = peers_.begin(); it != peers_.end();) {
    Peer* p = it->second.get();
    if (p->close_request != nullptr &&
        ucp_request_check_status(p->close_request) != UCS_INPROGRESS) {
      ucp_request_free(p->close_request);
      p->close_request = nullptr;
      p->closed = true;
    }
    if (p->forgotten && p->closed && p->waiters == 0) {
      AbandonOpsLocked(p, absl::CancelledError("peer disconnected"));
      it = peers_.erase(it);
    } else {
      ++it;
    }
  }
  // A peer that holds operations and completes none for progress_timeout is
  // treated as dead: without peer-failure detection nothing else tells (shared
  // memory: a killed or stopped process completes nothing).
  if (config_.progress_timeout != absl::InfiniteDuration()) {
    const absl::Time now = absl::Now();
    for (auto& [id, p] : peers_) {
      if (p->forgotten || !p->error.ok() || !Outstanding(*p) ||
          now - p->last_progress <= config_.progress_timeout) {
        continue;
      }
      FailPeer(
          p.get(),
          absl::UnavailableError(absl::StrCat(
              "peer ", absl::Hex(p->descriptor.agent_id), " failed: no completion for ",
              absl::FormatDuration(config_.progress_timeout), " (", p->ops.size(),
              " operations, ", p->waiters, " waits outstanding; dead or stopped)")));
    }
  }
  return progressed;
}

bool UcxBackend::BusyLocked() {
  for (const auto& [id, p] : peers_) {
    if (p->close_request != nullptr) return true;
  }
  return false;
}

absl::Duration UcxBackend::ArmLocked() {
  const ucs_status_t s = ucp_worker_arm(worker_);
  if (s == UCS_ERR_BUSY) return absl::ZeroDuration();
  // The timeout bounds how late keep-alive and error handling run when idle.
  return s == UCS_OK ? absl::Milliseconds(100) : absl::Milliseconds(1);
}

void UcxBackend::Sleep(absl::Duration timeout) {
  epoll_event events[2];
  epoll_wait(epoll_fd_, events, 2,
             static_cast<int>(absl::ToInt64Milliseconds(timeout)));
  uint64_t drained;
  [[maybe_unused]] ssize_t n = read(wake_fd_, &drained, sizeof(drained));
}

void UcxBackend::OnPendingOp(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<PendingOp*>(user_data);
  ucp_request_free(request);
  if (op->abandoned) {
    delete op;
    return;
  }
  op->done = true;
  op->status = status;
}

absl::Status UcxBackend::AwaitOpLocked(PendingOp* op, Peer* p, absl::Time deadline,
                                       absl::string_view what) {
  struct Args {
    PendingOp* op;
    Peer* p;
  } args{op, p};
  if (!Outstanding(*p)) p->last_progress = absl::Now();
  ++p->waiters;  // keeps `p` alive while the agent lock is released
  host_->AwaitLocked(
      absl::Condition(
          +[](Args* a) { return a->op->done || !a->p->error.ok(); }, &args),
      deadline);
  --p->waiters;
  if (op->done) {
    p->last_progress = absl::Now();
    absl::Status st = FromUcs(op->status, what);
    delete op;
    return st;
  }
  op->abandoned = true;  // freed by OnPendingOp
  if (!p->error.ok()) return p->error;
  return absl::DeadlineExceededError(
      absl::StrCat(what, ": not complete at the deadline"));
}

absl::Status UcxBackend::FlushAndWaitLocked(Peer* p, absl::Time deadline,
                                            absl::string_view what) {
  auto* op = new PendingOp();
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &UcxBackend::OnPendingOp;
  param.user_data = op;
  ucs_status_ptr_t req = ucp_ep_flush_nbx(p->ep, &param);
  if (UCS_PTR_IS_ERR(req)) {
    delete op;
    return FromUcs(UCS_PTR_STATUS(req), what);
  }
  if (req == nullptr) {
    delete op;
    return absl::OkStatus();
  }
  return AwaitOpLocked(op, p, deadline, what);
}

absl::Status UcxBackend::SendNotificationLocked(PeerId peer, const Notification& n,
                                                absl::Time deadline,
                                                std::function<absl::Status()>*) {
  Peer* p = FindPeer(peer);
  if (p == nullptr || p->forgotten) {
    return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
  }
  if (!p->error.ok()) return p->error;
  // Fence: every byte written to the peer so far is visible before the message.
  absl::Status st = FlushAndWaitLocked(p, deadline, "flush before notification");
  if (!st.ok()) return st;
  // The flush released the agent lock: a Disconnect may have closed the endpoint
  // (the Peer outlives it while this thread waits on it) or it may have failed.
  if (p->closed || p->forgotten || p->ep == nullptr) {
    return absl::CancelledError(
        absl::StrCat("peer ", peer, " disconnected before the notification"));
  }
  if (!p->error.ok()) return p->error;
  auto* op = new PendingOp();
  op->buffer.assign(kNotifyMagic, 4);
  PutLe(&op->buffer, n.sender_agent_id, 8);
  PutLe(&op->buffer, n.request_id.size(), 4);
  op->buffer.append(n.request_id);
  PutLe(&op->buffer, n.payload.size(), 4);
  op->buffer.append(n.payload);
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                       UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = &UcxBackend::OnPendingOp;
  param.flags = UCP_AM_SEND_FLAG_EAGER;
  param.user_data = op;
  ucs_status_ptr_t req = ucp_am_send_nbx(p->ep, kNotifyAmId, nullptr, 0,
                                         op->buffer.data(), op->buffer.size(), &param);
  if (UCS_PTR_IS_ERR(req)) {
    delete op;
    return FromUcs(UCS_PTR_STATUS(req), "sending notification");
  }
  if (req == nullptr) {
    delete op;
    return absl::OkStatus();
  }
  return AwaitOpLocked(op, p, deadline, "sending notification");
}

ucs_status_t UcxBackend::OnActiveMessage(void* arg, const void* /*header*/,
                                         size_t /*header_length*/, void* data,
                                         size_t length,
                                         const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxBackend*>(arg);
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) return UCS_OK;  // never sent by us
  const auto* p = static_cast<const uint8_t*>(data);
  const uint8_t* end = p + length;
  if (length < 4 || std::memcmp(p, kNotifyMagic, 4) != 0) return UCS_OK;
  p += 4;
  Notification n;
  uint64_t len = 0;
  if (!GetLe(p, end, 8, &n.sender_agent_id)) return UCS_OK;
  if (!GetLe(p, end, 4, &len) || len > static_cast<uint64_t>(end - p)) return UCS_OK;
  n.request_id.assign(reinterpret_cast<const char*>(p), len);
  p += len;
  if (!GetLe(p, end, 4, &len) || len > static_cast<uint64_t>(end - p)) return UCS_OK;
  n.payload.assign(reinterpret_cast<const char*>(p), len);
  // Runs inside ucp_worker_progress, under the agent lock.
  self->host_->NotificationReceivedLocked(std::move(n));
  return UCS_OK;
}

void UcxBackend::OnPeerError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* p = static_cast<Peer*>(arg);
  if (p->error.ok()) {
    p->error =
        absl::UnavailableError(absl::StrCat("peer ", absl::Hex(p->descriptor.agent_id),
                                            " failed: ", ucs_status_string(status)));
    p->backend->host_->PeerFailedLocked(p->id, p->error);
  }
}

std::string UcxBackend::TransportLocked(PeerId peer) {
  Peer* p = FindPeer(peer);
  if (p == nullptr || p->ep == nullptr || p->closed) return "";
  if (!p->transport.empty()) return p->transport;
  char* buf = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&buf, &size);
  if (f == nullptr) return "";
  ucp_ep_print_info(p->ep, f);
  fclose(f);
  p->transport = ParseUcxTransports(absl::string_view(buf, size));
  free(buf);
  return p->transport;
}

UcxAgent::UcxAgent(std::unique_ptr<Backend> backend, bool cuda_memory,
                   std::vector<std::string> resources)
    : AgentCore(std::move(backend)),
      cuda_memory_(cuda_memory),
      resources_(std::move(resources)) {}

absl::StatusOr<std::unique_ptr<UcxAgent>> UcxAgent::Create(
    const UcxAgentConfig& config) {
  if (config.max_inflight_ops < 1) {
    return absl::InvalidArgumentError("max_inflight_ops must be >= 1");
  }
  if (config.max_op_bytes < 1) {
    return absl::InvalidArgumentError("max_op_bytes must be >= 1");
  }
  auto backend = UcxBackend::Create(config);
  if (!backend.ok()) return backend.status();
  const bool cuda_memory = (*backend)->cuda_memory();
  std::vector<std::string> resources = (*backend)->resources();
  return std::unique_ptr<UcxAgent>(
      new UcxAgent(*std::move(backend), cuda_memory, std::move(resources)));
}

}  // namespace tandem::kvtransfer
