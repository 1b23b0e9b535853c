// The workers' tensor-parallel flags (--tp and the --tp_fail_rank_at_step drill)
// and speculative-decoding flags (--speculative, --num_speculative_tokens,
// --draft_model).
#include "worker/worker_model.h"

#include <tuple>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::worker {
namespace {

TEST(ApplyTpFlagsTest, SizeAndDrill) {
  engine::EngineOptions o;
  ASSERT_TRUE(ApplyTpFlags(1, "", &o).ok());
  EXPECT_EQ(o.tp.tp_size, 1);
  EXPECT_LT(o.tp.fail_rank, 0);  // drill off
  ASSERT_TRUE(ApplyTpFlags(4, "3:17", &o).ok());
  EXPECT_EQ(o.tp.tp_size, 4);
  EXPECT_EQ(o.tp.fail_rank, 3);
  EXPECT_EQ(o.tp.fail_rank_at_step, 17);
}

TEST(ApplyTpFlagsTest, RefusesBadValues) {
  engine::EngineOptions o;
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

TEST(ApplySpeculativeFlagsTest, MethodsAndBadValues) {
  auto model = LoadWorkerModel("engine/model/tiny_checkpoint", "cpu", "");
  ASSERT_TRUE(model.ok()) << model.status();
  engine::EngineOptions o;
  ASSERT_TRUE(ApplySpeculativeFlags("none", 3, "", model->get(), &o).ok());
  EXPECT_EQ(o.speculative.method, engine::SpeculativeMethod::kNone);
  ASSERT_TRUE(ApplySpeculativeFlags("ngram", 4, "", model->get(), &o).ok());
  EXPECT_EQ(o.speculative.method, engine::SpeculativeMethod::kNgram);
  EXPECT_EQ(o.speculative.num_speculative_tokens, 4);
  // The tiny checkpoint drafting for itself: loaded, same vocabulary.
  ASSERT_TRUE(ApplySpeculativeFlags("draft", 2, "engine/model/tiny_checkpoint",
                                    model->get(), &o)
                  .ok());
  EXPECT_EQ(o.speculative.method, engine::SpeculativeMethod::kDraft);
  ASSERT_NE((*model)->draft, nullptr);
  EXPECT_EQ(o.speculative.draft_weights, (*model)->draft->weights.get());

  engine::EngineOptions bad;
  for (auto [method, k, dir] : std::vector<std::tuple<const char*, int, const char*>>{
           {"ngram", 0, ""},
           {"ngram", 17, ""},
           {"eagle", 3, ""},
           {"draft", 3, ""},
           {"none", 3, "engine/model/tiny_checkpoint"},
           {"ngram", 3, "engine/model/tiny_checkpoint"},
           {"draft", 3, "/nonexistent/checkpoint"}}) {
    absl::Status s = ApplySpeculativeFlags(method, k, dir, model->get(), &bad);
    EXPECT_FALSE(s.ok()) << method << " " << k << " " << dir;
  }
}

}  // namespace
}  // namespace tandem::worker
