// Synthetic traces in the Mooncake format (bench/trace_format.h) for tests and
// benchmarks, deterministic in the seed. Lengths are in the trace's own units
// (512-token blocks); a new block always gets the next unused hash id.
//
//   multiturn      chats: each turn's prompt is the previous prompt, its answer and a
//                  new user message, so its hash_ids extend the previous turn's (all
//                  but a partial last block, whose content the turn continues).
//   system_prompt  every request = one of a few shared system prompts + a question of
//                  its own (one partial block).
//   agent          agent sessions: a shared tool-definition prompt, then a history that
//                  grows by the model's call and a tool's output every step.
//
// Sessions start as a Poisson process; turns of a session are a think time apart.
#ifndef TANDEM_BENCH_TRACE_GENERATE_H_
#define TANDEM_BENCH_TRACE_GENERATE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/trace_format.h"

namespace tandem::bench {

struct GenerateOptions {
  std::string kind;  // multiturn, system_prompt, agent
  uint64_t seed = 0;
  int requests = 48;          // exactly this many records (the earliest arrivals)
  double sessions_per_s = 1;  // session starts (Poisson)
  double think_ms = 4000;     // mean gap between turns of a session (exponential)
  int turns = 4;              // multiturn: turns per chat; agent: steps per session
  int system_blocks = 8;      // system_prompt / agent: blocks of the shared prompt
  int system_prompts = 1;     // system_prompt: distinct shared prompts
};

// The kinds, comma-separated, for help and errors.
inline constexpr char kTraceKinds[] = "multiturn, system_prompt, agent";

absl::StatusOr<std::vector<TraceRecord>> GenerateTrace(const GenerateOptions& o);

}  // namespace tandem::bench

#endif  // TANDEM_BENCH_TRACE_GENERATE_H_
