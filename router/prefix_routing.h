// Cache-aware routing: a per-worker index of the prompt prefixes each worker's
// cache can serve, fed by the workers' own reports (block-hash events over the
// registry stream), and the choice of prefill worker by a cost that weighs the
// prefill work a worker's cache would save against its load.
//
//   reports:  a worker (prefill or decode) reports usable hit positions p (a
//             multiple of 64) by route hash (common/route_hash.h): STORED,
//             REMOVED, CLEARED, numbered 1, 2, ... within its epoch (one per
//             process start). Registration carries a full snapshot and
//             replaces the worker's set (Reset); heartbeats carry the events
//             since (Apply): duplicates of applied events are skipped, a gap
//             or another epoch applies nothing and answers "resync" (the
//             worker registers again with a snapshot), so the index never
//             silently diverges from the worker's cache.
//   overlay:  what the router sent a worker and the worker has not reported
//             yet (the position of the prompt's last full chunk, where the
//             worker will snapshot), for overlay_ttl; a report of that hash
//             (stored or removed) or a CLEARED supersedes it.
//   match(w): the deepest p < prompt_tokens whose route hash of the prompt is
//             in w's reported set or overlay (tokens). A worker that does not
//             report (prefix caching off) matches nothing.
//   load(w):  queued prefill tokens (its last report) + tokens the router sent
//             it since (in flight)
//   cost(w) = overlap_weight * uncached(w) + load(w),
//             uncached(w) = prompt_tokens - match(w)
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
// kRoundRobin, kCacheAware. The index is kept whatever the policy: the
// conditional disaggregation (placement.h) asks it for the decode workers.
#ifndef TANDEM_ROUTER_PREFIX_ROUTING_H_
#define TANDEM_ROUTER_PREFIX_ROUTING_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/clock.h"
#include "common/route_hash.h"
#include "proto/router.pb.h"
#include "proto/worker.pb.h"
#include "router/pair_selection.h"
#include "router/worker_registry.h"

namespace tandem::router {

inline constexpr int32_t kRouterBlockTokens = kRouteBlockTokens;

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
  // How long a prompt sent to a worker counts as cached there before the
  // worker reports it (its prefill's time plus the report's way back).
  absl::Duration overlay_ttl = absl::Seconds(10);
  // Reported positions kept per worker at most (a worker's usable positions
  // are its snapshots: far fewer); past it further STORED events are dropped
  // and the worker is asked to resync once it has fewer.
  int64_t max_entries_per_worker = 1 << 20;
  // Overlay entries per worker at most (expired ones go first).
  int64_t max_overlay_per_worker = 1 << 14;
};

// The route hashes of the prompt's full 64-token blocks (RouteBlockHashes),
// with each image's content hash at its first placeholder.
std::vector<uint64_t> RouterBlockHashes(absl::Span<const int32_t> prompt,
                                        std::string_view cache_salt,
                                        absl::Span<const RouteMedia> media = {});
// The request's: its prompt_token_ids, cache_salt and images
// (placeholder_start, content_hash), the numbers the prefill worker's engine
// names the prefixes it reports with (MediaInput position, content_hash).
std::vector<uint64_t> RouterBlockHashes(const tandem::v1::GenerateRequest& request);

using PrefixEvents = google::protobuf::RepeatedPtrField<tandem::v1::PrefixCacheEvent>;

// What Apply made of a heartbeat's events.
struct ReportOutcome {
  bool resync = false;     // diverged: the worker must register again
  const char* why = "";    // "gap" | "epoch" | "overflow" (with resync)
  uint64_t acked_seq = 0;  // the last event applied in the worker's epoch
  int64_t applied = 0;     // events applied now
};

// Per worker, the usable prefixes it reported and the overlay. Not thread-safe.
class PrefixIndex {
 public:
  explicit PrefixIndex(const CacheAwareOptions& options) : options_(options) {}

  // Registration: `worker` reports its cache (epoch, last seq, every STORED
  // position it holds); replaces whatever was known of it.
  void Reset(const std::string& worker, uint64_t epoch, uint64_t seq,
             const PrefixEvents& snapshot);
  // A heartbeat's events, numbered from `first_seq`. An unknown worker (it
  // registered without reports, or was removed) gets resync when it sends
  // an epoch.
  ReportOutcome Apply(const std::string& worker, uint64_t epoch, uint64_t first_seq,
                      const PrefixEvents& events);
  // The router sent `worker` a prompt of `prompt_tokens` tokens with these
  // RouterBlockHashes: overlay its last full chunk until `now + overlay_ttl`.
  void RecordSent(const std::string& worker, absl::Span<const uint64_t> hashes,
                  int64_t prompt_tokens, absl::Time now);
  // match(worker) in tokens (the header's comment); 0 for a non-reporter.
  int64_t Match(const std::string& worker, absl::Span<const uint64_t> hashes,
                int64_t prompt_tokens, absl::Time now) const;
  // The deepest p <= prompt_tokens (a multiple of 64) at which `worker`
  // announced the MLA blocks of the prompt's [0, p) in its device tier: a
  // blocks-only announcement (a decode worker's landed or computed prompt,
  // withdrawn when its block leaves the device tier). What a reservation
  // there would share (KvTarget.cached_prefix_tokens). Usable positions are
  // not consulted (their blocks may be in the host tier, which a reservation
  // does not search), nor is the overlay. 0: none.
  int64_t MatchBlocks(const std::string& worker, absl::Span<const uint64_t> hashes,
                      int64_t prompt_tokens) const;
  // Everything of `worker` goes (removed from the registry, or it
  // registered without reports).
  void RemoveWorker(const std::string& worker) { workers_.erase(worker); }
  // Drops the workers not in `live` (ids).
  void Retain(const absl::flat_hash_set<std::string>& live);
  bool reports(const std::string& worker) const { return workers_.contains(worker); }
  // Reported positions held for `worker`.
  int64_t size(const std::string& worker) const;
  int64_t overlay_size(const std::string& worker) const;
  std::vector<std::string> workers() const;

