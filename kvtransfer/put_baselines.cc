#include "kvtransfer/put_baselines.h"

#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kvtransfer/descriptor.h"

namespace tandem::kvtransfer {
namespace {

double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

absl::Status UcsError(ucs_status_t s, absl::string_view what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", ucs_status_string(s)));
}

struct Piece {
  uint64_t src_offset;
  uint64_t dst_offset;
  uint64_t length;
};

std::vector<Piece> Pieces(absl::Span<const CopySegment> segments,
                          uint64_t piece_bytes) {
  std::vector<Piece> out;
  const uint64_t step = std::max<uint64_t>(piece_bytes, 1);
  for (const CopySegment& s : segments) {
    for (uint64_t off = 0; off < s.length; off += step) {
      out.push_back(
          {s.src_offset + off, s.dst_offset + off, std::min(step, s.length - off)});
    }
  }
  return out;
}

// Runs `work(piece)` over every piece on `threads` threads (pieces handed out in
// order from a shared counter); returns false if any call failed.
template <typename Fn>
bool ForEachPiece(const std::vector<Piece>& pieces, int threads, Fn work) {
  std::atomic<size_t> next{0};
  std::atomic<bool> ok{true};
  auto lane = [&] {
    for (size_t i = next++; i < pieces.size() && ok; i = next++) {
      if (!work(pieces[i])) ok = false;
    }
  };
  std::vector<std::thread> helpers;
  for (int t = 1; t < threads; ++t) helpers.emplace_back(lane);
  lane();
  for (std::thread& t : helpers) t.join();
  return ok;
}

struct Counter {
  int outstanding = 0;
  ucs_status_t status = UCS_OK;
};

void OnDone(void* request, ucs_status_t status, void* user_data) {
  auto* c = static_cast<Counter*>(user_data);
  --c->outstanding;
  if (status != UCS_OK && c->status == UCS_OK) c->status = status;
  ucp_request_free(request);
}

}  // namespace

absl::StatusOr<std::unique_ptr<PlainUcpPut>> PlainUcpPut::Create(
    const std::vector<std::pair<std::string, std::string>>& ucx_options,
    absl::string_view peer_descriptor, uint32_t remote_region, void* local,
    size_t local_len) {
  std::unique_ptr<PlainUcpPut> p(new PlainUcpPut());
  absl::Status st =
      p->Init(ucx_options, peer_descriptor, remote_region, local, local_len);
  if (!st.ok()) return st;
  return p;
}

absl::Status PlainUcpPut::Init(
    const std::vector<std::pair<std::string, std::string>>& options,
    absl::string_view peer_descriptor, uint32_t remote_region, void* local,
    size_t local_len) {
  auto d = ParseDescriptor(peer_descriptor);
  if (!d.ok()) return d.status();
  const RegionDescriptor* rd = d->FindRegion(remote_region);
  if (rd == nullptr) return absl::InvalidArgumentError("remote region not described");
  remote_base_ = rd->base;
  remote_length_ = rd->length;
  local_ = static_cast<uint8_t*>(local);
  local_length_ = local_len;

  ucp_config_t* cfg = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &cfg);
  if (s != UCS_OK) return UcsError(s, "ucp_config_read");
  for (const auto& [name, value] : options) {
    s = ucp_config_modify(cfg, name.c_str(), value.c_str());
    if (s != UCS_OK) {
      ucp_config_release(cfg);
      return UcsError(s, absl::StrCat("UCX option ", name));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA;
  s = ucp_init(&params, cfg, &context_);
  ucp_config_release(cfg);
  if (s != UCS_OK) return UcsError(s, "ucp_init");
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = ucp_worker_create(context_, &wp, &worker_);
  if (s != UCS_OK) return UcsError(s, "ucp_worker_create");
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
  ep.address = reinterpret_cast<const ucp_address_t*>(d->address.data());
  s = ucp_ep_create(worker_, &ep, &ep_);
  if (s != UCS_OK) return UcsError(s, "ucp_ep_create");
  s = ucp_ep_rkey_unpack(ep_, rd->rkey.data(), &rkey_);
  if (s != UCS_OK) return UcsError(s, "ucp_ep_rkey_unpack");
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = local;
  mp.length = local_len;
  s = ucp_mem_map(context_, &mp, &memh_);
  if (s != UCS_OK) return UcsError(s, "ucp_mem_map");
  return absl::OkStatus();
}

PlainUcpPut::~PlainUcpPut() {
  if (rkey_ != nullptr) ucp_rkey_destroy(rkey_);
  if (ep_ != nullptr) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* req = ucp_ep_close_nbx(ep_, &param);
    if (req != nullptr && !UCS_PTR_IS_ERR(req)) {
      const double deadline = Now() + 5;
      while (ucp_request_check_status(req) == UCS_INPROGRESS && Now() < deadline)
        ucp_worker_progress(worker_);
      ucp_request_free(req);
    }
  }
  if (memh_ != nullptr) ucp_mem_unmap(context_, memh_);
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
}

absl::StatusOr<double> PlainUcpPut::Run(absl::Span<const CopySegment> segments,
                                        int window, bool bandwidth_protocols,
                                        double timeout_seconds) {
  for (const CopySegment& s : segments) {
    if (s.src_offset + s.length > local_length_ ||
        s.dst_offset + s.length > remote_length_) {
      return absl::InvalidArgumentError("segment out of range");
    }
  }
  Counter c;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &OnDone;
  param.user_data = &c;
  ucp_request_param_t bulk = param;
  if (bandwidth_protocols) bulk.op_attr_mask |= UCP_OP_ATTR_FLAG_MULTI_SEND;
  const double t0 = Now();
  const double deadline = t0 + timeout_seconds;
  size_t next = 0;
  bool flushed = false;
  while (true) {
    while (next < segments.size() && c.outstanding < window) {
      const CopySegment& s = segments[next++];
      ucs_status_ptr_t req = ucp_put_nbx(ep_, local_ + s.src_offset, s.length,
                                         remote_base_ + s.dst_offset, rkey_, &bulk);
      if (UCS_PTR_IS_ERR(req)) return UcsError(UCS_PTR_STATUS(req), "ucp_put_nbx");
      if (req != nullptr) ++c.outstanding;
    }
    if (next == segments.size() && !flushed) {
      flushed = true;
      ucs_status_ptr_t req = ucp_ep_flush_nbx(ep_, &param);
      if (UCS_PTR_IS_ERR(req)) return UcsError(UCS_PTR_STATUS(req), "ucp_ep_flush_nbx");
      if (req != nullptr) ++c.outstanding;
    }
    if (flushed && c.outstanding == 0) break;
    ucp_worker_progress(worker_);
    if (c.status != UCS_OK) return UcsError(c.status, "put");
    if (Now() > deadline)
      return absl::DeadlineExceededError("plain put loop timed out");
  }
  return Now() - t0;
}

absl::StatusOr<double> CmaCopy(pid_t pid, const uint8_t* src, uint64_t remote_base,
                               absl::Span<const CopySegment> segments, int threads,
                               uint64_t piece_bytes) {
  const std::vector<Piece> pieces = Pieces(segments, piece_bytes);
  std::atomic<int> error{0};
  const double t0 = Now();
  const bool ok = ForEachPiece(pieces, std::max(threads, 1), [&](const Piece& p) {
    uint64_t done = 0;
    while (done < p.length) {
      iovec local{const_cast<uint8_t*>(src) + p.src_offset + done, p.length - done};
      iovec remote{reinterpret_cast<void*>(remote_base + p.dst_offset + done),
                   p.length - done};
      const ssize_t n = process_vm_writev(pid, &local, 1, &remote, 1, 0);
      if (n <= 0) {
        error = errno;
        return false;
      }
      done += n;
    }
    return true;
  });
  if (!ok) {
    return absl::UnavailableError(
        absl::StrCat("process_vm_writev: ", std::strerror(error.load())));
  }
  return Now() - t0;
}

double MemcpyCopy(const uint8_t* src, uint8_t* dst,
                  absl::Span<const CopySegment> segments, int threads,
                  uint64_t piece_bytes) {
  const std::vector<Piece> pieces = Pieces(segments, piece_bytes);
  const double t0 = Now();
  ForEachPiece(pieces, std::max(threads, 1), [&](const Piece& p) {
    std::memcpy(dst + p.dst_offset, src + p.src_offset, p.length);
    return true;
  });
  return Now() - t0;
}

}  // namespace tandem::kvtransfer
