// The scheduler with prefix caching: where hits start, where prefill chunks end
// (snapshot positions), what is cached, eviction before preemption, no leaks.
#include <cstdint>
#include <iterator>
#include <random>
#include <set>
#include <vector>

#include "engine/cache/prefix_cache.h"
#include "engine/scheduler/scheduler.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

SchedulerConfig Config(int32_t blocks, int64_t budget, int32_t snapshots = 8) {
  SchedulerConfig c;
  c.num_blocks = blocks;
  c.block_size = 16;
  c.num_slots = 8;
  c.max_tokens_per_step = budget;
  c.max_context_tokens = 4096;
  c.prefill_chunk_alignment = 64;
  c.enable_prefix_caching = true;
  c.num_prefix_snapshots = snapshots;
  return c;
}

std::vector<int32_t> Tokens(int n, int seed, int offset = 0) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = ((i + offset) * 7919 + seed * 104729) % 50000;
  return t;
}

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

SequenceRequest Req(SequenceId id, const std::vector<int32_t>& prompt,
                    int64_t max_new = 4) {
  SequenceRequest r;
  r.id = id;
  r.num_prompt_tokens = static_cast<int64_t>(prompt.size());
  r.max_new_tokens = max_new;
  r.block_hashes = ChainedBlockHashes(prompt, 16, "");
  return r;
}

struct Seen {
  SequenceId id;
  int64_t start, end;
  SnapshotId restore;
  bool snapshot;
};

// One step as the engine runs it: plan, store the snapshots the plan asks for,
// complete (every sampler gets one token).
std::vector<Seen> Step(Scheduler& s, std::set<SequenceId> finish = {}) {
  std::vector<Seen> seen;
  auto plan = s.Schedule();
  EXPECT_TRUE(plan.ok()) << plan.status();
  std::vector<SequenceOutcome> out;
  for (const ScheduledSequence& e : plan->sequences) {
    seen.push_back({e.id, e.start, e.end, e.restore_snapshot, e.snapshot_at_end});
    if (e.snapshot_at_end) {
      auto snap = s.StoreSnapshot(e.id, e.end);
      EXPECT_TRUE(snap.ok() && *snap >= 0) << e.id << " at " << e.end;
    }
    if (e.samples) out.push_back({e.id, 1, finish.contains(e.id)});
  }
  EXPECT_TRUE(s.CompleteStep(*plan, out).ok());
  EXPECT_TRUE(s.CheckInvariants().ok()) << s.CheckInvariants();
  return seen;
}

void Drain(Scheduler& s) {
  for (int i = 0; i < 100 && (s.num_running() > 0 || s.num_waiting() > 0); ++i) {
    std::set<SequenceId> all;
    auto plan = s.Schedule();
    ASSERT_TRUE(plan.ok());
    std::vector<SequenceOutcome> out;
    for (const auto& e : plan->sequences) {
      if (e.snapshot_at_end) ASSERT_TRUE(s.StoreSnapshot(e.id, e.end).ok());
      if (e.samples) out.push_back({e.id, 1, true});
    }
    ASSERT_TRUE(s.CompleteStep(*plan, out).ok());
    ASSERT_TRUE(s.CheckInvariants().ok()) << s.CheckInvariants();
  }
}

