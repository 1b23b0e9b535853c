// Prompt token ids for a trace record: a deterministic function of each block's hash
// id, so equal ids give equal tokens (and an equal prefix of ids an equal prefix of
// tokens), at a length scale that maps the trace's 512-token blocks to
// `block_tokens` tokens (e.g. 64 for the tiny model on a CPU).
#ifndef TANDEM_BENCH_TRACE_TOKENS_H_
#define TANDEM_BENCH_TRACE_TOKENS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/trace_format.h"

namespace tandem::bench {

struct TraceScale {
  // Tokens of one scaled block (the trace's 512 × --length-scale), >= 1.
  int block_tokens = kTraceBlockTokens;
  // Output lengths are scaled by the same factor, at least 1, at most this (0: no cap).
  double length_scale = 1;
  int64_t max_output_tokens = 0;
  // Token ids are drawn from [token_lo, token_hi] (ordinary ids, away from specials).
  int32_t token_lo = 100;
  int32_t token_hi = 1000;
};

// The scale for a factor: block_tokens = round(512 × length_scale); an error unless
// that is >= 1 and the token range is non-empty.
absl::StatusOr<TraceScale> MakeTraceScale(double length_scale,
                                          int64_t max_output_tokens, int32_t token_lo,
                                          int32_t token_hi);

// Full trace blocks map to full scaled blocks; a partial last block of t tokens to
// ceil(t × block_tokens / 512) tokens (>= 1): the block structure is kept exactly.
int64_t ScaledInputLength(const TraceRecord& r, const TraceScale& s);
int64_t ScaledOutputLength(const TraceRecord& r, const TraceScale& s);

// Token `offset` of the block with `hash_id`.
int32_t BlockToken(int64_t hash_id, int offset, const TraceScale& s);

// The prompt: ScaledInputLength(r, s) tokens, block i from hash_ids[i] (the last
// block's tail a prefix of that block's full content).
std::vector<int32_t> TraceTokens(const TraceRecord& r, const TraceScale& s);

}  // namespace tandem::bench

#endif  // TANDEM_BENCH_TRACE_TOKENS_H_
