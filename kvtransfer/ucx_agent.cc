#include "kvtransfer/ucx_agent.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kvtransfer/segment_check.h"

namespace tandem::kvtransfer {

// An endpoint to another agent plus the remote keys of its regions.
struct UcxAgent::Peer {
  UcxAgent* agent;
  PeerId id;
  ucp_ep_h ep = nullptr;
  AgentDescriptor descriptor;
  std::map<uint32_t, ucp_rkey_h> rkeys;
  absl::Status error;  // set once the endpoint failed
  void* close_request = nullptr;
  bool closed = false;        // ep released
  bool disconnected = false;  // Disconnect() called: erase once closed
  std::string transport;
};

struct UcxAgent::Batch {
  BatchId id;
  PeerId peer;
  bool write;
  std::vector<Segment> segments;
  CompletionCallback on_done;
  UcxAgent* agent;
  size_t next_segment = 0;
  uint64_t next_offset = 0;  // bytes of segments[next_segment] already posted
  uint64_t bytes = 0;        // total of the segments
  int inflight = 0;
  bool flush_posted = false;
  bool cancel_requested = false;
  bool ended = false;
  absl::Status status;  // first error
};

// A flush or active message that a caller thread waits for. Heap-allocated: when
// the caller gives up at its deadline, the completion callback frees it.
struct UcxAgent::PendingOp {
  bool done = false;
  bool abandoned = false;
  ucs_status_t status = UCS_OK;
  std::string buffer;
};

namespace {

constexpr unsigned kNotifyAmId = 0x7a;
constexpr char kNotifyMagic[4] = {'T', 'K', 'V', 'N'};

absl::Status FromUcs(ucs_status_t s, absl::string_view what) {
  const std::string msg = absl::StrCat(what, ": ", ucs_status_string(s));
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

uint64_t RandomId() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ 1;
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

std::string ParseUcxTransports(absl::string_view ep_info) {
  // Lane lines look like "#   lane[1]:  3:cma/memory.0 md[3] ... rma_bw#0".
  std::vector<std::string> found;
  for (absl::string_view line : absl::StrSplit(ep_info, '\n')) {
    const size_t lane = line.find("lane[");
    if (lane == absl::string_view::npos) continue;
    absl::string_view rest = line.substr(lane);
    const size_t colon = rest.find("]:");
    if (colon == absl::string_view::npos) continue;
    rest = rest.substr(colon + 2);
    // Skip blanks and the resource index ("3:").
    while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
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

UcxAgent::UcxAgent(const UcxAgentConfig& config)
    : config_(config), agent_id_(RandomId()) {}

absl::StatusOr<std::unique_ptr<UcxAgent>> UcxAgent::Create(
    const UcxAgentConfig& config) {
  if (config.max_inflight_ops < 1) {
    return absl::InvalidArgumentError("max_inflight_ops must be >= 1");
  }
  if (config.max_op_bytes < 1) {
    return absl::InvalidArgumentError("max_op_bytes must be >= 1");
  }
  std::unique_ptr<UcxAgent> agent(new UcxAgent(config));
  absl::Status st = agent->Init();
  if (!st.ok()) return st;
  return agent;
}

absl::Status UcxAgent::Init() {
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
  am.cb = &UcxAgent::OnActiveMessage;
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
  progress_ = std::thread([this] { ProgressLoop(); });
  return absl::OkStatus();
}

UcxAgent::~UcxAgent() {
  if (progress_.joinable()) {
    {
      absl::MutexLock l(&mu_);
      stop_ = true;
    }
    Wake();
    progress_.join();
  }
  if (worker_ != nullptr) {
    absl::MutexLock l(&mu_);
    // Force-close every endpoint: outstanding operations complete with errors,
    // their batches end, then keys, registrations, worker and context go.
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    for (auto& [id, p] : peers_) ClosePeerLocked(p.get(), /*wait=*/true, deadline);
    for (auto& [id, p] : peers_) ReleasePeerLocked(p.get());
    peers_.clear();
    for (auto& [id, r] : regions_) ucp_mem_unmap(context_, r.memh);
    regions_.clear();
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
  }
  if (context_ != nullptr) ucp_cleanup(context_);
  if (wake_fd_ >= 0) close(wake_fd_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
}

void UcxAgent::Wake() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));
}

absl::StatusOr<RegionId> UcxAgent::RegisterMemory(void* base, size_t len) {
  if (base == nullptr || len == 0) {
    return absl::InvalidArgumentError("RegisterMemory: null base or empty region");
  }
  absl::MutexLock l(&mu_);
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = base;
  mp.length = len;
  ucp_mem_h memh = nullptr;
  ucs_status_t s = ucp_mem_map(context_, &mp, &memh);
  if (s != UCS_OK) return FromUcs(s, "ucp_mem_map");
  void* rkey_buf = nullptr;
  size_t rkey_len = 0;
  s = ucp_rkey_pack(context_, memh, &rkey_buf, &rkey_len);
  if (s != UCS_OK) {
    ucp_mem_unmap(context_, memh);
    return FromUcs(s, "ucp_rkey_pack");
  }
  Region r{base, len, memh, std::string(static_cast<const char*>(rkey_buf), rkey_len)};
  ucp_rkey_buffer_release(rkey_buf);
  const RegionId id = next_region_++;
  regions_[id] = std::move(r);
  return id;
}

absl::StatusOr<Allocation> UcxAgent::AllocateMemory(size_t len) {
  if (len == 0) return absl::InvalidArgumentError("AllocateMemory: empty region");
  Region r{nullptr, len, nullptr, ""};
  {
    absl::MutexLock l(&mu_);
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.address = nullptr;
    mp.length = len;
    mp.flags = UCP_MEM_MAP_ALLOCATE;
    ucs_status_t s = ucp_mem_map(context_, &mp, &r.memh);
    if (s != UCS_OK) return FromUcs(s, "ucp_mem_map(ALLOCATE)");
    ucp_mem_attr_t attr{};
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    s = ucp_mem_query(r.memh, &attr);
    if (s != UCS_OK || attr.address == nullptr || attr.length < len) {
      ucp_mem_unmap(context_, r.memh);
      return absl::InternalError("ucp_mem_query on an allocated region failed");
    }
    r.base = attr.address;
    void* rkey_buf = nullptr;
    size_t rkey_len = 0;
    s = ucp_rkey_pack(context_, r.memh, &rkey_buf, &rkey_len);
    if (s != UCS_OK) {
      ucp_mem_unmap(context_, r.memh);
      return FromUcs(s, "ucp_rkey_pack");
    }
    r.rkey.assign(static_cast<const char*>(rkey_buf), rkey_len);
    ucp_rkey_buffer_release(rkey_buf);
  }
  // UCX does not promise zeroed memory; cleared before anyone can name it, and
  // without the agent lock (gigabytes take a while).
  std::memset(r.base, 0, len);
  absl::MutexLock l(&mu_);
  const RegionId id = next_region_++;
  void* base = r.base;
  regions_[id] = std::move(r);
  return Allocation{id, base};
}

absl::Status UcxAgent::DeregisterMemory(RegionId region) {
  absl::MutexLock l(&mu_);
  auto it = regions_.find(region);
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat("region ", region, " is not registered"));
  }
  for (const auto& [id, b] : batches_) {
    if (b->ended) continue;
    for (const Segment& s : b->segments) {
      if (s.local_region == region) {
        return absl::FailedPreconditionError(
            absl::StrCat("region ", region, " is used by in-flight batch ", id));
      }
    }
  }
  ucp_mem_unmap(context_, it->second.memh);
  regions_.erase(it);
  return absl::OkStatus();
}

size_t UcxAgent::NumRegisteredRegions() const {
  absl::MutexLock l(&mu_);
  return regions_.size();
}

size_t UcxAgent::NumBatchesForTesting() const {
  absl::MutexLock l(&mu_);
  return batches_.size();
}

absl::StatusOr<std::string> UcxAgent::LocalDescriptor(absl::string_view metadata) {
  if (metadata.size() > kMaxDescriptorMetadataBytes) {
    return absl::InvalidArgumentError("descriptor metadata too large");
  }
  AgentDescriptor d;
  d.kind = AgentKind::kUcx;
  d.agent_id = agent_id_;
  d.address = worker_address_;
  d.metadata = std::string(metadata);
  absl::MutexLock l(&mu_);
  for (const auto& [id, r] : regions_) {
    d.regions.push_back(
        RegionDescriptor{id, reinterpret_cast<uint64_t>(r.base), r.length, r.rkey});
  }
  return SerializeDescriptor(d);
}

absl::StatusOr<PeerId> UcxAgent::Connect(absl::string_view peer_descriptor) {
  auto d = ParseDescriptor(peer_descriptor);
  if (!d.ok()) return d.status();
  if (d->kind != AgentKind::kUcx)
    return absl::InvalidArgumentError("descriptor is not a UCX agent's");
  if (d->address.empty())
    return absl::InvalidArgumentError("descriptor has no worker address");
  absl::MutexLock l(&mu_);
  auto peer = std::make_unique<Peer>();
  peer->agent = this;
  peer->id = next_peer_++;
  peer->descriptor = *std::move(d);
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                  UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(peer->descriptor.address.data());
  ep.err_mode = config_.peer_failure_detection ? UCP_ERR_HANDLING_MODE_PEER
                                               : UCP_ERR_HANDLING_MODE_NONE;
  ep.err_handler.cb = &UcxAgent::OnPeerError;
  ep.err_handler.arg = peer.get();
  ucs_status_t s = ucp_ep_create(worker_, &ep, &peer->ep);
  if (s != UCS_OK) {
    // A garbled address that still passed the descriptor checksum, or a peer
    // with no transport in common.
    return absl::UnavailableError(
        absl::StrCat("ucp_ep_create: ", ucs_status_string(s)));
  }
  for (const RegionDescriptor& r : peer->descriptor.regions) {
    ucp_rkey_h rkey = nullptr;
    s = ucp_ep_rkey_unpack(peer->ep, r.rkey.data(), &rkey);
    if (s != UCS_OK) {
      ReleasePeerLocked(peer.get());
      ClosePeerLocked(peer.get(), /*wait=*/true, absl::Now() + absl::Seconds(2));
      return absl::InvalidArgumentError(
          absl::StrCat("remote key of region ", r.id, ": ", ucs_status_string(s)));
    }
    peer->rkeys[r.id] = rkey;
  }
  // Complete the wire-up now (the flush needs every lane connected): an
  // unreachable peer fails here, and no half-built connection is left behind.
  auto* op = new PendingOp();
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &UcxAgent::OnPendingOp;
  param.user_data = op;
  ucs_status_ptr_t req = ucp_ep_flush_nbx(peer->ep, &param);
  absl::Status st;
  if (UCS_PTR_IS_ERR(req)) {
    delete op;
    st = FromUcs(UCS_PTR_STATUS(req), "connecting");
  } else if (req == nullptr) {
    delete op;
  } else {
    ++busy_waiters_;
    Wake();
    st = AwaitOpLocked(op, peer.get(), absl::Now() + config_.connect_timeout,
                       "connecting");
    --busy_waiters_;
  }
  if (!st.ok()) {
    ReleasePeerLocked(peer.get());
    ClosePeerLocked(peer.get(), /*wait=*/true, absl::Now() + absl::Seconds(2));
    if (st.code() != absl::StatusCode::kUnavailable)
      st = absl::UnavailableError(st.message());
    return st;
  }
  const PeerId id = peer->id;
  peers_[id] = std::move(peer);
  return id;
}

void UcxAgent::ReleasePeerLocked(Peer* p) {
  for (auto& [id, rkey] : p->rkeys) ucp_rkey_destroy(rkey);
  p->rkeys.clear();
}

void UcxAgent::ClosePeerLocked(Peer* p, bool wait, absl::Time deadline) {
  if (p->ep != nullptr && p->close_request == nullptr && !p->closed) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    // A healthy, idle endpoint closes gracefully (the peer releases its side);
    // a failed one, or one with operations still in flight, is forced.
    bool idle = true;
    for (const auto& [id, b] : batches_) idle &= b->ended || b->peer != p->id;
    param.flags = (p->error.ok() && idle) ? 0 : UCP_EP_CLOSE_FLAG_FORCE;
    void* req = ucp_ep_close_nbx(p->ep, &param);
    if (req == nullptr || UCS_PTR_IS_ERR(req)) {
      p->closed = true;
    } else {
      p->close_request = req;
    }
  }
  if (!wait) return;
  while (p->close_request != nullptr && absl::Now() < deadline) {
    ucp_worker_progress(worker_);
    if (ucp_request_check_status(p->close_request) != UCS_INPROGRESS) {
      ucp_request_free(p->close_request);
      p->close_request = nullptr;
      p->closed = true;
    }
  }
}

