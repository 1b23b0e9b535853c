#include "bench/trace_ideal.h"

#include <algorithm>
#include <unordered_map>

namespace tandem::bench {
namespace {

uint64_t Chain(uint64_t parent, int64_t id) {
  uint64_t x = parent ^ (static_cast<uint64_t>(id) + 0x9e3779b97f4a7c15ULL +
                         (parent << 6) + (parent >> 2));
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

IdealHits ComputeIdealHits(const std::vector<TraceRecord>& trace,
                           const TraceScale& scale, int chunk_tokens) {
  // Chained hash of ids[0..k] -> the longest earlier prompt (scaled tokens) that had
  // that chain: it holds tokens [k × B, min(len, (k+1) × B)) of block k.
  std::unordered_map<uint64_t, int64_t> longest;
  const int64_t b = scale.block_tokens;
  IdealHits out;
  for (const TraceRecord& r : trace) {
    const int64_t len = ScaledInputLength(r, scale);
    std::vector<uint64_t> chain(r.hash_ids.size());
    uint64_t h = 0x5d588b656c078965ULL;
    for (size_t k = 0; k < r.hash_ids.size(); ++k)
      chain[k] = h = Chain(h, r.hash_ids[k]);
    int64_t matched = 0;  // tokens shared with some earlier prompt
    for (size_t k = 0; k < chain.size(); ++k) {
      auto it = longest.find(chain[k]);
      if (it == longest.end()) break;
      matched = std::min<int64_t>({it->second, len, (static_cast<int64_t>(k) + 1) * b});
      if (matched < (static_cast<int64_t>(k) + 1) * b) break;  // that prompt ended here
    }
    const int64_t usable = std::min(matched, len - 1) / chunk_tokens * chunk_tokens;
    out.queried_tokens += len;
    out.hit_tokens += usable;
    out.per_request_hits.push_back(usable);
    for (uint64_t c : chain) {
      int64_t& l = longest[c];
      l = std::max(l, len);
    }
  }
  return out;
}

}  // namespace tandem::bench
