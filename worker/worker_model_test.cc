// The workers' tensor-parallel flags: --tp and the --tp_fail_rank_at_step drill.
#include "worker/worker_model.h"

#include "gtest/gtest.h"

namespace tandem::worker {
namespace {

TEST(ApplyTpFlagsTest, SizeAndDrill) {
  runtime::EngineOptions o;
  ASSERT_TRUE(ApplyTpFlags(1, "", &o).ok());
  EXPECT_EQ(o.tp.tp_size, 1);
  EXPECT_LT(o.tp.fail_rank, 0);  // drill off
  ASSERT_TRUE(ApplyTpFlags(4, "3:17", &o).ok());
  EXPECT_EQ(o.tp.tp_size, 4);
  EXPECT_EQ(o.tp.fail_rank, 3);
  EXPECT_EQ(o.tp.fail_rank_at_step, 17);
}

TEST(ApplyTpFlagsTest, RefusesBadValues) {
  runtime::EngineOptions o;
  EXPECT_EQ(ApplyTpFlags(0, "", &o).code(), absl::StatusCode::kInvalidArgument);
  for (const char* bad : {"1", "1:", ":3", "a:b", "1:2:3", "1:-1"}) {
    EXPECT_EQ(ApplyTpFlags(2, bad, &o).code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
  // Rank 0 runs on the engine thread (not a rank thread); rank tp is out of range.
  absl::Status s = ApplyTpFlags(2, "0:1", &o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("[1, 2)"), absl::string_view::npos) << s;
  EXPECT_EQ(ApplyTpFlags(2, "2:1", &o).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ApplyTpFlags(1, "1:0", &o).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::worker
