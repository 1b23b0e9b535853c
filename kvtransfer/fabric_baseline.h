// The like-for-like yardstick for LibfabricAgent in kvtransfer_bench: the same
// segments between the same buffers, written by a plain libfabric loop with no
// agent (no batches, locks or progress thread): its own fabric, domain, one
// FI_EP_RDM endpoint, CQ and AV (the same fi_getinfo hints as the agent), every
// segment posted with fi_writemsg (FI_DELIVERY_COMPLETE, pieces of at most
// `max_op_bytes`, a window of outstanding writes), busy fi_cq_read on the
// calling thread. fabtests is not packaged in Debian; this is the write loop its
// fi_rma_bw runs, over the agent's workload instead of one reused buffer.
#ifndef TANDEM_KVTRANSFER_FABRIC_BASELINE_H_
#define TANDEM_KVTRANSFER_FABRIC_BASELINE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvtransfer/put_baselines.h"

namespace tandem::kvtransfer {

class PlainFabricWrite {
 public:
  // Reaches region `region` of the LibfabricAgent whose descriptor is
  // `descriptor` (its rail 0), from `src` [0, src_bytes).
  static absl::StatusOr<std::unique_ptr<PlainFabricWrite>> Create(
      const std::string& provider, const std::string& descriptor, uint32_t region,
      uint8_t* src, uint64_t src_bytes);
  ~PlainFabricWrite();

  // Seconds to write every segment, or an error; gives up after `timeout_s`.
  absl::StatusOr<double> Run(absl::Span<const CopySegment> segments, int window,
                             uint64_t max_op_bytes, double timeout_s);

 private:
  PlainFabricWrite() = default;
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_FABRIC_BASELINE_H_
