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

// At TP > 1 the worker keeps only the config: the ranks load their own shards,
// so the unsharded model is never resident (on a GPU it would all land on
// device 0). The engine over it still serves, with TP 1's greedy tokens.
TEST(LoadWorkerModelTest, TpLoadsNoUnshardedWeights) {
  auto one = LoadWorkerModel("engine/model/tiny_checkpoint", "cpu", "", 1);
  auto two = LoadWorkerModel("engine/model/tiny_checkpoint", "cpu", "", 2);
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_NE((*one)->weights->embed, nullptr);
  EXPECT_FALSE((*one)->weights->layers.empty());
  EXPECT_EQ((*two)->weights->embed, nullptr);
  EXPECT_TRUE((*two)->weights->layers.empty());
  EXPECT_EQ((*two)->weights->config.text.vocab_size,
            (*one)->weights->config.text.vocab_size);
  std::vector<std::vector<int32_t>> tokens;
  for (auto* m : {one->get(), two->get()}) {
    engine::EngineOptions o;
    ASSERT_TRUE(ApplyTpFlags(m == one->get() ? 1 : 2, "", &o).ok());
    o.num_slots = 1;
    o.max_context_tokens = 64;
    auto e = MakeEngine(m, o);
    ASSERT_TRUE(e.ok()) << e.status();
    engine::SamplingParams p;
    p.max_tokens = 6;
    p.ignore_eos = true;
    ASSERT_TRUE((*e)->AddRequest(1, {11, 22, 33, 44, 55, 66, 77}, p).ok());
    std::vector<int32_t> got;
    for (int i = 0; i < 100 && (*e)->HasWork(); ++i) {
      auto out = (*e)->Step();
      ASSERT_TRUE(out.ok()) << out.status();
      for (const auto& r : *out)
        got.insert(got.end(), r.new_tokens.begin(), r.new_tokens.end());
    }
    tokens.push_back(got);
  }
  ASSERT_EQ(tokens[0].size(), 6u);
  EXPECT_EQ(tokens[1], tokens[0]);
}

}  // namespace
}  // namespace tandem::worker
