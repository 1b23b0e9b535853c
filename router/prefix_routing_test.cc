#include "router/prefix_routing.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/route_hash.h"
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

using tandem::v1::PrefixCacheEvent;

PrefixCacheEvent Ev(PrefixCacheEvent::Kind kind, int64_t tokens, uint64_t hash) {
  PrefixCacheEvent e;
  e.set_kind(kind);
  e.set_tokens(tokens);
  e.set_route_hash(hash);
  return e;
}
// STORED / REMOVED of the prompt's prefix of `blocks` 64-token blocks.
PrefixCacheEvent Stored(const std::vector<uint64_t>& h, int blocks) {
  return Ev(PrefixCacheEvent::KIND_STORED, blocks * 64, h[blocks - 1]);
}
PrefixCacheEvent Removed(const std::vector<uint64_t>& h, int blocks) {
  return Ev(PrefixCacheEvent::KIND_REMOVED, blocks * 64, h[blocks - 1]);
}
PrefixCacheEvent Cleared() { return Ev(PrefixCacheEvent::KIND_CLEARED, 0, 0); }
PrefixEvents Events(std::vector<PrefixCacheEvent> v) {
  PrefixEvents out;
  for (auto& e : v) *out.Add() = std::move(e);
  return out;
}

const absl::Time kNow = absl::FromUnixSeconds(1000000);

TEST(RouterBlockHashesTest, ChainedSaltedFullBlocks) {
  const auto a = RouterBlockHashes(Prompt(200, 1), "");
  ASSERT_EQ(a.size(), 3u);
  EXPECT_NE(RouterBlockHashes(Prompt(200, 1), "t")[0], a[0]);
  EXPECT_EQ(RouterBlockHashes(Prompt(130, 1), ""),
            std::vector<uint64_t>(a.begin(), a.begin() + 2));
  EXPECT_EQ(a[2], RoutePrefixHash(Prompt(200, 1), 192, ""));  // what workers send
}

// A request with images hashes each image's content at its first placeholder
// (what a prefill worker's engine reports: common/route_hash.h), so a worker
// that reported the prompt with image A matches it with A, and only up to the
// image with another one.
TEST(RouterBlockHashesTest, ImagesAreMixedInAtTheirPlaceholders) {
  tandem::v1::GenerateRequest req;
  std::vector<int32_t> prompt = Prompt(400, 1);
  for (int i = 100; i < 120; ++i) prompt[i] = 163605;  // one image's pads
  for (int32_t t : prompt) req.mutable_prompt_token_ids()->add_ids(t);
  req.set_cache_salt("tenant");
  tandem::v1::ImageInput* im = req.add_images();
  im->set_placeholder_start(100);
  im->set_num_tokens(20);
  im->set_content_hash(0xa11ce);
  const std::vector<uint64_t> with_a = RouterBlockHashes(req);
  const RouteMedia a[] = {{.position = 100, .hash = 0xa11ce}};
  // What the worker names its positions with, from its MediaInput.
  EXPECT_EQ(with_a, RouteBlockHashes(prompt, "tenant", a));
  EXPECT_EQ(with_a[4], RoutePrefixHash(prompt, 320, "tenant", a));
  // Text only: the token chain, as before.
  tandem::v1::GenerateRequest text = req;
  text.clear_images();
  EXPECT_EQ(RouterBlockHashes(text), RouteBlockHashes(prompt, "tenant"));

  tandem::v1::GenerateRequest other = req;
  other.mutable_images(0)->set_content_hash(0xb0b);
  const std::vector<uint64_t> with_b = RouterBlockHashes(other);
  const std::vector<uint64_t> same = RouterBlockHashes(req);

  PrefixIndex idx{CacheAwareOptions{}};
  // The worker prefilled the prompt with image A: snapshots at 64 (before the
  // image) and 320.
  idx.Reset("w", 1, 2, Events({Stored(with_a, 1), Stored(with_a, 5)}));
  EXPECT_EQ(idx.Match("w", same, 400, kNow), 320);   // equal image: the deep hit
  EXPECT_EQ(idx.Match("w", with_b, 400, kNow), 64);  // other image: the text before
  // Without images in the hashes, B's prompt would look like a hit at 320.
  PrefixIndex text_only{CacheAwareOptions{}};
  const std::vector<uint64_t> tokens_only = RouteBlockHashes(prompt, "tenant");
  text_only.Reset("w", 1, 1, Events({Stored(tokens_only, 5)}));
  EXPECT_EQ(text_only.Match("w", with_b, 400, kNow), 0);
  EXPECT_EQ(text_only.Match("w", RouterBlockHashes(text), 400, kNow), 320);
}

