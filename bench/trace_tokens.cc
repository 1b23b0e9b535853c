#include "bench/trace_tokens.h"

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tandem::bench {
namespace {

// SplitMix64's finaliser: a bijective mix of all 64 bits.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

absl::StatusOr<TraceScale> MakeTraceScale(double length_scale,
                                          int64_t max_output_tokens, int32_t token_lo,
                                          int32_t token_hi) {
  if (!(length_scale > 0) || !std::isfinite(length_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--length-scale must be > 0, got ", length_scale));
  }
  TraceScale s;
  s.length_scale = length_scale;
  s.block_tokens = static_cast<int>(std::lround(kTraceBlockTokens * length_scale));
  if (s.block_tokens < 1 || length_scale > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--length-scale ", length_scale, " gives ", s.block_tokens,
        "-token blocks; it must give 1 .. 32768 tokens per 512-token block"));
  }
  if (max_output_tokens < 0) {
    return absl::InvalidArgumentError("--max-output-tokens must be >= 0");
  }
  s.max_output_tokens = max_output_tokens;
  if (token_lo < 0 || token_hi < token_lo) {
    return absl::InvalidArgumentError(
        absl::StrCat("empty token range [", token_lo, ", ", token_hi, "]"));
  }
  s.token_lo = token_lo;
  s.token_hi = token_hi;
  return s;
}

int64_t ScaledInputLength(const TraceRecord& r, const TraceScale& s) {
  const int64_t full = r.input_length / kTraceBlockTokens;
  const int64_t tail = r.input_length % kTraceBlockTokens;
  return full * s.block_tokens +
         (tail * s.block_tokens + kTraceBlockTokens - 1) / kTraceBlockTokens;
}

int64_t ScaledOutputLength(const TraceRecord& r, const TraceScale& s) {
  int64_t n = std::max<int64_t>(1, std::llround(r.output_length * s.length_scale));
  if (s.max_output_tokens > 0) n = std::min(n, s.max_output_tokens);
  return n;
}

int32_t BlockToken(int64_t hash_id, int offset, const TraceScale& s) {
  const uint64_t h =
      Mix(Mix(static_cast<uint64_t>(hash_id)) ^ static_cast<uint64_t>(offset));
  const uint64_t range = static_cast<uint64_t>(s.token_hi - s.token_lo) + 1;
  return s.token_lo + static_cast<int32_t>(h % range);
}

std::vector<int32_t> TraceTokens(const TraceRecord& r, const TraceScale& s) {
  const int64_t n = ScaledInputLength(r, s);
  std::vector<int32_t> out;
  out.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    const size_t block = static_cast<size_t>(i / s.block_tokens);
    out.push_back(
        BlockToken(r.hash_ids[block], static_cast<int>(i % s.block_tokens), s));
  }
  return out;
}

}  // namespace tandem::bench
