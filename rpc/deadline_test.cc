#include "rpc/deadline.h"

#include <gtest/gtest.h>

namespace tandem::rpc {
namespace {

TEST(DeadlineTest, NoDeadlineMapsBothWays) {
  EXPECT_EQ(FromGrpcDeadline(std::chrono::system_clock::time_point::max()),
            absl::InfiniteFuture());
  EXPECT_EQ(ToGrpcDeadline(absl::InfiniteFuture()),
            std::chrono::system_clock::time_point::max());
  EXPECT_EQ(ToUnixMillisOrZero(absl::InfiniteFuture()), 0);
}

TEST(DeadlineTest, FiniteDeadlinesRoundTripToTheMicrosecond) {
  const absl::Time t = absl::FromUnixMicros(1'764'000'000'123'456);
  EXPECT_EQ(FromGrpcDeadline(ToGrpcDeadline(t)), t);
  EXPECT_EQ(ToUnixMillisOrZero(t), 1'764'000'000'123);
}

TEST(DeadlineTest, UnixMillisTakesTheEarlier) {
  const absl::Time t = absl::FromUnixMillis(5000);
  EXPECT_EQ(WithUnixMillis(t, 0), t);                              // none
  EXPECT_EQ(WithUnixMillis(t, 4000), absl::FromUnixMillis(4000));  // earlier
  EXPECT_EQ(WithUnixMillis(t, 6000), t);                           // later
  EXPECT_EQ(WithUnixMillis(absl::InfiniteFuture(), 6000), absl::FromUnixMillis(6000));
}

TEST(DeadlineTest, ServerContextWithoutDeadlineIsInfinite) {
  grpc::ServerContext ctx;
  EXPECT_EQ(ContextDeadline(ctx), absl::InfiniteFuture());
}

}  // namespace
}  // namespace tandem::rpc
