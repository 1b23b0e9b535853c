// The draft-model proposer on the tiny checkpoint used as its own draft: greedy
// drafts equal the bare runner's greedy continuation, a rejected proposal rolls
// the draft state back exactly (the next proposal equals a fresh proposer's),
// random drafts come with their distribution rows, and Release frees the
// draft's slot and blocks.
#include "engine/runtime/draft_model_proposer.h"

#include <vector>

#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using engine::testing::BlockRange;
using engine::testing::GreedyGenerate;
using engine::testing::MakeBackend;
using engine::testing::MakeCache;
using engine::testing::MakePrompt;
using engine::testing::TestSequence;
using engine::testing::TinyWeights;

std::unique_ptr<DraftModelProposer> MakeProposer(kernels::Backend* backend,
                                                 int32_t slots = 4) {
  DraftModelOptions o;
  o.num_slots = slots;
  o.block_size = 16;
  o.max_context_tokens = 256;
  auto p = DraftModelProposer::Create(&TinyWeights(), backend,
                                      TinyWeights().config.text.vocab_size, o);
  EXPECT_TRUE(p.ok()) << p.status();
  return std::move(p).value();
}

speculative::ProposeRequest Req(int64_t id, const std::vector<int32_t>& tokens,
                                int32_t k, const engine::SamplingParams* params,
                                int64_t prompt_len) {
  speculative::ProposeRequest r;
  r.id = id;
  r.tokens = tokens;
  r.num_prompt_tokens = prompt_len;
  r.max_drafts = k;
  r.params = params;
  return r;
}

TEST(DraftModelProposerTest, GreedyDraftsEqualTheModelsGreedyContinuation) {
  auto backend = MakeBackend("cpu");
  const std::vector<int32_t> prompt = MakePrompt(23, 5);
  auto cache = MakeCache(TinyWeights(), 8, 16, 1);
  engine::ModelRunner runner(&TinyWeights(), cache.get(), backend.get());
  TestSequence s{BlockRange(0, 8), 0, 0};
  auto want = GreedyGenerate(&runner, &s, prompt, 1000, 9);
  ASSERT_TRUE(want.ok());

  auto p = MakeProposer(backend.get());
  engine::SamplingParams greedy;
  // History = prompt + first greedy token; 4 drafts, then (all accepted) the
  // next proposal continues from the target's bonus token.
  std::vector<int32_t> h = prompt;
  h.push_back((*want)[0]);
  std::vector<speculative::Proposal> out;
  ASSERT_TRUE(p->Propose({Req(1, h, 4, &greedy, prompt.size())}, &out).ok());
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].tokens, std::vector<int32_t>(want->begin() + 1, want->begin() + 5));
  EXPECT_TRUE(out[0].probs.empty());
  p->OnAccepted(1, 4, (*want)[5]);
  h.insert(h.end(), want->begin() + 1, want->begin() + 6);
  ASSERT_TRUE(p->Propose({Req(1, h, 3, &greedy, prompt.size())}, &out).ok());
  EXPECT_EQ(out[0].tokens, std::vector<int32_t>(want->begin() + 6, want->begin() + 9));
}

TEST(DraftModelProposerTest, RejectionRollsTheDraftStateBack) {
  auto backend = MakeBackend("cpu");
  const std::vector<int32_t> prompt = MakePrompt(30, 6);
  engine::SamplingParams greedy;
  auto p = MakeProposer(backend.get());
  std::vector<speculative::Proposal> out;
  ASSERT_TRUE(p->Propose({Req(3, prompt, 5, &greedy, 29)}, &out).ok());
  ASSERT_EQ(out[0].tokens.size(), 5u);
  // Accept 1 draft; the target chose another token than draft 2.
  const int32_t other = (out[0].tokens[1] + 1) % 1000;
  p->OnAccepted(3, 1, other);
  std::vector<int32_t> h = prompt;
  h.push_back(out[0].tokens[0]);
  h.push_back(other);
  std::vector<speculative::Proposal> got, fresh;
  ASSERT_TRUE(p->Propose({Req(3, h, 4, &greedy, 29)}, &got).ok());
  auto q = MakeProposer(backend.get());
  ASSERT_TRUE(q->Propose({Req(3, h, 4, &greedy, 29)}, &fresh).ok());
  EXPECT_EQ(got[0].tokens, fresh[0].tokens);
  // The draft KDA state equals that of a proposer that never saw the rejected
  // drafts (same forms: h's tail fed in one forward, then the same drafts).
  auto a = p->cache().SnapshotSlot(0);
  auto b = q->cache().SnapshotSlot(0);
  ASSERT_TRUE(a.ok() && b.ok());
  // Proposer p fed [d0, other] after its snapshot, q fed the whole history at
  // once: equal up to fp32 rounding between chunk splits.
  ASSERT_EQ(a->values.size(), b->values.size());
  double max_diff = 0, max_abs = 0;
  for (size_t i = 0; i < a->values.size(); ++i) {
    max_diff = std::max<double>(max_diff, std::abs(a->values[i] - b->values[i]));
    max_abs = std::max<double>(max_abs, std::abs(b->values[i]));
  }
  EXPECT_LE(max_diff, 1e-4 * max_abs + 1e-6);

  // Without OnAccepted, Propose notices the divergence itself.
  auto r = MakeProposer(backend.get());
  ASSERT_TRUE(r->Propose({Req(3, prompt, 5, &greedy, 29)}, &out).ok());
  ASSERT_TRUE(r->Propose({Req(3, h, 4, &greedy, 29)}, &got).ok());
  EXPECT_EQ(got[0].tokens, fresh[0].tokens);
}

