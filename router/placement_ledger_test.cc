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

}  // namespace
}  // namespace tandem::router