TEST(PrefixSchedulerTest, SharedPrefixHitsAtSnapshotsOnly) {
  auto s = *Scheduler::Create(Config(256, 512));
  const std::vector<int32_t> a = Tokens(200, 1);
  // 1: a miss; its prefill stops at 192 (last full chunk) for the snapshot.
  ASSERT_TRUE(s->Submit(Req(1, a)).ok());
  auto st = Step(*s);
  ASSERT_EQ(st.size(), 1u);
  EXPECT_EQ(st[0].start, 0);
  EXPECT_EQ(st[0].end, 192);
  EXPECT_TRUE(st[0].snapshot);
  EXPECT_EQ(st[0].restore, -1);
  st = Step(*s, {1});
  EXPECT_EQ(st[0].start, 192);
  EXPECT_EQ(st[0].end, 200);
  EXPECT_EQ(s->prefix_cache()->num_cached_blocks(), 12);  // 200 / 16 full blocks
  // 2: the same prompt: starts at 192 from the snapshot, computes 8 tokens.
  ASSERT_TRUE(s->Submit(Req(2, a)).ok());
  st = Step(*s, {2});
  ASSERT_EQ(st.size(), 1u);
  EXPECT_EQ(st[0].start, 192);
  EXPECT_EQ(st[0].end, 200);
  EXPECT_GE(st[0].restore, 0);
  EXPECT_FALSE(st[0].snapshot);
  // 3: shares 160 tokens (10 blocks) of a: cached blocks but no snapshot at or
  // below 160 -> a miss (never an MLA-only hit); it snapshots at the branch
  // point 128 and at its own last chunk 256.
  const std::vector<int32_t> c =
      Concat(std::vector<int32_t>(a.begin(), a.begin() + 160), Tokens(140, 3));
  ASSERT_TRUE(s->Submit(Req(3, c)).ok());
  st = Step(*s);
  EXPECT_EQ(st[0].start, 0);
  EXPECT_EQ(st[0].end, 128);
  EXPECT_TRUE(st[0].snapshot);
  st = Step(*s);
  EXPECT_EQ(st[0].start, 128);
  EXPECT_EQ(st[0].end, 256);
  EXPECT_TRUE(st[0].snapshot);
  st = Step(*s, {3});
  EXPECT_EQ(st[0].end, 300);
  // 4: another suffix after the same 160: hit at the branch point.
  const std::vector<int32_t> d =
      Concat(std::vector<int32_t>(a.begin(), a.begin() + 160), Tokens(50, 4));
  ASSERT_TRUE(s->Submit(Req(4, d)).ok());
  st = Step(*s);
  EXPECT_EQ(st[0].start, 128);
  EXPECT_GE(st[0].restore, 0);
  // A tenant with another salt: a miss.
  SequenceRequest other = Req(5, a);
  other.block_hashes = ChainedBlockHashes(a, 16, "tenant-b");
  ASSERT_TRUE(s->Submit(other).ok());
  Drain(*s);
  const PrefixCacheStats& stats = s->prefix_cache()->stats();
  EXPECT_EQ(stats.lookups, 5);
  EXPECT_EQ(stats.hits, 2);
  EXPECT_EQ(stats.hit_tokens, 192 + 128);
  // Everything back: free counts the cached blocks (evictable), no slot held.
  EXPECT_EQ(s->num_free_blocks(), 256);
  EXPECT_EQ(s->num_free_slots(), 8);
}

