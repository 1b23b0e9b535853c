#include "engine/sampling/structured_output.h"

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/grammar/grammar.h"
#include "engine/sampling/sampler.h"
#include "engine/tokenizer/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::engine {
namespace {

constexpr char kModelDir[] = "third_party/kimi_k3_tokenizer";
constexpr int64_t kV = tokenizer::kVocabSize;

class StructuredOutputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto t = tokenizer::Tokenizer::Load(kModelDir);
    ASSERT_TRUE(t.ok()) << t.status();
    tok_ = std::move(*t).release();
    auto v = grammar::TokenVocabulary::FromTokenizer(*tok_, Stops());
    ASSERT_TRUE(v.ok()) << v.status();
    compiler_ = new grammar::GrammarCompiler(*v);
  }
  static std::vector<int32_t> Stops() {
    return {tokenizer::kEosId, tokenizer::kEndOfMsgId};
  }
  static std::unique_ptr<OutputConstraint> Make(const StructuredOutputSpec& spec,
                                                int rollback = 8) {
    auto g = compiler_->Compile(GrammarSpecOf(spec));
    EXPECT_TRUE(g.ok()) << g.status();
    auto c = OutputConstraint::Create(*g, spec, Stops(), compiler_->vocab().size(), kV,
                                      rollback);
    EXPECT_TRUE(c.ok()) << c.status();
    return *std::move(c);
  }
  static std::vector<int32_t> Allowed(OutputConstraint* c) {
    std::vector<uint32_t> mask(c->mask_words());
    c->FillNextTokenBitmask(absl::MakeSpan(mask));
    std::vector<int32_t> ids;
    for (int32_t i = 0; i < kV; ++i) {
      if ((mask[i >> 5] >> (i & 31)) & 1u) ids.push_back(i);
    }
    return ids;
  }
  // Samples a whole output under the constraint from random logits (the
  // Sampler applies the mask), at most `max` tokens.
  static std::vector<int32_t> Generate(OutputConstraint* c, uint64_t seed, int max,
                                       float temperature) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.0f, 3.0f);
    Sampler sampler(kV);
    SamplingParams p;
    p.temperature = temperature;
    p.seed = seed;
    std::vector<float> logits(kV);
    std::vector<uint32_t> mask(c->mask_words());
    std::vector<int32_t> out;
    for (int i = 0; i < max; ++i) {
      for (float& x : logits) x = d(rng);
      c->FillNextTokenBitmask(absl::MakeSpan(mask));
      SampleRequest r;
      r.logits = logits;
      r.params = &p;
      r.allowed_bitmask = mask;
      r.position = i;
      absl::StatusOr<SampleResult> s = sampler.Sample(r);
      EXPECT_TRUE(s.ok()) << s.status();
      if (!s.ok()) break;
      EXPECT_TRUE(c->Accept(s->token_id).ok());
      out.push_back(s->token_id);
      if (s->token_id == tokenizer::kEosId || s->token_id == tokenizer::kEndOfMsgId)
        break;
    }
    return out;
  }
  static std::string Text(const std::vector<int32_t>& ids) {
    std::string s;
    for (int32_t id : ids) {
      if (id >= tokenizer::kNumBaseTokens) continue;
      auto b = tok_->Decode(std::vector<int>{id});
      if (b.ok()) s += *b;
    }
    return s;
  }
  static tokenizer::Tokenizer* tok_;
  static grammar::GrammarCompiler* compiler_;
};
tokenizer::Tokenizer* StructuredOutputTest::tok_ = nullptr;
grammar::GrammarCompiler* StructuredOutputTest::compiler_ = nullptr;

TEST_F(StructuredOutputTest, ChoiceEndsWithAStopToken) {
  StructuredOutputSpec spec;
  spec.kind = StructuredOutputSpec::Kind::kChoice;
  spec.choices = {"alpha", "beta", "gamma delta"};
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    auto c = Make(spec);
    std::vector<int32_t> ids = Generate(c.get(), seed, 64, 1.0f);
    ASSERT_FALSE(ids.empty());
    EXPECT_TRUE(ids.back() == tokenizer::kEosId ||
                ids.back() == tokenizer::kEndOfMsgId);
    EXPECT_THAT(Text(ids), ::testing::AnyOf("alpha", "beta", "gamma delta"));
    EXPECT_TRUE(c->Done());
    // After the end only the stop tokens are allowed.
    EXPECT_THAT(Allowed(c.get()),
                ::testing::ElementsAre(tokenizer::kEosId, tokenizer::kEndOfMsgId));
  }
}

