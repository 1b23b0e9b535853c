#include "router/prefix_routing.h"

#include <algorithm>
#include <cmath>
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
                                        std::string_view cache_salt,
                                        absl::Span<const RouteMedia> media) {
  return RouteBlockHashes(prompt, cache_salt, media);
}

std::vector<uint64_t> RouterBlockHashes(const tandem::v1::GenerateRequest& request) {
  std::vector<RouteMedia> media;
  media.reserve(request.images_size());
  for (const tandem::v1::ImageInput& im : request.images()) {
    media.push_back({.position = im.placeholder_start(), .hash = im.content_hash()});
  }
  return RouterBlockHashes(request.prompt_token_ids().ids(), request.cache_salt(),
                           media);
}

using tandem::v1::PrefixCacheEvent;

void PrefixIndex::Reset(const std::string& worker, uint64_t epoch, uint64_t seq,
                        const PrefixEvents& snapshot) {
  Worker& w = workers_[worker];
  w = Worker{};
  w.epoch = epoch;
  w.last_seq = seq;
  for (const PrefixCacheEvent& e : snapshot) ApplyOne(w, e);
}

void PrefixIndex::ApplyOne(Worker& w, const PrefixCacheEvent& e) {
  // Blocks-only holdings (a decode worker's landed prompts) have their own
  // set and never touch the usable one or the overlay.
  auto& set = e.blocks_only() ? w.blocks : w.reported;
  switch (e.kind()) {
    case PrefixCacheEvent::KIND_STORED:
      if (!e.blocks_only()) w.overlay.erase(e.route_hash());
      if (e.tokens() <= 0 || e.tokens() % kRouteBlockTokens != 0)
        return;  // no position
      if (static_cast<int64_t>(set.size()) >= options_.max_entries_per_worker &&
          !set.contains(e.route_hash())) {
        w.overflowed = true;
        return;
      }
      set[e.route_hash()] = e.tokens();
      return;
    case PrefixCacheEvent::KIND_REMOVED:
      if (!e.blocks_only()) w.overlay.erase(e.route_hash());
      set.erase(e.route_hash());
      return;
    case PrefixCacheEvent::KIND_CLEARED:
      w.overlay.clear();
      w.reported.clear();
      w.blocks.clear();
      w.overflowed = false;
      return;
    default:
      return;  // an unknown kind from a newer worker changes nothing
  }
}

ReportOutcome PrefixIndex::Apply(const std::string& worker, uint64_t epoch,
                                 uint64_t first_seq, const PrefixEvents& events) {
  ReportOutcome out;
  auto it = workers_.find(worker);
  if (it == workers_.end() || it->second.epoch != epoch) {
    // Not known as a reporter, or another incarnation of it: nothing of this
    // stream can be placed on what the router holds.
    out.resync = true;
    out.why = "epoch";
    return out;
  }
  Worker& w = it->second;
  out.acked_seq = w.last_seq;
  if (w.overflowed) {
    out.resync = true;
    out.why = "overflow";
    return out;
  }
  // first_seq names the first event here (or, with none, the next to come):
  // anything after last_seq + 1 means events the router never saw.
  if (first_seq == 0 || first_seq > w.last_seq + 1) {
    out.resync = true;
    out.why = "gap";
    return out;
  }
  for (int i = 0; i < events.size(); ++i) {
    const uint64_t seq = first_seq + i;
    if (seq <= w.last_seq) continue;  // applied before (a resend)
    ApplyOne(w, events[i]);
    w.last_seq = seq;
    ++out.applied;
  }
  out.acked_seq = w.last_seq;
  if (w.overflowed) {
    out.resync = true;
    out.why = "overflow";
  }
  return out;
}

void PrefixIndex::RecordSent(const std::string& worker,
                             absl::Span<const uint64_t> hashes, int64_t prompt_tokens,
                             absl::Time now) {
  auto it = workers_.find(worker);
  if (it == workers_.end()) return;  // it reports nothing: guess nothing
  // The worker snapshots the prompt's last full chunk (the deepest multiple
  // of 64 below its last token): a repeat or the next turn hits there.
  const int64_t p = (prompt_tokens - 1) / kRouteBlockTokens * kRouteBlockTokens;
  if (p <= 0 || p / kRouteBlockTokens > static_cast<int64_t>(hashes.size())) return;
  Worker& w = it->second;
  if (static_cast<int64_t>(w.overlay.size()) >= options_.max_overlay_per_worker) {
    absl::erase_if(w.overlay, [now](const auto& kv) { return kv.second <= now; });
    if (static_cast<int64_t>(w.overlay.size()) >= options_.max_overlay_per_worker) {
      w.overlay.clear();
    }
  }
  w.overlay[hashes[p / kRouteBlockTokens - 1]] = now + options_.overlay_ttl;
}

