// What a device backend's worker holds on its device(s) besides the KV cache,
// measured before the cache is sized (--gpu_memory_utilization,
// engine/cache/cache_sizing.h ResolveDeviceBudget): as vLLM profiles its
// activation memory with a forward at the largest batch.
//
//   ProfileDeviceMemory(weights, backend, checkpoint, options)
//     → a TpExecutor over a temporary cache just big enough for one sequence of
//       `tokens` tokens (TP 1: the caller's weights and backend; TP N: N ranks,
//       each loading its shard onto its own backend's device, as the engine will)
//     → per rank: in_use = the device's allocated bytes without the temporary
//       cache (the weights and the backend's buffers), free bytes
//     → one Forward of `tokens` tokens with logits for every row (no step of that
//       many tokens asks for more) → Synchronize
//     → activation peak = what the forward left allocated: the runner's device
//       scratch and the backend's scratch only grow (DeviceScratch, the GPU
//       backend's Scratch free the old buffer before taking a larger one), so the
//       live bytes after the forward are its high-water mark
//     → the executor (temporary cache, runner scratch; the TP N ranks' shards) is
//       freed before returning
//
// The backend's scratch stays allocated (it belongs to the backend), so it is
// counted once, in the peak. Attention scratch does not grow with the context:
// the GPU MLA kernels bound it (kExpandedScratchBudget, split counts), so a step
// at position 0 needs what a step at any position does.
#ifndef TANDEM_ENGINE_RUNTIME_MEMORY_PROFILE_H_
#define TANDEM_ENGINE_RUNTIME_MEMORY_PROFILE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cache/cache_sizing.h"
#include "engine/model/checkpoint.h"
#include "engine/runtime/tp_executor.h"
#include "engine/runtime/weights.h"
#include "kernels/backend.h"

namespace tandem::engine {

struct MemoryProfileOptions {
  int64_t tokens = 256;  // the largest step (EngineOptions::max_tokens_per_step)
  // Rows of that step with logits (the last ones); 0: every row. A step's
  // logits are its sequences' last rows (and their drafts'), so a worker passes
  // min(tokens, max_num_seqs * (1 + drafts per step)): an 8192-token step's
  // logits for every row would hold 8192 * vocab fp32 values (5.4 GB for K3's
  // 163,840) that no step ever asks for.
  int64_t logit_rows = 0;
  int32_t block_size = 16;
  // tp.tp_size > 1: the ranks are built from `checkpoint` with tp.backend (as
  // Engine::Create builds them); tp.cache is replaced by the temporary cache.
  TpExecutorOptions tp;
};

// One DeviceMemoryMeasure per rank (rank order). weights, backend: TP 1 (not
// owned); checkpoint: TP N (not owned). FAILED_PRECONDITION on a host backend
// (nothing to measure); the errors of the executor and the forward (a device
// too small for the profile: RESOURCE_EXHAUSTED naming what did not fit).
absl::StatusOr<std::vector<DeviceMemoryMeasure>> ProfileDeviceMemory(
    const ModelWeights* weights, kernels::Backend* backend,
    const model::Checkpoint* checkpoint, const MemoryProfileOptions& options);

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_RUNTIME_MEMORY_PROFILE_H_
