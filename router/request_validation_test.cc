#include "router/request_validation.h"

#include <functional>
#include <string>

#include "gtest/gtest.h"

namespace tandem::router {
namespace {

constexpr ModelLimits kLimits{.vocab_size = 163840, .max_context_tokens = 1000};

tandem::v1::GenerateRequest Good() {
  tandem::v1::GenerateRequest r;
  r.set_request_id("req-1");
  for (int id : {1, 2, 163839}) r.mutable_prompt_token_ids()->add_ids(id);
  r.mutable_sampling()->set_temperature(0.8f);
  r.mutable_stop()->set_max_tokens(16);
  return r;
}

struct Case {
  std::string name;
  std::function<void(tandem::v1::GenerateRequest*)> mutate;
  std::string message_part;  // empty: must be OK
};

class ValidationTest : public ::testing::TestWithParam<Case> {};

TEST_P(ValidationTest, Table) {
  tandem::v1::GenerateRequest r = Good();
  GetParam().mutate(&r);
  absl::Status s = ValidateGenerateRequest(r, kLimits);
  if (GetParam().message_part.empty()) {
    EXPECT_TRUE(s.ok()) << s;
  } else {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find(GetParam().message_part), absl::string_view::npos) << s;
  }
}

using R = tandem::v1::GenerateRequest;
INSTANTIATE_TEST_SUITE_P(
    All, ValidationTest,
    ::testing::Values(
        Case{"ok", [](R*) {}, ""},
        Case{"image_ok",
             [](R* r) {
               auto* im = r->add_images();
               im->set_data("png");
               im->set_num_tokens(2);
               im->set_placeholder_start(1);
             },
             ""},
        Case{"image_outside",
             [](R* r) {
               auto* im = r->add_images();
               im->set_data("png");
               im->set_num_tokens(3);
               im->set_placeholder_start(1);
             },
             "images[0]: placeholders [1, 4) are not inside the prompt of 3 tokens"},
        Case{"images_overlap",
             [](R* r) {
               for (int i = 0; i < 2; ++i) {
                 auto* im = r->add_images();
                 im->set_data("png");
                 im->set_num_tokens(2);
                 im->set_placeholder_start(i);
               }
             },
             "images[1]: placeholders [1, 3)"},
        Case{"image_no_tokens", [](R* r) { r->add_images()->set_data("png"); },
             "images[0].num_tokens must be > 0"},
        Case{"image_no_data", [](R* r) { r->add_images()->set_num_tokens(1); },
             "images[0].data is empty"},
        Case{"image_text_prompt",
             [](R* r) {
               r->set_prompt_text("hello");
               auto* im = r->add_images();
               im->set_data("png");
               im->set_num_tokens(1);
             },
             "images need prompt_token_ids"},
        Case{"image_min_tokens",
             [](R* r) {
               auto* im = r->add_images();
               im->set_data("png");
               im->set_num_tokens(1);
               r->mutable_stop()->set_min_tokens(1);
             },
             "stop.min_tokens with images"},
        Case{"text_prompt", [](R* r) { r->set_prompt_text("hello"); }, ""},
        Case{"no_prompt", [](R* r) { r->clear_prompt(); }, "must be set"},
        Case{"empty_ids", [](R* r) { r->mutable_prompt_token_ids()->clear_ids(); },
             "prompt_token_ids is empty"},
        Case{"id_too_big", [](R* r) { r->mutable_prompt_token_ids()->add_ids(163840); },
             "prompt_token_ids[3] = 163840"},
        Case{"negative_id", [](R* r) { r->mutable_prompt_token_ids()->set_ids(0, -1); },
             "prompt_token_ids[0] = -1"},
        Case{"bad_request_id", [](R* r) { r->set_request_id("a b"); }, "request_id"},
        Case{"temperature", [](R* r) { r->mutable_sampling()->set_temperature(2.5f); },
             "sampling.temperature"},
        Case{"nan_top_p", [](R* r) { r->mutable_sampling()->set_top_p(NAN); },
             "sampling.top_p"},
        Case{"top_k", [](R* r) { r->mutable_sampling()->set_top_k(-1); }, "top_k"},
        Case{"top_logprobs", [](R* r) { r->mutable_sampling()->set_top_logprobs(21); },
             "top_logprobs"},
        Case{"presence", [](R* r) { r->mutable_sampling()->set_presence_penalty(-3); },
             "presence_penalty"},
        Case{"max_tokens", [](R* r) { r->mutable_stop()->set_max_tokens(-1); },
             "max_tokens"},
        Case{"context", [](R* r) { r->mutable_stop()->set_max_tokens(998); },
             "exceeds the model's context"},
        Case{"prompt_too_long",
             [](R* r) {
               for (int i = 0; i < 1000; ++i) r->mutable_prompt_token_ids()->add_ids(5);
             },
             "more than the model's context"},
        Case{"min_gt_max", [](R* r) { r->mutable_stop()->set_min_tokens(17); },
             "min_tokens"},
        Case{"empty_stop", [](R* r) { r->mutable_stop()->add_stop_strings(""); },
             "stop_strings[0]"},
        Case{"too_many_stops",
             [](R* r) {
               for (int i = 0; i < 17; ++i) r->mutable_stop()->add_stop_strings("x");
             },
             "at most 16"},
        Case{"stop_id", [](R* r) { r->mutable_stop()->add_stop_token_ids(200000); },
             "stop_token_ids[0]"},
        Case{
            "logit_bias_ok",
            [](R* r) { (*r->mutable_sampling()->mutable_logit_bias())[163839] = -100; },
            ""},
        Case{"logit_bias_id",
             [](R* r) { (*r->mutable_sampling()->mutable_logit_bias())[163840] = 1; },
             "sampling.logit_bias: token id 163840 is outside the vocabulary"},
        Case{"logit_bias_value",
             [](R* r) { (*r->mutable_sampling()->mutable_logit_bias())[5] = 100.5f; },
             "sampling.logit_bias: the bias of token 5 must be in [-100, 100]"},
        Case{"prompt_logprobs_ok",
             [](R* r) { r->mutable_sampling()->set_prompt_logprobs(20); }, ""},
        Case{"prompt_logprobs_range",
             [](R* r) { r->mutable_sampling()->set_prompt_logprobs(21); },
             "sampling.prompt_logprobs must be in [0, 20]"}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Prompt logprobs ride in one message: a prompt whose scores would pass
// kMaxPromptScoreBytes is refused up front, naming how many tokens fit.
TEST(PromptLogprobsSize, TooManyScoresForOneMessageAreRefused) {
  constexpr ModelLimits kLong{.vocab_size = 163840, .max_context_tokens = 1 << 20};
  tandem::v1::GenerateRequest r = Good();
  r.mutable_prompt_token_ids()->clear_ids();
  for (int i = 0; i < 20000; ++i) r.mutable_prompt_token_ids()->add_ids(i + 1);
  r.mutable_sampling()->set_prompt_logprobs(20);  // 256 bytes a token
  absl::Status s = ValidateGenerateRequest(r, kLong);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("score at most 14337 prompt tokens"),
            absl::string_view::npos)
      << s;
  r.mutable_sampling()->set_prompt_logprobs(0);  // 16 bytes a token: fits
  EXPECT_TRUE(ValidateGenerateRequest(r, kLong).ok());
}

}  // namespace
}  // namespace tandem::router
