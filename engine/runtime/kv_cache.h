// Per-sequence attention state storage: the paged MLA latent cache and the KDA
// state pool.
//
// MLA (per MLA layer m): one 64-byte-aligned buffer
//     [num_blocks, block_size, kv_lora_rank + rope_dim] BF16
//   token p of a sequence lives in block block_table[p / block_size], row
//   p % block_size: [kv_a_layernorm(c_kv) | k_rot]. Buffers are separate per layer
//   so that each can be registered with a transfer agent (UCX) on its own.
// KDA (all KDA layers): one 64-byte-aligned buffer
//     [num_slots, num_kda_layers, recurrent h*dk*dv | conv q | conv k | conv v] fp32
//   conv tails are [K-1, P] each (oldest first, CausalConv1dSilu's layout), so one
//   slot's state for one layer is a single contiguous byte range.
//
// Export/import for the KV hand-off: ExportSequence() lists a sequence's state as
// plain byte ranges, in logical order per (layer, kind): the MLA ranges of a layer
// concatenated are its tokens 0..n-1 row after row; the KDA range of a layer is
// the slot's whole state. CopyStateRanges() copies one such list into another
// (matched by layer and kind, by logical byte offset), so source and destination
// may use different block sizes.
//
// Tensor parallelism (KvCacheOptions::tp_rank / tp_size): a rank's cache holds
// the KDA state of its heads only (recurrent [h/N, dk, dv], conv tails of its
// h/N * d channels); the MLA latent cache is replicated (the same bytes on every
// rank: q_a / kv_a are not split). Every range carries its rank; an executor
// lists the ranges of all ranks rank-major, and CopyStateRanges matches
// (rank, layer, kind). With tp_size 1 the layout is the unsharded one.
#ifndef TANDEM_ENGINE_RUNTIME_KV_CACHE_H_
#define TANDEM_ENGINE_RUNTIME_KV_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/model/config.h"
#include "kernels/device.h"

namespace tandem::engine {

// Where a cache's buffers come from; empty functions: 64-byte-aligned heap
// memory. A decode worker's engine cache takes them from its transfer agent
// (worker/cache_layout.h, AgentAllocations) so that peers' puts are plain copies.
struct KvCacheAllocator {
  // `bytes` (> 0) zero-filled bytes aligned to at least 64, or an error.
  std::function<absl::StatusOr<void*>(size_t bytes)> allocate;
  // Gives back memory `allocate` returned.
  std::function<void(void*)> release;
};

struct KvCacheOptions {
  int64_t num_blocks = 0;   // MLA blocks per layer
  int64_t block_size = 16;  // tokens per block
  int64_t num_slots = 0;    // KDA state slots (concurrent sequences)
  // This cache's tensor-parallel rank and group size (KDA heads split; sizes the
  // config does not divide are refused with parallel::CheckTpSize's error).
  int tp_rank = 0;
  int tp_size = 1;
  KvCacheAllocator allocator;
  // The device the buffers live on (a backend's, kernels/device.h). Null or the
  // host device: host memory (from `allocator` or the heap). Another device:
  // its memory (zero-filled at creation); the slot operations below then run
  // as device copies and fills, and `allocator` must be empty.
  kernels::Device* device = nullptr;
  // On a device: buffers another process of this host can map
  // (Device::AllocateShareable), so that a peer writes the KV into them device
  // to device (the host staging's IPC, kvtransfer/host_staging_agent.h). A
  // device without it allocates as usual.
  bool shareable = false;
};

enum class StateKind { kMla, kKda };

// One contiguous piece of a sequence's state.
struct StateRange {
  int rank = 0;   // tensor-parallel rank whose cache holds it
  int layer = 0;  // model layer index (0-based)
  StateKind kind = StateKind::kMla;
  uint8_t* data = nullptr;  // not owned: points into a KvCache buffer
  size_t bytes = 0;
  // The device `data` lives on (a device cache's, KvCacheOptions::device); null:
  // host memory. Device bytes are read and written with the device's copies only
  // (CopyStateRanges, CopyRangeToHost), never by host code.
  kernels::Device* device = nullptr;
};

// A copy of one slot's KDA state (all KDA layers), for rollback.
struct KdaSnapshot {
  std::vector<float> values;
};

class KvCache {
 public:
  static absl::StatusOr<std::unique_ptr<KvCache>> Create(
      const model::ModelConfig& config, const KvCacheOptions& options);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const KvCacheOptions& options() const { return options_; }
  int64_t block_size() const { return options_.block_size; }
  int64_t num_blocks() const { return options_.num_blocks; }
  int64_t num_slots() const { return options_.num_slots; }
  int64_t mla_width() const { return mla_width_; }  // values per token
  int num_mla_layers() const { return static_cast<int>(mla_.size()); }
  int num_kda_layers() const { return num_kda_layers_; }
  int tp_rank() const { return options_.tp_rank; }
  int64_t kda_heads() const { return kda_heads_; }        // this rank's heads
  int64_t kda_channels() const { return kda_channels_; }  // heads * head_dim