// match(w) = the deepest reported position of the prompt, below its last token.
TEST(PrefixIndexTest, MatchIsTheDeepestReportedPosition) {
  const auto h = RouterBlockHashes(Prompt(640, 1), "");  // 10 blocks
  const auto other = RouterBlockHashes(Prompt(640, 2), "");
  struct Case {
    const char* name;
    std::vector<PrefixCacheEvent> snapshot;
    int64_t prompt_tokens;
    int64_t want;
  };
  const std::vector<Case> cases = {
      {"nothing reported", {}, 640, 0},
      {"one position", {Stored(h, 4)}, 640, 256},
      // Positions between snapshots are not hits (the KDA state exists only
      // at snapshots): 2 and 7 reported, the deepest wins, nothing "leading".
      {"deepest of two", {Stored(h, 2), Stored(h, 7)}, 640, 448},
      {"another prompt's position", {Stored(other, 7)}, 640, 0},
      {"at the prompt's end: not usable (its last token must be computed)",
       {Stored(h, 10)},
       640,
       0},
      {"below the end", {Stored(h, 9)}, 640, 576},
      {"prompt shorter than the position", {Stored(h, 9)}, 300, 0},
      {"tokens not matching the hash's position",
       {Ev(PrefixCacheEvent::KIND_STORED, 128, h[3])},
       640,
       0},
      {"off the 64 grid: ignored",
       {Ev(PrefixCacheEvent::KIND_STORED, 100, h[3])},
       640,
       0},
  };
  for (const Case& c : cases) {
    PrefixIndex idx{CacheAwareOptions{}};
    idx.Reset("w", 7, 0, Events(c.snapshot));
    EXPECT_EQ(idx.Match("w", h, c.prompt_tokens, kNow), c.want) << c.name;
    EXPECT_EQ(idx.Match("v", h, c.prompt_tokens, kNow), 0) << c.name;
  }
}

// Blocks-only holdings (a decode worker's device-tier blocks): their own set,
// matched up to the prompt's end (its rows are all there to share), never
// joined by usable positions (a usable position's blocks may have moved to the
// worker's host tier, which a reservation does not search) nor by the
// overlay; Match (usable hits) ignores them.
TEST(PrefixIndexTest, MatchBlocksCountsBlocksOnlyAnnouncementsAlone) {
  const auto h = RouterBlockHashes(Prompt(640, 1), "");  // 10 blocks
  auto blocks = [&](int b) {
    PrefixCacheEvent e = Stored(h, b);
    e.set_blocks_only(true);
    return e;
  };
  PrefixIndex idx{CacheAwareOptions{}};
  idx.Reset("w", 7, 0, Events({blocks(10), Stored(h, 3)}));
  EXPECT_EQ(idx.MatchBlocks("w", h, 640), 640);  // the whole prompt's rows
  EXPECT_EQ(idx.Match("w", h, 640, kNow), 192);  // usable: the snapshot only
  // 640 lies past this prompt, and the usable 192 is no holding of blocks.
  EXPECT_EQ(idx.MatchBlocks("w", h, 500), 0);
  EXPECT_EQ(idx.size("w"), 1);
  // The blocks-only one goes (its block left the device tier); the usable
  // one is still a hit (from either tier) but no holding of blocks.
  PrefixCacheEvent gone = Removed(h, 10);
  gone.set_blocks_only(true);
  auto out = idx.Apply("w", 7, 1, Events({gone}));
  EXPECT_FALSE(out.resync);
  EXPECT_EQ(idx.MatchBlocks("w", h, 640), 0);
  EXPECT_EQ(idx.Match("w", h, 640, kNow), 192);
  // A usable REMOVED does not take a blocks-only entry of the same hash.
  out = idx.Apply("w", 7, 2, Events({blocks(3), Removed(h, 3)}));
  EXPECT_EQ(idx.Match("w", h, 640, kNow), 0);
  EXPECT_EQ(idx.MatchBlocks("w", h, 640), 192);
  // The overlay (what was sent) is not a holding of blocks.
  idx.Reset("v", 9, 0, Events({}));
  idx.RecordSent("v", h, 640, kNow);
  EXPECT_GT(idx.Match("v", h, 640, kNow), 0);
  EXPECT_EQ(idx.MatchBlocks("v", h, 640), 0);
  idx.Apply("w", 7, 4, Events({Cleared()}));
  EXPECT_EQ(idx.MatchBlocks("w", h, 640), 0);
}

