// Transfer planning: which bytes of a sequence's state go where.
//
// A rank's state lives in pools inside registered regions:
//   MLA layer l: a cache [num_blocks, block_size, token_bytes] at `offset` in
//                `region` (block b at offset + b * block_stride); the sequence's
//                tokens are in `block_ids` order, token t in block t / block_size.
//   KDA layer l: slots [num_slots] at `offset` (slot s at offset + s * slot_stride),
//                each holding the recurrent state (kda_state_bytes) and, at
//                `conv_offset` within the slot, the conv tails (kda_conv_bytes).
// Sender and receiver may use different block sizes and placements; the plan cuts
// each layer at both sides' block boundaries (token order) and coalesces pieces
// that are contiguous on both sides. Pure functions, no I/O.
#ifndef TANDEM_KVTRANSFER_PLAN_H_
#define TANDEM_KVTRANSFER_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvtransfer/transfer_agent.h"
#include "proto/kv_state.pb.h"

namespace tandem::kvtransfer {

struct MlaPool {
  RegionId region = 0;
  uint64_t offset = 0;
  uint64_t block_stride = 0;  // 0: block_size * mla_token_bytes
  int64_t num_blocks = 0;
};

struct KdaPool {
  RegionId region = 0;
  uint64_t offset = 0;
  uint64_t slot_stride = 0;  // 0: kda_state_bytes + kda_conv_bytes
  uint64_t conv_offset = 0;  // 0: right after the state
  int64_t num_slots = 0;
};

// One side's view of a sequence's state.
struct RankLayout {
  tandem::v1::KvLayout layout;
  std::vector<MlaPool> mla;  // one per MLA layer
  std::vector<KdaPool> kda;  // one per KDA layer
  std::vector<int32_t> block_ids;
  int32_t state_slot = 0;
};

// The standard placement: every pool of the rank back to back in one region
// starting at `base_offset`: MLA layers in order, then KDA layers in order.
RankLayout ContiguousRankLayout(const tandem::v1::KvLayout& layout, int64_t num_blocks,
                                int64_t num_slots, RegionId region,
                                uint64_t base_offset = 0);
// Bytes ContiguousRankLayout occupies.
uint64_t ContiguousRegionBytes(const tandem::v1::KvLayout& layout, int64_t num_blocks,
                               int64_t num_slots);

enum class LayerKind { kMla, kKda };
struct LayerRef {
  LayerKind kind = LayerKind::kMla;
  int index = 0;
};

struct ByteRange {
  RegionId region = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  friend bool operator==(const ByteRange&, const ByteRange&) = default;
};

// Checks one side on its own (pool counts, strides, block ids and slot in range,
// enough blocks for `num_tokens`).
absl::Status ValidateRankLayout(const RankLayout& side, int64_t num_tokens);
// Checks both sides and that they are compatible (layer counts, token bytes,
// dtype, KDA sizes, TP size and rank).
absl::Status ValidatePair(const RankLayout& src, const RankLayout& dst,
                          int64_t num_tokens);

// The bytes of one layer of the sequence in token order (MLA: one range per block
// piece; KDA: state then conv tails). Validates the side first.
absl::StatusOr<std::vector<ByteRange>> LayerRanges(const RankLayout& side,
                                                   LayerRef layer, int64_t num_tokens);

struct TransferPlan {
  std::vector<Segment> segments;  // after coalescing
  int64_t segments_before_coalescing = 0;
  uint64_t bytes = 0;
};

// Merges consecutive segments contiguous on both sides (same regions). Returns
// the new count.
size_t Coalesce(std::vector<Segment>* segments);

// Tokens [0, num_tokens) of one layer (per-layer streaming: prefill sends layer L
// as soon as it is computed). src regions are the sender's, dst regions the
// receiver's (as in its descriptor).
absl::StatusOr<TransferPlan> PlanLayer(const RankLayout& src, const RankLayout& dst,
                                       LayerRef layer, int64_t num_tokens);
// Layer-by-layer streaming: the segments of ONE layer for the rows
// [begin, end) that a prefill chunk has just made final. MLA: those tokens'
// latent rows, cut at both sides' block boundaries (a chunk may start and end
// inside a block of either side) and coalesced. KDA: the layer's whole slot
// state (state, conv tails; the row range is ignored: the slot is final only
// after the last chunk). Streaming the chunks [0, c1), [c1, c2), ..., [ck, n)
// of every MLA layer plus each KDA layer once moves exactly the bytes of
// PlanAll(src, dst, n): no byte twice, none missed (plan_test checks it).
// Validates the pair for `end` tokens and 0 <= begin <= end.
absl::StatusOr<TransferPlan> PlanLayerRows(const RankLayout& src, const RankLayout& dst,
                                           LayerRef layer, int64_t begin, int64_t end);
// Every MLA layer then every KDA layer, coalesced across layer boundaries too.
// MLA rows [first_token, num_tokens) only: the receiver already holds the rows
// before first_token (a decode-side prefix hit, KvTarget.cached_prefix_tokens);
// the KDA slots go whole. InvalidArgument unless 0 <= first_token <= num_tokens.
absl::StatusOr<TransferPlan> PlanAll(const RankLayout& src, const RankLayout& dst,
                                     int64_t num_tokens, int64_t first_token = 0);

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_PLAN_H_
