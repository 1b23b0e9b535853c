#include "router/prefix_routing.h"

#include <xxhash.h>

#include <algorithm>
#include <limits>
#include <tuple>

#include "absl/strings/str_cat.h"

namespace tandem::router {

absl::StatusOr<RoutingPolicy> ParseRoutingPolicy(std::string_view name) {
  if (name == "least_load") return RoutingPolicy::kLeastLoad;
  if (name == "round_robin") return RoutingPolicy::kRoundRobin;
  if (name == "cache_aware") return RoutingPolicy::kCacheAware;
  return absl::InvalidArgumentError(
      absl::StrCat("routing policy '", std::string(name),
                   "': expected least_load, round_robin or cache_aware"));
}

const char* RoutingPolicyName(RoutingPolicy policy) {
  switch (policy) {
    case RoutingPolicy::kLeastLoad:
      return "least_load";
    case RoutingPolicy::kRoundRobin:
      return "round_robin";
    case RoutingPolicy::kCacheAware:
      return "cache_aware";
  }
  return "least_load";
}

std::vector<uint64_t> RouterBlockHashes(absl::Span<const int32_t> prompt,
                                        std::string_view cache_salt) {
  std::vector<uint64_t> out;
  uint64_t parent = XXH3_64bits(cache_salt.data(), cache_salt.size());
  for (size_t b = 0; (b + 1) * kRouterBlockTokens <= prompt.size(); ++b) {
    parent = XXH3_64bits_withSeed(prompt.data() + b * kRouterBlockTokens,
                                  kRouterBlockTokens * sizeof(int32_t), parent);
    out.push_back(parent);
  }
  return out;
}

int64_t PrefixIndex::Match(const std::string& worker,
                           absl::Span<const uint64_t> hashes) const {
  auto it = workers_.find(worker);
  if (it == workers_.end()) return 0;
  int64_t k = 0;
  while (k < static_cast<int64_t>(hashes.size()) &&
         it->second.where.contains(hashes[k])) {
    ++k;
  }
  return k;
}

void PrefixIndex::Record(const std::string& worker, absl::Span<const uint64_t> hashes) {
  Lru& l = workers_[worker];
  // Deepest first, so that the root ends most recent (evicted last).
  for (auto h = hashes.rbegin(); h != hashes.rend(); ++h) {
    auto it = l.where.find(*h);
    if (it != l.where.end()) l.order.erase(it->second);
    l.order.push_front(*h);
    l.where[*h] = l.order.begin();
  }
  while (static_cast<int64_t>(l.order.size()) > max_blocks_) {
    l.where.erase(l.order.back());
    l.order.pop_back();
  }
}

int64_t PrefixIndex::size(const std::string& worker) const {
  auto it = workers_.find(worker);
  return it == workers_.end() ? 0 : static_cast<int64_t>(it->second.order.size());
}

std::optional<PrefillChoice> SelectPrefillCacheAware(
    const std::vector<WorkerRecord>& workers,
    const absl::flat_hash_set<std::string>& exclude, const InFlightMap& in_flight,
    int64_t prompt_tokens, absl::Span<const uint64_t> hashes, const PrefixIndex& index,
    const CacheAwareOptions& options) {
  struct Candidate {
    size_t index;
    int64_t load;
    int64_t matched;
  };
  std::vector<Candidate> c;
  int64_t min_load = std::numeric_limits<int64_t>::max(), max_load = 0;
  for (size_t i = 0; i < workers.size(); ++i) {
    const std::string& id = workers[i].registration.worker_id();
    if (exclude.contains(id)) continue;
    auto f = in_flight.find(id);
    const int64_t load = workers[i].load.queued_prefill_tokens() +
                         (f == in_flight.end() ? 0 : f->second.tokens);
    const int64_t matched =
        std::min(prompt_tokens, index.Match(id, hashes) * kRouterBlockTokens);
    c.push_back({i, load, matched});
    min_load = std::min(min_load, load);
    max_load = std::max(max_load, load);
  }
  if (c.empty()) return std::nullopt;
  const bool imbalanced = max_load > options.balance_abs_tokens &&
                          static_cast<double>(max_load) >
                              options.balance_rel * static_cast<double>(min_load);
  std::optional<PrefillChoice> best;
  std::tuple<double, int64_t, std::string> best_key;
  for (const Candidate& k : c) {
    const double cost =
        imbalanced
            ? static_cast<double>(k.load)
            : options.overlap_weight * static_cast<double>(prompt_tokens - k.matched) +
                  static_cast<double>(k.load);
    auto key = std::make_tuple(cost, k.load, workers[k.index].registration.worker_id());
    if (!best.has_value() || key < best_key) {
      best = PrefillChoice{k.index, k.matched, imbalanced};
      best_key = std::move(key);
    }
  }
  return best;
}

std::optional<PrefillChoice> PrefillRouter::Select(
    const std::vector<WorkerRecord>& workers,
    const absl::flat_hash_set<std::string>& exclude, const InFlightMap& in_flight,
    int64_t prompt_tokens, absl::Span<const uint64_t> hashes) {
  absl::MutexLock l(&mu_);
  switch (policy_) {
    case RoutingPolicy::kLeastLoad: {
      std::optional<size_t> i = SelectPrefill(workers, exclude, in_flight);
      if (!i.has_value()) return std::nullopt;
      return PrefillChoice{*i, 0, false};
    }
    case RoutingPolicy::kRoundRobin: {
      // Worker ids in order, the next one after the last choice not excluded.
      std::vector<size_t> order;
      for (size_t i = 0; i < workers.size(); ++i) {
        if (!exclude.contains(workers[i].registration.worker_id())) order.push_back(i);
      }
      if (order.empty()) return std::nullopt;
      std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        return workers[a].registration.worker_id() <
               workers[b].registration.worker_id();
      });
      return PrefillChoice{order[next_++ % order.size()], 0, false};
    }
    case RoutingPolicy::kCacheAware: {
      std::optional<PrefillChoice> c = SelectPrefillCacheAware(
          workers, exclude, in_flight, prompt_tokens, hashes, index_, options_);
      if (c.has_value())
        index_.Record(workers[c->index].registration.worker_id(), hashes);
      return c;
    }
  }
  return std::nullopt;
}

void PrefillRouter::RemoveWorker(const std::string& worker) {
  absl::MutexLock l(&mu_);
  index_.RemoveWorker(worker);
}

}  // namespace tandem::router
