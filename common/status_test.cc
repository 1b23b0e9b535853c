#include "common/status.h"

#include "gtest/gtest.h"

namespace tandem {
namespace {

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return InvalidArgument("odd: ", x);
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  TANDEM_ASSIGN_OR_RETURN(int h, Half(x));
  TANDEM_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

absl::Status CheckPositive(int x) {
  TANDEM_RETURN_IF_ERROR(x > 0 ? absl::OkStatus() : OutOfRange("not positive: ", x));
  return absl::OkStatus();
}

TEST(StatusTest, AssignOrReturnPropagatesFirstError) {
  EXPECT_EQ(*Quarter(12), 3);
  absl::StatusOr<int> r = Quarter(6);  // 6 -> 3 -> odd
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "odd: 3");
}

TEST(StatusTest, ReturnIfError) {
  EXPECT_TRUE(CheckPositive(1).ok());
  EXPECT_EQ(CheckPositive(-2).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(CheckPositive(-2).message(), "not positive: -2");
}

TEST(StatusTest, AnnotateKeepsCodeAndPrefixes) {
  absl::Status s = Annotate(NotFound("tensor x"), "loading shard 3");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "loading shard 3: tensor x");
  EXPECT_TRUE(Annotate(absl::OkStatus(), "ctx").ok());
}

}  // namespace
}  // namespace tandem
