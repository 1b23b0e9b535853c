#include "engine/runtime/memory_profile.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "engine/cache/memory_budget.h"

namespace tandem::engine {

absl::StatusOr<std::vector<DeviceMemoryMeasure>> ProfileDeviceMemory(
    const ModelWeights* weights, kernels::Backend* backend,
    const model::Checkpoint* checkpoint, const MemoryProfileOptions& options) {
  if (options.tokens < 1 || options.block_size < 1) {
    return InvalidArgument("memory profile: tokens (", options.tokens,
                           ") and block_size (", options.block_size, ") must be >= 1");
  }
  const int n = std::max(1, options.tp.tp_size);
  KvCacheOptions co;
  co.block_size = options.block_size;
  co.num_blocks = (options.tokens + options.block_size - 1) / options.block_size;
  co.num_slots = 1;
  std::unique_ptr<TpExecutor> ex;
  const model::ModelConfig* config = nullptr;
  if (n == 1) {
    if (weights == nullptr || backend == nullptr) {
      return InvalidArgument("memory profile: TP 1 needs the weights and the backend");
    }
    if (backend->device().name() == "host") {
      return FailedPrecondition("memory profile: backend ", backend->name(),
                                " computes in host memory (no device to size)");
    }
    config = &weights->config;
    TANDEM_ASSIGN_OR_RETURN(
        ex, TpExecutor::CreateLocal(weights, backend, co, options.tp.runner));
  } else {
    if (checkpoint == nullptr) {
      return InvalidArgument("memory profile: TP ", n, " needs the checkpoint");
    }
    config = &checkpoint->config();
    TpExecutorOptions t = options.tp;
    t.tp_size = n;
    t.cache = co;
    TANDEM_ASSIGN_OR_RETURN(ex, TpExecutor::Create(*checkpoint, t));
    if (ex->backend(0).device().name() == "host") {
      return FailedPrecondition("memory profile: backend ", t.backend,
                                " computes in host memory (no device to size)");
    }
  }
  std::vector<DeviceMemoryMeasure> out(n);
  std::vector<int64_t> before(n);
  for (int r = 0; r < n; ++r) {
    kernels::Device& d = ex->backend(r).device();
    TANDEM_RETURN_IF_ERROR(d.Synchronize());
    const kernels::DeviceMemoryInfo info = d.MemoryInfo();
    const int64_t cache = static_cast<int64_t>(ex->cache(r).total_bytes());
    DeviceMemoryMeasure& m = out[r];
    m.device = std::string(d.name());
    m.total_bytes = info.total_bytes;
    m.free_bytes = info.free_bytes + cache;  // the temporary cache goes
    m.in_use_bytes = info.allocated_bytes - cache;
    m.weights_bytes = static_cast<int64_t>(ex->weights(r).device_bytes);
    before[r] = info.allocated_bytes;
  }
  // One sequence of the step's size from position 0, logits for its last
  // `logit_rows` rows (every row when 0).
  const int64_t V = config->text.vocab_size;
  std::vector<int32_t> tokens(options.tokens);
  for (int64_t i = 0; i < options.tokens; ++i) {
    tokens[i] = static_cast<int32_t>((i * 7919 + 1) % V);
  }
  std::vector<int32_t> table(co.num_blocks);
  for (int64_t b = 0; b < co.num_blocks; ++b) table[b] = static_cast<int32_t>(b);
  SequenceInput s;
  s.tokens = tokens;
  s.start_pos = 0;
  s.block_table = table;
  s.kda_slot = 0;
  const int64_t rows = options.logit_rows > 0
                           ? std::min(options.logit_rows, options.tokens)
                           : options.tokens;
  s.logits_indices.resize(rows);
  for (int64_t i = 0; i < rows; ++i) {
    s.logits_indices[i] = static_cast<int32_t>(options.tokens - rows + i);
  }
  std::vector<float> logits;
  if (absl::Status st = ex->Forward({s}, &logits); !st.ok()) {
    return Annotate(st, absl::StrCat("the memory profile's forward of ", options.tokens,
                                     " tokens (the largest step)"));
  }
  for (int r = 0; r < n; ++r) {
    kernels::Device& d = ex->backend(r).device();
    TANDEM_RETURN_IF_ERROR(d.Synchronize());
    out[r].activation_peak_bytes =
        std::max<int64_t>(0, d.MemoryInfo().allocated_bytes - before[r]);
  }
  return out;
}

}  // namespace tandem::engine
