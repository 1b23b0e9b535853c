// The router's placement bookkeeping: a request placed on a worker counts against
// it only until the worker's next load report (which includes it), so running
// requests are never counted twice.
#include "router/placement_ledger.h"

#include "common/clock.h"
#include "gtest/gtest.h"

namespace tandem::router {
namespace {

tandem::v1::RegisterRequest Decode(const std::string& id) {
  tandem::v1::RegisterRequest r;
  r.set_worker_id(id);
  r.set_role(tandem::v1::WORKER_ROLE_DECODE);
  r.set_grpc_address("127.0.0.1:1");
  r.set_model_fingerprint("fp");
  return r;
}

class PlacementLedgerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(registry_.Register(Decode("d0")).ok());
    ASSERT_TRUE(registry_.Register(Decode("d1")).ok());
  }
  std::vector<WorkerRecord> Live() {
    return registry_.Live(tandem::v1::WORKER_ROLE_DECODE);
  }

  FakeClock clock_;
  WorkerRegistry registry_{&clock_, absl::Seconds(10)};
  PlacementLedger ledger_;
};

TEST_F(PlacementLedgerTest, PlacementsCountUntilTheNextLoadReport) {
  auto live = Live();
  ledger_.Place(live[0], "a", 100);
  ledger_.Place(live[0], "b", 50);
  InFlightMap f = ledger_.Snapshot(live);
  EXPECT_EQ(f["d0"].requests, 2);
  EXPECT_EQ(f["d0"].tokens, 150);
  EXPECT_FALSE(f.contains("d1"));

  ledger_.Unplace("d0", "b");
  ledger_.Unplace("d0", "b");  // idempotent
  f = ledger_.Snapshot(Live());
  EXPECT_EQ(f["d0"].requests, 1);
  EXPECT_EQ(f["d0"].tokens, 100);

  // d0 reports its load: "a" is in that report now, so it no longer counts.
  ASSERT_TRUE(registry_.Heartbeat("d0", {}));
  live = Live();
  EXPECT_TRUE(ledger_.Snapshot(live).empty());
  ledger_.Place(live[0], "c", 7);  // placed after that report: counts again
  f = ledger_.Snapshot(live);
  EXPECT_EQ(f["d0"].requests, 1);
  EXPECT_EQ(f["d0"].tokens, 7);
  ledger_.Unplace("d0", "a");  // already dropped: nothing happens
  EXPECT_EQ(ledger_.Snapshot(live)["d0"].requests, 1);
}

TEST_F(PlacementLedgerTest, OneRequestOnTwoWorkersIsTwoPlacements) {
  auto live = Live();
  ledger_.Place(live[0], "a", 10);  // e.g. the decode reservation
  ledger_.Place(live[1], "a", 10);  // and the prefill of the same request
  InFlightMap f = ledger_.Snapshot(live);
  EXPECT_EQ(f["d0"].requests, 1);
  EXPECT_EQ(f["d1"].requests, 1);
  ledger_.Unplace("d1", "a");  // only that worker's
  f = ledger_.Snapshot(live);
  EXPECT_EQ(f["d0"].tokens, 10);
  EXPECT_FALSE(f.contains("d1"));
}

TEST_F(PlacementLedgerTest, UnknownWorkersAndRequestsAreIgnored) {
  auto live = Live();
  ledger_.Unplace("nobody", "x");
  ledger_.Place(live[0], "a", 5);
  ledger_.Unplace("d0", "x");
  EXPECT_EQ(ledger_.Snapshot(live)["d0"].tokens, 5);
  // Only workers in `live` are reported.
  EXPECT_TRUE(ledger_.Snapshot({live[1]}).empty());
}

TEST_F(PlacementLedgerTest, DuplicateRequestIdsCountTwiceAndUnplaceOneAtATime) {
  auto live = Live();
  ledger_.Place(live[0], "a", 5);
  ledger_.Place(live[0], "a", 7);
  EXPECT_EQ(ledger_.Snapshot(live)["d0"].requests, 2);
  ledger_.Unplace("d0", "a");
  EXPECT_EQ(ledger_.Snapshot(live)["d0"].requests, 1);
  ledger_.Unplace("d0", "a");
  EXPECT_TRUE(ledger_.Snapshot(live).empty());
}

// A request that ends after its worker's report counted it leaves room the
// reports do not show yet: credited until the next report, which has it.
TEST_F(PlacementLedgerTest, AFinishedRequestIsCreditedUntilTheNextReport) {
  const uint64_t at_start = Live()[0].reports;
  ledger_.Place(Live()[0], "a", 100);
  ASSERT_TRUE(registry_.Heartbeat("d0", {}));  // the report counts "a"
  ledger_.Finished(Live()[0], "a", 100, at_start);
  InFlightMap f = ledger_.Snapshot(Live());
  EXPECT_EQ(f["d0"].requests, -1);
  EXPECT_EQ(f["d0"].tokens, -100);
  ledger_.Unplace("d0", "a");  // an Unplace never takes a credit back
  EXPECT_EQ(ledger_.Snapshot(Live())["d0"].requests, -1);
  // A new placement and the credit add up.
  ledger_.Place(Live()[0], "b", 30);
  f = ledger_.Snapshot(Live());
  EXPECT_EQ(f["d0"].requests, 0);
  EXPECT_EQ(f["d0"].tokens, -70);
  // The next report no longer has "a" (and now has "b"): both drop.
  ASSERT_TRUE(registry_.Heartbeat("d0", {}));
  EXPECT_TRUE(ledger_.Snapshot(Live()).empty());
}

// A request that started and ended between two reports was never counted by
// one: forgetting its placement is the whole correction, no credit.
TEST_F(PlacementLedgerTest, ARequestEndingBeforeAnyReportCountedItIsNotCredited) {
  ledger_.Place(Live()[0], "a", 100);
  ledger_.Finished(Live()[0], "a", 100, Live()[0].reports);
  EXPECT_TRUE(ledger_.Snapshot(Live()).empty());
  // A colocated request is never placed; a report since its start counted it.
  const uint64_t at_start = Live()[1].reports;
  ledger_.Finished(Live()[1], "c", 8, at_start);  // no report yet: nothing
  EXPECT_TRUE(ledger_.Snapshot(Live()).empty());
  ASSERT_TRUE(registry_.Heartbeat("d1", {}));
  ledger_.Finished(Live()[1], "c", 8, at_start);
  EXPECT_EQ(ledger_.Snapshot(Live())["d1"].requests, -1);
  EXPECT_EQ(ledger_.Snapshot(Live())["d1"].tokens, -8);
}

}  // namespace
}  // namespace tandem::router
