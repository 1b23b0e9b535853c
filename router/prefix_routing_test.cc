#include "router/prefix_routing.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::router {
namespace {

WorkerRecord Worker(const std::string& id, int64_t queued) {
  WorkerRecord r;
  r.registration.set_worker_id(id);
  r.load.set_queued_prefill_tokens(queued);
  return r;
}

std::vector<int32_t> Prompt(int n, int seed, int shared = 0) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i)
    p[i] = i < shared ? i * 31 % 9973 : (i * 17 + seed * 7919) % 9973;
  return p;
}

TEST(RouterBlockHashesTest, ChainedSaltedFullBlocks) {
  const auto a = RouterBlockHashes(Prompt(200, 1), "");
  ASSERT_EQ(a.size(), 3u);
  EXPECT_NE(RouterBlockHashes(Prompt(200, 1), "t")[0], a[0]);
  EXPECT_EQ(RouterBlockHashes(Prompt(130, 1), ""),
            std::vector<uint64_t>(a.begin(), a.begin() + 2));
}

TEST(PrefixIndexTest, MatchRecordLru) {
  PrefixIndex idx(4);
  const auto a = RouterBlockHashes(Prompt(256, 1), "");  // 4 blocks
  const auto b = RouterBlockHashes(Prompt(128, 2), "");  // 2 blocks
  idx.Record("w", a);
  EXPECT_EQ(idx.Match("w", a), 4);
  EXPECT_EQ(idx.Match("v", a), 0);
  idx.Record("w", b);  // evicts a's two least recent: its deepest blocks
  EXPECT_EQ(idx.size("w"), 4);
  EXPECT_EQ(idx.Match("w", a), 2);
  EXPECT_EQ(idx.Match("w", b), 2);
  idx.RemoveWorker("w");
  EXPECT_EQ(idx.Match("w", b), 0);
}

struct Case {
  const char* name;
  std::vector<std::pair<std::string, int64_t>> workers;  // id, queued tokens
  std::map<std::string, int> cached_blocks;              // of the prompt
  std::string want;
  bool balanced = false;
};

TEST(SelectPrefillCacheAwareTest, Table) {
  const std::vector<int32_t> prompt = Prompt(4096, 1);  // 64 blocks
  const auto h = RouterBlockHashes(prompt, "");
  const std::vector<Case> cases = {
      {"equal load: the longest hit",
       {{"a", 0}, {"b", 0}, {"c", 0}},
       {{"b", 10}, {"c", 40}},
       "c"},
      {"no hits: least load", {{"a", 300}, {"b", 100}}, {}, "b"},
      {"hit saves more than the extra load", {{"a", 0}, {"b", 1000}}, {{"b", 40}}, "b"},
      {"extra load exceeds the saving", {{"a", 0}, {"b", 2000}}, {{"b", 20}}, "a"},
      {"imbalanced: least load whatever the cache",
       {{"a", 1000}, {"b", 20000}},
       {{"b", 64}},
       "a",
       true},
      {"below the absolute threshold: cost decides",
       {{"a", 100}, {"b", 2000}},
       {{"b", 64}},
       "b"},
      {"ties: id", {{"b", 0}, {"a", 0}}, {}, "a"},
  };
  for (const Case& c : cases) {
    std::vector<WorkerRecord> ws;
    PrefixIndex idx(1 << 16);
    for (const auto& [id, q] : c.workers) ws.push_back(Worker(id, q));
    for (const auto& [id, k] : c.cached_blocks) {
      idx.Record(id, absl::MakeConstSpan(h).subspan(0, k));
    }
    auto got = SelectPrefillCacheAware(ws, {}, {}, 4096, h, idx, CacheAwareOptions{});
    ASSERT_TRUE(got.has_value()) << c.name;
    EXPECT_EQ(ws[got->index].registration.worker_id(), c.want) << c.name;
    EXPECT_EQ(got->balanced, c.balanced) << c.name;
  }
  // Excluded workers are skipped; none left: nothing.
  std::vector<WorkerRecord> ws = {Worker("a", 0)};
  PrefixIndex idx(16);
  EXPECT_FALSE(SelectPrefillCacheAware(ws, {"a"}, {}, 100, h, idx, CacheAwareOptions{})
                   .has_value());
}

// Every request shares a 2048-token system prompt (32 blocks) and has 256 tokens
// of its own; 4 workers each drain 100 tokens of prefill per tick, one request
// arrives per tick: no single worker keeps up even with every hit (256 tokens
// of work per request), four do. Returns the most loaded worker's total work / the
// mean.
double Spread(const CacheAwareOptions& o, double* hit_rate) {
  const std::vector<std::string> ids = {"w0", "w1", "w2", "w3"};
  std::vector<WorkerRecord> ws;
  for (const auto& id : ids) ws.push_back(Worker(id, 0));
  PrefixIndex idx(o.max_blocks_per_worker);
  InFlightMap in_flight;
  std::map<std::string, int64_t> work;
  int64_t hit = 0, total = 0;
  for (int r = 0; r < 400; ++r) {
    std::vector<int32_t> p = Prompt(2048 + 256, 100 + r, /*shared=*/2048);
    const auto h = RouterBlockHashes(p, "");
    auto c = SelectPrefillCacheAware(ws, {}, in_flight, p.size(), h, idx, o);
    const std::string& id = ws[c->index].registration.worker_id();
    idx.Record(id, h);
    const int64_t uncached = static_cast<int64_t>(p.size()) - c->matched_tokens;
    in_flight[id].tokens += uncached;
    work[id] += uncached;
    hit += c->matched_tokens;
    total += p.size();
    for (auto& [w, f] : in_flight) f.tokens = std::max<int64_t>(0, f.tokens - 100);
  }
  *hit_rate = static_cast<double>(hit) / total;
  int64_t max = 0, sum = 0;
  for (const auto& id : ids) {
    max = std::max(max, work[id]);
    sum += work[id];
  }
  return static_cast<double>(max) / (static_cast<double>(sum) / ids.size());
}

TEST(SelectPrefillCacheAwareTest, SharedFirstBlocksDoNotHotSpotOneWorker) {
  double hit_rate = 0;
  const double spread = Spread(CacheAwareOptions{}, &hit_rate);
  EXPECT_LE(spread, 1.3);
  EXPECT_GT(hit_rate, 0.8);  // the system prompt is cached on every worker it went to
  // Pure affinity (the failure designed against): no load in the cost, no guard.
  CacheAwareOptions affinity;
  affinity.overlap_weight = 1e9;
  affinity.balance_abs_tokens = std::numeric_limits<int64_t>::max();
  double affinity_hits = 0;
  EXPECT_GT(Spread(affinity, &affinity_hits), 3.0);  // everything on one worker
}

TEST(RoutingPolicyTest, Parse) {
  EXPECT_EQ(*ParseRoutingPolicy("cache_aware"), RoutingPolicy::kCacheAware);
  EXPECT_EQ(*ParseRoutingPolicy("least_load"), RoutingPolicy::kLeastLoad);
  EXPECT_EQ(*ParseRoutingPolicy("round_robin"), RoutingPolicy::kRoundRobin);
  EXPECT_FALSE(ParseRoutingPolicy("affinity").ok());
}

}  // namespace
}  // namespace tandem::router
