// Reservations: each state placed and stepped (lease and wait expiry, cancel
// and release in every state, peer loss, quarantine expiry, double reserve, a
// notification for an unknown id), on a FakeClock.
#include "decode/reservations.h"

#include <memory>
#include <string>

#include "gtest/gtest.h"

namespace tandem::decode {
namespace {

class TestWaiter : public Waiter {
 public:
  explicit TestWaiter(int tag) : tag(tag) {}
  int tag;
};

int TagOf(const std::unique_ptr<Waiter>& w) {
  return w == nullptr ? -1 : static_cast<const TestWaiter*>(w.get())->tag;
}

constexpr absl::Duration kLease = absl::Seconds(10);
constexpr absl::Duration kQuarantine = absl::Seconds(5);

class ReservationsTest : public ::testing::Test {
 protected:
  ReservationsTest() : table_(&clock_, ReservationsOptions{kQuarantine}) {}

  // A RESERVED entry: engine id `eid`, 2 blocks, slot `eid`.
  void Reserve(const std::string& id, int64_t eid) {
    ReservationInfo info;
    info.request_id = id;
    info.engine_id = eid;
    info.blocks = {static_cast<int32_t>(2 * eid), static_cast<int32_t>(2 * eid + 1)};
    info.slot = static_cast<int32_t>(eid);
    info.prompt_tokens = 20;
    auto added = table_.Add(info, kLease);
    ASSERT_TRUE(added.ok()) << added.status();
    EXPECT_EQ(added->lease_expiry, clock_.Now() + kLease);
  }
  // RESERVED → LANDING: a Decode waiting `wait` at most.
  void StartDecode(const std::string& id, int tag,
                   absl::Duration wait = absl::Seconds(3)) {
    int64_t eid = 0;
    auto r =
        table_.Decode(id, std::make_unique<TestWaiter>(tag), clock_.Now() + wait, &eid);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_FALSE(r->has_value());
  }
  void Land(const std::string& id) {
    auto r = table_.Landed(id);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_FALSE(r->has_value());
  }
  // LANDED → ADMITTED through a Decode.
  Handoff Admit(const std::string& id, int tag) {
    int64_t eid = 0;
    auto r = table_.Decode(id, std::make_unique<TestWaiter>(tag),
                           clock_.Now() + absl::Seconds(3), &eid);
    EXPECT_TRUE(r.ok() && r->has_value());
    return std::move(**r);
  }
  ReservationState StateOf(const std::string& id) {
    std::optional<ReservationState> s = table_.State(id);
    EXPECT_TRUE(s.has_value()) << id;
    return s.value_or(ReservationState::kQuarantined);
  }

