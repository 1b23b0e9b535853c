#include "engine/sampling/proto_convert.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(ProtoConvertTest, UnsetProtoMeansGreedyDefaults) {
  auto p = SamplingParamsFromProto({}, {});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->IsGreedy());
  EXPECT_EQ(p->top_p, 1.0f);               // 0 on the wire disables
  EXPECT_EQ(p->repetition_penalty, 1.0f);  // 0 on the wire disables
  EXPECT_FALSE(p->seed.has_value());
  EXPECT_FALSE(p->HasPenalties());
}

TEST(ProtoConvertTest, RoundTripsEveryField) {
  tandem::v1::SamplingParams s;
  s.set_temperature(0.6f);
  s.set_top_p(0.9f);
  s.set_top_k(40);
  s.set_min_p(0.05f);
  s.set_seed(123456789012345ull);
  s.set_presence_penalty(0.5f);
  s.set_frequency_penalty(-0.5f);
  s.set_repetition_penalty(1.1f);
  s.set_logprobs(true);
  s.set_top_logprobs(5);
  tandem::v1::StopConditions c;
  c.set_max_tokens(64);
  c.add_stop_token_ids(3);
  c.add_stop_strings("\n\n");
  c.set_ignore_eos(true);
  c.set_min_tokens(2);
  auto p = SamplingParamsFromProto(s, c);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->temperature, 0.6f);
  EXPECT_EQ(p->top_k, 40);
  EXPECT_EQ(*p->seed, 123456789012345ull);
  EXPECT_THAT(p->stop_token_ids, ElementsAre(3));
  EXPECT_THAT(p->stop_strings, ElementsAre("\n\n"));
  EXPECT_EQ(p->min_tokens, 2);
  tandem::v1::SamplingParams s2;
  tandem::v1::StopConditions c2;
  SamplingParamsToProto(*p, &s2, &c2);
  EXPECT_EQ(s2.SerializeAsString(), s.SerializeAsString());
  EXPECT_EQ(c2.SerializeAsString(), c.SerializeAsString());
}

TEST(ProtoConvertTest, LogitBiasComesInAscendingIdsAndRoundTrips) {
  tandem::v1::SamplingParams s;
  (*s.mutable_logit_bias())[900] = -100.0f;
  (*s.mutable_logit_bias())[7] = 2.5f;
  (*s.mutable_logit_bias())[31] = 0.0f;
  auto p = SamplingParamsFromProto(s, {});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(p->logit_bias, ElementsAre(TokenBias{7, 2.5f}, TokenBias{31, 0.0f},
                                         TokenBias{900, -100.0f}));
  tandem::v1::SamplingParams s2;
  tandem::v1::StopConditions c2;
  SamplingParamsToProto(*p, &s2, &c2);
  ASSERT_EQ(s2.logit_bias_size(), 3);
  EXPECT_EQ(s2.logit_bias().at(7), 2.5f);
  EXPECT_EQ(s2.logit_bias().at(31), 0.0f);
  EXPECT_EQ(s2.logit_bias().at(900), -100.0f);
  // Out of range on the wire: refused, naming the field.
  (*s.mutable_logit_bias())[5] = 250.0f;
  EXPECT_THAT(SamplingParamsFromProto(s, {}).status().message(),
              HasSubstr("logit_bias: the bias of token 5"));
}

TEST(ProtoConvertTest, InvalidValuesAreRejected) {
  tandem::v1::SamplingParams s;
  s.set_temperature(3.0f);
  EXPECT_THAT(SamplingParamsFromProto(s, {}).status().message(),
              HasSubstr("temperature"));
}

TEST(ProtoConvertTest, FinishReasonsAndLogprobs) {
  for (FinishReason r :
       {FinishReason::kNone, FinishReason::kStop, FinishReason::kLength,
        FinishReason::kCancelled, FinishReason::kError}) {
    EXPECT_EQ(FinishReasonFromProto(FinishReasonToProto(r)), r);
    EXPECT_EQ(static_cast<int>(FinishReasonToProto(r)), static_cast<int>(r));
  }
  SampleResult result{7, -0.25f, {{7, -0.25f}, {9, -2.0f}}};
  tandem::v1::TokenLogprob out;
  SampleResultToProto(result, &out);
  EXPECT_EQ(out.token_id(), 7);
  EXPECT_EQ(out.logprob(), -0.25f);
  ASSERT_EQ(out.top_size(), 2);
  EXPECT_EQ(out.top(1).token_id(), 9);
  EXPECT_EQ(out.top(1).logprob(), -2.0f);
}

}  // namespace
}  // namespace tandem::engine

