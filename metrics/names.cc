#include "metrics/names.h"

#include <cstdint>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace tandem::metrics {
namespace {

bool IsLetterOrUnderscore(char c) { return absl::ascii_isalpha(c) || c == '_'; }

}  // namespace

absl::Status ValidateMetricName(absl::string_view name) {
  if (name.empty()) return InvalidArgument("metric name is empty");
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok =
        IsLetterOrUnderscore(c) || c == ':' || (i > 0 && absl::ascii_isdigit(c));
    if (!ok) {
      return InvalidArgument(
          "invalid metric name \"", absl::CHexEscape(name),
          "\": must match [a-zA-Z_:][a-zA-Z0-9_:]* (bad character at ", i, ")");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateLabelName(absl::string_view name) {
  if (name.empty()) return InvalidArgument("label name is empty");
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = IsLetterOrUnderscore(c) || (i > 0 && absl::ascii_isdigit(c));
    if (!ok) {
      return InvalidArgument("invalid label name \"", absl::CHexEscape(name),
                             "\": must match [a-zA-Z_][a-zA-Z0-9_]* (bad character at ",
                             i, ")");
    }
  }
  if (name.size() >= 2 && name[0] == '_' && name[1] == '_') {
    return InvalidArgument("invalid label name \"", name,
                           "\": names starting with \"__\" are reserved");
  }
  return absl::OkStatus();
}

bool IsValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const uint8_t c = static_cast<uint8_t>(s[i]);
    size_t extra;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      extra = 1;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      extra = 2;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      extra = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + extra >= s.size()) return false;  // truncated sequence
    for (size_t k = 1; k <= extra; ++k) {
      const uint8_t cc = static_cast<uint8_t>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    // Overlong encodings, surrogates and values past U+10FFFF are invalid.
    static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[extra] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += extra + 1;
  }
  return true;
}

absl::Status ValidateLabels(const Labels& labels, MetricType type) {
  absl::flat_hash_set<absl::string_view> seen;
  for (const auto& [name, value] : labels) {
    TANDEM_RETURN_IF_ERROR(ValidateLabelName(name));
    if (type == MetricType::kHistogram && name == "le") {
      return InvalidArgument("label name \"le\" is reserved for histogram buckets");
    }
    if (!seen.insert(name).second) {
      return InvalidArgument("label name \"", name, "\" appears twice");
    }
    if (!IsValidUtf8(value)) {
      return InvalidArgument("value of label \"", name, "\" is not valid UTF-8");
    }
  }
  return absl::OkStatus();
}

}  // namespace tandem::metrics
