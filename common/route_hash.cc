#include "common/route_hash.h"

#include <xxhash.h>

#include <algorithm>

namespace tandem {

std::vector<uint64_t> RouteBlockHashes(absl::Span<const int32_t> tokens,
                                       std::string_view cache_salt,
                                       absl::Span<const RouteMedia> media) {
  const int64_t n = static_cast<int64_t>(tokens.size()) / kRouteBlockTokens;
  std::vector<uint64_t> out;
  out.reserve(n);
  // Ascending positions, so each block takes its images in one pass and the
  // bytes do not depend on the order the caller listed them in.
  std::vector<RouteMedia> sorted(media.begin(), media.end());
  std::stable_sort(
      sorted.begin(), sorted.end(),
      [](const RouteMedia& a, const RouteMedia& b) { return a.position < b.position; });
  auto next = std::find_if(sorted.begin(), sorted.end(),
                           [](const RouteMedia& m) { return m.position >= 0; });
  uint64_t parent = XXH3_64bits(cache_salt.data(), cache_salt.size());
  std::vector<uint64_t> words;  // a block's (position, hash) pairs
  for (int64_t b = 0; b < n; ++b) {
    const int32_t* block = tokens.data() + b * kRouteBlockTokens;
    const size_t block_bytes = kRouteBlockTokens * sizeof(int32_t);
    words.clear();
    for (; next != sorted.end() && next->position < (b + 1) * kRouteBlockTokens;
         ++next) {
      words.push_back(static_cast<uint64_t>(next->position));
      words.push_back(next->hash);
    }
    if (words.empty()) {
      parent = XXH3_64bits_withSeed(block, block_bytes, parent);
    } else {
      // XXH3 of the block's token ids followed by the pairs, as one input.
      XXH3_state_t* state = XXH3_createState();
      XXH3_64bits_reset_withSeed(state, parent);
      XXH3_64bits_update(state, block, block_bytes);
      XXH3_64bits_update(state, words.data(), words.size() * sizeof(uint64_t));
      parent = XXH3_64bits_digest(state);
      XXH3_freeState(state);
    }
    out.push_back(parent);
  }
  return out;
}

uint64_t RoutePrefixHash(absl::Span<const int32_t> tokens, int64_t n,
                         std::string_view cache_salt,
                         absl::Span<const RouteMedia> media) {
  if (n <= 0 || n % kRouteBlockTokens != 0 || n > static_cast<int64_t>(tokens.size())) {
    return 0;
  }
  return RouteBlockHashes(tokens.subspan(0, n), cache_salt, media).back();
}

}  // namespace tandem
