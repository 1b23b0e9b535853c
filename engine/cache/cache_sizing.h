// How many MLA blocks and KDA state slots a worker's memory budget buys, and the
// longest context it can then hold. Pure arithmetic over the per-token and
// per-sequence sizes (memory_accounting.h has what they are for K3); the engine
// fills them in from the model config (engine/runtime/engine.h,
// SizeCacheFromMemory).
//
//   slots  = max_num_seqs, unless their KDA state would take more than half the
//            budget: then as many as half the budget holds (concurrency limited
//            by memory, reported); and unless they would leave the blocks too
//            few for one sequence of the full length (max_model_len, else the
//            model's) where fewer slots (at least one) would not: then as many
//            as leave room for it. The model's own context comes before the last
//            slots (K3 on 8 B300s: 245 slots and 1M tokens rather than 256 and
//            1,027,920; docs/benchmarks.md, "Projection")
//   snapshots = floor(budget * snapshot_fraction / slot_bytes): the prefix
//            cache's KDA snapshots (extra slots), their share taken first
//   blocks = (budget - (slots + snapshots) * slot_bytes) / (block_size * token_bytes)
//            (or num_blocks_override), at most 2^31 - 1
//   max_model_len = the requested one (default: the model's), which must not
//            exceed the model's; when the blocks hold fewer tokens, a requested
//            length is an error and the model's default is lowered to what fits
//
// On a device backend (a GPU; cuda_sim's emulated device) the budget itself comes
// from the device, as vLLM's --gpu_memory_utilization does (ResolveDeviceBudget):
//
//   per device = floor(utilization * total) - in_use - activation_peak
//                in_use: what this worker holds there once the weights are loaded
//                (the weights and the backend's own buffers); activation_peak: what
//                a profiling forward at the largest step adds (the runner's and the
//                backend's scratch, engine/runtime/memory_profile.h)
//   budget     = num_devices * the smallest device's (TP ranks, one device each,
//                each holding 1/num_devices of the cache)
//
// --kv_cache_memory given on a device backend overrides the utilization: bytes
// (every rank's cache together), or a fraction of what the device has free after
// the weights and the profile's peak.
#ifndef TANDEM_ENGINE_CACHE_CACHE_SIZING_H_
#define TANDEM_ENGINE_CACHE_CACHE_SIZING_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cache/memory_budget.h"

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

// The least budget that holds one KDA slot (at most half the budget goes to the
// slots) and one MLA block: max(2 * slot_bytes, slot_bytes + block_size *
// token_bytes).
int64_t MinCacheBytes(const CacheSizingInput& in);

// One device as a worker measured it before sizing its cache (a TP rank's).
struct DeviceMemoryMeasure {
  std::string device;         // "cuda:0", "cuda_sim"
  int64_t total_bytes = 0;    // capacity
  int64_t free_bytes = 0;     // free with the weights loaded, before the profile
  int64_t in_use_bytes = 0;   // this worker's allocations there (weights + other)
  int64_t weights_bytes = 0;  // of which the weights
  int64_t activation_peak_bytes = 0;  // what the profiling forward added at its peak
};

// How a device backend's worker sizes its cache, and what it measured.
struct DeviceMemoryUse {
  std::string device;      // empty: a host backend (nothing below is set)
  int num_devices = 0;     // TP ranks, one device each
  std::string source;      // "--gpu_memory_utilization=0.9", "--kv_cache_memory=8GiB"
  double utilization = 0;  // --gpu_memory_utilization (when it was the source)
  int64_t profile_tokens = 0;  // tokens of the profiling forward (the largest step)
  // Of the device the budget was limited by (the smallest per-device budget):
  int64_t total_bytes = 0;
  int64_t free_bytes = 0;
  int64_t in_use_bytes = 0;
  int64_t weights_bytes = 0;
  int64_t activation_peak_bytes = 0;
  int64_t budget_per_device_bytes = 0;  // the cache's share of one device
  int64_t budget_bytes = 0;             // num_devices * budget_per_device_bytes
  // The least per-device memory this worker needs (in_use + activation peak +
  // its share of MinCacheBytes), and the utilization that gives it.
  int64_t needed_per_device_bytes = 0;
  double min_utilization = 0;
  // The device had less free than the budget asked for (another process or
  // worker holds some): the budget was lowered to what is free.
  bool limited_by_free_memory = false;
  std::string Summary() const;
};

struct DeviceBudgetInput {
  std::vector<DeviceMemoryMeasure> devices;  // one per TP rank (>= 1)
  double utilization = 0.9;                  // used when kv_cache_memory is unset
  // --kv_cache_memory as given (bytes: the whole worker's; a fraction: of one
  // device's total - in_use - activation_peak); nullopt-like: `has_kv_cache_memory`.
  bool has_kv_cache_memory = false;
  MemoryBudget kv_cache_memory;
  std::string kv_cache_memory_text;  // for messages
  int64_t min_cache_bytes = 0;       // MinCacheBytes of the worker's cache
  int64_t profile_tokens = 0;
};

// The device budget (DeviceMemoryUse::budget_bytes is SizeCache's budget_bytes).
// INVALID_ARGUMENT for a utilization outside (0, 1], no device, a non-positive
// capacity; RESOURCE_EXHAUSTED when the budget leaves less than min_cache_bytes
// for the cache, or --kv_cache_memory bytes ask for more than the device has
// free (a budget by utilization or fraction is lowered to what is free, another
// process or worker holding the rest; limited_by_free_memory): the message names the
// device, the weights, the other buffers, the activation peak, and the memory (or
// utilization) that would be enough.
absl::StatusOr<DeviceMemoryUse> ResolveDeviceBudget(const DeviceBudgetInput& in);

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
  // A device backend's measurement (device empty on the host backends).
  DeviceMemoryUse device;
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