// A decode worker's reservation shares the prompt's cached leading blocks
// (MLA rows only: no snapshot needed, the KDA state arrives whole), never has
// them evicted while held, caches what landed at admission (up to the peer's
// aligned positions), and never shares without hashes, across tenants, or on
// the copy path (AdmitPrefilled).
TEST(PrefixSchedulerTest, ReservationSharesTheCachedPrefixAndCachesWhatLanded) {
  auto s = *Scheduler::Create(Config(256, 512));
  const std::vector<int32_t> a = Tokens(200, 1);
  ASSERT_TRUE(s->Submit(Req(1, a)).ok());
  Drain(*s);
  ASSERT_EQ(s->prefix_cache()->num_cached_blocks(), 12);
  // 2: 160 tokens of a, then its own: the 10 shared blocks are held, 7 new.
  const std::vector<int32_t> b =
      Concat(std::vector<int32_t>(a.begin(), a.begin() + 160), Tokens(100, 2));
  SequenceRequest rb = Req(2, b);
  rb.route_hashes = {101, 102, 103, 104};  // 4 full 64-token blocks of 260
  ASSERT_TRUE(s->Reserve(rb, 1).ok());
  EXPECT_EQ(s->HeldPrefixTokens(2), 160);
  auto b2 = s->Blocks(2);
  ASSERT_TRUE(b2.ok());
  EXPECT_EQ(b2->size(), 17u);  // 260 positions
  // 3: a itself: its 12 full blocks (192 positions), the first 10 the same.
  ASSERT_TRUE(s->Reserve(Req(3, a), 1).ok());
  EXPECT_EQ(s->HeldPrefixTokens(3), 192);
  auto b3 = s->Blocks(3);
  ASSERT_TRUE(b3.ok());
  for (int i = 0; i < 10; ++i) EXPECT_EQ((*b2)[i], (*b3)[i]) << i;
  EXPECT_NE((*b2)[10], (*b3)[10]);
  // Held blocks survive a reclaim of everything.
  s->mutable_prefix_cache()->Reclaim(256);
  EXPECT_EQ(s->prefix_cache()->num_cached_blocks(), 12);
  ASSERT_TRUE(s->CheckInvariants().ok()) << s->CheckInvariants();
  ASSERT_TRUE(s->Abort(3).ok());
  // Admitted: b's landed full blocks (16 of 260 positions) are cached after
  // the shared 10, so the next reservation of b holds all 16; the deepest
  // 64-multiple of them, 256, and the branch point where b left a's chain,
  // 160 rounded down to 128, are announced to the router (blocks_only).
  PrefixEventQueue q(64);
  s->mutable_prefix_cache()->set_event_queue(&q);
  ASSERT_TRUE(s->AdmitReserved(2, 4).ok());
  std::vector<PrefixEvent> ev = q.Take();
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0], (PrefixEvent{PrefixEvent::Kind::kStored, 128, 102, true}));
  EXPECT_EQ(ev[1], (PrefixEvent{PrefixEvent::Kind::kStored, 256, 104, true}));
  ASSERT_TRUE(s->Reserve(Req(4, b), 1).ok());
  EXPECT_EQ(s->HeldPrefixTokens(4), 256);
  ASSERT_TRUE(s->Abort(4).ok());
  // The peer's aligned positions cap what is cached: c landed aligned to 300.
  const std::vector<int32_t> c = Concat(b, Tokens(100, 5));
  ASSERT_TRUE(s->Reserve(Req(5, c), 1).ok());
  EXPECT_EQ(s->HeldPrefixTokens(5), 256);
  ASSERT_TRUE(s->AdmitReserved(5, 4, /*cacheable_tokens=*/300).ok());
  ASSERT_TRUE(s->Reserve(Req(6, c), 1).ok());
  EXPECT_EQ(s->HeldPrefixTokens(6), 288);  // 18 full blocks below 300
  // No hashes, another tenant, the copy path: nothing shared.
  SequenceRequest plain = Req(7, c);
  plain.block_hashes.clear();
  ASSERT_TRUE(s->Reserve(plain, 1).ok());
  EXPECT_EQ(s->HeldPrefixTokens(7), 0);
  SequenceRequest other = Req(8, c);
  other.block_hashes = ChainedBlockHashes(c, 16, "tenant-b");
  ASSERT_TRUE(s->Reserve(other, 1).ok());
  EXPECT_EQ(s->HeldPrefixTokens(8), 0);
  ASSERT_TRUE(s->AdmitPrefilled(Req(9, c), 1).ok());
  EXPECT_EQ(s->HeldPrefixTokens(9), 0);
  const PrefixCacheStats& st = s->prefix_cache()->stats();
  EXPECT_EQ(st.reserve_hit_tokens, 160 + 192 + 256 + 256 + 288);
  ASSERT_TRUE(s->CheckInvariants().ok()) << s->CheckInvariants();
  s->mutable_prefix_cache()->set_event_queue(nullptr);  // q goes first
  for (SequenceId id : {2, 5, 6, 7, 8, 9}) ASSERT_TRUE(s->Abort(id).ok()) << id;
  ASSERT_TRUE(s->CheckInvariants().ok()) << s->CheckInvariants();
  EXPECT_EQ(s->num_free_blocks(), 256);
  EXPECT_EQ(s->num_free_slots(), 8);
}

