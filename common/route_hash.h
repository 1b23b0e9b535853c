// The prefix hashes the router and the workers agree on, so that a worker can
// tell the router which prompt prefixes its cache can serve (block-hash events)
// and the router can look a new prompt up in what each worker reported.
//
//   hash[0] = XXH3(cache_salt)                      (the tenant's root)
//   hash[b + 1] = XXH3(tokens[64b .. 64b + 63] ++ media(b), seed = hash[b])
// where media(b) is, for each image whose first placeholder token lies in
// block b (ascending positions), its (position, content hash) as two uint64s:
// the layout engine/cache ChainedBlockHashes mixes into its block keys. A block
// without an image hashes its token ids alone, so text-only hashes are the
// plain token chain. RouteBlockHashes returns hash[1..n] for the n full
// 64-token blocks: entry i names the prefix of the first (i + 1) * 64 tokens.
// 64 is the KDA chunk, the grid every usable prefix-cache hit lies on
// (engine/cache/prefix_cache.h). Two prompts with the same placeholder tokens
// but other images differ from the block holding the first image that differs
// on; the router computes them from GenerateRequest.images
// (placeholder_start, content_hash), the engine from its MediaInputs
// (position, content_hash): the same numbers (the prefill worker checks the
// gateway's hash against its own).
#ifndef TANDEM_COMMON_ROUTE_HASH_H_
#define TANDEM_COMMON_ROUTE_HASH_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/types/span.h"

namespace tandem {

inline constexpr int32_t kRouteBlockTokens = 64;

// One image of a prompt: the index of its first placeholder token and its
// content hash (engine/media PatchedImage.content_hash).
struct RouteMedia {
  int64_t position = 0;
  uint64_t hash = 0;
};

// Chained hashes of the full kRouteBlockTokens blocks of `tokens`, with each
// of `media` mixed into the block that holds its position (any order; a
// position outside the full blocks changes nothing).
std::vector<uint64_t> RouteBlockHashes(absl::Span<const int32_t> tokens,
                                       std::string_view cache_salt,
                                       absl::Span<const RouteMedia> media = {});

// The hash naming the prefix tokens[0, n) for n a positive multiple of
// kRouteBlockTokens (RouteBlockHashes(tokens, salt, media)[n / 64 - 1]); 0
// when n is not such a multiple or exceeds tokens.size().
uint64_t RoutePrefixHash(absl::Span<const int32_t> tokens, int64_t n,
                         std::string_view cache_salt,
                         absl::Span<const RouteMedia> media = {});

}  // namespace tandem

#endif  // TANDEM_COMMON_ROUTE_HASH_H_