absl::Status UcxAgent::Disconnect(PeerId peer) {
  absl::MutexLock l(&mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end())
    return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
  Peer* p = it->second.get();
  for (auto& [id, b] : batches_) {
    if (b->peer == peer && !b->ended) {
      b->cancel_requested = true;
      if (b->status.ok()) b->status = absl::CancelledError("peer disconnected");
    }
  }
  ClosePeerLocked(p, /*wait=*/true, absl::Now() + absl::Seconds(5));
  for (auto& [id, b] : batches_) {
    if (b->peer == peer) MaybeEndLocked(b.get());
  }
  ReleasePeerLocked(p);
  p->disconnected = true;
  if (p->closed) peers_.erase(it);  // else the progress thread erases it once closed
  return absl::OkStatus();
}

size_t UcxAgent::NumPeers() const {
  absl::MutexLock l(&mu_);
  size_t n = 0;
  for (const auto& [id, p] : peers_) n += p->disconnected ? 0 : 1;
  return n;
}

absl::StatusOr<BatchId> UcxAgent::PostWrite(PeerId peer,
                                            absl::Span<const Segment> segments,
                                            CompletionCallback on_done) {
  return Post(peer, segments, /*write=*/true, std::move(on_done));
}

absl::StatusOr<BatchId> UcxAgent::PostRead(PeerId peer,
                                           absl::Span<const Segment> segments,
                                           CompletionCallback on_done) {
  return Post(peer, segments, /*write=*/false, std::move(on_done));
}

