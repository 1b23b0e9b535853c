// The KV cache's memory budget as a worker's --kv_cache_memory gives it: bytes
// ("8GiB", "512MiB", "4000000000", "1.5GB") or a fraction of the host memory
// available at start ("0.2": 20% of MemAvailable in /proc/meminfo), as vLLM's
// --gpu_memory_utilization is a fraction of the GPU's memory.
//
//   ParseMemoryBudget("8GiB")  → {bytes = 8 << 30}
//   ParseMemoryBudget("0.2")   → {fraction = 0.2}
//   ResolveMemoryBudget(spec, available) → bytes (fraction * available)
//   ReadMemAvailable("/proc/meminfo")    → MemAvailable in bytes
#ifndef TANDEM_ENGINE_CACHE_MEMORY_BUDGET_H_
#define TANDEM_ENGINE_CACHE_MEMORY_BUDGET_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::engine {

struct MemoryBudget {
  int64_t bytes = 0;      // > 0: this many bytes
  double fraction = 0.0;  // in (0, 1]: this share of the available memory
  bool is_fraction() const { return bytes == 0; }
};

// A number with an optional unit: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB
// (powers of 1024; K/M/G/T alone mean the binary units too, as `free -g` does);
// case-insensitive, spaces allowed between number and unit. A plain number with
// no unit that is at most 1 is a fraction (0.2 = 20%); a larger plain number is
// bytes. INVALID_ARGUMENT (naming the text) for anything else: empty, negative,
// zero, unknown unit, a fraction above 1 written with a unit-less decimal point
// ("1.5"), more than 2^62 bytes.
absl::StatusOr<MemoryBudget> ParseMemoryBudget(absl::string_view text);

// The budget in bytes: `budget.bytes`, or fraction * available_bytes (rounded
// down). INVALID_ARGUMENT when a fraction meets a non-positive available size.
absl::StatusOr<int64_t> ResolveMemoryBudget(const MemoryBudget& budget,
                                            int64_t available_bytes);

// MemAvailable of a /proc/meminfo-format file, in bytes. NOT_FOUND / INTERNAL
// naming the path when the file or the line is missing or malformed.
absl::StatusOr<int64_t> ReadMemAvailable(const std::string& meminfo_path);

// "1.50 GiB", "512.00 MiB", "100 B": for logs and messages.
std::string FormatBytes(int64_t bytes);

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_CACHE_MEMORY_BUDGET_H_