  // [num_blocks, block_size, mla_width] BF16 of MLA layer `mla_index`.
  uint16_t* mla_layer(int mla_index) { return mla_[mla_index]; }
  size_t mla_layer_bytes() const { return mla_layer_bytes_; }

  // KDA state of (slot, kda layer): recurrent [h, dk, dv], then conv q, k, v.
  float* kda_recurrent(int64_t slot, int kda_index);
  float* kda_conv(int64_t slot, int kda_index, int which /*0 q, 1 k, 2 v*/);
  size_t kda_bytes_per_layer() const { return kda_layer_floats_ * sizeof(float); }
  size_t kda_bytes_per_slot() const { return kda_bytes_per_layer() * num_kda_layers_; }
  // Total bytes held (MLA + KDA).
  size_t total_bytes() const;

  // Zeroes a slot's KDA state (a new sequence starts from S = 0, empty conv tails).
  absl::Status ResetSlot(int64_t slot);
  absl::StatusOr<KdaSnapshot> SnapshotSlot(int64_t slot) const;
  absl::Status RestoreSlot(int64_t slot, const KdaSnapshot& snapshot);
  absl::Status CopySlot(int64_t from, int64_t to);

  // The prefix cache's host tier: one block's rows of every MLA layer
  // (block_bytes(): layer after layer) and one slot's KDA state
  // (kda_bytes_per_slot()) to and from host memory; device copies on a device
  // cache, synchronised before returning (the host bytes may be reused then).
  size_t block_bytes() const {
    return mla_.size() * static_cast<size_t>(options_.block_size) * mla_width_ *
           sizeof(uint16_t);
  }
  absl::Status CopyBlockToHost(int64_t block, void* host_dst) const;
  absl::Status CopyBlockFromHost(int64_t block, const void* host_src);
  absl::Status CopySlotToHost(int64_t slot, void* host_dst) const;
  absl::Status CopySlotFromHost(int64_t slot, const void* host_src);

  // The state of a sequence of `num_tokens` cached tokens whose blocks are
  // `block_table` (at least ceil(num_tokens / block_size) ids) and KDA slot `slot`:
  // per MLA layer the used rows of each block (tokens in order), per KDA layer one
  // range. Ordered by layer.
  absl::StatusOr<std::vector<StateRange>> ExportSequence(
      absl::Span<const int32_t> block_table, int64_t num_tokens, int64_t slot);

  // Layer schedule: for model layer i, its kind and index in this cache.
  const std::vector<model::LayerSpec>& layers() const { return layers_; }

 private:
  KvCache() = default;
  KvCacheOptions options_;
  std::vector<model::LayerSpec> layers_;
  std::vector<int> layer_index_;  // model layer -> mla or kda index
  int64_t mla_width_ = 0;
  size_t mla_layer_bytes_ = 0;
  std::vector<uint16_t*> mla_;  // owned (aligned allocations)
  int num_kda_layers_ = 0;
  int64_t kda_heads_ = 0;
  int64_t kda_channels_ = 0;
  int64_t kda_recurrent_floats_ = 0;
  int64_t kda_conv_floats_ = 0;  // one of q/k/v
  int64_t kda_layer_floats_ = 0;
  float* kda_ = nullptr;  // owned
  size_t kda_total_bytes_ = 0;
};

// Copies the bytes described by `src` into `dst`: for every (rank, layer, kind) the
// ranges of each list are concatenated and the two streams must have equal
// length; then the stream is copied. Errors when the lists do not describe the
// same layers and sizes. Ranges on a device are copied by that device (host to
// device, device to host, on one device; between two devices through the host),
// and every device written or read is synchronised before this returns, so the
// host bytes of `src` may be freed then.
absl::Status CopyStateRanges(absl::Span<const StateRange> src,
                             absl::Span<const StateRange> dst);

// Copies the range's bytes to `host_dst` (r.bytes of them): a device copy for a
// range on a device (synchronised), a memcpy for host memory.
absl::Status CopyRangeToHost(const StateRange& r, void* host_dst);

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_RUNTIME_KV_CACHE_H_
