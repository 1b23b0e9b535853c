// How a worker sizes its KV cache and KDA state pool at start, from the memory
// flags (worker_flags.h reads them): the one place the host and the device
// rules meet.
//
//   host backends (device "host"): budget = --kv_cache_memory (bytes, or a
//     fraction of MemAvailable; default 0.1)
//   device backends (cuda, cuda_sim; the weights already placed by
//     LoadWorkerModel): ProfileDeviceMemory (a forward at the largest step,
//     --max_tokens_per_step, on a temporary cache) → ResolveDeviceBudget:
//       --kv_cache_memory unset: floor(--gpu_memory_utilization * capacity)
//         - in use after the weights - the profile's activation peak, per device
//       --kv_cache_memory bytes: exactly that (every TP rank's cache together;
//         no profile, only checked against what the model's device has free)
//       --kv_cache_memory fraction: that share of capacity - in use - peak
//     lowered to what the device has free (another process or worker on it)
//   then engine::SizeCacheFromMemory: slots, blocks, max_model_len
//     (engine/cache/cache_sizing.h), logged ("KV cache sized from memory"),
//     returned (CacheSizing::device holds the device's numbers for metrics).
#ifndef TANDEM_WORKER_MEMORY_SIZING_H_
#define TANDEM_WORKER_MEMORY_SIZING_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "engine/cache/cache_sizing.h"
#include "engine/runtime/engine.h"
#include "worker/worker_model.h"

namespace tandem::worker {

struct WorkerMemoryFlags {
  std::string kv_cache_memory;          // "": the backend's default rule
  double gpu_memory_utilization = 0.9;  // device backends
  int max_num_seqs = 256;
  int64_t max_model_len = 0;
  int num_blocks = 0;
  double prefix_snapshot_memory = 0.05;
  // Drafts verified per decode step (0: no speculative decoding): the profile
  // computes logits for max_num_seqs * (1 + it) rows at most.
  int speculative_tokens = 0;
  std::string meminfo_path = "/proc/meminfo";
};

// The host backends' default --kv_cache_memory.
inline constexpr char kDefaultHostKvCacheMemory[] = "0.1";

// Sizes `options` (block_size, max_tokens_per_step, tp and
// prefix_caching.enabled already set) for `model` as above. INVALID_ARGUMENT for
// bad flags; the profile's errors (RESOURCE_EXHAUSTED when the device cannot
// hold the profile), ResolveDeviceBudget's and SizeCache's (annotated with the
// device's numbers on a device backend).
absl::StatusOr<engine::CacheSizing> SizeWorkerCache(const WorkerModel& model,
                                                    const WorkerMemoryFlags& flags,
                                                    engine::EngineOptions* options);

}  // namespace tandem::worker

#endif  // TANDEM_WORKER_MEMORY_SIZING_H_
