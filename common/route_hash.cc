#include "common/route_hash.h"

#include <xxhash.h>

namespace tandem {

std::vector<uint64_t> RouteBlockHashes(absl::Span<const int32_t> tokens,
                                       std::string_view cache_salt) {
  std::vector<uint64_t> out;
  out.reserve(tokens.size() / kRouteBlockTokens);
  uint64_t parent = XXH3_64bits(cache_salt.data(), cache_salt.size());
  for (size_t b = 0; (b + 1) * kRouteBlockTokens <= tokens.size(); ++b) {
    parent = XXH3_64bits_withSeed(tokens.data() + b * kRouteBlockTokens,
                                  kRouteBlockTokens * sizeof(int32_t), parent);
    out.push_back(parent);
  }
  return out;
}

uint64_t RoutePrefixHash(absl::Span<const int32_t> tokens, int64_t n,
                         std::string_view cache_salt) {
  if (n <= 0 || n % kRouteBlockTokens != 0 || n > static_cast<int64_t>(tokens.size())) {
    return 0;
  }
  return RouteBlockHashes(tokens.subspan(0, n), cache_salt).back();
}

}  // namespace tandem
