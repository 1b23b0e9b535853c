#include "router/structured_output_check.h"

#include <memory>
#include <string>

#include "engine/tokenizer/tokenizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::router {
namespace {

using ::testing::HasSubstr;
using Proto = tandem::v1::StructuredOutput;

const tokenizer::Tokenizer& Tok() {
  static const tokenizer::Tokenizer* t = [] {
    auto r = tokenizer::Tokenizer::Load("third_party/kimi_k3_tokenizer");
    EXPECT_TRUE(r.ok()) << r.status();
    return std::move(*r).release();
  }();
  return *t;
}

Proto Make(Proto::Kind kind, const std::string& source) {
  Proto p;
  p.set_kind(kind);
  p.set_source(source);
  return p;
}

TEST(StructuredOutputCheckTest, GoodConstraintsPass) {
  StructuredOutputCheck check(&Tok(), tokenizer::kVocabSize);
  EXPECT_TRUE(check.Check(Make(Proto::KIND_JSON_OBJECT, "")).ok());
  EXPECT_TRUE(check.Check(Make(Proto::KIND_REGEX, "[a-z]+@[a-z]+\\.com")).ok());
  EXPECT_TRUE(
      check
          .Check(Make(Proto::KIND_JSON_SCHEMA,
                      R"({"type":"object","properties":{"a":{"type":"integer"}}})"))
          .ok());
  Proto choice = Make(Proto::KIND_CHOICE, "");
  choice.add_choices("yes");
  EXPECT_TRUE(check.Check(choice).ok());
  // The same spec again is the compiler's cache.
  EXPECT_TRUE(check.Check(choice).ok());
}

TEST(StructuredOutputCheckTest, BadConstraintsAreInvalidArgumentNamingTheProblem) {
  StructuredOutputCheck check(&Tok(), tokenizer::kVocabSize);
  absl::Status bad_regex = check.Check(Make(Proto::KIND_REGEX, "(unclosed"));
  EXPECT_EQ(bad_regex.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_regex.message(), HasSubstr("structured_output: regex"));
  absl::Status bad_schema =
      check.Check(Make(Proto::KIND_JSON_SCHEMA, R"({"type":"object","not":{}})"));
  EXPECT_EQ(bad_schema.code(), absl::StatusCode::kInvalidArgument) << bad_schema;
  EXPECT_THAT(bad_schema.message(), HasSubstr("not")) << bad_schema;
  // Too deep: past the compiler's nesting budget is a 400 too.
  std::string deep = "{\"type\":\"string\"}";
  for (int i = 0; i < 100; ++i) deep = "{\"type\":\"array\",\"items\":" + deep + "}";
  absl::Status too_deep = check.Check(Make(Proto::KIND_JSON_SCHEMA, deep));
  EXPECT_EQ(too_deep.code(), absl::StatusCode::kInvalidArgument) << too_deep;
  // Fields: framing ids outside the vocabulary, a missing kind.
  Proto framing = Make(Proto::KIND_JSON_OBJECT, "");
  framing.add_prefix_token_ids(tokenizer::kVocabSize);
  EXPECT_THAT(check.Check(framing).message(), HasSubstr("outside the vocabulary"));
  EXPECT_THAT(check.Check(Proto()).message(), HasSubstr("structured_output.kind"));
}

TEST(StructuredOutputCheckTest, WithoutATokenizerOnlyTheFieldsAreChecked) {
  StructuredOutputCheck check(nullptr, 0);
  EXPECT_TRUE(check.Check(Make(Proto::KIND_REGEX, "(unclosed")).ok());
  EXPECT_FALSE(check.Check(Make(Proto::KIND_REGEX, "")).ok());
}

}  // namespace
}  // namespace tandem::router