absl::StatusOr<BatchId> UcxAgent::Post(PeerId peer, absl::Span<const Segment> segments,
                                       bool write, CompletionCallback on_done) {
  BatchId id = 0;
  {
    absl::MutexLock l(&mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end() || it->second->disconnected) {
      return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
    }
    Peer* p = it->second.get();
    if (!p->error.ok()) return p->error;
    absl::Status st = CheckSegments(
        segments,
        [this](RegionId r) ABSL_NO_THREAD_SAFETY_ANALYSIS -> uint64_t {
          auto x = regions_.find(r);
          return x == regions_.end() ? 0 : x->second.length;
        },
        p->descriptor);
    if (!st.ok()) return st;
    auto b = std::make_unique<Batch>();
    b->id = id = next_batch_++;
    b->peer = peer;
    b->write = write;
    b->segments.assign(segments.begin(), segments.end());
    for (const Segment& seg : segments) b->bytes += seg.length;
    b->on_done = std::move(on_done);
    b->agent = this;
    Batch* raw = b.get();
    batches_[id] = std::move(b);
    // A small batch is posted here (its latency is one post + flush); a large one
    // by the progress thread, so the caller returns at once.
    if (raw->bytes <= config_.inline_post_bytes) {
      uint64_t budget = raw->bytes + 1;
      PumpLocked(raw, &budget);
      MaybeEndLocked(raw);
    }
  }
  Wake();
  return id;
}