// Without the caller's word that the peer writes after held rows
// (share_cached_blocks false: a router or prefill worker older than the
// handshake) a reservation shares nothing, even of a prompt the cache holds
// whole, so the peer may write every row; the landed prompt is still cached
// and announced, and a later sharing reservation uses it.
TEST(PrefixSchedulerTest, AReservationNotAllowedToShareAllocatesEveryBlock) {
  auto s = *Scheduler::Create(Config(256, 512));
  const std::vector<int32_t> a = Tokens(200, 1);
  ASSERT_TRUE(s->Submit(Req(1, a)).ok());
  Drain(*s);
  ASSERT_EQ(s->prefix_cache()->num_cached_blocks(), 12);
  const std::vector<int32_t> b = Concat(a, Tokens(100, 2));  // 300: 18 full
  SequenceRequest rb = Req(2, b);
  rb.route_hashes = {201, 202, 203, 204};
  rb.share_cached_blocks = false;
  ASSERT_TRUE(s->Reserve(rb, 1).ok());
  EXPECT_EQ(s->HeldPrefixTokens(2), 0);
  auto blocks = s->Blocks(2);
  ASSERT_TRUE(blocks.ok());
  ASSERT_EQ(blocks->size(), 19u);  // 300 positions, all its own
  for (BlockId id : *blocks) EXPECT_FALSE(s->prefix_cache()->Holds(id)) << id;
  EXPECT_EQ(s->prefix_cache()->stats().reserve_queried_tokens, 0);
  // Landed: its blocks after a's 12 join the cache (a's own copies stay),
  // announced at its deepest 64-multiple (it shared nothing: no branch).
  PrefixEventQueue q(64);
  s->mutable_prefix_cache()->set_event_queue(&q);
  ASSERT_TRUE(s->AdmitReserved(2, 4).ok());
  std::vector<PrefixEvent> ev = q.Take();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0], (PrefixEvent{PrefixEvent::Kind::kStored, 256, 204, true}));
  EXPECT_EQ(s->prefix_cache()->num_cached_blocks(), 18);
  ASSERT_TRUE(s->Reserve(Req(3, b), 1).ok());  // allowed: shares all 18
  EXPECT_EQ(s->HeldPrefixTokens(3), 288);
  s->mutable_prefix_cache()->set_event_queue(nullptr);
  for (SequenceId id : {2, 3}) ASSERT_TRUE(s->Abort(id).ok()) << id;
  ASSERT_TRUE(s->CheckInvariants().ok()) << s->CheckInvariants();
  EXPECT_EQ(s->num_free_blocks(), 256);
}

TEST(AnnouncedPositionsTest, Table) {
  struct Case {
    const char* name;
    int64_t cached, branch;
    int32_t block_size;
    int64_t grid;
    std::vector<int64_t> want;
  };
  const std::vector<Case> cases = {
      {"nothing cached", 0, 0, 16, 0, {}},
      {"below one chunk", 48, 0, 16, 0, {}},
      {"the deepest 64-multiple", 300, 0, 16, 0, {256}},
      {"a branch point too", 300, 160, 16, 0, {128, 256}},
      {"the branch at the deepest", 300, 280, 16, 0, {256}},
      {"a branch past what is cached", 300, 900, 16, 0, {256}},
      {"the grid", 1000, 0, 16, 256, {256, 512, 768, 960}},
      {"grid, branch and deepest", 1000, 600, 16, 512, {512, 576, 960}},
      {"block size 48: lcm 192", 1000, 400, 48, 0, {384, 960}},
      {"a grid off the chunk rounds up",
       1000,
       0,
       16,
       100,
       {128, 256, 384, 512, 640, 768, 896, 960}},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(AnnouncedPositions(c.cached, c.branch, c.block_size, c.grid), c.want)
        << c.name;
  }
}

