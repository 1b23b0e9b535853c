#include "gateway/auth.h"

#include <cstdint>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"

namespace tandem::gateway {

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  const size_t n = a.size() > b.size() ? a.size() : b.size();
  // A length difference alone makes the result false, without an early exit.
  volatile uint8_t diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const uint8_t x = i < a.size() ? static_cast<uint8_t>(a[i]) : 0;
    const uint8_t y = i < b.size() ? static_cast<uint8_t>(b[i]) : 0;
    diff = diff | (x ^ y);
  }
  return diff == 0;
}

bool AuthorizationMatches(absl::string_view authorization, absl::string_view api_key) {
  if (api_key.empty()) return true;
  absl::string_view value = absl::StripAsciiWhitespace(authorization);
  constexpr absl::string_view kScheme = "bearer ";
  if (value.size() < kScheme.size() ||
      !absl::EqualsIgnoreCase(value.substr(0, kScheme.size()), kScheme)) {
    return false;
  }
  absl::string_view key = absl::StripAsciiWhitespace(value.substr(kScheme.size()));
  return ConstantTimeEquals(key, api_key);
}

}  // namespace tandem::gateway