void UcxAgent::OnBatchOp(void* request, ucs_status_t status, void* user_data) {
  auto* b = static_cast<Batch*>(user_data);
  --b->inflight;
  if (status != UCS_OK && b->status.ok()) {
    b->status =
        FromUcs(status, absl::StrCat(b->write ? "write" : "read", " batch ", b->id));
  }
  ucp_request_free(request);
}

void UcxAgent::PumpLocked(Batch* b, uint64_t* budget) {
  auto it = peers_.find(b->peer);
  Peer* p = it == peers_.end() ? nullptr : it->second.get();
  if (p == nullptr || p->closed || p->close_request != nullptr) {
    if (b->status.ok()) b->status = absl::CancelledError("peer disconnected");
    return;
  }
  if (!p->error.ok() && b->status.ok()) b->status = p->error;
  if (b->cancel_requested || !b->status.ok()) return;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &UcxAgent::OnBatchOp;
  param.user_data = b;
  // Data operations may use bandwidth-oriented protocols; the flush keeps `param`.
  ucp_request_param_t bulk = param;
  if (config_.bandwidth_protocols) bulk.op_attr_mask |= UCP_OP_ATTR_FLAG_MULTI_SEND;
  while (b->next_segment < b->segments.size() &&
         b->inflight<config_.max_inflight_ops&& * budget> 0) {
    const Segment& s = b->segments[b->next_segment];
    auto r = regions_.find(s.local_region);
    if (r == regions_.end()) {
      b->status = absl::InternalError("local region vanished during a transfer");
      return;
    }
    // At most max_op_bytes per operation: over shared memory UCX copies inline,
    // under mu_, so this bounds how long Wait deadlines, Cancel and other
    // batches wait for the lock.
    const uint64_t len =
        std::min<uint64_t>(s.length - b->next_offset, config_.max_op_bytes);
    void* local =
        static_cast<uint8_t*>(r->second.base) + s.local_offset + b->next_offset;
    const RegionDescriptor* rd = p->descriptor.FindRegion(s.remote_region);
    const uint64_t remote = rd->base + s.remote_offset + b->next_offset;
    ucp_rkey_h rkey = p->rkeys.at(s.remote_region);
    ucs_status_ptr_t req = b->write
                               ? ucp_put_nbx(p->ep, local, len, remote, rkey, &bulk)
                               : ucp_get_nbx(p->ep, local, len, remote, rkey, &bulk);
    *budget -= std::min(*budget, len);
    b->next_offset += len;
    if (b->next_offset == s.length) {
      ++b->next_segment;
      b->next_offset = 0;
    }
    if (UCS_PTR_IS_ERR(req)) {
      b->status = FromUcs(UCS_PTR_STATUS(req), absl::StrCat("posting batch ", b->id));
      return;
    }
    if (req != nullptr) ++b->inflight;
  }
  if (b->next_segment == b->segments.size() && !b->flush_posted) {
    // Completion of a put is local; the flush makes the batch's bytes visible at
    // the target before the batch is reported complete.
    b->flush_posted = true;
    ucs_status_ptr_t req = ucp_ep_flush_nbx(p->ep, &param);
    if (UCS_PTR_IS_ERR(req)) {
      b->status = FromUcs(UCS_PTR_STATUS(req), absl::StrCat("flushing batch ", b->id));
    } else if (req != nullptr) {
      ++b->inflight;
    }
  }
}

