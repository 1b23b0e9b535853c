#include "worker/memory_sizing.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status.h"
#include "engine/cache/memory_budget.h"
#include "engine/runtime/memory_profile.h"

namespace tandem::worker {
namespace {

absl::StatusOr<engine::MemoryBudget> ParseFlag(const std::string& spec) {
  absl::StatusOr<engine::MemoryBudget> b = engine::ParseMemoryBudget(spec);
  if (!b.ok()) return InvalidArgument("--kv_cache_memory: ", b.status().message());
  return b;
}

// The host rule: bytes, or a fraction of MemAvailable now.
absl::StatusOr<int64_t> HostBudget(const WorkerMemoryFlags& flags) {
  const std::string spec =
      flags.kv_cache_memory.empty() ? kDefaultHostKvCacheMemory : flags.kv_cache_memory;
  TANDEM_ASSIGN_OR_RETURN(engine::MemoryBudget budget, ParseFlag(spec));
  int64_t available = 0;
  if (budget.is_fraction()) {
    absl::StatusOr<int64_t> a = engine::ReadMemAvailable(flags.meminfo_path);
    if (!a.ok()) {
      return InvalidArgument("--kv_cache_memory=", spec,
                             " is a fraction of the available memory, which cannot be "
                             "read (",
                             a.status().message(), "); give bytes, like 8GiB");
    }
    available = *a;
  }
  TANDEM_ASSIGN_OR_RETURN(int64_t bytes,
                          engine::ResolveMemoryBudget(budget, available));
  TLOG(INFO, "KV cache budget from host memory")
      .Kv("kv_cache_memory", spec)
      .Kv("available_bytes", available)
      .Kv("budget_bytes", bytes);
  return bytes;
}

// The device rule: profile, then ResolveDeviceBudget.
absl::StatusOr<engine::DeviceMemoryUse> DeviceBudget(const WorkerModel& model,
                                                     const WorkerMemoryFlags& flags,
                                                     const engine::EngineOptions& eo) {
  engine::DeviceBudgetInput in;
  in.utilization = flags.gpu_memory_utilization;
  if (!(in.utilization > 0 && in.utilization <= 1)) {
    return InvalidArgument("--gpu_memory_utilization must be in (0, 1], got ",
                           in.utilization);
  }
  if (!flags.kv_cache_memory.empty()) {
    TANDEM_ASSIGN_OR_RETURN(in.kv_cache_memory, ParseFlag(flags.kv_cache_memory));
    in.has_kv_cache_memory = true;
    in.kv_cache_memory_text = flags.kv_cache_memory;
  }
  const int tp = std::max(1, eo.tp.tp_size);
  engine::MemoryProfileOptions po;
  po.tokens = eo.max_tokens_per_step;
  // A step's logits: its sequences' sampled rows, and the prompt rows of
  // requests with prompt logprobs (SchedulerConfig::max_scored_tokens_per_step).
  po.logit_rows = std::min<int64_t>(
      po.tokens,
      int64_t{flags.max_num_seqs} * (1 + std::max(0, flags.speculative_tokens)) +
          std::max<int64_t>(0, eo.max_scored_tokens_per_step));
  po.block_size = eo.block_size;
  po.tp = eo.tp;
  po.tp.backend = model.backend_name;
  po.tp.fail_rank = -1;  // the failure drill is for the engine's steps
  po.tp.fail_rank_at_step = -1;
  if (in.has_kv_cache_memory && !in.kv_cache_memory.is_fraction()) {
    // Bytes: taken as given, without a profile (as vLLM's --kv-cache-memory);
    // only checked against what the model's device has free.
    kernels::Device& dev = model.backend->device();
    const kernels::DeviceMemoryInfo info = dev.MemoryInfo();
    engine::DeviceMemoryMeasure m;
    m.device = std::string(dev.name());
    m.total_bytes = info.total_bytes;
    m.free_bytes = info.free_bytes;
    m.in_use_bytes = info.allocated_bytes;
    m.weights_bytes = static_cast<int64_t>(model.weights->device_bytes);
    in.devices.assign(tp, m);
  } else {
    TLOG(INFO, "profiling device memory: one forward at the largest step")
        .Kv("device", model.backend->device().name())
        .Kv("tokens", po.tokens)
        .Kv("tp", tp);
    TANDEM_ASSIGN_OR_RETURN(in.devices, engine::ProfileDeviceMemory(
                                            model.weights.get(), model.backend.get(),
                                            model.checkpoint.get(), po));
    in.profile_tokens = po.tokens;
  }
  // What the worker holds beside the engine on each rank's device (its own
  // allocations, which the engine's profile does not see).
  for (size_t r = 0; r < model.extra_device_bytes.size() && r < in.devices.size();
       ++r) {
    in.devices[r].in_use_bytes += model.extra_device_bytes[r];
  }
  // One block and one slot of the worker's cache (SizeCacheFromMemory's sizes).
  in.min_cache_bytes = engine::MinCacheBytes(
      engine::WorkerCacheUnits(model.checkpoint->config(), tp, eo.block_size));
  TANDEM_ASSIGN_OR_RETURN(engine::DeviceMemoryUse use, engine::ResolveDeviceBudget(in));
  TLOG(INFO, "KV cache budget from device memory")
      .Kv("device", use.device)
      .Kv("devices", use.num_devices)
      .Kv("source", use.source)
      .Kv("device_total_bytes", use.total_bytes)
      .Kv("device_free_bytes", use.free_bytes)
      .Kv("weights_bytes", use.weights_bytes)
      .Kv("other_bytes", use.in_use_bytes - use.weights_bytes)
      .Kv("profile_tokens", use.profile_tokens)
      .Kv("profile_peak_bytes", use.activation_peak_bytes)
      .Kv("budget_per_device_bytes", use.budget_per_device_bytes)
      .Kv("budget_bytes", use.budget_bytes)
      .Kv("min_gpu_memory_utilization", use.min_utilization);
  if (use.limited_by_free_memory) {
    TLOG(WARNING,
         "the device has less free than the budget asked for (another process or "
         "worker uses it): the KV cache gets what is free")
        .Kv("device", use.device)
        .Kv("free_bytes", use.free_bytes)
        .Kv("budget_per_device_bytes", use.budget_per_device_bytes);
  }
  return use;
}

}  // namespace

absl::StatusOr<engine::CacheSizing> SizeWorkerCache(const WorkerModel& model,
                                                    const WorkerMemoryFlags& flags,
                                                    engine::EngineOptions* eo) {
  const bool on_device = model.backend->device().name() != "host";
  engine::CacheMemoryOptions m;
  engine::DeviceMemoryUse use;
  if (on_device) {
    TANDEM_ASSIGN_OR_RETURN(use, DeviceBudget(model, flags, *eo));
    m.budget_bytes = use.budget_bytes;
  } else {
    TANDEM_ASSIGN_OR_RETURN(m.budget_bytes, HostBudget(flags));
  }
  m.max_num_seqs = flags.max_num_seqs;
  m.max_model_len = flags.max_model_len;
  m.num_blocks_override = flags.num_blocks;
  m.prefix_snapshot_fraction = flags.prefix_snapshot_memory;
  absl::StatusOr<engine::CacheSizing> sized =
      engine::SizeCacheFromMemory(model.checkpoint->config(), m, eo);
  if (!sized.ok()) {
    if (!on_device) return sized.status();
    return Annotate(
        sized.status(),
        absl::StrCat("sizing the KV cache on the device (", use.Summary(),
                     "; with --gpu_memory_utilization the budget grows with "
                     "it)"));
  }
  engine::CacheSizing sizing = *std::move(sized);
  sizing.device = use;
  TLOG(INFO, "KV cache sized from memory")
      .Kv("budget_bytes", sizing.budget_bytes)
      .Kv("mla_blocks", sizing.num_blocks)
      .Kv("block_size", eo->block_size)
      .Kv("cache_tokens", sizing.cache_tokens)
      .Kv("kda_slots", sizing.num_slots)
      .Kv("max_model_len", sizing.max_model_len)
      .Kv("mla_bytes", sizing.block_bytes)
      .Kv("kda_bytes", sizing.slot_bytes)
      .Kv("tp", eo->tp.tp_size)
      .Kv("prefix_caching", eo->prefix_caching.enabled)
      .Kv("prefix_snapshots", eo->prefix_caching.num_snapshots)
      .Kv("summary", sizing.Summary());
  const char* raise = on_device && flags.kv_cache_memory.empty()
                          ? "--gpu_memory_utilization"
                          : "--kv_cache_memory";
  if (sizing.slots_limited_by_memory) {
    TLOG(WARNING,
         "fewer KDA slots than --max_num_seqs: their state would take more "
         "than half of the KV cache budget")
        .Kv("max_num_seqs", m.max_num_seqs)
        .Kv("kda_slots", sizing.num_slots)
        .Kv("raise", raise);
  }
  if (sizing.max_model_len_limited_by_memory) {
    TLOG(WARNING, "max_model_len lowered to what the cache holds")
        .Kv("model_max_position_embeddings",
            model.checkpoint->config().text.max_position_embeddings)
        .Kv("max_model_len", sizing.max_model_len)
        .Kv("raise", raise);
  }
  return sizing;
}

}  // namespace tandem::worker
