// How many MLA blocks and KDA state slots a worker's memory budget buys, and the
// longest context it can then hold. Pure arithmetic over the per-token and
// per-sequence sizes (memory_accounting.h has what they are for K3); the engine
// fills them in from the model config (engine/runtime/engine.h,
// SizeCacheFromMemory).
//
//   slots  = max_num_seqs, unless their KDA state would take more than half the
//            budget: then as many as half the budget holds (concurrency limited
//            by memory, reported)
//   snapshots = floor(budget * snapshot_fraction / slot_bytes): the prefix
//            cache's KDA snapshots (extra slots), their share taken first
//   blocks = (budget - (slots + snapshots) * slot_bytes) / (block_size * token_bytes)
//            (or num_blocks_override), at most 2^31 - 1
//   max_model_len = the requested one (default: the model's), which must not
//            exceed the model's; when the blocks hold fewer tokens, a requested
//            length is an error and the model's default is lowered to what fits
#ifndef TANDEM_ENGINE_CACHE_CACHE_SIZING_H_
#define TANDEM_ENGINE_CACHE_CACHE_SIZING_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace tandem::engine {

struct CacheSizingInput {
  int64_t budget_bytes = 0;
  // The whole worker's bytes (every tensor-parallel rank's cache together).
  int64_t token_bytes = 0;  // one token's MLA latent, all MLA layers
  int64_t slot_bytes = 0;   // one sequence's KDA state, all KDA layers
  int32_t block_size = 16;
  int32_t max_num_seqs = 256;
  int64_t max_model_len = 0;        // 0: model_max_len
  int64_t model_max_len = 0;        // the checkpoint's max_position_embeddings
  int64_t num_blocks_override = 0;  // > 0: exactly this many blocks
  // Prefix caching: the share of the budget for KDA snapshots, in [0, 0.9].
  double snapshot_fraction = 0.0;
};

struct CacheSizing {
  int64_t budget_bytes = 0;
  int32_t num_slots = 0;
  int64_t num_blocks = 0;
  int64_t cache_tokens = 0;   // num_blocks * block_size
  int64_t max_model_len = 0;  // prompt + output tokens of one request, at most
  int64_t slot_bytes = 0;     // all slots (snapshots included)
  int32_t num_snapshots = 0;  // prefix-cache snapshot slots
  int64_t block_bytes = 0;    // all blocks
  int64_t total_bytes() const { return slot_bytes + block_bytes; }
  bool slots_limited_by_memory = false;          // fewer slots than max_num_seqs
  bool max_model_len_limited_by_memory = false;  // default lowered to fit
  // One line for the start-up log and messages.
  std::string Summary() const;
};

// INVALID_ARGUMENT for non-positive sizes or counts, a max_model_len above the
// model's, or a requested max_model_len the cache cannot hold (the message says
// how much memory it needs); RESOURCE_EXHAUSTED when the budget holds no slot or
// no block.
absl::StatusOr<CacheSizing> SizeCache(const CacheSizingInput& in);

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_CACHE_CACHE_SIZING_H_