namespace tandem::engine {
namespace {

TEST(ProtoConvertTest, StructuredOutputRoundTrips) {
  SamplingParams p;
  StructuredOutputSpec spec;
  spec.kind = StructuredOutputSpec::Kind::kChoice;
  spec.choices = {"yes", "no"};
  spec.free_banned_token_ids = {1, 2};
  spec.free_until_token_id = 9;
  spec.prefix_token_ids = {4, 5};
  spec.terminator_token_id = 9;
  spec.suffix_token_ids = {6, 7, 8};
  p.structured = spec;
  tandem::v1::SamplingParams sp;
  tandem::v1::StopConditions st;
  SamplingParamsToProto(p, &sp, &st);
  ASSERT_TRUE(sp.has_structured_output());
  absl::StatusOr<SamplingParams> back = SamplingParamsFromProto(sp, st);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_TRUE(back->structured.has_value());
  const StructuredOutputSpec& b = *back->structured;
  EXPECT_EQ(b.kind, spec.kind);
  EXPECT_EQ(b.choices, spec.choices);
  EXPECT_EQ(b.free_banned_token_ids, spec.free_banned_token_ids);
  EXPECT_EQ(b.free_until_token_id, 9);
  EXPECT_EQ(b.prefix_token_ids, spec.prefix_token_ids);
  EXPECT_EQ(b.terminator_token_id, 9);
  EXPECT_EQ(b.suffix_token_ids, spec.suffix_token_ids);
  // Unset optional ids stay unset (-1), and no constraint stays none.
  tandem::v1::SamplingParams plain;
  plain.mutable_structured_output()->set_kind(
      tandem::v1::StructuredOutput::KIND_JSON_OBJECT);
  absl::StatusOr<SamplingParams> json = SamplingParamsFromProto(plain, {});
  ASSERT_TRUE(json.ok());
  EXPECT_EQ(json->structured->free_until_token_id, -1);
  EXPECT_EQ(json->structured->terminator_token_id, -1);
  EXPECT_FALSE(SamplingParamsFromProto({}, {})->structured.has_value());
}

TEST(ProtoConvertTest, BadStructuredOutputsAreRejectedNamingTheField) {
  auto err = [](tandem::v1::StructuredOutput so, tandem::v1::StopConditions st = {}) {
    tandem::v1::SamplingParams sp;
    *sp.mutable_structured_output() = so;
    return std::string(SamplingParamsFromProto(sp, st).status().message());
  };
  tandem::v1::StructuredOutput so;
  EXPECT_THAT(err(so), ::testing::HasSubstr("structured_output.kind"));
  so.set_kind(tandem::v1::StructuredOutput::KIND_REGEX);
  EXPECT_THAT(err(so), ::testing::HasSubstr("structured_output.source"));
  so.set_kind(tandem::v1::StructuredOutput::KIND_CHOICE);
  EXPECT_THAT(err(so), ::testing::HasSubstr("structured_output.choices"));
  so.add_choices("a");
  so.add_suffix_token_ids(3);
  EXPECT_THAT(err(so), ::testing::HasSubstr("terminator_token_id"));
  so.clear_suffix_token_ids();
  EXPECT_EQ(err(so), "");  // valid
  // ignore_eos is the prefill worker's for its one token (clients are refused
  // it by the gateway and the router).
  tandem::v1::StopConditions st;
  st.set_ignore_eos(true);
  EXPECT_EQ(err(so, st), "");
  SamplingParams p;
  p.structured = StructuredOutputSpec{};
  p.structured->prefix_token_ids = {200};
  EXPECT_THAT(std::string(p.ValidateForVocab(100).message()),
              ::testing::HasSubstr("outside the vocabulary"));
}

}  // namespace
}  // namespace tandem::engine
