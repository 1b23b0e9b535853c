// The prefix hashes the router and the workers agree on, so that a worker can
// tell the router which prompt prefixes its cache can serve (block-hash events)
// and the router can look a new prompt up in what each worker reported.
//
//   hash[0] = XXH3(cache_salt)                      (the tenant's root)
//   hash[b + 1] = XXH3(tokens[64b .. 64b + 63], seed = hash[b])
// RouteBlockHashes returns hash[1..n] for the n full 64-token blocks: entry i
// names the prefix of the first (i + 1) * 64 tokens. 64 is the KDA chunk, the
// grid every usable prefix-cache hit lies on (engine/cache/prefix_cache.h).
// Media (image) hashes are not mixed in yet: prompts that differ only in an
// image hash equal here, which costs the router a wrong guess, never a wrong
// answer (the worker's own cache keys do include them).
#ifndef TANDEM_COMMON_ROUTE_HASH_H_
#define TANDEM_COMMON_ROUTE_HASH_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/types/span.h"

namespace tandem {

inline constexpr int32_t kRouteBlockTokens = 64;

// Chained hashes of the full kRouteBlockTokens blocks of `tokens`.
std::vector<uint64_t> RouteBlockHashes(absl::Span<const int32_t> tokens,
                                       std::string_view cache_salt);

// The hash naming the prefix tokens[0, n) for n a positive multiple of
// kRouteBlockTokens (RouteBlockHashes(tokens, salt)[n / 64 - 1]); 0 when n is
// not such a multiple or exceeds tokens.size().
uint64_t RoutePrefixHash(absl::Span<const int32_t> tokens, int64_t n,
                         std::string_view cache_salt);

}  // namespace tandem

#endif  // TANDEM_COMMON_ROUTE_HASH_H_