// A decode worker's engine (announce_prompt_blocks) announces what it
// computes itself as well, not only landed prompts: the deepest 64-multiple,
// and the branch point where a prompt left another's chain, so a third prompt
// sharing only that part is reserved where its rows are.
TEST(PrefixSchedulerTest, ADecodeWorkersOwnPrefillsAreAnnouncedAtTheBranchToo) {
  SchedulerConfig config = Config(256, 512);
  config.announce_prompt_blocks = true;
  auto s = *Scheduler::Create(config);
  PrefixEventQueue q(64);
  s->mutable_prefix_cache()->set_event_queue(&q);
  auto blocks_only = [&] {
    std::vector<PrefixEvent> out;
    for (const PrefixEvent& e : q.Take()) {
      if (e.blocks_only) out.push_back(e);
    }
    return out;
  };
  const std::vector<int32_t> a = Tokens(200, 1);
  SequenceRequest ra = Req(1, a);
  ra.route_hashes = {11, 12, 13};
  ASSERT_TRUE(s->Submit(ra).ok());
  Drain(*s);
  std::vector<PrefixEvent> ev = blocks_only();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0], (PrefixEvent{PrefixEvent::Kind::kStored, 192, 13, true}));
  // b shares a's first 160 tokens (10 blocks), then its own 140: announced at
  // its deepest (256) and at the branch (128, a's block there: named by b's
  // route hash of it, which is a's too for the same tokens).
  const std::vector<int32_t> b =
      Concat(std::vector<int32_t>(a.begin(), a.begin() + 160), Tokens(140, 3));
  SequenceRequest rb = Req(2, b);
  rb.route_hashes = {11, 12, 23, 24};
  ASSERT_TRUE(s->Submit(rb).ok());
  Drain(*s);
  ev = blocks_only();
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0], (PrefixEvent{PrefixEvent::Kind::kStored, 128, 12, true}));
  EXPECT_EQ(ev[1], (PrefixEvent{PrefixEvent::Kind::kStored, 256, 24, true}));
  // Without the option (a prefill worker) nothing of its own is announced.
  auto plain = *Scheduler::Create(Config(256, 512));
  PrefixEventQueue q2(64);
  plain->mutable_prefix_cache()->set_event_queue(&q2);
  ASSERT_TRUE(plain->Submit(ra).ok());
  Drain(*plain);
  for (const PrefixEvent& e : q2.Take()) EXPECT_FALSE(e.blocks_only);
  plain->mutable_prefix_cache()->set_event_queue(nullptr);
  s->mutable_prefix_cache()->set_event_queue(nullptr);
}

TEST(PrefixSchedulerTest, CachedBlocksAreEvictedBeforeAnyoneWaits) {
  // 40 blocks: three 192-token prompts (12 blocks each) fill the cache.
  auto s = *Scheduler::Create(Config(40, 512));
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(s->Submit(Req(i, Tokens(192, 10 + i))).ok());
    Drain(*s);
  }
  EXPECT_EQ(s->prefix_cache()->num_cached_blocks(), 36);
  EXPECT_EQ(s->num_free_blocks(), 40);
  // A 400-token prompt (25 blocks) needs 21 of the cached ones: evicted, LRU.
  ASSERT_TRUE(s->Submit(Req(9, Tokens(400, 99), 1)).ok());
  auto st = Step(*s);
  ASSERT_EQ(st.size(), 1u);
  EXPECT_EQ(st[0].start, 0);
  EXPECT_GT(s->prefix_cache()->stats().blocks_evicted, 0);
  Drain(*s);
  EXPECT_EQ(s->num_free_blocks(), 40);
  // The most recent prompt (2) kept more of its blocks than the oldest (0).
  ASSERT_TRUE(s->Submit(Req(20, Tokens(192, 10))).ok());
  st = Step(*s);
  EXPECT_EQ(st[0].start, 0);  // 0's prefix is gone
  Drain(*s);
}

