// Cache-aware prefill routing: a router-side index of the prompt prefixes it
// sent to each prefill worker (SGLang's router keeps such an approximate tree;
// no worker report needed) and the choice of worker by a cost that weighs the
// prefill work a worker's cache would save against its load.
//
//   blocks:   chained XXH3 hashes of the prompt in kRouterBlockTokens-token
//             blocks, salted by cache_salt (the KDA chunk: a worker's hits
//             start only at its multiples, prefix_cache.h)
//   match(w): leading blocks of the prompt the router sent to w before (w's
//             index is LRU-bounded to about what its cache holds)
//   load(w):  queued prefill tokens (its last report) + tokens the router sent
//             it since (in flight)
//   cost(w) = overlap_weight * uncached(w) + load(w),
//             uncached(w) = prompt_tokens - match(w) * kRouterBlockTokens
//             (Dynamo's KV router: overlap weight x uncached blocks + load; in
//             tokens here, so both terms are prefill work)
//   balance guard (SGLang's cache-aware policy): when the loads are imbalanced
//             (max load > balance_abs_tokens AND max > balance_rel * min), the
//             least loaded worker is chosen regardless of the cache
//   ties: lower load, then worker id (stable).
// Why both: the cost alone already moves a shared-prefix stream off a hot
// worker once its queue exceeds the work its cache saves; the guard bounds the
// spread when the saving is large (a long shared system prompt on every
// request: SGLang #14305 and vllm-project/router #179, where pure affinity
// sent everything to one worker).
//
// Policies for comparison: kLeastLoad (SelectPrefill, pair_selection.h),
// kRoundRobin, kCacheAware.
#ifndef TANDEM_ROUTER_PREFIX_ROUTING_H_
#define TANDEM_ROUTER_PREFIX_ROUTING_H_

#include <cstdint>
#include <list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "router/pair_selection.h"
#include "router/worker_registry.h"

namespace tandem::router {

inline constexpr int32_t kRouterBlockTokens = 64;

enum class RoutingPolicy { kLeastLoad, kRoundRobin, kCacheAware };

// "least_load" | "round_robin" | "cache_aware".
absl::StatusOr<RoutingPolicy> ParseRoutingPolicy(std::string_view name);
// The name ParseRoutingPolicy takes.
const char* RoutingPolicyName(RoutingPolicy policy);

struct CacheAwareOptions {
  double overlap_weight = 1.0;
  // Guard thresholds (tokens of queued prefill; tune per deployment: a K3
  // worker's prompts are far longer than the tiny model's).
  int64_t balance_abs_tokens = 2048;
  double balance_rel = 1.5;
  // Blocks remembered per worker (LRU); about its cache's tokens / 64.
  int64_t max_blocks_per_worker = 1 << 16;
};

// Chained hashes of the prompt's full kRouterBlockTokens blocks.
std::vector<uint64_t> RouterBlockHashes(absl::Span<const int32_t> prompt,
                                        std::string_view cache_salt);

// Per worker, the prompt blocks the router sent it (LRU). Not thread-safe.
class PrefixIndex {
 public:
  explicit PrefixIndex(int64_t max_blocks_per_worker)
      : max_blocks_(max_blocks_per_worker) {}
  // Leading blocks of `hashes` in `worker`'s index.
  int64_t Match(const std::string& worker, absl::Span<const uint64_t> hashes) const;
  // `worker` now holds `hashes` (most recently used).
  void Record(const std::string& worker, absl::Span<const uint64_t> hashes);
  void RemoveWorker(const std::string& worker) { workers_.erase(worker); }
  void Clear() { workers_.clear(); }
  int64_t size(const std::string& worker) const;

 private:
  struct Lru {
    std::list<uint64_t> order;  // most recent first
    absl::flat_hash_map<uint64_t, std::list<uint64_t>::iterator> where;
  };
  int64_t max_blocks_;
  absl::flat_hash_map<std::string, Lru> workers_;
};

struct PrefillChoice {
  size_t index = 0;
  int64_t matched_tokens = 0;  // the router's estimate of the chosen worker's hit
  bool balanced = false;       // the balance guard chose it
};

// The cache-aware choice among `workers` (skipping `exclude`) for a prompt of
// `prompt_tokens` tokens with RouterBlockHashes `hashes`.
std::optional<PrefillChoice> SelectPrefillCacheAware(
    const std::vector<WorkerRecord>& workers,
    const absl::flat_hash_set<std::string>& exclude, const InFlightMap& in_flight,
    int64_t prompt_tokens, absl::Span<const uint64_t> hashes, const PrefixIndex& index,
    const CacheAwareOptions& options);

// The router's prefill choice by policy, shared by every request's Placement
// (thread-safe): kCacheAware records each choice in its PrefixIndex.
class PrefillRouter {
 public:
  PrefillRouter(RoutingPolicy policy, const CacheAwareOptions& options)
      : policy_(policy), options_(options), index_(options.max_blocks_per_worker) {}
  RoutingPolicy policy() const { return policy_; }
  // Index into `workers`, or nullopt when every one is excluded.
  std::optional<PrefillChoice> Select(const std::vector<WorkerRecord>& workers,
                                      const absl::flat_hash_set<std::string>& exclude,
                                      const InFlightMap& in_flight,
                                      int64_t prompt_tokens,
                                      absl::Span<const uint64_t> hashes);
  void RemoveWorker(const std::string& worker);

 private:
  const RoutingPolicy policy_;
  const CacheAwareOptions options_;
  absl::Mutex mu_;
  PrefixIndex index_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 0;  // round robin
};

}  // namespace tandem::router

#endif  // TANDEM_ROUTER_PREFIX_ROUTING_H_