  FakeClock clock_;
  Reservations table_;
};

TEST_F(ReservationsTest, DecodeThenNotificationHandsOffWithTheWaiter) {
  Reserve("a", 1);
  EXPECT_EQ(StateOf("a"), ReservationState::kReserved);
  StartDecode("a", 7);
  EXPECT_EQ(StateOf("a"), ReservationState::kLanding);
  clock_.Advance(absl::Milliseconds(250));
  auto h = table_.Landed("a");
  ASSERT_TRUE(h.ok() && h->has_value());
  EXPECT_EQ(TagOf((*h)->waiter), 7);
  EXPECT_EQ((*h)->info.engine_id, 1);
  EXPECT_EQ((*h)->info.blocks, (std::vector<int32_t>{2, 3}));
  EXPECT_EQ((*h)->info.slot, 1);
  EXPECT_EQ((*h)->decode_started, clock_.Now() - absl::Milliseconds(250));
  EXPECT_EQ(StateOf("a"), ReservationState::kAdmitted);
  EXPECT_EQ(table_.held_blocks(), 0);  // the engine owns it now
  EXPECT_TRUE(table_.Finish("a", 1));
  EXPECT_FALSE(table_.State("a").has_value());
  EXPECT_FALSE(table_.Finish("a", 1));
}

TEST_F(ReservationsTest, NotificationThenDecodeHandsOffAtOnce) {
  Reserve("a", 1);
  Land("a");
  EXPECT_EQ(StateOf("a"), ReservationState::kLanded);
  Handoff h = Admit("a", 3);
  EXPECT_EQ(TagOf(h.waiter), 3);
  EXPECT_EQ(StateOf("a"), ReservationState::kAdmitted);
}

TEST_F(ReservationsTest, DoubleReserveIsRefusedAndTheIdIsReusableAfterRelease) {
  Reserve("a", 1);
  ReservationInfo again;
  again.request_id = "a";
  again.engine_id = 2;
  EXPECT_EQ(table_.Add(again, kLease).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(table_.size(), 1);
  Land("a");
  EXPECT_TRUE(table_.Release("a").free_now);
  EXPECT_TRUE(table_.Add(again, kLease).ok());
}

TEST_F(ReservationsTest, NotificationForAnUnknownIdOrTwiceIsAnError) {
  EXPECT_EQ(table_.Landed("nobody").status().code(), absl::StatusCode::kNotFound);
  Reserve("a", 1);
  Land("a");
  EXPECT_EQ(table_.Landed("a").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(StateOf("a"), ReservationState::kLanded);
}

// Released before its state landed, reserved again under the same id: the
// abandoned prefill's late notification (the old reservation's token) must not
// mark the new reservation landed; the new one's does.
TEST_F(ReservationsTest, ALateNotificationForAnEarlierReservationIsIgnored) {
  Reserve("a", 1);
  EXPECT_FALSE(table_.Release("a").free_now);  // quarantined: not landed
  Reserve("a", 2);
  EXPECT_EQ(table_.Landed("a", /*engine_id=*/1).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(StateOf("a"), ReservationState::kReserved);
  auto r = table_.Landed("a", /*engine_id=*/2);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(StateOf("a"), ReservationState::kLanded);
}

TEST_F(ReservationsTest, DecodeWithoutReservationOrTwice) {
  int64_t eid = 0;
  EXPECT_EQ(table_.Decode("nobody", std::make_unique<TestWaiter>(1), clock_.Now(), &eid)
                .status()
                .code(),
            absl::StatusCode::kNotFound);
  Reserve("a", 4);
  StartDecode("a", 1);
  auto second = table_.Decode("a", std::make_unique<TestWaiter>(2),
                              clock_.Now() + absl::Seconds(1), &eid);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(eid, 4);
  // The first Decode still waits and gets the hand-off.
  auto h = table_.Landed("a");
  ASSERT_TRUE(h.ok() && h->has_value());
  EXPECT_EQ(TagOf((*h)->waiter), 1);
}

TEST_F(ReservationsTest, LeaseExpiryOfReservedIsQuarantinedThenFreed) {
  Reserve("a", 1);
  clock_.Advance(kLease);
  EXPECT_TRUE(table_.Tick(clock_.Now()).expired.empty());  // at the expiry: still held
  clock_.Advance(absl::Milliseconds(1));
  TickResult t = table_.Tick(clock_.Now());
  ASSERT_EQ(t.expired.size(), 1u);
  EXPECT_EQ(t.expired[0].was, ReservationState::kReserved);
  EXPECT_FALSE(t.expired[0].free_now);  // the peer may still write
  EXPECT_FALSE(table_.State("a").has_value());
  EXPECT_EQ(table_.num_quarantined(), 1);
  EXPECT_EQ(table_.held_blocks(), 2);
  EXPECT_EQ(table_.held_slots(), 1);
  // Quarantine expiry.
  clock_.Advance(kQuarantine - absl::Milliseconds(1));
  EXPECT_TRUE(table_.Tick(clock_.Now()).unquarantined.empty());
  clock_.Advance(absl::Milliseconds(1));
  t = table_.Tick(clock_.Now());
  ASSERT_EQ(t.unquarantined.size(), 1u);
  EXPECT_EQ(t.unquarantined[0].engine_id, 1);
  EXPECT_EQ(t.unquarantined[0].blocks, (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(table_.num_quarantined(), 0);
  EXPECT_EQ(table_.held_blocks(), 0);
}

TEST_F(ReservationsTest, LeaseExpiryOfLandedFreesAtOnce) {
  Reserve("a", 1);
  Land("a");
  clock_.Advance(kLease + absl::Milliseconds(1));
  TickResult t = table_.Tick(clock_.Now());
  ASSERT_EQ(t.expired.size(), 1u);
  EXPECT_EQ(t.expired[0].was, ReservationState::kLanded);
  EXPECT_TRUE(t.expired[0].free_now);
  EXPECT_EQ(table_.num_quarantined(), 0);
  EXPECT_EQ(table_.held_blocks(), 0);
}

// Peer loss: the prefill worker died, the notification never comes; the Decode's
// wait deadline ends it (not the lease), and the memory is quarantined.
TEST_F(ReservationsTest, WaitDeadlineExpiryOfLandingHandsBackTheWaiter) {
  Reserve("a", 1);
  StartDecode("a", 9, absl::Seconds(3));
  clock_.Advance(absl::Seconds(3));
  EXPECT_TRUE(table_.Tick(clock_.Now()).expired.empty());
  clock_.Advance(absl::Milliseconds(1));
  TickResult t = table_.Tick(clock_.Now());
  ASSERT_EQ(t.expired.size(), 1u);
  EXPECT_EQ(t.expired[0].was, ReservationState::kLanding);
  EXPECT_EQ(TagOf(t.expired[0].waiter), 9);
  EXPECT_FALSE(t.expired[0].free_now);
  EXPECT_EQ(table_.num_quarantined(), 1);
  // A notification after the expiry finds nothing.
  EXPECT_EQ(table_.Landed("a").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ReservationsTest, LandingOutlivesItsLeaseUntilItsWaitDeadline) {
  Reserve("a", 1);
  clock_.Advance(kLease - absl::Seconds(1));
  StartDecode("a", 1, absl::Seconds(5));
  clock_.Advance(absl::Seconds(2));  // past the lease, within the wait
  EXPECT_TRUE(table_.Tick(clock_.Now()).expired.empty());
  EXPECT_EQ(StateOf("a"), ReservationState::kLanding);
}

TEST_F(ReservationsTest, AdmittedNeverExpires) {
  Reserve("a", 1);
  Land("a");
  Handoff h = Admit("a", 1);
  clock_.Advance(kLease * 10);
  EXPECT_TRUE(table_.Tick(clock_.Now()).expired.empty());
  EXPECT_EQ(StateOf("a"), ReservationState::kAdmitted);
}

TEST_F(ReservationsTest, ReleaseInEachState) {
  // RESERVED: quarantined.
  Reserve("r", 1);
  Removal r = table_.Release("r");
  EXPECT_TRUE(r.found);
  EXPECT_EQ(r.was, ReservationState::kReserved);
  EXPECT_FALSE(r.free_now);
  EXPECT_EQ(r.waiter, nullptr);
  // LANDING: quarantined, its Decode handed back to be ended.
  Reserve("w", 2);
  StartDecode("w", 5);
  r = table_.Release("w");
  EXPECT_EQ(r.was, ReservationState::kLanding);
  EXPECT_EQ(TagOf(r.waiter), 5);
  EXPECT_FALSE(r.free_now);
  EXPECT_EQ(table_.num_quarantined(), 2);
  // LANDED: freed now.
  Reserve("l", 3);
  Land("l");
  r = table_.Release("l");
  EXPECT_EQ(r.was, ReservationState::kLanded);
  EXPECT_TRUE(r.free_now);
  EXPECT_EQ(r.info.engine_id, 3);
  // ADMITTED: the engine's; nothing changes.
  Reserve("d", 4);
  Land("d");
  Handoff h = Admit("d", 1);
  r = table_.Release("d");
  EXPECT_TRUE(r.found);
  EXPECT_EQ(r.was, ReservationState::kAdmitted);
  EXPECT_FALSE(r.free_now);
  EXPECT_EQ(StateOf("d"), ReservationState::kAdmitted);
  // Unknown.
  EXPECT_FALSE(table_.Release("nobody").found);
  EXPECT_EQ(table_.num_quarantined(), 2);
  EXPECT_EQ(table_.size(), 1);
}

TEST_F(ReservationsTest, CancelInEachState) {
  // RESERVED and LANDED have no Decode to cancel.
  Reserve("r", 1);
  EXPECT_FALSE(table_.Cancel("r", 1).found);
  Reserve("l", 2);
  Land("l");
  EXPECT_FALSE(table_.Cancel("l", 2).found);
  // LANDING: quarantined, the waiter handed back.
  Reserve("w", 3);
  StartDecode("w", 6);
  EXPECT_FALSE(table_.Cancel("w", 99).found);  // another reservation's Decode
  Removal c = table_.Cancel("w", 3);
  EXPECT_TRUE(c.found);
  EXPECT_EQ(c.was, ReservationState::kLanding);
  EXPECT_EQ(TagOf(c.waiter), 6);
  EXPECT_FALSE(c.free_now);
  EXPECT_FALSE(table_.State("w").has_value());
  EXPECT_EQ(table_.num_quarantined(), 1);
  // ADMITTED: stays; the caller cancels it in the engine and finishes it.
  Reserve("d", 4);
  Land("d");
  Handoff h = Admit("d", 1);
  c = table_.Cancel("d", 4);
  EXPECT_TRUE(c.found);
  EXPECT_EQ(c.was, ReservationState::kAdmitted);
  EXPECT_FALSE(c.free_now);
  EXPECT_EQ(StateOf("d"), ReservationState::kAdmitted);
  EXPECT_TRUE(table_.Finish("d", 4));
  // Gone: nothing.
  EXPECT_FALSE(table_.Cancel("d", 4).found);
}

TEST_F(ReservationsTest, RefusedAdmissionFreesAtOnce) {
  Reserve("a", 1);
  StartDecode("a", 1);
  auto h = table_.Landed("a");
  ASSERT_TRUE(h.ok() && h->has_value());
  EXPECT_FALSE(table_.Refuse("a", 2).found);  // wrong engine id
  Removal r = table_.Refuse("a", 1);
  EXPECT_TRUE(r.found);
  EXPECT_TRUE(r.free_now);
  EXPECT_EQ(r.info.blocks, (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(table_.size(), 0);
  EXPECT_EQ(table_.num_quarantined(), 0);
}

TEST_F(ReservationsTest, ZeroQuarantineFreesUnlandedAtOnce) {
  Reservations table(&clock_, ReservationsOptions{absl::ZeroDuration()});
  ReservationInfo info;
  info.request_id = "a";
  info.engine_id = 1;
  info.blocks = {0};
  ASSERT_TRUE(table.Add(info, kLease).ok());
  Removal r = table.Release("a");
  EXPECT_TRUE(r.free_now);
  EXPECT_EQ(table.num_quarantined(), 0);
}

TEST_F(ReservationsTest, HeldCountsEveryStateButAdmitted) {
  Reserve("r", 1);  // 2 blocks each
  Reserve("w", 2);
  StartDecode("w", 1);
  Reserve("l", 3);
  Land("l");
  Reserve("d", 4);
  Land("d");
  Handoff h = Admit("d", 1);
  Reserve("q", 5);
  table_.Release("q");
  EXPECT_EQ(table_.held_blocks(), 8);
  EXPECT_EQ(table_.held_slots(), 4);
  EXPECT_EQ(table_.size(), 4);
  EXPECT_EQ(table_.num_admitted(), 1);
}

TEST(ReservationStateName, Names) {
  EXPECT_STREQ(ReservationStateName(ReservationState::kLanding), "LANDING");
  EXPECT_STREQ(ReservationStateName(ReservationState::kQuarantined), "QUARANTINED");
}

}  // namespace
}  // namespace tandem::decode
