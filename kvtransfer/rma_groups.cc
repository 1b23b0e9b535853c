#include "kvtransfer/rma_groups.h"

#include <algorithm>

namespace tandem::kvtransfer {

bool AppendToRmaGroup(const RmaGroupLimits& limits, const RmaPiece& piece,
                      RmaGroup* group) {
  if (piece.length == 0) return true;  // nothing to carry
  if (!group->empty() && limits.max_bytes > 0 &&
      group->bytes + piece.length > limits.max_bytes) {
    return false;
  }
  const size_t iov_limit = std::max<size_t>(1, limits.iov_limit);
  const size_t rma_iov_limit = std::max<size_t>(1, limits.rma_iov_limit);
  const bool local_joins =
      !group->local.empty() && group->local.back().desc == piece.desc &&
      group->local.back().addr + group->local.back().length == piece.local;
  const bool remote_joins =
      !group->remote.empty() && group->remote.back().key == piece.key &&
      group->remote.back().addr + group->remote.back().length == piece.remote;
  if (!local_joins && group->local.size() >= iov_limit) return false;
  if (!remote_joins && group->remote.size() >= rma_iov_limit) return false;
  if (local_joins) {
    group->local.back().length += piece.length;
  } else {
    group->local.push_back({piece.local, piece.desc, piece.length});
  }
  if (remote_joins) {
    group->remote.back().length += piece.length;
  } else {
    group->remote.push_back({piece.remote, piece.key, piece.length});
  }
  group->bytes += piece.length;
  ++group->pieces;
  return true;
}

std::vector<RmaGroup> GroupRmaPieces(absl::Span<const RmaPiece> pieces,
                                     const RmaGroupLimits& limits) {
  std::vector<RmaGroup> out;
  RmaGroup current;
  for (const RmaPiece& piece : pieces) {
    if (AppendToRmaGroup(limits, piece, &current)) continue;
    out.push_back(std::move(current));
    current = RmaGroup();
    AppendToRmaGroup(limits, piece, &current);  // an empty group takes any piece
  }
  if (!current.empty()) out.push_back(std::move(current));
  return out;
}

}  // namespace tandem::kvtransfer
