#include "engine/sampling/sampling_params.h"

#include <functional>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

using ::testing::HasSubstr;

TEST(SamplingParamsTest, DefaultsAreValidAndGreedy) {
  SamplingParams p;
  EXPECT_TRUE(p.Validate().ok());
  EXPECT_TRUE(p.IsGreedy());
  EXPECT_FALSE(p.HasPenalties());
  p.temperature = 0.7f;
  EXPECT_FALSE(p.IsGreedy());
  p.repetition_penalty = 1.1f;
  EXPECT_TRUE(p.HasPenalties());
}

struct BadCase {
  std::string name;
  std::function<void(SamplingParams&)> mutate;
  std::string message;
};

TEST(SamplingParamsTest, RejectsOutOfRangeValuesNamingTheField) {
  const BadCase cases[] = {
      {"temp_high", [](SamplingParams& p) { p.temperature = 2.5f; },
       "temperature must be in [0, 2], got 2.5"},
      {"temp_neg", [](SamplingParams& p) { p.temperature = -0.1f; }, "temperature"},
      {"temp_nan", [](SamplingParams& p) { p.temperature = NAN; }, "temperature"},
      {"top_p_zero", [](SamplingParams& p) { p.top_p = 0.0f; },
       "top_p must be in (0, 1], got 0"},
      {"top_p_high", [](SamplingParams& p) { p.top_p = 1.5f; }, "top_p"},
      {"top_k", [](SamplingParams& p) { p.top_k = -1; }, "top_k must be >= 0, got -1"},
      {"min_p", [](SamplingParams& p) { p.min_p = 1.5f; }, "min_p"},
      {"presence", [](SamplingParams& p) { p.presence_penalty = 3.0f; },
       "presence_penalty"},
      {"frequency", [](SamplingParams& p) { p.frequency_penalty = -2.5f; },
       "frequency_penalty"},
      {"repetition", [](SamplingParams& p) { p.repetition_penalty = 0.0f; },
       "repetition_penalty"},
      {"top_logprobs",
       [](SamplingParams& p) {
         p.logprobs = true;
         p.top_logprobs = 21;
       },
       "top_logprobs must be in [0, 20], got 21"},
      {"top_logprobs_without_logprobs", [](SamplingParams& p) { p.top_logprobs = 3; },
       "requires logprobs"},
      {"max_tokens", [](SamplingParams& p) { p.max_tokens = -1; }, "max_tokens"},
      {"min_over_max",
       [](SamplingParams& p) {
         p.max_tokens = 5;
         p.min_tokens = 6;
       },
       "min_tokens (6) must not exceed max_tokens (5)"},
      {"empty_stop", [](SamplingParams& p) { p.stop_strings = {""}; },
       "must not be empty"},
      {"long_stop", [](SamplingParams& p) { p.stop_strings = {std::string(300, 'x')}; },
       "at most 256 bytes"},
      {"many_stops", [](SamplingParams& p) { p.stop_strings.assign(17, "x"); },
       "at most 16 stop strings"},
      {"neg_stop_id", [](SamplingParams& p) { p.stop_token_ids = {-3}; },
       "stop token id must be >= 0, got -3"},
      {"bias_neg_id",
       [](SamplingParams& p) {
         p.logit_bias = {{-1, 1.0f}};
       },
       "logit_bias: token id must be >= 0, got -1"},
      {"bias_repeated_id",
       [](SamplingParams& p) {
         p.logit_bias = {{4, 1.0f}, {4, 2.0f}};
       },
       "logit_bias: token ids must be distinct and ascending (4 then 4)"},
      {"bias_unsorted",
       [](SamplingParams& p) {
         p.logit_bias = {{9, 1.0f}, {4, 2.0f}};
       },
       "(9 then 4)"},
      {"bias_high",
       [](SamplingParams& p) {
         p.logit_bias = {{7, 100.5f}};
       },
       "logit_bias: the bias of token 7 must be in [-100, 100], got 100.5"},
      {"bias_nan",
       [](SamplingParams& p) {
         p.logit_bias = {{7, NAN}};
       },
       "the bias of token 7"},
  };
  for (const BadCase& c : cases) {
    SamplingParams p;
    c.mutate(p);
    const absl::Status s = p.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(s.message(), HasSubstr(c.message)) << c.name;
  }
}

TEST(SamplingParamsTest, VocabCheckNamesTokenAndVocab) {
  SamplingParams p;
  p.stop_token_ids = {5, 100};
  EXPECT_TRUE(p.ValidateForVocab(101).ok());
  const absl::Status s = p.ValidateForVocab(100);
  EXPECT_THAT(s.message(), HasSubstr("stop token id 100 is outside the "
                                     "vocabulary of 100 tokens"));
  SamplingParams b;
  b.logit_bias = {{0, -100.0f}, {99, 100.0f}};
  EXPECT_TRUE(b.ValidateForVocab(100).ok());
  b.logit_bias.push_back({100, 1.0f});
  EXPECT_THAT(b.ValidateForVocab(100).message(),
              HasSubstr("logit_bias: token id 100 is outside the vocabulary of 100"));
}

TEST(SamplingParamsTest, EnsureSeedSeedsSamplingRequestsOnly) {
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  EnsureSeed(&greedy);
  EXPECT_FALSE(greedy.seed.has_value());

  SamplingParams given;
  given.temperature = 1.0f;
  given.seed = 7;
  EnsureSeed(&given);
  EXPECT_EQ(given.seed, 7u);

  SamplingParams a, b;
  a.temperature = b.temperature = 0.8f;
  EnsureSeed(&a);
  EnsureSeed(&b);
  ASSERT_TRUE(a.seed.has_value() && b.seed.has_value());
  EXPECT_NE(*a.seed, *b.seed);  // 2^-64 chance of a false failure
}

}  // namespace
}  // namespace tandem::engine