void UcxAgent::MaybeEndLocked(Batch* b) {
  if (b->ended || b->inflight > 0) return;
  const bool stopped = b->cancel_requested || !b->status.ok();
  if (!stopped && !b->flush_posted) return;
  b->ended = true;
  if (b->cancel_requested && b->status.ok()) {
    b->status = absl::CancelledError(absl::StrCat("batch ", b->id, " cancelled"));
  }
  if (b->on_done) done_callbacks_.push_back({b->on_done, {b->id, b->status}});
}

bool UcxAgent::ServiceLocked() {
  for (auto it = peers_.begin(); it != peers_.end();) {
    Peer* p = it->second.get();
    if (!p->error.ok() && !p->closed) ClosePeerLocked(p, /*wait=*/false, absl::Now());
    if (p->close_request != nullptr &&
        ucp_request_check_status(p->close_request) != UCS_INPROGRESS) {
      ucp_request_free(p->close_request);
      p->close_request = nullptr;
      p->closed = true;
    }
    if (p->disconnected && p->closed) {
      it = peers_.erase(it);
    } else {
      ++it;
    }
  }
  // Batches are served in order, about max_op_bytes per pass, so the lock is
  // released between operations that UCX completes inline.
  uint64_t budget = config_.max_op_bytes;
  for (auto& [id, b] : batches_) {
    if (b->ended) continue;
    PumpLocked(b.get(), &budget);
    MaybeEndLocked(b.get());
  }
  return budget < config_.max_op_bytes;
}

void UcxAgent::RunCallbacks() {
  std::vector<std::pair<CompletionCallback, std::pair<BatchId, absl::Status>>> done;
  std::vector<Notification> notes;
  NotificationCallback ncb;
  {
    absl::MutexLock l(&mu_);
    done.swap(done_callbacks_);
    notes.swap(to_dispatch_);
    ncb = notification_callback_;
  }
  for (auto& [cb, arg] : done) cb(arg.first, arg.second);
  if (!notes.empty()) {
    absl::MutexLock c(&callback_mu_);
    for (const Notification& n : notes) {
      if (ncb) {
        ncb(n);
      } else {
        absl::MutexLock l(&mu_);
        notifications_.push_back(n);
      }
    }
  }
}