// A stream of heartbeats after a registration: what is applied, acknowledged,
// and when the router asks for a resync.
TEST(PrefixIndexTest, StoredRemovedClearedGapsAndEpochs) {
  const auto h = RouterBlockHashes(Prompt(640, 1), "");
  struct Step {
    const char* name;
    uint64_t epoch, first_seq;
    std::vector<PrefixCacheEvent> events;
    bool resync;
    const char* why;
    uint64_t acked;
    int64_t applied;
    int64_t match;  // of the 640-token prompt after the step
    int64_t size;
  };
  const std::vector<Step> steps = {
      {"stored 2", 7, 4, {Stored(h, 2)}, false, "", 4, 1, 128, 2},
      {"stored 5, removed 2",
       7,
       5,
       {Stored(h, 5), Removed(h, 2)},
       false,
       "",
       6,
       2,
       320,
       2},
      {"a resend of 5..6 plus 7 (the ack was lost)",
       7,
       5,
       {Stored(h, 5), Removed(h, 2), Stored(h, 8)},
       false,
       "",
       7,
       1,
       512,
       3},
      {"no events, the next seq: nothing to do", 7, 8, {}, false, "", 7, 0, 512, 3},
      {"cleared", 7, 8, {Cleared()}, false, "", 8, 1, 0, 0},
      {"stored again", 7, 9, {Stored(h, 3)}, false, "", 9, 1, 192, 1},
      {"a gap: 10 never arrived", 7, 11, {Stored(h, 6)}, true, "gap", 9, 0, 192, 1},
      {"a gap without events", 7, 12, {}, true, "gap", 9, 0, 192, 1},
      {"another epoch (the worker restarted)",
       8,
       1,
       {Stored(h, 6)},
       true,
       "epoch",
       0,
       0,
       192,
       1},
      {"seq 0 is no sequence", 7, 0, {Stored(h, 6)}, true, "gap", 9, 0, 192, 1},
  };
  PrefixIndex idx{CacheAwareOptions{}};
  idx.Reset("w", 7, 3, Events({Stored(h, 1)}));  // snapshot through seq 3
  EXPECT_EQ(idx.Match("w", h, 640, kNow), 64);
  for (const Step& s : steps) {
    ReportOutcome o = idx.Apply("w", s.epoch, s.first_seq, Events(s.events));
    EXPECT_EQ(o.resync, s.resync) << s.name;
    EXPECT_STREQ(o.why, s.why) << s.name;
    if (!s.resync || std::string(s.why) != "epoch")
      EXPECT_EQ(o.acked_seq, s.acked) << s.name;
    EXPECT_EQ(o.applied, s.applied) << s.name;
    EXPECT_EQ(idx.Match("w", h, 640, kNow), s.match) << s.name;
    EXPECT_EQ(idx.size("w"), s.size) << s.name;
  }
  // The resync: registration with a snapshot replaces the set and the stream.
  idx.Reset("w", 8, 1, Events({Stored(h, 6)}));
  EXPECT_EQ(idx.Match("w", h, 640, kNow), 384);
  EXPECT_EQ(idx.size("w"), 1);
  ReportOutcome o = idx.Apply("w", 8, 2, Events({Stored(h, 9)}));
  EXPECT_FALSE(o.resync);
  EXPECT_EQ(o.acked_seq, 2u);
  EXPECT_EQ(idx.Match("w", h, 640, kNow), 576);
  // A worker never registered as a reporter: resync (register again).
  EXPECT_TRUE(idx.Apply("v", 1, 1, Events({Stored(h, 2)})).resync);
  EXPECT_EQ(idx.Match("v", h, 640, kNow), 0);
  idx.RemoveWorker("w");
  EXPECT_FALSE(idx.reports("w"));
  EXPECT_EQ(idx.Match("w", h, 640, kNow), 0);
}

