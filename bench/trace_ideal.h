// The trace's own ideal token hit rate: one infinite prefix cache that every request
// goes through in arrival order, reusing a prefix at any multiple of the KDA chunk
// (64 tokens: a hybrid model's recurrent state exists only at chunk ends, so no cache
// can do better on that grid), always computing at least the prompt's last token (its
// logits). Computed from the hash ids alone: two prompts share their first p tokens
// iff the ids of the blocks holding tokens 0 .. p-1 are equal (a partial last block is
// a prefix of that block's content, as TraceTokens makes it).
#ifndef TANDEM_BENCH_TRACE_IDEAL_H_
#define TANDEM_BENCH_TRACE_IDEAL_H_

#include <cstdint>
#include <vector>

#include "bench/trace_format.h"
#include "bench/trace_tokens.h"

namespace tandem::bench {

inline constexpr int kKdaChunkTokens = 64;

struct IdealHits {
  int64_t queried_tokens = 0;  // all prompt tokens
  int64_t hit_tokens = 0;      // reusable ones
  double hit_rate() const {
    return queried_tokens > 0 ? static_cast<double>(hit_tokens) / queried_tokens : 0;
  }
  std::vector<int64_t> per_request_hits;
};

// At `scale` (the lengths the cluster sees) on a grid of `chunk_tokens`.
IdealHits ComputeIdealHits(const std::vector<TraceRecord>& trace,
                           const TraceScale& scale, int chunk_tokens = kKdaChunkTokens);

}  // namespace tandem::bench

#endif  // TANDEM_BENCH_TRACE_IDEAL_H_
