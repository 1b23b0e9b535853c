#include "worker/prefix_event_log.h"

#include <vector>

#include "gtest/gtest.h"

namespace tandem::worker {
namespace {

using engine::PrefixEvent;
using tandem::v1::PrefixCacheEvent;
using Kind = PrefixEvent::Kind;

PrefixEvent Ev(Kind k, int64_t tokens, uint64_t hash) { return {k, tokens, hash}; }

tandem::v1::HeartbeatResponse Ack(uint64_t seq, bool resync = false) {
  tandem::v1::HeartbeatResponse r;
  r.set_known(true);
  r.set_prefix_acked_seq(seq);
  r.set_resync_prefix_index(resync);
  return r;
}

TEST(PrefixEventLogTest, NumbersResendsUntilAckedAndSnapshots) {
  PrefixEventLog log(42);
  tandem::v1::RegisterRequest reg;
  log.FillRegister(&reg);
  EXPECT_TRUE(reg.reports_prefix_cache());
  EXPECT_EQ(reg.prefix_epoch(), 42u);
  EXPECT_EQ(reg.prefix_seq(), 0u);
  EXPECT_EQ(reg.prefix_snapshot_size(), 0);

  log.Add({Ev(Kind::kStored, 64, 11), Ev(Kind::kStored, 128, 12)});
  tandem::v1::HeartbeatRequest hb;
  log.FillHeartbeat(&hb);
  EXPECT_EQ(hb.prefix_epoch(), 42u);
  EXPECT_EQ(hb.prefix_first_seq(), 1u);
  ASSERT_EQ(hb.prefix_events_size(), 2);
  EXPECT_EQ(hb.prefix_events(1).kind(), PrefixCacheEvent::KIND_STORED);
  EXPECT_EQ(hb.prefix_events(1).tokens(), 128);
  EXPECT_EQ(hb.prefix_events(1).route_hash(), 12u);
  // The answer was lost: the same events go again, with the new one.
  log.Add({Ev(Kind::kRemoved, 64, 11)});
  hb.Clear();
  log.FillHeartbeat(&hb);
  EXPECT_EQ(hb.prefix_first_seq(), 1u);
  EXPECT_EQ(hb.prefix_events_size(), 3);
  log.OnHeartbeatResponse(Ack(2));
  hb.Clear();
  log.FillHeartbeat(&hb);
  EXPECT_EQ(hb.prefix_first_seq(), 3u);
  ASSERT_EQ(hb.prefix_events_size(), 1);
  EXPECT_EQ(hb.prefix_events(0).kind(), PrefixCacheEvent::KIND_REMOVED);
  log.OnHeartbeatResponse(Ack(3));
  EXPECT_FALSE(log.has_pending());
  hb.Clear();
  log.FillHeartbeat(&hb);
  EXPECT_EQ(hb.prefix_first_seq(), 4u);  // the next one to come
  EXPECT_EQ(hb.prefix_events_size(), 0);

  // A resync asked: register again with what the engine holds (12 only).
  log.OnHeartbeatResponse(Ack(3, /*resync=*/true));
  EXPECT_TRUE(log.needs_register());
  log.Add({Ev(Kind::kStored, 192, 13)});
  reg.Clear();
  log.FillRegister(&reg);
  EXPECT_FALSE(log.needs_register());
  EXPECT_EQ(reg.prefix_seq(), 4u);
  ASSERT_EQ(reg.prefix_snapshot_size(), 2);
  int64_t tokens = 0;
  for (const auto& e : reg.prefix_snapshot()) {
    EXPECT_EQ(e.kind(), PrefixCacheEvent::KIND_STORED);
    tokens += e.tokens();
  }
  EXPECT_EQ(tokens, 128 + 192);
  EXPECT_FALSE(log.has_pending());  // the snapshot covers them

  // Cleared (a reset): the mirror is empty; the event itself is reported.
  log.Add({Ev(Kind::kCleared, 0, 0)});
  EXPECT_EQ(log.held(), 0);
  hb.Clear();
  log.FillHeartbeat(&hb);
  EXPECT_EQ(hb.prefix_first_seq(), 5u);
  ASSERT_EQ(hb.prefix_events_size(), 1);
  EXPECT_EQ(hb.prefix_events(0).kind(), PrefixCacheEvent::KIND_CLEARED);
}

TEST(PrefixEventLogTest, ReportsAreBoundedAndABacklogBecomesASnapshot) {
  PrefixEventLog log(7, /*max_pending=*/10, /*max_per_report=*/4);
  for (int i = 0; i < 6; ++i) log.Add({Ev(Kind::kStored, 64 * (i + 1), 100 + i)});
  tandem::v1::HeartbeatRequest hb;
  log.FillHeartbeat(&hb);
  EXPECT_EQ(hb.prefix_events_size(), 4);  // the rest next time
  EXPECT_FALSE(log.needs_register());
  for (int i = 0; i < 5; ++i) log.Add({Ev(Kind::kStored, 64 * (i + 7), 200 + i)});
  EXPECT_TRUE(log.needs_register());  // 11 unacknowledged > 10
  EXPECT_EQ(log.pending(), 0);
  EXPECT_EQ(log.held(), 11);
  tandem::v1::RegisterRequest reg;
  log.FillRegister(&reg);
  EXPECT_EQ(reg.prefix_seq(), 11u);
  EXPECT_EQ(reg.prefix_snapshot_size(), 11);
}

// Blocks-only announcements travel with their flag and have their own mirror:
// the same route hash may name a usable prefix and a blocks-only one.
TEST(PrefixEventLogTest, BlocksOnlyEventsKeepTheirFlagAndMirror) {
  PrefixEventLog log(7);
  PrefixEvent blocks{Kind::kStored, 128, 21, true};
  log.Add({Ev(Kind::kStored, 128, 21), blocks});
  EXPECT_EQ(log.held(), 1);
  EXPECT_EQ(log.held_blocks(), 1);
  tandem::v1::HeartbeatRequest hb;
  log.FillHeartbeat(&hb);
  ASSERT_EQ(hb.prefix_events_size(), 2);
  EXPECT_FALSE(hb.prefix_events(0).blocks_only());
  EXPECT_TRUE(hb.prefix_events(1).blocks_only());
  // The usable one goes; the blocks-only one stays (and vice versa).
  log.Add({Ev(Kind::kRemoved, 128, 21)});
  EXPECT_EQ(log.held(), 0);
  EXPECT_EQ(log.held_blocks(), 1);
  tandem::v1::RegisterRequest reg;
  log.FillRegister(&reg);
  ASSERT_EQ(reg.prefix_snapshot_size(), 1);
  EXPECT_TRUE(reg.prefix_snapshot(0).blocks_only());
  EXPECT_EQ(reg.prefix_snapshot(0).tokens(), 128);
  log.Add({Ev(Kind::kCleared, 0, 0)});
  EXPECT_EQ(log.held_blocks(), 0);
}

TEST(PrefixEventLogTest, RandomEpochsDiffer) {
  EXPECT_NE(RandomPrefixEpoch(), 0u);
  EXPECT_NE(RandomPrefixEpoch(), RandomPrefixEpoch());
}

}  // namespace
}  // namespace tandem::worker
