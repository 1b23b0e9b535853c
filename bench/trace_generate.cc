#include "bench/trace_generate.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tandem::bench {
namespace {

constexpr int64_t B = kTraceBlockTokens;

class Builder {
 public:
  explicit Builder(uint64_t seed) : rng_(seed) {}

  int64_t Uniform(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }
  double Exp(double mean) {
    return mean > 0 ? std::exponential_distribution<double>(1 / mean)(rng_) : 0;
  }
  std::vector<int64_t> NewIds(int64_t n) {
    std::vector<int64_t> ids;
    for (int64_t i = 0; i < n; ++i) ids.push_back(next_id_++);
    return ids;
  }
  // A prompt of `length` tokens that keeps the full blocks of `prefix_length`
  // tokens with ids `prefix_ids` and gets new ids for the rest.
  TraceRecord Extend(const std::vector<int64_t>& prefix_ids, int64_t prefix_length,
                     int64_t length, int64_t output, double t) {
    TraceRecord r;
    r.timestamp_ms = std::round(t);
    r.input_length = length;
    r.output_length = output;
    const int64_t keep = std::min<int64_t>(prefix_length / B, prefix_ids.size());
    r.hash_ids.assign(prefix_ids.begin(), prefix_ids.begin() + keep);
    const int64_t blocks = (length + B - 1) / B;
    for (int64_t id : NewIds(blocks - keep)) r.hash_ids.push_back(id);
    return r;
  }

 private:
  std::mt19937_64 rng_;
  int64_t next_id_ = 0;
};

// A chat or agent session of `steps` requests starting at `t` after a shared prefix
// (`shared_ids`, `shared_length` tokens; none for a chat). Each step adds the previous
// answer and `add_lo .. add_hi` new tokens.
void Session(Builder& b, const GenerateOptions& o,
             const std::vector<int64_t>& shared_ids, int64_t shared_length,
             int64_t first_lo, int64_t first_hi, int64_t add_lo, int64_t add_hi,
             int64_t out_lo, int64_t out_hi, double t, std::vector<TraceRecord>* out) {
  std::vector<int64_t> ids = shared_ids;
  int64_t length = shared_length;
  int64_t add = b.Uniform(first_lo, first_hi);
  int64_t last_output = 0;
  for (int s = 0; s < o.turns; ++s) {
    const int64_t output = b.Uniform(out_lo, out_hi);
    TraceRecord r = b.Extend(ids, length, length + last_output + add, output, t);
    length = r.input_length;
    ids = r.hash_ids;
    last_output = output;
    out->push_back(std::move(r));
    add = b.Uniform(add_lo, add_hi);
    // The next turn comes after this one's answer and the user's think time.
    t += 1000 + b.Exp(o.think_ms);
  }
}

}  // namespace

absl::StatusOr<std::vector<TraceRecord>> GenerateTrace(const GenerateOptions& o) {
  if (o.requests < 1) return absl::InvalidArgumentError("--requests must be >= 1");
  if (o.turns < 1) return absl::InvalidArgumentError("--turns must be >= 1");
  if (o.system_blocks < 1 || o.system_prompts < 1) {
    return absl::InvalidArgumentError(
        "--system-blocks and --system-prompts must be >= 1");
  }
  if (!(o.sessions_per_s > 0) || !(o.think_ms >= 0)) {
    return absl::InvalidArgumentError(
        "--sessions-per-s must be > 0 and --think-ms >= 0");
  }
  Builder b(o.seed);
  std::vector<TraceRecord> out;
  double t = 0;
  const double mean_gap_ms = 1000 / o.sessions_per_s;
  if (o.kind == "multiturn") {
    const int sessions = (o.requests + o.turns - 1) / o.turns;
    for (int c = 0; c < sessions; ++c) {
      // First message 1-4 blocks, later ones up to a block, answers up to a block.
      Session(b, o, {}, 0, B / 2, 4 * B, B / 8, B, B / 8, B, t, &out);
      t += b.Exp(mean_gap_ms);
    }
  } else if (o.kind == "system_prompt") {
    std::vector<std::vector<int64_t>> prompts;
    for (int p = 0; p < o.system_prompts; ++p)
      prompts.push_back(b.NewIds(o.system_blocks));
    const int64_t system_length = int64_t{o.system_blocks} * B;
    for (int i = 0; i < o.requests; ++i) {
      const auto& sys = prompts[b.Uniform(0, o.system_prompts - 1)];
      // A question of its own: part of one block.
      out.push_back(b.Extend(sys, system_length,
                             system_length + b.Uniform(B / 8, B - 1),
                             b.Uniform(B / 8, B / 2), t));
      t += b.Exp(mean_gap_ms);
    }
  } else if (o.kind == "agent") {
    const std::vector<int64_t> tools = b.NewIds(o.system_blocks);
    const int64_t tools_length = int64_t{o.system_blocks} * B;
    const int sessions = (o.requests + o.turns - 1) / o.turns;
    for (int c = 0; c < sessions; ++c) {
      // A task of up to a block; each step: a short call (the answer) and a tool
      // output of up to two blocks.
      Session(b, o, tools, tools_length, B / 8, B, B / 4, 2 * B, B / 16, B / 4, t,
              &out);
      t += b.Exp(mean_gap_ms);
    }
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown trace kind '", o.kind, "' (", kTraceKinds, ")"));
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const TraceRecord& a, const TraceRecord& c) {
                     return a.timestamp_ms < c.timestamp_ms;
                   });
  out.resize(std::min<size_t>(out.size(), o.requests));
  return out;
}

}  // namespace tandem::bench