int64_t PrefixIndex::Match(const std::string& worker, absl::Span<const uint64_t> hashes,
                           int64_t prompt_tokens, absl::Time now) const {
  auto it = workers_.find(worker);
  if (it == workers_.end()) return 0;
  const Worker& w = it->second;
  // Usable hits lie below the prompt's last token (it must be computed).
  const int64_t max_blocks = std::min<int64_t>(
      hashes.size(), std::max<int64_t>(prompt_tokens - 1, 0) / kRouteBlockTokens);
  for (int64_t b = max_blocks; b >= 1; --b) {
    const uint64_t h = hashes[b - 1];
    const int64_t p = b * kRouteBlockTokens;
    if (auto r = w.reported.find(h); r != w.reported.end() && r->second == p) return p;
    if (auto o = w.overlay.find(h); o != w.overlay.end() && o->second > now) return p;
  }
  return 0;
}

int64_t PrefixIndex::MatchBlocks(const std::string& worker,
                                 absl::Span<const uint64_t> hashes,
                                 int64_t prompt_tokens) const {
  auto it = workers_.find(worker);
  if (it == workers_.end()) return 0;
  const Worker& w = it->second;
  // Every prompt token's rows may be held (nothing is computed there).
  const int64_t max_blocks =
      std::min<int64_t>(hashes.size(), prompt_tokens / kRouteBlockTokens);
  for (int64_t b = max_blocks; b >= 1; --b) {
    const uint64_t h = hashes[b - 1];
    const int64_t p = b * kRouteBlockTokens;
    // Blocks-only announcements alone: a usable position does not imply
    // blocks a reservation can share (its blocks may sit in the worker's host
    // tier, which Reserve does not search; the announcement goes when its
    // block leaves the device tier).
    if (auto r = w.blocks.find(h); r != w.blocks.end() && r->second == p) return p;
  }
  return 0;
}

void PrefixIndex::Retain(const absl::flat_hash_set<std::string>& live) {
  absl::erase_if(workers_,
                 [&live](const auto& kv) { return !live.contains(kv.first); });
}

int64_t PrefixIndex::size(const std::string& worker) const {
  auto it = workers_.find(worker);
  return it == workers_.end() ? 0 : static_cast<int64_t>(it->second.reported.size());
}

int64_t PrefixIndex::overlay_size(const std::string& worker) const {
  auto it = workers_.find(worker);
  return it == workers_.end() ? 0 : static_cast<int64_t>(it->second.overlay.size());
}

std::vector<std::string> PrefixIndex::workers() const {
  std::vector<std::string> out;
  for (const auto& [id, w] : workers_) out.push_back(id);
  std::sort(out.begin(), out.end());
  return out;
}

double RecentWork::At(const std::string& worker, absl::Time now) const {
  auto it = work_.find(worker);
  if (it == work_.end()) return 0;
  const double dt = std::max(0.0, absl::ToDoubleSeconds(now - it->second.at));
  return it->second.tokens * std::exp(-dt / absl::ToDoubleSeconds(tau_));
}

void RecentWork::Add(const std::string& worker, int64_t tokens, absl::Time now) {
  const double before = At(worker, now);
  work_[worker] = Entry{before + static_cast<double>(tokens), now};
}

std::optional<PrefillChoice> SelectPrefillCacheAware(
    const std::vector<WorkerRecord>& workers,
    const absl::flat_hash_set<std::string>& exclude, const InFlightMap& in_flight,
    int64_t prompt_tokens, absl::Span<const uint64_t> hashes, const PrefixIndex& index,
    const CacheAwareOptions& options, absl::Time now, const RecentWork* recent) {
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
    const int64_t matched = index.Match(id, hashes, prompt_tokens, now);
    c.push_back({i, load, matched});
    min_load = std::min(min_load, load);
    max_load = std::max(max_load, load);
  }
  if (c.empty()) return std::nullopt;
  const bool imbalanced = max_load > options.balance_abs_tokens &&
                          static_cast<double>(max_load) >
                              options.balance_rel * static_cast<double>(min_load);
  std::optional<PrefillChoice> best;
  std::tuple<double, int64_t, double, std::string> best_key;
  for (const Candidate& k : c) {
    const double cost =
        imbalanced
            ? static_cast<double>(k.load)
            : options.overlap_weight * static_cast<double>(prompt_tokens - k.matched) +
                  static_cast<double>(k.load);
    const std::string& id = workers[k.index].registration.worker_id();
    auto key = std::make_tuple(cost, k.load,
                               recent == nullptr ? 0.0 : recent->At(id, now), id);
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
  const absl::Time now = clock_->Now();
  absl::MutexLock l(&mu_);
  switch (policy_) {
    case RoutingPolicy::kLeastLoad: {
      // SelectPrefill's order (queued + in-flight tokens, then requests), the
      // least recent work before the id on a tie.
      std::optional<size_t> best;
      std::tuple<int64_t, int64_t, double, std::string> best_key;
      for (size_t i = 0; i < workers.size(); ++i) {
        const std::string& id = workers[i].registration.worker_id();
        if (exclude.contains(id)) continue;
        auto f = in_flight.find(id);
        const InFlight fl = f == in_flight.end() ? InFlight{} : f->second;
        const tandem::v1::WorkerLoad& l = workers[i].load;
        auto key =
            std::make_tuple(l.queued_prefill_tokens() + fl.tokens,
                            static_cast<int64_t>(l.running_requests()) + fl.requests,
                            recent_.At(id, now), id);
        if (!best.has_value() || key < best_key) {
          best = i;
          best_key = std::move(key);
        }
      }
      if (!best.has_value()) return std::nullopt;
      recent_.Add(workers[*best].registration.worker_id(), prompt_tokens, now);
      return PrefillChoice{*best, 0, false};
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
      std::optional<PrefillChoice> c =
          SelectPrefillCacheAware(workers, exclude, in_flight, prompt_tokens, hashes,
                                  index_, options_, now, &recent_);
      if (c.has_value()) {
        const std::string& id = workers[c->index].registration.worker_id();
        index_.RecordSent(id, hashes, prompt_tokens, now);
        recent_.Add(id, prompt_tokens - c->matched_tokens, now);
      }
      return c;
    }
  }
  return std::nullopt;
}

