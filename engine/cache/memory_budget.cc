#include "engine/cache/memory_budget.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/status.h"

namespace tandem::engine {
namespace {

constexpr double kMaxBytes = 4.611686018427388e18;  // 2^62

struct Unit {
  const char* name;
  double scale;
};

constexpr Unit kUnits[] = {
    {"b", 1.0},
    {"k", 1024.0},
    {"kb", 1e3},
    {"kib", 1024.0},
    {"m", 1048576.0},
    {"mb", 1e6},
    {"mib", 1048576.0},
    {"g", 1073741824.0},
    {"gb", 1e9},
    {"gib", 1073741824.0},
    {"t", 1099511627776.0},
    {"tb", 1e12},
    {"tib", 1099511627776.0},
};

absl::Status Bad(absl::string_view text, absl::string_view why) {
  return InvalidArgument("memory size \"", text, "\": ", why,
                         " (bytes with a unit, like 8GiB or 512MiB, or a fraction "
                         "of the available memory in (0, 1], like 0.2)");
}

}  // namespace

absl::StatusOr<MemoryBudget> ParseMemoryBudget(absl::string_view text) {
  const absl::string_view t = absl::StripAsciiWhitespace(text);
  if (t.empty()) return Bad(text, "empty");
  size_t n = 0;
  while (n < t.size() && (absl::ascii_isdigit(t[n]) || t[n] == '.')) ++n;
  double value = 0;
  if (n == 0 || !absl::SimpleAtod(t.substr(0, n), &value) || !std::isfinite(value)) {
    return Bad(text, "not a number");
  }
  if (value <= 0) return Bad(text, "must be more than zero");
  const std::string unit =
      absl::AsciiStrToLower(absl::StripAsciiWhitespace(t.substr(n)));
  MemoryBudget b;
  if (unit.empty()) {
    if (value <= 1.0) {
      b.fraction = value;
      return b;
    }
    if (value != std::floor(value)) {
      return Bad(text, "a fraction must be at most 1; bytes must be whole");
    }
    if (value > kMaxBytes) return Bad(text, "too large");
    b.bytes = static_cast<int64_t>(value);
    return b;
  }
  for (const Unit& u : kUnits) {
    if (unit != u.name) continue;
    const double bytes = std::floor(value * u.scale);
    if (bytes > kMaxBytes) return Bad(text, "too large");
    if (bytes < 1) return Bad(text, "less than one byte");
    b.bytes = static_cast<int64_t>(bytes);
    return b;
  }
  return Bad(text, absl::StrCat("unknown unit \"", unit, "\""));
}

absl::StatusOr<int64_t> ResolveMemoryBudget(const MemoryBudget& budget,
                                            int64_t available_bytes) {
  if (!budget.is_fraction()) return budget.bytes;
  if (budget.fraction <= 0 || budget.fraction > 1) {
    return InvalidArgument("memory fraction must be in (0, 1], got ", budget.fraction);
  }
  if (available_bytes <= 0) {
    return InvalidArgument("a memory fraction (", budget.fraction,
                           ") needs the available memory, which is unknown (",
                           available_bytes, "); give bytes instead, like 8GiB");
  }
  return static_cast<int64_t>(std::floor(budget.fraction * available_bytes));
}

absl::StatusOr<int64_t> ReadMemAvailable(const std::string& meminfo_path) {
  std::ifstream in(meminfo_path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", meminfo_path));
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view rest = line;
    if (!absl::ConsumePrefix(&rest, "MemAvailable:")) continue;
    rest = absl::StripAsciiWhitespace(rest);
    const bool kb = absl::ConsumeSuffix(&rest, "kB");
    rest = absl::StripAsciiWhitespace(rest);
    int64_t v = 0;
    if (!kb || !absl::SimpleAtoi(rest, &v) || v < 0) {
      return Internal(meminfo_path, ": malformed MemAvailable line \"", line, "\"");
    }
    return v * 1024;
  }
  return absl::NotFoundError(absl::StrCat("no MemAvailable line in ", meminfo_path));
}

std::string FormatBytes(int64_t bytes) {
  constexpr const char* kNames[] = {"KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  double v = static_cast<double>(bytes);
  int i = -1;
  while (v >= 1024 && i < 3) {
    v /= 1024;
    ++i;
  }
  return absl::StrFormat("%.2f %s", v, kNames[i]);
}

}  // namespace tandem::engine