TEST(PrefixSchedulerTest, ARunningSequencesBlocksAreNotEvictedAndPreemptionRehits) {
  // 24 blocks. 1 runs a 192-token prompt (snapshot at 128) and decodes; 2
  // shares its first 128 tokens: it adopts 8 cached blocks that 1 still holds.
  auto s = *Scheduler::Create(Config(24, 512));
  const std::vector<int32_t> a = Tokens(129, 7);
  ASSERT_TRUE(s->Submit(Req(1, a, 100)).ok());
  Step(*s);  // [0, 128) snapshot
  Step(*s);  // [128, 129) samples
  const std::vector<int32_t> b =
      Concat(std::vector<int32_t>(a.begin(), a.begin() + 128), Tokens(100, 8));
  ASSERT_TRUE(s->Submit(Req(2, b, 200)).ok());
  auto st = Step(*s);
  bool saw2 = false;
  for (const Seen& e : st) {
    if (e.id == 2) {
      saw2 = true;
      EXPECT_EQ(e.start, 128);
      EXPECT_GE(e.restore, 0);
    }
  }
  EXPECT_TRUE(saw2);
  // Decode both until the pool runs out: 2 (newest) is preempted; evicting never
  // frees a block either holds (CheckInvariants after every step), and when 2 is
  // readmitted it hits the prefix again.
  int64_t hits_before = s->prefix_cache()->stats().hits;
  for (int i = 0; i < 200 && s->num_preemptions() == 0; ++i) Step(*s);
  EXPECT_GT(s->num_preemptions(), 0);
  ASSERT_TRUE(s->Abort(1).ok());  // room again
  Step(*s);
  EXPECT_GT(s->prefix_cache()->stats().hits, hits_before);
  ASSERT_TRUE(s->Abort(2).ok());
  EXPECT_TRUE(s->CheckInvariants().ok()) << s->CheckInvariants();
  EXPECT_EQ(s->num_free_blocks(), 24);
  EXPECT_EQ(s->num_free_slots(), 8);
  s->ResetPrefixCache();
  EXPECT_EQ(s->prefix_cache()->num_cached_blocks(), 0);
  EXPECT_EQ(s->num_free_blocks(), 24);
}

