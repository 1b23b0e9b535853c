// The Mooncake trace format (kvcache-ai/Mooncake, FAST'25 traces): JSON lines, one
// request each,
//   {"timestamp": 3052, "input_length": 7234, "output_length": 794,
//    "hash_ids": [0, 28, 29, ...]}
// `timestamp`: arrival in ms from the trace's start; `hash_ids`: one id per
// 512-token block of the prompt (the last one possibly partial), equal ids meaning
// equal content (and, as ids are assigned to prefixes, an equal prefix).
#ifndef TANDEM_BENCH_TRACE_FORMAT_H_
#define TANDEM_BENCH_TRACE_FORMAT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::bench {

// Tokens per hash id in the published traces.
inline constexpr int kTraceBlockTokens = 512;

struct TraceRecord {
  double timestamp_ms = 0;
  int64_t input_length = 0;
  int64_t output_length = 0;
  std::vector<int64_t> hash_ids;
};

// One line (`line_number` counts from 1, for the error). Requires the four fields,
// timestamp >= 0, input_length >= 1, output_length >= 1, and exactly
// ceil(input_length / block_tokens) non-negative hash ids. Other fields are ignored.
absl::StatusOr<TraceRecord> ParseTraceLine(absl::string_view line, int line_number,
                                           int block_tokens = kTraceBlockTokens);

// A whole trace: blank lines are skipped; timestamps must not decrease. Errors name
// the line ("line 7: ...").
absl::StatusOr<std::vector<TraceRecord>> ParseTrace(
    absl::string_view text, int block_tokens = kTraceBlockTokens);
absl::StatusOr<std::vector<TraceRecord>> ReadTraceFile(
    const std::string& path, int block_tokens = kTraceBlockTokens);

// The record as one JSON line (no newline), in the field order above.
std::string FormatTraceLine(const TraceRecord& r);
// Writes the records, one line each.
absl::Status WriteTraceFile(const std::string& path,
                            const std::vector<TraceRecord>& records);

}  // namespace tandem::bench

#endif  // TANDEM_BENCH_TRACE_FORMAT_H_
