#include "kvtransfer/fabric_baseline.h"

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvtransfer/descriptor.h"

namespace tandem::kvtransfer {

struct PlainFabricWrite::State {
  fi_info* info = nullptr;
  fid_fabric* fabric = nullptr;
  fid_domain* domain = nullptr;
  fid_ep* ep = nullptr;
  fid_cq* cq = nullptr;
  fid_av* av = nullptr;
  fid_mr* mr = nullptr;
  fi_addr_t peer = FI_ADDR_NOTAVAIL;
  uint8_t* src = nullptr;
  uint64_t remote_base = 0;  // what remote offset 0 is addressed as
  uint64_t key = 0;
  std::vector<fi_context2> contexts;

  ~State() {
    if (ep != nullptr) fi_close(&ep->fid);
    if (mr != nullptr) fi_close(&mr->fid);
    if (av != nullptr) fi_close(&av->fid);
    if (cq != nullptr) fi_close(&cq->fid);
    if (domain != nullptr) fi_close(&domain->fid);
    if (fabric != nullptr) fi_close(&fabric->fid);
    if (info != nullptr) fi_freeinfo(info);
  }
};

namespace {

absl::Status Fi(int ret, absl::string_view what) {
  if (ret == 0) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", fi_strerror(ret < 0 ? -ret : ret)));
}

bool Le(const uint8_t*& p, const uint8_t* end, uint64_t* v) {
  if (end - p < 4) return false;
  *v = p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint64_t>(p[3]) << 24);
  p += 4;
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<PlainFabricWrite>> PlainFabricWrite::Create(
    const std::string& provider, const std::string& descriptor, uint32_t region,
    uint8_t* src, uint64_t src_bytes) {
  auto d = ParseDescriptor(descriptor);
  if (!d.ok()) return d.status();
  const RegionDescriptor* r = d->FindRegion(region);
  if (r == nullptr || r->rkey.size() < 8 || r->rkey.size() % 8 != 0) {
    return absl::InvalidArgumentError("no such region with a libfabric key");
  }
  // The agent's address (libfabric_agent.cc, version 2): "TKL2", provider; per
  // domain its fabric name and a key; per rail its domain and name; identity.
  const auto* p = reinterpret_cast<const uint8_t*>(d->address.data());
  const uint8_t* end = p + d->address.size();
  uint64_t n = 0;
  if (d->address.size() < 4 || std::memcmp(p, "TKL2", 4) != 0) {
    return absl::InvalidArgumentError("not a libfabric agent's descriptor");
  }
  p += 4;
  if (!Le(p, end, &n) || n > static_cast<uint64_t>(end - p)) {
    return absl::InvalidArgumentError("bad address");
  }
  p += n;
  uint64_t domains = 0;
  if (!Le(p, end, &domains) || domains == 0) {
    return absl::InvalidArgumentError("bad address");
  }
  for (uint64_t i = 0; i < domains; ++i) {
    if (!Le(p, end, &n) || n + 8 > static_cast<uint64_t>(end - p)) {
      return absl::InvalidArgumentError("bad address");
    }
    p += n + 8;
  }
  uint64_t rails = 0, domain0 = 0, len = 0;
  if (!Le(p, end, &rails) || rails == 0 || !Le(p, end, &domain0) ||
      domain0 >= domains || !Le(p, end, &len) || len > static_cast<uint64_t>(end - p) ||
      r->rkey.size() != 8 * domains) {
    return absl::InvalidArgumentError("bad address");
  }
  const std::string rail0(reinterpret_cast<const char*>(p), len);

  std::unique_ptr<PlainFabricWrite> out(new PlainFabricWrite());
  out->s_ = std::make_unique<State>();
  State& s = *out->s_;
  s.src = src;
  fi_info* hints = fi_allocinfo();
  hints->caps = FI_RMA | FI_MSG | FI_READ | FI_WRITE | FI_REMOTE_READ |
                FI_REMOTE_WRITE | FI_SEND | FI_RECV;
  hints->ep_attr->type = FI_EP_RDM;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->domain_attr->mr_mode =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
  hints->fabric_attr->prov_name = strdup(provider.c_str());
  int ret = fi_getinfo(FI_VERSION(1, 14), nullptr, nullptr, 0, hints, &s.info);
  fi_freeinfo(hints);
  if (absl::Status st = Fi(ret, "fi_getinfo"); !st.ok()) return st;
  if (s.info->addr_format == FI_ADDR_STR && s.info->src_addr != nullptr) {
    const std::string name =
        absl::StrCat(static_cast<const char*>(s.info->src_addr), "_plain");
    free(s.info->src_addr);
    s.info->src_addr = strdup(name.c_str());
    s.info->src_addrlen = name.size() + 1;
  }
  if (auto st = Fi(fi_fabric(s.info->fabric_attr, &s.fabric, nullptr), "fi_fabric");
      !st.ok())
    return st;
  if (auto st = Fi(fi_domain(s.fabric, s.info, &s.domain, nullptr), "fi_domain");
      !st.ok())
    return st;
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_CONTEXT;
  cq_attr.wait_obj = FI_WAIT_NONE;
  if (auto st = Fi(fi_cq_open(s.domain, &cq_attr, &s.cq, nullptr), "fi_cq_open");
      !st.ok())
    return st;
  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  if (auto st = Fi(fi_av_open(s.domain, &av_attr, &s.av, nullptr), "fi_av_open");
      !st.ok())
    return st;
  ret = fi_endpoint(s.domain, s.info, &s.ep, nullptr);
  if (ret == 0) ret = fi_ep_bind(s.ep, &s.av->fid, 0);
  if (ret == 0) ret = fi_ep_bind(s.ep, &s.cq->fid, FI_TRANSMIT | FI_RECV);
  if (ret == 0) ret = fi_enable(s.ep);
  if (auto st = Fi(ret, "endpoint"); !st.ok()) return st;
  if (auto st = Fi(fi_mr_reg(s.domain, src, src_bytes, FI_WRITE | FI_READ, 0, 1, 0,
                             &s.mr, nullptr),
                   "fi_mr_reg");
      !st.ok())
    return st;
  if (fi_av_insert(s.av, rail0.data(), 1, &s.peer, 0, nullptr) != 1) {
    return absl::UnavailableError("fi_av_insert of the agent's rail 0 failed");
  }
  // Rail 0's domain's key.
  const auto* k = reinterpret_cast<const uint8_t*>(r->rkey.data()) + 8 * domain0;
  for (int i = 0; i < 8; ++i) s.key |= static_cast<uint64_t>(k[i]) << (8 * i);
  s.remote_base = (s.info->domain_attr->mr_mode & FI_MR_VIRT_ADDR) ? r->base : 0;
  return out;
}

PlainFabricWrite::~PlainFabricWrite() = default;

absl::StatusOr<double> PlainFabricWrite::Run(absl::Span<const CopySegment> segments,
                                             int window, uint64_t max_op_bytes,
                                             double timeout_s) {
  State& s = *s_;
  s.contexts.resize(window);
  std::vector<int> free_ctx;
  for (int i = 0; i < window; ++i) free_ctx.push_back(i);
  void* desc = fi_mr_desc(s.mr);
  const absl::Time t0 = absl::Now();
  const absl::Time give_up = t0 + absl::Seconds(timeout_s);
  size_t seg = 0;
  uint64_t done_in_seg = 0;
  int outstanding = 0;
  auto reap = [&]() -> absl::Status {
    fi_cq_entry entries[32];
    const ssize_t n = fi_cq_read(s.cq, entries, 32);
    if (n == -FI_EAGAIN) return absl::OkStatus();
    if (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      fi_cq_readerr(s.cq, &err, 0);
      return absl::UnavailableError(
          absl::StrCat("write failed: ", fi_strerror(err.err)));
    }
    for (ssize_t i = 0; i < n; ++i) {
      free_ctx.push_back(static_cast<int>(
          static_cast<fi_context2*>(entries[i].op_context) - s.contexts.data()));
      --outstanding;
    }
    return absl::OkStatus();
  };
  while (seg < segments.size() || outstanding > 0) {
    if (absl::Now() > give_up) return absl::DeadlineExceededError("plain write loop");
    while (seg < segments.size() && !free_ctx.empty()) {
      const CopySegment& c = segments[seg];
      const uint64_t len = std::min(c.length - done_in_seg, max_op_bytes);
      iovec iov{s.src + c.src_offset + done_in_seg, len};
      fi_rma_iov rma{s.remote_base + c.dst_offset + done_in_seg, len, s.key};
      const int ctx = free_ctx.back();
      fi_msg_rma msg{};
      msg.msg_iov = &iov;
      msg.desc = &desc;
      msg.iov_count = 1;
      msg.addr = s.peer;
      msg.rma_iov = &rma;
      msg.rma_iov_count = 1;
      msg.context = &s.contexts[ctx];
      const ssize_t ret = fi_writemsg(s.ep, &msg, FI_COMPLETION | FI_DELIVERY_COMPLETE);
      if (ret == -FI_EAGAIN) break;
      if (ret != 0) return Fi(static_cast<int>(ret), "fi_writemsg");
      free_ctx.pop_back();
      ++outstanding;
      done_in_seg += len;
      if (done_in_seg == c.length) {
        ++seg;
        done_in_seg = 0;
      }
    }
    if (absl::Status st = reap(); !st.ok()) return st;
  }
  return absl::ToDoubleSeconds(absl::Now() - t0);
}

}  // namespace tandem::kvtransfer