void UcxAgent::ProgressLoop() {
  while (true) {
    bool active = false;
    bool progressed = false;
    {
      absl::MutexLock l(&mu_);
      if (stop_) break;
      for (int i = 0; i < 64; ++i) {
        if (ucp_worker_progress(worker_) == 0) break;
        progressed = true;
      }
      // Posting is progress too: no yield between pieces of a transfer (on a
      // loaded machine a yield per piece hands the core to other processes).
      progressed |= ServiceLocked();
      active = busy_waiters_ > 0;
      for (const auto& [id, b] : batches_) active |= !b->ended;
      for (const auto& [id, p] : peers_) active |= p->close_request != nullptr;
    }
    RunCallbacks();
    if (progressed) continue;
    if (active) {
      std::this_thread::yield();
      continue;
    }
    ucs_status_t s;
    {
      absl::MutexLock l(&mu_);
      if (stop_) break;
      s = ucp_worker_arm(worker_);
    }
    if (s == UCS_ERR_BUSY) continue;
    epoll_event events[2];
    // The timeout bounds how late keep-alive and error handling run when idle.
    epoll_wait(epoll_fd_, events, 2, s == UCS_OK ? 100 : 1);
    uint64_t drained;
    [[maybe_unused]] ssize_t n = read(wake_fd_, &drained, sizeof(drained));
  }
}

absl::StatusOr<bool> UcxAgent::Poll(BatchId batch) {
  absl::MutexLock l(&mu_);
  auto it = batches_.find(batch);
  if (it == batches_.end())
    return absl::NotFoundError(absl::StrCat("unknown batch ", batch));
  if (!it->second->ended) return false;
  absl::Status st = it->second->status;
  batches_.erase(it);
  if (!st.ok()) return st;
  return true;
}

absl::Status UcxAgent::Wait(BatchId batch, absl::Time deadline) {
  absl::MutexLock l(&mu_);
  auto it = batches_.find(batch);
  if (it == batches_.end())
    return absl::NotFoundError(absl::StrCat("unknown batch ", batch));
  Batch* b = it->second.get();
  if (!mu_.AwaitWithDeadline(absl::Condition(&b->ended), deadline) && !b->ended) {
    return absl::DeadlineExceededError(
        absl::StrCat("batch ", batch, " still running at its deadline (",
                     b->next_segment, "/", b->segments.size(), " segments posted)"));
  }
  absl::Status st = b->status;
  batches_.erase(batch);
  return st;
}

absl::Status UcxAgent::Cancel(BatchId batch) {
  {
    absl::MutexLock l(&mu_);
    auto it = batches_.find(batch);
    if (it == batches_.end())
      return absl::NotFoundError(absl::StrCat("unknown batch ", batch));
    Batch* b = it->second.get();
    if (b->ended) return absl::OkStatus();
    b->cancel_requested = true;
    MaybeEndLocked(b);
  }
  Wake();
  return absl::OkStatus();
}

void UcxAgent::OnPendingOp(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<PendingOp*>(user_data);
  ucp_request_free(request);
  if (op->abandoned) {
    delete op;
    return;
  }
  op->done = true;
  op->status = status;
}

absl::Status UcxAgent::AwaitOpLocked(PendingOp* op, Peer* p, absl::Time deadline,
                                     absl::string_view what) {
  struct Args {
    PendingOp* op;
    Peer* p;
  } args{op, p};
  mu_.AwaitWithDeadline(
      absl::Condition(
          +[](Args* a) { return a->op->done || !a->p->error.ok(); }, &args),
      deadline);
  if (op->done) {
    absl::Status st = FromUcs(op->status, what);
    delete op;
    return st;
  }
  op->abandoned = true;  // freed by OnPendingOp
  if (!p->error.ok()) return p->error;
  return absl::DeadlineExceededError(
      absl::StrCat(what, ": not complete at the deadline"));
}