 private:
  struct Worker {
    uint64_t epoch = 0;
    uint64_t last_seq = 0;
    bool overflowed = false;  // a STORED was dropped: resync at the next report
    absl::flat_hash_map<uint64_t, int64_t> reported;    // route hash -> tokens
    absl::flat_hash_map<uint64_t, int64_t> blocks;      // blocks-only ones
    absl::flat_hash_map<uint64_t, absl::Time> overlay;  // route hash -> expiry
  };
  void ApplyOne(Worker& w, const tandem::v1::PrefixCacheEvent& e);

  const CacheAwareOptions options_;
  absl::flat_hash_map<std::string, Worker> workers_;
};

struct PrefillChoice {
  size_t index = 0;
  int64_t matched_tokens = 0;  // the index's match of the chosen worker
  bool balanced = false;       // the balance guard chose it
};

// Prefill tokens recently routed to each worker, decaying exponentially
// (time constant `tau`): the tie-break between workers whose cost and load are
// equal. At light load every worker reports 0 queued and nothing is in flight
// between requests, so without it the lowest worker id would win every tie and
// take all uncached work (the trace bench measured a 1.6-1.9x spread for
// least_load and cache_aware). Not thread-safe.
class RecentWork {
 public:
  explicit RecentWork(absl::Duration tau = absl::Seconds(10)) : tau_(tau) {}
  // The decayed tokens routed to `worker` as of `now`.
  double At(const std::string& worker, absl::Time now) const;
  void Add(const std::string& worker, int64_t tokens, absl::Time now);
  void Remove(const std::string& worker) { work_.erase(worker); }

 private:
  struct Entry {
    double tokens = 0;
    absl::Time at;
  };
  absl::Duration tau_;
  absl::flat_hash_map<std::string, Entry> work_;
};

// The cache-aware choice among `workers` (skipping `exclude`) for a prompt of
// `prompt_tokens` tokens with RouterBlockHashes `hashes`. Ties in cost and
// load go to the worker with the least recent work (`recent`, may be null),
// then the lower id.
std::optional<PrefillChoice> SelectPrefillCacheAware(
    const std::vector<WorkerRecord>& workers,
    const absl::flat_hash_set<std::string>& exclude, const InFlightMap& in_flight,
    int64_t prompt_tokens, absl::Span<const uint64_t> hashes, const PrefixIndex& index,
    const CacheAwareOptions& options, absl::Time now,
    const RecentWork* recent = nullptr);

// A worker's match (PrefillRouter::BestMatch).
struct DecodeMatch {
  std::string worker_id;
  int64_t matched_tokens = 0;
};

// The router's prefill choice by policy and its prefix index, shared by every
// request's Placement and the Registry service (thread-safe).
class PrefillRouter {
 public:
  PrefillRouter(RoutingPolicy policy, const CacheAwareOptions& options,
                Clock* clock = Clock::Real())
      : policy_(policy), options_(options), clock_(clock), index_(options) {}
  RoutingPolicy policy() const { return policy_; }
  // Index into `workers`, or nullopt when every one is excluded. kCacheAware
  // overlays the prompt on the chosen worker.
  std::optional<PrefillChoice> Select(const std::vector<WorkerRecord>& workers,
                                      const absl::flat_hash_set<std::string>& exclude,
                                      const InFlightMap& in_flight,
                                      int64_t prompt_tokens,
                                      absl::Span<const uint64_t> hashes);
  // The deepest match among `workers` not in `exclude`; nullopt when none.
  std::optional<DecodeMatch> BestMatch(const std::vector<WorkerRecord>& workers,
                                       const absl::flat_hash_set<std::string>& exclude,
                                       int64_t prompt_tokens,
                                       absl::Span<const uint64_t> hashes);
  // MatchBlocks of every worker in `workers` that holds some of the prompt
  // (the decode choice: pair_selection.h SelectDecode's `held`).
  absl::flat_hash_map<std::string, int64_t> HeldBlocks(
      const std::vector<WorkerRecord>& workers, int64_t prompt_tokens,
      absl::Span<const uint64_t> hashes);
  // A prompt went to `worker` other than by Select (a colocated prefill).
  void RecordSent(const std::string& worker, absl::Span<const uint64_t> hashes,
                  int64_t prompt_tokens);

  // Registry glue (router_service.cc): a registration (replaces the worker's
  // set, or drops it when the worker does not report) and a heartbeat's
  // events.
  void OnRegister(const tandem::v1::RegisterRequest& request);
  ReportOutcome OnHeartbeat(const tandem::v1::HeartbeatRequest& request);
  void RemoveWorker(const std::string& worker);
  void Retain(const absl::flat_hash_set<std::string>& live);
  // Reported positions held per reporting worker, and for one.
  std::vector<std::pair<std::string, int64_t>> IndexSizes();
  int64_t IndexSize(const std::string& worker);
  int64_t Match(const std::string& worker, absl::Span<const uint64_t> hashes,
                int64_t prompt_tokens);

 private:
  const RoutingPolicy policy_;
  const CacheAwareOptions options_;
  Clock* const clock_;
  absl::Mutex mu_;
  PrefixIndex index_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 0;  // round robin
  RecentWork recent_ ABSL_GUARDED_BY(mu_);  // tie-break (least_load, cache_aware)
};

}  // namespace tandem::router

#endif  // TANDEM_ROUTER_PREFIX_ROUTING_H_