TEST_F(StructuredOutputTest, ChatFramingForcesPrefixAndSuffix) {
  // As the gateway frames a thinking chat response (gateway/structured_output.h).
  StructuredOutputSpec spec;
  spec.kind = StructuredOutputSpec::Kind::kRegex;
  spec.source = "[0-9]{3}";
  spec.free_banned_token_ids = {tokenizer::kEosId, tokenizer::kEndOfMsgId,
                                tokenizer::kOpenId, tokenizer::kSepId};
  spec.free_until_token_id = tokenizer::kCloseId;
  spec.prefix_token_ids = {11, 12, 13};
  spec.terminator_token_id = tokenizer::kCloseId;
  spec.suffix_token_ids = {21, 22, tokenizer::kEndOfMsgId};
  auto c = Make(spec);
  EXPECT_EQ(c->phase(), OutputConstraint::Phase::kFree);
  std::vector<int32_t> free = Allowed(c.get());
  EXPECT_EQ(free.size(), static_cast<size_t>(kV - 4));
  EXPECT_FALSE(c->Accept(tokenizer::kEndOfMsgId)
                   .ok());  // the think channel cannot end the message
  ASSERT_TRUE(c->Accept(500).ok());
  ASSERT_TRUE(c->Accept(tokenizer::kCloseId).ok());
  for (int32_t forced : spec.prefix_token_ids) {
    EXPECT_THAT(Allowed(c.get()), ::testing::ElementsAre(forced));
    EXPECT_FALSE(c->Accept(forced + 1).ok());
    ASSERT_TRUE(c->Accept(forced).ok());
  }
  EXPECT_EQ(c->phase(), OutputConstraint::Phase::kGrammar);
  for (const char* digit : {"4", "0", "2"}) {
    auto ids = tok_->Encode(digit);
    ASSERT_TRUE(ids.ok());
    ASSERT_EQ(ids->size(), 1u);
    EXPECT_THAT(Allowed(c.get()),
                ::testing::Not(::testing::Contains(tokenizer::kCloseId)));
    ASSERT_TRUE(c->Accept((*ids)[0]).ok());
  }
  // Three digits: the grammar must end, with the terminator, never a stop token.
  EXPECT_THAT(Allowed(c.get()), ::testing::ElementsAre(tokenizer::kCloseId));
  ASSERT_TRUE(c->Accept(tokenizer::kCloseId).ok());
  for (int32_t forced : spec.suffix_token_ids) {
    EXPECT_THAT(Allowed(c.get()), ::testing::ElementsAre(forced));
    ASSERT_TRUE(c->Accept(forced).ok());
  }
  EXPECT_TRUE(c->Done());
}

TEST_F(StructuredOutputTest, RollbackRestoresEveryPhase) {
  StructuredOutputSpec spec;
  spec.kind = StructuredOutputSpec::Kind::kJsonObject;
  spec.prefix_token_ids = {7, 8};
  spec.terminator_token_id = tokenizer::kCloseId;
  spec.suffix_token_ids = {9};
  auto c = Make(spec, /*rollback=*/6);
  ASSERT_TRUE(c->Accept(7).ok());
  const std::vector<int32_t> at1 = Allowed(c.get());
  ASSERT_TRUE(c->Accept(8).ok());
  const std::vector<int32_t> at2 = Allowed(c.get());
  std::vector<int32_t> body;
  for (const char* piece : {"{", "\"a", "\":", "1"}) {
    auto ids = tok_->Encode(piece);
    ASSERT_TRUE(ids.ok());
    for (int id : *ids) {
      ASSERT_TRUE(c->Accept(id).ok()) << piece;
      body.push_back(id);
    }
  }
  const std::vector<int32_t> mid = Allowed(c.get());
  ASSERT_TRUE(c->Rollback(static_cast<int>(body.size())).ok());
  EXPECT_EQ(Allowed(c.get()), at2);
  ASSERT_TRUE(c->Rollback(1).ok());
  EXPECT_EQ(Allowed(c.get()), at1);
  EXPECT_EQ(c->phase(), OutputConstraint::Phase::kPrefix);
  ASSERT_TRUE(c->Accept(8).ok());
  for (int32_t id : body) ASSERT_TRUE(c->Accept(id).ok());
  EXPECT_EQ(Allowed(c.get()), mid);
  EXPECT_FALSE(c->Rollback(7).ok());  // more than kept
}

TEST_F(StructuredOutputTest, JsonSchemaOutputsFromRandomLogitsParse) {
  StructuredOutputSpec spec;
  spec.kind = StructuredOutputSpec::Kind::kJsonSchema;
  spec.source =
      R"({"type":"object","properties":{"n":{"type":"integer"},"ok":{"type":"boolean"}},)"
      R"("required":["n","ok"],"additionalProperties":false})";
  for (uint64_t seed = 1; seed <= 10; ++seed) {
    auto c = Make(spec);
    std::vector<int32_t> ids = Generate(c.get(), seed, 200, seed % 2 ? 1.0f : 0.0f);
    if (!c->Done()) continue;  // ran out of tokens (the length case)
    const std::string text = Text(ids);
    nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << text;
    EXPECT_TRUE(j["n"].is_number_integer()) << text;
    EXPECT_TRUE(j["ok"].is_boolean()) << text;
    EXPECT_EQ(j.size(), 2u) << text;
  }
}

TEST_F(StructuredOutputTest, BadTokensAreRefusedAndStateKept) {
  StructuredOutputSpec spec;
  spec.kind = StructuredOutputSpec::Kind::kChoice;
  spec.choices = {"yes"};
  auto c = Make(spec);
  const std::vector<int32_t> before = Allowed(c.get());
  auto no = tok_->Encode("no");
  ASSERT_TRUE(no.ok());
  EXPECT_EQ(c->Accept((*no)[0]).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(c->Accept(-1).ok());
  EXPECT_FALSE(c->Accept(kV).ok());
  EXPECT_FALSE(c->Accept(tokenizer::kOpenId).ok());  // structure is never grammar text
  EXPECT_EQ(Allowed(c.get()), before);
}

}  // namespace
}  // namespace tandem::engine