absl::Status UcxAgent::Notify(PeerId peer, absl::string_view request_id,
                              absl::string_view payload, absl::Time deadline) {
  if (request_id.size() + payload.size() > kMaxNotificationBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("notification of ", request_id.size() + payload.size(),
                     " bytes exceeds ", kMaxNotificationBytes));
  }
  absl::MutexLock l(&mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end() || it->second->disconnected) {
    return absl::NotFoundError(absl::StrCat("unknown peer ", peer));
  }
  Peer* p = it->second.get();
  if (!p->error.ok()) return p->error;
  ++busy_waiters_;
  Wake();
  struct Args {
    UcxAgent* a;
    Peer* p;
    BatchId horizon;
  } args{this, p, next_batch_};
  auto prior_ended = +[](Args* x) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (!x->p->error.ok()) return true;
    for (const auto& [id, b] : x->a->batches_) {
      if (id < x->horizon && b->peer == x->p->id && !b->ended) return false;
    }
    return true;
  };
  absl::Status st;
  if (!mu_.AwaitWithDeadline(absl::Condition(prior_ended, &args), deadline)) {
    st = absl::DeadlineExceededError(
        "earlier batches to the peer still running at deadline");
  } else if (!p->error.ok()) {
    st = p->error;
  }
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &UcxAgent::OnPendingOp;
  if (st.ok()) {
    // Fence: every byte written to the peer so far is visible before the message.
    auto* op = new PendingOp();
    param.user_data = op;
    ucs_status_ptr_t req = ucp_ep_flush_nbx(p->ep, &param);
    if (UCS_PTR_IS_ERR(req)) {
      delete op;
      st = FromUcs(UCS_PTR_STATUS(req), "flush before notification");
    } else if (req == nullptr) {
      delete op;
    } else {
      st = AwaitOpLocked(op, p, deadline, "flush before notification");
    }
  }
  if (st.ok()) {
    auto* op = new PendingOp();
    op->buffer.assign(kNotifyMagic, 4);
    PutLe(&op->buffer, agent_id_, 8);
    PutLe(&op->buffer, request_id.size(), 4);
    op->buffer.append(request_id.data(), request_id.size());
    PutLe(&op->buffer, payload.size(), 4);
    op->buffer.append(payload.data(), payload.size());
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_EAGER;
    param.user_data = op;
    ucs_status_ptr_t req = ucp_am_send_nbx(
        p->ep, kNotifyAmId, nullptr, 0, op->buffer.data(), op->buffer.size(), &param);
    if (UCS_PTR_IS_ERR(req)) {
      delete op;
      st = FromUcs(UCS_PTR_STATUS(req), "sending notification");
    } else if (req == nullptr) {
      delete op;
    } else {
      st = AwaitOpLocked(op, p, deadline, "sending notification");
    }
  }
  --busy_waiters_;
  return st;
}

ucs_status_t UcxAgent::OnActiveMessage(void* arg, const void* /*header*/,
                                       size_t /*header_length*/, void* data,
                                       size_t length,
                                       const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxAgent*>(arg);
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
  // Runs inside ucp_worker_progress with mu_ held by the calling thread.
  if (self->notification_callback_) {
    self->to_dispatch_.push_back(std::move(n));
  } else {
    self->notifications_.push_back(std::move(n));
  }
  return UCS_OK;
}

void UcxAgent::OnPeerError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* p = static_cast<Peer*>(arg);
  if (p->error.ok()) {
    p->error =
        absl::UnavailableError(absl::StrCat("peer ", absl::Hex(p->descriptor.agent_id),
                                            " failed: ", ucs_status_string(status)));
  }
}

void UcxAgent::SetNotificationCallback(NotificationCallback callback) {
  absl::MutexLock c(&callback_mu_);
  std::vector<Notification> queued;
  {
    absl::MutexLock l(&mu_);
    notification_callback_ = callback;
    if (callback) queued.swap(notifications_);
  }
  for (const Notification& n : queued) callback(n);
}

std::vector<Notification> UcxAgent::PollNotifications() {
  absl::MutexLock l(&mu_);
  std::vector<Notification> out;
  out.swap(notifications_);
  return out;
}

std::string UcxAgent::Transport(PeerId peer) {
  absl::MutexLock l(&mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end() || it->second->ep == nullptr || it->second->closed) return "";
  Peer* p = it->second.get();
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

}  // namespace tandem::kvtransfer