// A reserved sequence whose positions [0, floor) this engine cannot recompute
// (an image prompt on a decode worker: recompute_floor, Engine::Reserve):
//   - while a sequence without a floor runs, that one is preempted instead,
//     even though it is older;
//   - preempted (every running one has a floor), it is readmitted only from a
//     prefix hit at least that deep: 1 leaves a snapshot at 128 of its first
//     128 tokens and ends; 2 (another prompt) and 3 (those 128 tokens, then
//     its own) are reserved with floors and admitted, and 3, the newest, is
//     preempted when the pool runs out. With floor 100 it comes back from the
//     hit at 128; with floor 150 no hit reaches it and it is dropped
//     (StepPlan::unrecomputable), freed.
TEST(PrefixSchedulerTest,
     AnUnrecomputablePrefixIsPreemptedLastAndReadmittedOnlyPastIt) {
  {
    auto s = *Scheduler::Create(Config(24, 512));
    ASSERT_TRUE(s->Submit(Req(1, Tokens(129, 7), 100)).ok());
    Step(*s);
    Step(*s);
    SequenceRequest r2 = Req(2, Tokens(180, 8), 200);
    r2.recompute_floor = 100;
    ASSERT_TRUE(s->Reserve(r2, 1).ok());
    ASSERT_TRUE(s->AdmitReserved(2, 200).ok());
    for (int i = 0; i < 200 && s->num_preemptions() == 0; ++i) Step(*s);
    ASSERT_EQ(s->num_preemptions(), 1);
    EXPECT_EQ(*s->State(1), SequenceState::kWaiting);  // the older, recomputable
    EXPECT_EQ(*s->State(2), SequenceState::kRunning);
    for (SequenceId id : {1, 2}) ASSERT_TRUE(s->Abort(id).ok());
    ASSERT_TRUE(s->CheckInvariants().ok()) << s->CheckInvariants();
    EXPECT_EQ(s->num_free_blocks(), 24);
  }
  for (int64_t floor : {100, 150}) {
    SCOPED_TRACE(::testing::Message() << "recompute_floor " << floor);
    auto s = *Scheduler::Create(Config(24, 512));
    const std::vector<int32_t> a = Tokens(129, 7);
    ASSERT_TRUE(s->Submit(Req(1, a, 1)).ok());
    Step(*s);       // [0, 128), snapshot at 128
    Step(*s, {1});  // [128, 129) samples, ends
    ASSERT_FALSE(s->Contains(1));
    SequenceRequest r2 = Req(2, Tokens(100, 9), 200);
    r2.recompute_floor = 1;
    ASSERT_TRUE(s->Reserve(r2, 1).ok());
    ASSERT_TRUE(s->AdmitReserved(2, 200).ok());
    const std::vector<int32_t> b =
        Concat(std::vector<int32_t>(a.begin(), a.begin() + 128), Tokens(100, 8));
    SequenceRequest r3 = Req(3, b, 200);
    r3.recompute_floor = floor;
    ASSERT_TRUE(s->Reserve(r3, 1).ok());
    ASSERT_TRUE(s->AdmitReserved(3, 200).ok());
    for (int i = 0; i < 200 && s->num_preemptions() == 0; ++i) Step(*s);
    ASSERT_EQ(s->num_preemptions(), 1);
    ASSERT_EQ(*s->State(3), SequenceState::kWaiting);  // the newest went
    ASSERT_TRUE(s->Abort(2).ok());                     // room again
    auto plan = s->Schedule();
    ASSERT_TRUE(plan.ok()) << plan.status();
    if (floor == 100) {
      EXPECT_TRUE(plan->unrecomputable.empty());
      ASSERT_EQ(plan->sequences.size(), 1u);
      EXPECT_EQ(plan->sequences[0].id, 3);
      EXPECT_EQ(plan->sequences[0].start, 128);  // from the snapshot
      EXPECT_GE(plan->sequences[0].restore_snapshot, 0);
    } else {
      EXPECT_EQ(plan->unrecomputable, std::vector<SequenceId>{3});
      EXPECT_TRUE(plan->sequences.empty());
      EXPECT_FALSE(s->Contains(3));
    }
    std::vector<SequenceOutcome> out;
    for (const ScheduledSequence& e : plan->sequences) {
      if (e.samples) out.push_back({e.id, 1, false});
    }
    ASSERT_TRUE(s->CompleteStep(*plan, out).ok());
    if (floor == 100) ASSERT_TRUE(s->Abort(3).ok());
    ASSERT_TRUE(s->CheckInvariants().ok()) << s->CheckInvariants();
    EXPECT_EQ(s->num_free_blocks(), 24);
    EXPECT_EQ(s->num_free_slots(), 8);
  }
}

TEST(PrefixSchedulerTest, OffMeansNoHashesKeptAndNoSnapshots) {
  SchedulerConfig c = Config(64, 512);
  c.enable_prefix_caching = false;
  auto s = *Scheduler::Create(c);
  ASSERT_TRUE(s->Submit(Req(1, Tokens(200, 1))).ok());
  auto st = Step(*s);
  EXPECT_EQ(st[0].end, 200);  // one chunk: no snapshot cut
  EXPECT_FALSE(st[0].snapshot);
  EXPECT_EQ(s->prefix_cache(), nullptr);
  EXPECT_FALSE(s->StoreSnapshot(1, 192).ok());
}

