#include "engine/cache/cache_sizing.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "engine/cache/memory_budget.h"

namespace tandem::engine {

std::string CacheSizing::Summary() const {
  std::string line = absl::StrCat(
      num_blocks, " MLA blocks (", cache_tokens, " tokens, ", FormatBytes(block_bytes),
      "), ", num_slots, " KDA slots and ", num_snapshots, " prefix snapshots (",
      FormatBytes(slot_bytes), "), max_model_len ", max_model_len, " tokens; ",
      FormatBytes(total_bytes()), " of a ", FormatBytes(budget_bytes), " budget");
  if (!device.device.empty()) absl::StrAppend(&line, " (", device.Summary(), ")");
  return line;
}

std::string DeviceMemoryUse::Summary() const {
  return absl::StrCat(
      source, " on ", num_devices, " x ", device, " of ", FormatBytes(total_bytes),
      ": weights ", FormatBytes(weights_bytes), ", other ",
      FormatBytes(in_use_bytes - weights_bytes), ", activations ",
      profile_tokens > 0 ? absl::StrCat(FormatBytes(activation_peak_bytes), " (",
                                        profile_tokens, "-token profile)")
                         : std::string("not profiled"),
      ", KV cache ", FormatBytes(budget_per_device_bytes), " per device");
}

int64_t MinCacheBytes(const CacheSizingInput& in) {
  return std::max(2 * in.slot_bytes,
                  in.slot_bytes + static_cast<int64_t>(in.block_size) * in.token_bytes);
}

absl::StatusOr<DeviceMemoryUse> ResolveDeviceBudget(const DeviceBudgetInput& in) {
  if (in.devices.empty()) {
    return InvalidArgument("device cache sizing needs at least one device");
  }
  const bool by_utilization = !in.has_kv_cache_memory;
  if (by_utilization && !(in.utilization > 0 && in.utilization <= 1)) {
    return InvalidArgument("--gpu_memory_utilization must be in (0, 1], got ",
                           in.utilization);
  }
  const int64_t n = static_cast<int64_t>(in.devices.size());
  DeviceMemoryUse u;
  u.num_devices = static_cast<int>(n);
  u.profile_tokens = in.profile_tokens;
  u.utilization = by_utilization ? in.utilization : 0.0;
  u.source = by_utilization
                 ? absl::StrCat("--gpu_memory_utilization=", in.utilization)
                 : absl::StrCat("--kv_cache_memory=", in.kv_cache_memory_text);
  const int64_t min_share = (in.min_cache_bytes + n - 1) / n;
  int best = -1;
  int64_t per = 0;
  for (size_t i = 0; i < in.devices.size(); ++i) {
    const DeviceMemoryMeasure& d = in.devices[i];
    if (d.total_bytes <= 0) {
      return InvalidArgument("device ", d.device, " reports a capacity of ",
                             d.total_bytes, " bytes");
    }
    const int64_t rest = d.total_bytes - d.in_use_bytes - d.activation_peak_bytes;
    int64_t p = 0;
    if (by_utilization) {
      p = static_cast<int64_t>(std::floor(in.utilization * d.total_bytes)) -
          d.in_use_bytes - d.activation_peak_bytes;
    } else if (in.kv_cache_memory.is_fraction()) {
      p = rest <= 0
              ? rest
              : static_cast<int64_t>(std::floor(in.kv_cache_memory.fraction * rest));
    } else {
      p = in.kv_cache_memory.bytes / n;
    }
    if (best < 0 || p < per) {
      best = static_cast<int>(i);
      per = p;
    }
  }
  const DeviceMemoryMeasure& d = in.devices[best];
  u.device = d.device;
  u.total_bytes = d.total_bytes;
  u.free_bytes = d.free_bytes;
  u.in_use_bytes = d.in_use_bytes;
  u.weights_bytes = d.weights_bytes;
  u.activation_peak_bytes = d.activation_peak_bytes;
  u.needed_per_device_bytes = d.in_use_bytes + d.activation_peak_bytes + min_share;
  u.min_utilization = static_cast<double>(u.needed_per_device_bytes) /
                      static_cast<double>(d.total_bytes);
  const std::string what =
      absl::StrCat("on ", d.device, " (", FormatBytes(d.total_bytes),
                   "; the weights take ", FormatBytes(d.weights_bytes),
                   ", other buffers ", FormatBytes(d.in_use_bytes - d.weights_bytes),
                   ", the profiling forward's activations at ", in.profile_tokens,
                   " tokens ", FormatBytes(d.activation_peak_bytes), ")");
  if (per < min_share) {
    std::string fix;
    if (u.needed_per_device_bytes > d.total_bytes) {
      fix =
          "more than the device has: use a larger device, more TP ranks (--tp) or a "
          "smaller step (--max_tokens_per_step)";
    } else if (by_utilization) {
      fix = absl::StrCat("raise --gpu_memory_utilization to at least ",
                         absl::StrFormat("%.4f", u.min_utilization));
    } else {
      fix =
          "give --kv_cache_memory more, or leave it out to size by "
          "--gpu_memory_utilization";
    }
    return ResourceExhausted(
        u.source, " leaves ", per <= 0 ? std::string("nothing") : FormatBytes(per),
        " for the KV cache ", what, "; one MLA block and one KDA slot need ",
        FormatBytes(min_share), " per device, so this worker needs at least ",
        FormatBytes(u.needed_per_device_bytes), " of each device: ", fix);
  }
  // What the device really has free (another process or worker may hold some):
  // the cache and the activations must fit in it, with room for the allocations'
  // rounding.
  constexpr int64_t kRoundingSlack = int64_t{1} << 20;
  const int64_t fits = d.free_bytes - d.activation_peak_bytes - kRoundingSlack;
  const bool exact = in.has_kv_cache_memory && !in.kv_cache_memory.is_fraction();
  if (per > fits) {
    if (exact || fits < min_share) {
      return ResourceExhausted(
          u.source, " asks for ", FormatBytes(per), " of KV cache ", what,
          ", but the device has only ", FormatBytes(d.free_bytes),
          " free (the activations need ", FormatBytes(d.activation_peak_bytes),
          " of it): ",
          exact ? std::string("give --kv_cache_memory less, or leave it out to size by "
                              "--gpu_memory_utilization")
                : absl::StrCat(
                      "another process or worker uses it; this worker needs ",
                      FormatBytes(min_share + d.activation_peak_bytes + kRoundingSlack),
                      " free beside its weights"));
    }
    per = fits;
    u.limited_by_free_memory = true;
  }
  u.budget_per_device_bytes = per;
  u.budget_bytes = per * n;
  return u;
}

absl::StatusOr<CacheSizing> SizeCache(const CacheSizingInput& in) {
  if (in.budget_bytes <= 0) {
    return InvalidArgument("the KV cache memory budget must be > 0 bytes, got ",
                           in.budget_bytes);
  }
  if (in.token_bytes <= 0 || in.slot_bytes < 0 || in.block_size <= 0) {
    return InvalidArgument("cache sizing needs positive bytes per token (",
                           in.token_bytes, "), bytes per slot >= 0 (", in.slot_bytes,
                           ") and a positive block size (", in.block_size, ")");
  }
  if (in.max_num_seqs <= 0) {
    return InvalidArgument("--max_num_seqs must be >= 1, got ", in.max_num_seqs);
  }
  if (in.model_max_len <= 1) {
    return InvalidArgument(
        "the model's context (max_position_embeddings) must be "
        ">= 2 tokens, got ",
        in.model_max_len);
  }
  if (in.max_model_len < 0 || in.max_model_len == 1) {
    return InvalidArgument("--max_model_len must be >= 2 (0: the model's ",
                           in.model_max_len, "), got ", in.max_model_len);
  }
  if (in.max_model_len > in.model_max_len) {
    return InvalidArgument("--max_model_len ", in.max_model_len,
                           " exceeds the model's context of ", in.model_max_len,
                           " tokens (max_position_embeddings)");
  }
  if (in.num_blocks_override < 0) {
    return InvalidArgument("--num_blocks must be >= 0, got ", in.num_blocks_override);
  }
  if (!(in.snapshot_fraction >= 0.0 && in.snapshot_fraction <= 0.9)) {
    return InvalidArgument("the prefix snapshot share must be in [0, 0.9], got ",
                           in.snapshot_fraction);
  }
  CacheSizing s;
  s.budget_bytes = in.budget_bytes;
  int64_t snapshots = 0;
  if (in.slot_bytes > 0 && in.snapshot_fraction > 0) {
    snapshots =
        static_cast<int64_t>(in.budget_bytes * in.snapshot_fraction) / in.slot_bytes;
    snapshots = std::min<int64_t>(snapshots, 1 << 20);
  }
  s.num_snapshots = static_cast<int32_t>(snapshots);
  const int64_t snapshot_bytes = snapshots * in.slot_bytes;
  // KDA state first, up to half the budget.
  int64_t slots = in.max_num_seqs;
  if (in.slot_bytes > 0 && slots * in.slot_bytes > in.budget_bytes / 2) {
    slots = (in.budget_bytes / 2) / in.slot_bytes;
    s.slots_limited_by_memory = true;
    if (slots == 0) {
      return ResourceExhausted("a KV cache budget of ", FormatBytes(in.budget_bytes),
                               " holds no sequence's KDA state (", in.slot_bytes,
                               " bytes; at most half the budget goes to it): raise "
                               "--kv_cache_memory");
    }
  }
  const int64_t block_cost = in.token_bytes * in.block_size;
  const int64_t wanted = in.max_model_len > 0 ? in.max_model_len : in.model_max_len;
  if (in.num_blocks_override == 0 && in.slot_bytes > 0) {
    // One sequence of the full length (the requested one, else the model's)
    // comes before the last slots: where the slots leave the blocks too few
    // for it and fewer slots would not, the slots give way.
    const int64_t need = (wanted + in.block_size - 1) / in.block_size * block_cost;
    const int64_t blocks_room =
        in.budget_bytes - snapshot_bytes - slots * in.slot_bytes;
    if (blocks_room < need) {
      const int64_t fit = (in.budget_bytes - snapshot_bytes - need) / in.slot_bytes;
      if (fit >= 1 && fit < slots) {
        slots = fit;
        s.slots_limited_by_memory = true;
      }
    }
  }
  s.num_slots = static_cast<int32_t>(slots);
  s.slot_bytes = slots * in.slot_bytes + snapshot_bytes;
  if (in.num_blocks_override > 0) {
    s.num_blocks = in.num_blocks_override;
  } else {
    s.num_blocks = (in.budget_bytes - s.slot_bytes) / block_cost;
  }
  s.num_blocks = std::min<int64_t>(s.num_blocks, std::numeric_limits<int32_t>::max());
  if (s.num_blocks <= 0) {
    return ResourceExhausted("a KV cache budget of ", FormatBytes(in.budget_bytes),
                             " leaves no ", FormatBytes(block_cost),
                             " MLA block beside ", s.num_slots, " KDA slots (",
                             FormatBytes(s.slot_bytes),
                             "): raise --kv_cache_memory or lower --max_num_seqs");
  }
  s.block_bytes = s.num_blocks * block_cost;
  s.cache_tokens = s.num_blocks * in.block_size;
  s.max_model_len = wanted;
  if (wanted > s.cache_tokens) {
    if (in.max_model_len > 0) {
      const int64_t need_blocks = (wanted + in.block_size - 1) / in.block_size;
      return InvalidArgument(
          "--max_model_len ", wanted, " needs ", FormatBytes(need_blocks * block_cost),
          " of MLA cache for one sequence, but the cache holds ", s.cache_tokens,
          " tokens (", s.Summary(),
          "): raise --kv_cache_memory, lower --max_num_seqs or lower --max_model_len");
    }
    s.max_model_len = s.cache_tokens;
    s.max_model_len_limited_by_memory = true;
  }
  if (s.max_model_len < 2) {
    return ResourceExhausted("the KV cache holds ", s.cache_tokens,
                             " tokens, too few for a request: raise --kv_cache_memory");
  }
  return s;
}

}  // namespace tandem::engine