TEST(PrefixIndexTest, OverflowAsksForAResync) {
  const auto h = RouterBlockHashes(Prompt(640, 1), "");
  CacheAwareOptions o;
  o.max_entries_per_worker = 2;
  PrefixIndex idx(o);
  idx.Reset("w", 1, 0, Events({}));
  ReportOutcome r =
      idx.Apply("w", 1, 1, Events({Stored(h, 1), Stored(h, 2), Stored(h, 3)}));
  EXPECT_TRUE(r.resync);
  EXPECT_STREQ(r.why, "overflow");
  EXPECT_EQ(r.acked_seq, 3u);
  EXPECT_EQ(idx.size("w"), 2);
  EXPECT_TRUE(idx.Apply("w", 1, 4, Events({})).resync);  // until it registers again
  idx.Reset("w", 1, 4, Events({Stored(h, 3)}));
  EXPECT_FALSE(idx.Apply("w", 1, 5, Events({})).resync);
}

// The overlay: sent, not yet reported; for overlay_ttl, superseded by reports.
TEST(PrefixIndexTest, OverlayUntilReportedOrExpired) {
  const std::vector<int32_t> p = Prompt(300, 1);  // last full chunk: 256
  const auto h = RouterBlockHashes(p, "");
  const auto longer = RouterBlockHashes(Prompt(700, 1), "");  // the next turn
  CacheAwareOptions o;
  o.overlay_ttl = absl::Seconds(10);
  PrefixIndex idx(o);
  idx.RecordSent("w", h, 300, kNow);  // not a reporter: no guess
  EXPECT_EQ(idx.Match("w", h, 300, kNow), 0);
  idx.Reset("w", 1, 0, Events({}));
  idx.RecordSent("w", h, 300, kNow);
  EXPECT_EQ(idx.overlay_size("w"), 1);
  EXPECT_EQ(idx.Match("w", h, 300, kNow), 256);
  EXPECT_EQ(idx.Match("w", longer, 700, kNow), 256);  // a continuation hits it too
  EXPECT_EQ(idx.Match("w", h, 300, kNow + absl::Seconds(11)), 0);  // expired
  // Removed before the TTL: the worker's word wins.
  idx.RecordSent("w", h, 300, kNow);
  idx.Apply("w", 1, 1, Events({Removed(h, 4)}));
  EXPECT_EQ(idx.Match("w", h, 300, kNow), 0);
  // Stored: the report replaces the guess (no overlay entry left).
  idx.RecordSent("w", h, 300, kNow);
  idx.Apply("w", 1, 2, Events({Stored(h, 4)}));
  EXPECT_EQ(idx.overlay_size("w"), 0);
  EXPECT_EQ(idx.Match("w", h, 300, kNow + absl::Seconds(60)), 256);
  // Cleared (a reset): guesses go too.
  idx.RecordSent("w", longer, 700, kNow);
  idx.Apply("w", 1, 3, Events({Cleared()}));
  EXPECT_EQ(idx.Match("w", longer, 700, kNow), 0);
  // A prompt of under one full chunk below its last token records nothing.
  idx.RecordSent("w", RouterBlockHashes(Prompt(64, 3), ""), 64, kNow);
  EXPECT_EQ(idx.overlay_size("w"), 0);
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
       {{"b", 63}},
       "a",
       true},
      {"below the absolute threshold: cost decides",
       {{"a", 100}, {"b", 2000}},
       {{"b", 63}},
       "b"},
      {"ties: id", {{"b", 0}, {"a", 0}}, {}, "a"},
  };
  for (const Case& c : cases) {
    std::vector<WorkerRecord> ws;
    PrefixIndex idx{CacheAwareOptions{}};
    for (const auto& [id, q] : c.workers) ws.push_back(Worker(id, q));
    for (const auto& [id, k] : c.cached_blocks) {
      idx.Reset(id, 1, 0, Events({Stored(h, k)}));
    }
    auto got =
        SelectPrefillCacheAware(ws, {}, {}, 4096, h, idx, CacheAwareOptions{}, kNow);
    ASSERT_TRUE(got.has_value()) << c.name;
    EXPECT_EQ(ws[got->index].registration.worker_id(), c.want) << c.name;
    EXPECT_EQ(got->balanced, c.balanced) << c.name;
  }
  // Excluded workers are skipped; none left: nothing.
  std::vector<WorkerRecord> ws = {Worker("a", 0)};
  PrefixIndex idx{CacheAwareOptions{}};
  EXPECT_FALSE(
      SelectPrefillCacheAware(ws, {"a"}, {}, 100, h, idx, CacheAwareOptions{}, kNow)
          .has_value());
}

