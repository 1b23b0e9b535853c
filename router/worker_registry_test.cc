#include "router/worker_registry.h"

#include "gtest/gtest.h"

namespace tandem::router {
namespace {

tandem::v1::RegisterRequest Worker(const std::string& id, tandem::v1::WorkerRole role,
                                   const std::string& fingerprint = "fp1") {
  tandem::v1::RegisterRequest r;
  r.set_worker_id(id);
  r.set_role(role);
  r.set_grpc_address("127.0.0.1:1234");
  r.set_model_id("kimi-k3");
  r.set_model_fingerprint(fingerprint);
  r.set_tp_size(1);
  return r;
}

TEST(WorkerRegistryTest, RegisterHeartbeatExpire) {
  FakeClock clock;
  WorkerRegistry reg(&clock, absl::Seconds(10));
  ASSERT_TRUE(reg.Register(Worker("decode-0", tandem::v1::WORKER_ROLE_DECODE)).ok());
  ASSERT_TRUE(reg.Register(Worker("prefill-0", tandem::v1::WORKER_ROLE_PREFILL)).ok());
  EXPECT_EQ(reg.Live(tandem::v1::WORKER_ROLE_DECODE).size(), 1u);
  EXPECT_EQ(reg.Live(tandem::v1::WORKER_ROLE_PREFILL).size(), 1u);

  clock.Advance(absl::Seconds(8));
  tandem::v1::WorkerLoad load;
  load.set_free_kv_blocks(42);
  EXPECT_TRUE(reg.Heartbeat("decode-0", load));
  clock.Advance(absl::Seconds(8));  // prefill-0 silent for 16 s > 10 s
  EXPECT_TRUE(reg.Live(tandem::v1::WORKER_ROLE_PREFILL).empty());
  auto decode = reg.Live(tandem::v1::WORKER_ROLE_DECODE);
  ASSERT_EQ(decode.size(), 1u);
  EXPECT_EQ(decode[0].load.free_kv_blocks(), 42);
  EXPECT_FALSE(reg.Heartbeat("prefill-0", load));  // expired: must register again
  EXPECT_EQ(reg.size(), 1u);
}

TEST(WorkerRegistryTest, RejectsBadRegistrations) {
  FakeClock clock;
  WorkerRegistry reg(&clock, absl::Seconds(10));
  EXPECT_EQ(reg.Register(Worker("bad id", tandem::v1::WORKER_ROLE_DECODE)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.Register(Worker("w", tandem::v1::WORKER_ROLE_UNSPECIFIED)).code(),
            absl::StatusCode::kInvalidArgument);
  auto no_addr = Worker("w", tandem::v1::WORKER_ROLE_DECODE);
  no_addr.clear_grpc_address();
  EXPECT_EQ(reg.Register(no_addr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.size(), 0u);
}

TEST(WorkerRegistryTest, RefusesMixedModelsButAllowsReRegistration) {
  FakeClock clock;
  WorkerRegistry reg(&clock, absl::Seconds(10));
  ASSERT_TRUE(reg.Register(Worker("d0", tandem::v1::WORKER_ROLE_DECODE, "fpA")).ok());
  absl::Status s = reg.Register(Worker("p0", tandem::v1::WORKER_ROLE_PREFILL, "fpB"));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("fpB"), absl::string_view::npos);
  // The only worker may re-register with new weights.
  EXPECT_TRUE(reg.Register(Worker("d0", tandem::v1::WORKER_ROLE_DECODE, "fpB")).ok());
  EXPECT_TRUE(reg.Remove("d0"));
  EXPECT_FALSE(reg.Remove("d0"));
}

TEST(WorkerRegistryTest, RefusesTpSizeMismatchAcrossRoles) {
  FakeClock clock;
  WorkerRegistry reg(&clock, absl::Seconds(10));
  auto d2 = Worker("d0", tandem::v1::WORKER_ROLE_DECODE);
  d2.set_tp_size(2);
  ASSERT_TRUE(reg.Register(d2).ok());
  // Same role, other size: allowed (never paired with each other).
  auto d1 = Worker("d1", tandem::v1::WORKER_ROLE_DECODE);
  EXPECT_TRUE(reg.Register(d1).ok());
  EXPECT_TRUE(reg.Remove("d1"));
  absl::Status s = reg.Register(Worker("p0", tandem::v1::WORKER_ROLE_PREFILL));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("TP 1"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("TP 2"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("d0"), absl::string_view::npos) << s;
  EXPECT_TRUE(reg.Live(tandem::v1::WORKER_ROLE_PREFILL).empty());
  auto p2 = Worker("p0", tandem::v1::WORKER_ROLE_PREFILL);
  p2.set_tp_size(2);
  EXPECT_TRUE(reg.Register(p2).ok());
  // tp_size 0 (an older worker) counts as 1: refused against TP 2.
  auto p_old = Worker("p1", tandem::v1::WORKER_ROLE_PREFILL);
  p_old.set_tp_size(0);
  EXPECT_EQ(reg.Register(p_old).code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace tandem::router
