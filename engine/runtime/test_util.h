// Shared helpers for the runtime tests: the tiny generated checkpoint (loaded
// once per test process), backends, and a one-sequence driver over ModelRunner.
#ifndef TANDEM_ENGINE_RUNTIME_TEST_UTIL_H_
#define TANDEM_ENGINE_RUNTIME_TEST_UTIL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/model/checkpoint.h"
#include "engine/runtime/kv_cache.h"
#include "engine/runtime/model_runner.h"
#include "engine/runtime/weights.h"
#include "kernels/backend.h"

namespace tandem::engine::testing {

// engine/model/tiny_checkpoint, relative to the runfiles root.
inline constexpr char kTinyCheckpointDir[] = "engine/model/tiny_checkpoint";

// The tiny checkpoint and its weights, opened on first use (CHECK-fails on error).
const ModelWeights& TinyWeights();

// The tiny weights placed on `backend`'s device (PlaceModelWeights); the host
// device gets its own unplaced copy. CHECK-fails on error.
std::unique_ptr<ModelWeights> TinyWeightsOn(kernels::Backend& backend);

// CreateBackend(name), CHECK-failing on error.
std::unique_ptr<kernels::Backend> MakeBackend(const char* name);

// A cache sized for tests: `blocks` blocks of `block_size`, `slots` slots.
std::unique_ptr<KvCache> MakeCache(const ModelWeights& w, int64_t blocks,
                                   int64_t block_size, int64_t slots);

// MakeCache with its buffers on `backend`'s device.
std::unique_ptr<KvCache> MakeCacheOn(const ModelWeights& w, kernels::Backend& backend,
                                     int64_t blocks, int64_t block_size, int64_t slots);

// Consecutive block ids first .. first + count - 1.
std::vector<int32_t> BlockRange(int32_t first, int32_t count);

// One sequence driven by hand: its blocks, slot and cached length.
struct TestSequence {
  std::vector<int32_t> blocks;
  int64_t slot = 0;
  int64_t pos = 0;
};

// Feeds `tokens` to `seq` in one forward; fills `logits` with the rows of every
// token when all_logits, else of the last token only. Advances seq->pos.
absl::Status Feed(ModelRunner* runner, TestSequence* seq,
                  absl::Span<const int32_t> tokens, bool all_logits,
                  std::vector<float>* logits);

// Index of the largest value (lowest index on ties).
int32_t Argmax(absl::Span<const float> row);

// Prefill `prompt` in chunks of `chunk` tokens, then greedy-decode `steps`
// tokens one at a time. Returns the generated tokens.
absl::StatusOr<std::vector<int32_t>> GreedyGenerate(ModelRunner* runner,
                                                    TestSequence* seq,
                                                    absl::Span<const int32_t> prompt,
                                                    int64_t chunk, int steps);

// A deterministic prompt of `n` token ids below 100000 seeded by `seed`.
std::vector<int32_t> MakePrompt(int n, uint64_t seed);

}  // namespace tandem::engine::testing

#endif  // TANDEM_ENGINE_RUNTIME_TEST_UTIL_H_
