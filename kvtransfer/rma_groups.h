// RMA groups: consecutive pieces of one batch carried by one multi-iov RMA
// (libfabric's fi_writemsg / fi_readmsg take several local iovs and several
// remote rma_iovs; the bytes of the local list, in order, go to the remote
// list, in order). A group holds at most `iov_limit` local entries and
// `rma_iov_limit` remote ones (the provider's tx_attr limits) and at most
// `max_bytes`; a piece that starts where the previous one ended (locally with
// the same memory descriptor, remotely with the same key) extends the last
// entry instead of taking a new one. Pure logic: no libfabric here, so the
// limits and the byte order are tested with tables (rma_groups_test.cc).
#ifndef TANDEM_KVTRANSFER_RMA_GROUPS_H_
#define TANDEM_KVTRANSFER_RMA_GROUPS_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace tandem::kvtransfer {

// One piece as the transport sees it: local address and its memory descriptor,
// remote address (virtual address or offset, as the MR mode demands) and key.
struct RmaPiece {
  uintptr_t local = 0;
  void* desc = nullptr;  // not owned: the local registration's fi_mr_desc
  uint64_t remote = 0;
  uint64_t key = 0;
  uint64_t length = 0;
};

struct RmaGroupLimits {
  size_t iov_limit = 1;      // local entries (tx_attr->iov_limit)
  size_t rma_iov_limit = 1;  // remote entries (tx_attr->rma_iov_limit)
  uint64_t max_bytes = 0;    // bytes in one operation; 0: unbounded
};

struct RmaGroup {
  struct Local {
    uintptr_t addr = 0;
    void* desc = nullptr;
    uint64_t length = 0;
  };
  struct Remote {
    uint64_t addr = 0;
    uint64_t key = 0;
    uint64_t length = 0;
  };
  std::vector<Local> local;
  std::vector<Remote> remote;
  uint64_t bytes = 0;
  int pieces = 0;

  bool empty() const { return pieces == 0; }
  void Clear() {
    local.clear();
    remote.clear();
    bytes = 0;
    pieces = 0;
  }
};

// Appends `piece` to `group` when it fits `limits` (merging with the last entries
// where contiguous) and returns true; otherwise leaves `group` unchanged and
// returns false. An empty group takes any non-empty piece (one piece is one
// local and one remote entry, within any limits >= 1), so callers always make
// progress. Limits of 0 entries are treated as 1.
bool AppendToRmaGroup(const RmaGroupLimits& limits, const RmaPiece& piece,
                      RmaGroup* group);

// `pieces`, in order, as groups filled greedily (each as full as the limits let
// it be before the next starts).
std::vector<RmaGroup> GroupRmaPieces(absl::Span<const RmaPiece> pieces,
                                     const RmaGroupLimits& limits);

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_RMA_GROUPS_H_
