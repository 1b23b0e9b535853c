// The router's placement bookkeeping: a request placed on a worker counts against
// it only until the worker's next load report (which includes it), so running
// requests are never counted twice.
#include "router/handoff.h"

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

TEST(HandoffTest, PlacementsCountUntilTheNextLoadReport) {
  FakeClock clock;
  WorkerRegistry registry(&clock, absl::Seconds(10));
  metrics::Registry metric_registry;
  HandoffMetrics metrics(&metric_registry);
  Handoff handoff(&registry, &metrics, HandoffOptions{});
  ASSERT_TRUE(registry.Register(Decode("d0")).ok());
  ASSERT_TRUE(registry.Register(Decode("d1")).ok());

  auto live = registry.Live(tandem::v1::WORKER_ROLE_DECODE);
  handoff.Place(live[0], "a", 100);
  handoff.Place(live[0], "b", 50);
  InFlightMap f = handoff.InFlightSnapshot(live);
  EXPECT_EQ(f["d0"].requests, 2);
  EXPECT_EQ(f["d0"].tokens, 150);
  EXPECT_FALSE(f.contains("d1"));

  handoff.Unplace("d0", "b");
  handoff.Unplace("d0", "b");  // idempotent
  f = handoff.InFlightSnapshot(registry.Live(tandem::v1::WORKER_ROLE_DECODE));
  EXPECT_EQ(f["d0"].requests, 1);
  EXPECT_EQ(f["d0"].tokens, 100);

  // d0 reports its load: "a" is in that report now, so it no longer counts.
  ASSERT_TRUE(registry.Heartbeat("d0", {}));
  live = registry.Live(tandem::v1::WORKER_ROLE_DECODE);
  EXPECT_TRUE(handoff.InFlightSnapshot(live).empty());
  handoff.Place(live[0], "c", 7);  // placed after that report: counts again
  f = handoff.InFlightSnapshot(live);
  EXPECT_EQ(f["d0"].requests, 1);
  EXPECT_EQ(f["d0"].tokens, 7);
  handoff.Unplace("d0", "a");  // already dropped: nothing happens
  EXPECT_EQ(handoff.InFlightSnapshot(live)["d0"].requests, 1);
}

}  // namespace
}  // namespace tandem::router
