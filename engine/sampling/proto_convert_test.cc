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