// Every request shares a 2048-token system prompt (32 blocks) and has 256 tokens
// of its own; each worker reports what a worker's cache would hold after it:
// the branch point (2048, the shared prompt) and the prompt's last full chunk;
// 4 workers each drain 100 tokens of prefill per tick, one request
// arrives per tick: no single worker keeps up even with every hit (256 tokens
// of work per request), four do. Returns the most loaded worker's total work / the
// mean.
double Spread(const CacheAwareOptions& o, double* hit_rate) {
  const std::vector<std::string> ids = {"w0", "w1", "w2", "w3"};
  std::vector<WorkerRecord> ws;
  for (const auto& id : ids) ws.push_back(Worker(id, 0));
  PrefixIndex idx(o);
  std::map<std::string, uint64_t> seq;
  for (const auto& id : ids) idx.Reset(id, 1, 0, Events({}));
  InFlightMap in_flight;
  std::map<std::string, int64_t> work;
  int64_t hit = 0, total = 0;
  for (int r = 0; r < 400; ++r) {
    std::vector<int32_t> p = Prompt(2048 + 256, 100 + r, /*shared=*/2048);
    const auto h = RouterBlockHashes(p, "");
    auto c = SelectPrefillCacheAware(ws, {}, in_flight, p.size(), h, idx, o, kNow);
    const std::string& id = ws[c->index].registration.worker_id();
    EXPECT_FALSE(
        idx.Apply(id, 1, seq[id] + 1, Events({Stored(h, 32), Stored(h, 35)})).resync);
    seq[id] += 2;
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

TEST(RecentWorkTest, DecaysExponentially) {
  RecentWork r(absl::Seconds(10));
  EXPECT_EQ(r.At("a", kNow), 0);
  r.Add("a", 1000, kNow);
  EXPECT_DOUBLE_EQ(r.At("a", kNow), 1000);
  EXPECT_NEAR(r.At("a", kNow + absl::Seconds(10)), 1000 * std::exp(-1.0), 1e-9);
  r.Add("a", 500, kNow + absl::Seconds(10));
  EXPECT_NEAR(r.At("a", kNow + absl::Seconds(10)), 1000 * std::exp(-1.0) + 500, 1e-9);
  r.Remove("a");
  EXPECT_EQ(r.At("a", kNow), 0);
}

// Light load (the trace bench's finding): every worker reports 0 queued and
// nothing is in flight between sequential requests, so cost and load tie on
// every uncached prompt. The tie used to go to the lowest id, which then took
// all uncached work; the recent-work tie-break spreads it.
TEST(PrefillRouterTest, TiesAtLightLoadSpreadOverWorkers) {
  for (RoutingPolicy policy : {RoutingPolicy::kLeastLoad, RoutingPolicy::kCacheAware}) {
    FakeClock clock(kNow);
    PrefillRouter router(policy, CacheAwareOptions{}, &clock);
    const std::vector<WorkerRecord> ws = {Worker("a", 0), Worker("b", 0),
                                          Worker("c", 0)};
    std::map<std::string, int64_t> work;
    for (int i = 0; i < 300; ++i) {
      const auto p = Prompt(256 + (i % 5) * 64, i + 1);  // distinct: nothing hits
      const auto h = RouterBlockHashes(p, "");
      auto c = router.Select(ws, {}, {}, p.size(), h);
      ASSERT_TRUE(c.has_value());
      work[ws[c->index].registration.worker_id()] += p.size();
      clock.Advance(absl::Milliseconds(200));
    }
    ASSERT_EQ(work.size(), 3u) << RoutingPolicyName(policy);
    int64_t total = 0, most = 0;
    for (const auto& [id, t] : work) {
      total += t;
      most = std::max(most, t);
    }
    EXPECT_LE(static_cast<double>(most) / (static_cast<double>(total) / 3), 1.1)
        << RoutingPolicyName(policy);
  }
}

// The tie-break never outweighs the cache: a worker holding the prefix wins
// although it took all the recent work.
TEST(PrefillRouterTest, RecentWorkNeverBeatsAHit) {
  FakeClock clock(kNow);
  PrefillRouter router(RoutingPolicy::kCacheAware, CacheAwareOptions{}, &clock);
  const std::vector<WorkerRecord> ws = {Worker("a", 0), Worker("b", 0)};
  const auto p = Prompt(1024, 7);
  const auto h = RouterBlockHashes(p, "");
  // "b" reports the prompt's first 512 tokens; "a" reports nothing.
  for (const char* id : {"a", "b"}) {
    tandem::v1::RegisterRequest r;
    r.set_worker_id(id);
    r.set_reports_prefix_cache(true);
    r.set_prefix_epoch(1);
    if (std::string(id) == "b") {
      r.set_prefix_seq(1);
      *r.add_prefix_snapshot() = Stored(h, 8);
    }
    router.OnRegister(r);
  }
  for (int i = 0; i < 5; ++i) {  // "b" takes every repeat, its recent work growing
    auto c = router.Select(ws, {}, {}, p.size(), h);
    ASSERT_TRUE(c.has_value());
    EXPECT_EQ(ws[c->index].registration.worker_id(), "b");
    // 512 reported; then the overlay of the prompt sent (its last full chunk).
    EXPECT_EQ(c->matched_tokens, i == 0 ? 512 : 960);
  }
  // Without the hit, recent work sends the next uncached prompt to "a".
  const auto q = Prompt(1024, 8);
  auto c = router.Select(ws, {}, {}, q.size(), RouterBlockHashes(q, ""));
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(ws[c->index].registration.worker_id(), "a");
}

TEST(RoutingPolicyTest, Parse) {
  EXPECT_EQ(*ParseRoutingPolicy("cache_aware"), RoutingPolicy::kCacheAware);
  EXPECT_EQ(*ParseRoutingPolicy("least_load"), RoutingPolicy::kLeastLoad);
  EXPECT_EQ(*ParseRoutingPolicy("round_robin"), RoutingPolicy::kRoundRobin);
  EXPECT_FALSE(ParseRoutingPolicy("affinity").ok());
}

}  // namespace
}  // namespace tandem::router