// Background continuations (generation snapshots) in a random mix of real
// requests, aborts and block pressure: a block some sequence holds is never
// freed (CheckInvariants counts every reference after every step), a
// continuation never samples, pauses while anything waits, and everything
// is free at the end; the counters balance.
TEST(PrefixSchedulerTest, FuzzBackgroundContinuationsNeverTakeWhatIsInUse) {
  std::mt19937_64 rng(23);
  SchedulerConfig c = Config(/*blocks=*/72, /*budget=*/192, /*snapshots=*/6);
  c.num_slots = 4;
  c.max_running = 4;
  auto s = *Scheduler::Create(c);
  std::vector<std::vector<int32_t>> convs;
  for (int i = 0; i < 5; ++i) convs.push_back(Tokens(100 + 40 * i, 70 + i % 3));
  SequenceId next_real = 1, next_bg = -1;
  std::set<SequenceId> live;
  int64_t submitted = 0;
  for (int step = 0; step < 1500; ++step) {
    const int op = static_cast<int>(rng() % 6);
    if (op == 0) {  // a real request: a conversation so far
      const auto& t = convs[rng() % convs.size()];
      if (s->Submit(Req(next_real, t, 1 + rng() % 20)).ok()) live.insert(next_real);
      ++next_real;
    } else if (op == 1) {  // a finished turn's continuation
      const size_t k = rng() % convs.size();
      std::vector<int32_t> t = Concat(convs[k], Tokens(30 + rng() % 100, 900 + k));
      const int64_t q = static_cast<int64_t>(t.size()) / 64 * 64;
      t.resize(q);
      SequenceRequest r = Req(next_bg--, t, 1);
      ASSERT_TRUE(s->SubmitBackground(r, (convs[k].size() - 1) / 64 * 64).ok());
      ++submitted;
      if (rng() % 3 == 0) convs[k] = t;  // the conversation grew
    } else if (op == 2 && !live.empty()) {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      if (s->Contains(*it)) ASSERT_TRUE(s->Abort(*it).ok());
      live.erase(it);
    }
    auto plan = s->Schedule();
    ASSERT_TRUE(plan.ok()) << plan.status();
    std::vector<SequenceOutcome> out;
    for (const ScheduledSequence& e : plan->sequences) {
      if (e.id < 0) {
        ASSERT_FALSE(e.samples) << "a continuation sampled";
        ASSERT_EQ(e.num_draft_tokens, 0);
        ASSERT_TRUE(s->IsBackground(e.id));
        ASSERT_EQ(s->num_waiting(), 0) << "a continuation ran while a request waits";
      }
      if (e.snapshot_at_end) ASSERT_TRUE(s->StoreSnapshot(e.id, e.end).ok());
      if (e.samples) out.push_back({e.id, 1, rng() % 8 == 0});
    }
    ASSERT_TRUE(s->CompleteStep(*plan, out).ok());
    ASSERT_TRUE(s->CheckInvariants().ok()) << s->CheckInvariants();
    for (auto it = live.begin(); it != live.end();) {
      it = s->Contains(*it) ? std::next(it) : live.erase(it);
    }
  }
  for (SequenceId id : live) ASSERT_TRUE(s->Abort(id).ok());
  for (int i = 0; i < 200 && s->num_background() > 0; ++i) {
    auto plan = s->Schedule();
    ASSERT_TRUE(plan.ok());
    for (const auto& e : plan->sequences) {
      if (e.snapshot_at_end) ASSERT_TRUE(s->StoreSnapshot(e.id, e.end).ok());
    }
    ASSERT_TRUE(s->CompleteStep(*plan, {}).ok());
  }
  EXPECT_EQ(s->num_background(), 0);
  const BackgroundStats& b = s->background_stats();
  EXPECT_EQ(b.submitted, submitted);
  EXPECT_EQ(b.completed + b.skipped + b.cancelled, b.submitted);
  EXPECT_GT(b.completed, 0);
  EXPECT_GT(b.cancelled + b.skipped, 0);
  EXPECT_EQ(s->num_free_blocks(), 72);
  EXPECT_EQ(s->num_free_slots(), 4);
  ASSERT_TRUE(s->CheckInvariants().ok()) << s->CheckInvariants();
}

}  // namespace
}  // namespace tandem::engine