TEST(DraftModelProposerTest, RandomDraftsCarryTheirDistribution) {
  auto backend = MakeBackend("cpu");
  auto p = MakeProposer(backend.get());
  const int64_t V = TinyWeights().config.text.vocab_size;
  engine::SamplingParams sp;
  sp.temperature = 0.8f;
  sp.top_k = 20;
  sp.seed = 77;
  const std::vector<int32_t> prompt = MakePrompt(12, 7);
  std::vector<speculative::Proposal> out;
  ASSERT_TRUE(p->Propose({Req(9, prompt, 3, &sp, 11)}, &out).ok());
  ASSERT_EQ(out[0].tokens.size(), 3u);
  ASSERT_EQ(out[0].probs.size(), static_cast<size_t>(3 * V));
  for (int j = 0; j < 3; ++j) {
    double sum = 0;
    int nonzero = 0;
    for (int64_t i = 0; i < V; ++i) {
      sum += out[0].probs[j * V + i];
      nonzero += out[0].probs[j * V + i] > 0;
    }
    EXPECT_NEAR(sum, 1.0, 1e-4);
    EXPECT_EQ(nonzero, 20);  // top_k
    EXPECT_GT(out[0].probs[j * V + out[0].tokens[j]], 0.0f);
  }
  // Same seed, fresh proposer: the same drafts.
  auto q = MakeProposer(backend.get());
  std::vector<speculative::Proposal> again;
  ASSERT_TRUE(q->Propose({Req(9, prompt, 3, &sp, 11)}, &again).ok());
  EXPECT_EQ(again[0].tokens, out[0].tokens);
}

TEST(DraftModelProposerTest, SlotsAreBoundedAndReleased) {
  auto backend = MakeBackend("cpu");
  auto p = MakeProposer(backend.get(), /*slots=*/2);
  const int32_t blocks = p->num_free_blocks();
  engine::SamplingParams greedy;
  std::vector<std::vector<int32_t>> prompts = {MakePrompt(5, 1), MakePrompt(40, 2),
                                               MakePrompt(7, 3)};
  std::vector<speculative::ProposeRequest> reqs;
  for (int i = 0; i < 3; ++i) reqs.push_back(Req(i, prompts[i], 2, &greedy, 1));
  std::vector<speculative::Proposal> out;
  ASSERT_TRUE(p->Propose(reqs, &out).ok());
  EXPECT_EQ(out[0].tokens.size(), 2u);
  EXPECT_EQ(out[1].tokens.size(), 2u);
  EXPECT_TRUE(out[2].tokens.empty());  // no draft slot left
  EXPECT_EQ(p->num_sequences(), 2);
  EXPECT_EQ(p->num_free_slots(), 0);
  EXPECT_LT(p->num_free_blocks(), blocks);
  p->Release(0);
  p->Release(1);
  p->Release(42);  // unknown: nothing
  EXPECT_EQ(p->num_sequences(), 0);
  EXPECT_EQ(p->num_free_slots(), 2);
  EXPECT_EQ(p->num_free_blocks(), blocks);
  // A history beyond the draft's context gets no drafts.
  std::vector<int32_t> huge = MakePrompt(300, 4);
  ASSERT_TRUE(p->Propose({Req(5, huge, 2, &greedy, 1)}, &out).ok());
  EXPECT_TRUE(out[0].tokens.empty());
}

TEST(DraftModelProposerTest, RejectsAnotherVocabulary) {
  auto backend = MakeBackend("cpu");
  DraftModelOptions o;
  EXPECT_FALSE(DraftModelProposer::Create(&TinyWeights(), backend.get(), 1000, o).ok());
  EXPECT_FALSE(DraftModelProposer::Create(nullptr, backend.get(), 1000, o).ok());
}

}  // namespace
}  // namespace tandem::engine