std::optional<DecodeMatch> PrefillRouter::BestMatch(
    const std::vector<WorkerRecord>& workers,
    const absl::flat_hash_set<std::string>& exclude, int64_t prompt_tokens,
    absl::Span<const uint64_t> hashes) {
  const absl::Time now = clock_->Now();
  absl::MutexLock l(&mu_);
  std::optional<DecodeMatch> best;
  for (const WorkerRecord& w : workers) {
    const std::string& id = w.registration.worker_id();
    if (exclude.contains(id)) continue;
    const int64_t m = index_.Match(id, hashes, prompt_tokens, now);
    if (m > 0 && (!best.has_value() || m > best->matched_tokens)) {
      best = DecodeMatch{id, m};
    }
  }
  return best;
}

absl::flat_hash_map<std::string, int64_t> PrefillRouter::HeldBlocks(
    const std::vector<WorkerRecord>& workers, int64_t prompt_tokens,
    absl::Span<const uint64_t> hashes) {
  absl::flat_hash_map<std::string, int64_t> out;
  absl::MutexLock l(&mu_);
  for (const WorkerRecord& w : workers) {
    const std::string& id = w.registration.worker_id();
    const int64_t m = index_.MatchBlocks(id, hashes, prompt_tokens);
    if (m > 0) out[id] = m;
  }
  return out;
}

void PrefillRouter::RecordSent(const std::string& worker,
                               absl::Span<const uint64_t> hashes,
                               int64_t prompt_tokens) {
  const absl::Time now = clock_->Now();
  absl::MutexLock l(&mu_);
  index_.RecordSent(worker, hashes, prompt_tokens, now);
}

void PrefillRouter::OnRegister(const tandem::v1::RegisterRequest& r) {
  absl::MutexLock l(&mu_);
  if (!r.reports_prefix_cache()) {
    index_.RemoveWorker(r.worker_id());
    return;
  }
  index_.Reset(r.worker_id(), r.prefix_epoch(), r.prefix_seq(), r.prefix_snapshot());
}

ReportOutcome PrefillRouter::OnHeartbeat(const tandem::v1::HeartbeatRequest& r) {
  absl::MutexLock l(&mu_);
  if (r.prefix_epoch() == 0) {
    // A worker that reports nothing: nothing to apply; its set (if any) stays
    // as registration left it.
    ReportOutcome out;
    if (index_.reports(r.worker_id())) {
      out.resync = true;  // registered as a reporter, now silent: diverged
      out.why = "epoch";
    }
    return out;
  }
  return index_.Apply(r.worker_id(), r.prefix_epoch(), r.prefix_first_seq(),
                      r.prefix_events());
}

void PrefillRouter::RemoveWorker(const std::string& worker) {
  absl::MutexLock l(&mu_);
  index_.RemoveWorker(worker);
  recent_.Remove(worker);
}

void PrefillRouter::Retain(const absl::flat_hash_set<std::string>& live) {
  absl::MutexLock l(&mu_);
  index_.Retain(live);
}

std::vector<std::pair<std::string, int64_t>> PrefillRouter::IndexSizes() {
  absl::MutexLock l(&mu_);
  std::vector<std::pair<std::string, int64_t>> out;
  for (const std::string& id : index_.workers()) out.emplace_back(id, index_.size(id));
  return out;
}

int64_t PrefillRouter::IndexSize(const std::string& worker) {
  absl::MutexLock l(&mu_);
  return index_.size(worker);
}

int64_t PrefillRouter::Match(const std::string& worker,
                             absl::Span<const uint64_t> hashes, int64_t prompt_tokens) {
  const absl::Time now = clock_->Now();
  absl::MutexLock l(&mu_);
  return index_.Match(worker, hashes, prompt_tokens, now);
}

}  // namespace tandem::router
