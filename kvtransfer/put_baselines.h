// Yardsticks for kvtransfer_bench: the same segments over the same memory as a
// TransferAgent transfer, moved without the agent, so the agent's bandwidth can be
// compared like for like (ucx_perftest reuses one buffer of at most a few tens of
// MiB; a KV hand-off walks gigabytes of distinct memory).
//
//   PlainUcpPut   plain UCP: its own context (RMA only) and worker, one endpoint to
//                 the peer's worker, every segment posted with ucp_put_nbx (a window
//                 of outstanding operations), one ucp_ep_flush_nbx, busy
//                 ucp_worker_progress on the calling thread. No agent, no batches,
//                 no locks, no progress thread.
//   CmaCopy       process_vm_writev of each segment into the peer process, the
//                 system call UCX's cma transport makes on one host.
//   MemcpyCopy    memcpy of each segment into a local buffer: the copy ceiling.
//
// CmaCopy and MemcpyCopy split segments into pieces of at most `piece_bytes` and
// hand them out to `threads` threads; with threads == 1 they run on the caller.
#ifndef TANDEM_KVTRANSFER_PUT_BASELINES_H_
#define TANDEM_KVTRANSFER_PUT_BASELINES_H_

#include <sys/types.h>
#include <ucp/api/ucp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace tandem::kvtransfer {

// Offsets are into the source buffer and the destination region.
struct CopySegment {
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t length = 0;
};

class PlainUcpPut {
 public:
  // `ucx_options`: UCX variables without the prefix (e.g. {"TLS", "tcp"},
  // {"PROTO_ENABLE", "y"}). Registers [local, local + local_len) and connects to
  // the worker and region `remote_region` named by `peer_descriptor` (a UcxAgent's
  // descriptor).
  static absl::StatusOr<std::unique_ptr<PlainUcpPut>> Create(
      const std::vector<std::pair<std::string, std::string>>& ucx_options,
      absl::string_view peer_descriptor, uint32_t remote_region, void* local,
      size_t local_len);
  ~PlainUcpPut();
  PlainUcpPut(const PlainUcpPut&) = delete;
  PlainUcpPut& operator=(const PlainUcpPut&) = delete;

  // Puts every segment (at most `window` outstanding, with
  // UCP_OP_ATTR_FLAG_MULTI_SEND when `bandwidth_protocols`, as UcxAgent does by
  // default), flushes; returns the
  // seconds from the first post to the flush's completion. Fails after `timeout`.
  absl::StatusOr<double> Run(absl::Span<const CopySegment> segments, int window,
                             bool bandwidth_protocols, double timeout_seconds);

 private:
  PlainUcpPut() = default;
  absl::Status Init(const std::vector<std::pair<std::string, std::string>>& options,
                    absl::string_view peer_descriptor, uint32_t remote_region,
                    void* local, size_t local_len);

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  ucp_mem_h memh_ = nullptr;
  ucp_rkey_h rkey_ = nullptr;
  uint8_t* local_ = nullptr;
  uint64_t remote_base_ = 0;
  uint64_t remote_length_ = 0;
  size_t local_length_ = 0;
};

// Seconds to write every segment from `src` into process `pid` at `remote_base`.
absl::StatusOr<double> CmaCopy(pid_t pid, const uint8_t* src, uint64_t remote_base,
                               absl::Span<const CopySegment> segments, int threads,
                               uint64_t piece_bytes);

// Seconds to memcpy every segment from `src` into `dst`.
double MemcpyCopy(const uint8_t* src, uint8_t* dst,
                  absl::Span<const CopySegment> segments, int threads,
                  uint64_t piece_bytes);

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_PUT_BASELINES_H_
