#include "gateway/api_error.h"

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::gateway {
namespace {

TEST(ApiErrorTest, BodyHasOpenAIShapeWithNulls) {
  ApiError e = BadRequest("bad thing");
  nlohmann::json j = nlohmann::json::parse(e.ToJson());
  ASSERT_TRUE(j.contains("error"));
  EXPECT_EQ(j["error"]["message"], "bad thing");
  EXPECT_EQ(j["error"]["type"], "invalid_request_error");
  EXPECT_TRUE(j["error"]["param"].is_null());
  EXPECT_TRUE(j["error"]["code"].is_null());
  EXPECT_EQ(j["error"].size(), 4u);
}

TEST(ApiErrorTest, ParamAndCodeAreStrings) {
  ApiError e = BadRequest("too long", "messages", "context_length_exceeded");
  nlohmann::json j = nlohmann::json::parse(e.ToJson());
  EXPECT_EQ(j["error"]["param"], "messages");
  EXPECT_EQ(j["error"]["code"], "context_length_exceeded");
  EXPECT_EQ(e.http_status, 400);
}

TEST(ApiErrorTest, InvalidUtf8InMessageStillGivesValidJson) {
  ApiError e = BadRequest(std::string("bad \xff\xfe byte"));
  EXPECT_NO_THROW(nlohmann::json::parse(e.ToJson()));
}

TEST(ApiErrorTest, ParamFromMessage) {
  EXPECT_EQ(ParamFromMessage("temperature: 3 is out of range"), "temperature");
  EXPECT_EQ(ParamFromMessage("messages[2].content: expected a string"),
            "messages[2].content");
  EXPECT_EQ(ParamFromMessage("We could not parse: the body"), "");
  EXPECT_EQ(ParamFromMessage("no colon here"), "");
  EXPECT_EQ(ParamFromMessage(": leading"), "");
}

struct MappingCase {
  absl::StatusCode code;
  int http;
  const char* type;
  int retry_after;
};

class StatusMappingTest : public ::testing::TestWithParam<MappingCase> {};

TEST_P(StatusMappingTest, MapsCodeToHttp) {
  const MappingCase& c = GetParam();
  ApiError e = ApiErrorFromStatus(absl::Status(c.code, "x: boom"), 3);
  EXPECT_EQ(e.http_status, c.http);
  EXPECT_EQ(e.type, c.type);
  EXPECT_EQ(e.retry_after_s, c.retry_after);
  EXPECT_EQ(e.message, "x: boom");
}

INSTANTIATE_TEST_SUITE_P(
    All, StatusMappingTest,
    ::testing::Values(
        MappingCase{absl::StatusCode::kInvalidArgument, 400, "invalid_request_error",
                    0},
        MappingCase{absl::StatusCode::kOutOfRange, 400, "invalid_request_error", 0},
        MappingCase{absl::StatusCode::kNotFound, 404, "invalid_request_error", 0},
        MappingCase{absl::StatusCode::kUnauthenticated, 401, "invalid_request_error",
                    0},
        MappingCase{absl::StatusCode::kPermissionDenied, 403, "invalid_request_error",
                    0},
        MappingCase{absl::StatusCode::kResourceExhausted, 429, "rate_limit_error", 3},
        MappingCase{absl::StatusCode::kUnavailable, 503, "server_error", 3},
        MappingCase{absl::StatusCode::kDeadlineExceeded, 504, "server_error", 0},
        MappingCase{absl::StatusCode::kUnimplemented, 501, "invalid_request_error", 0},
        MappingCase{absl::StatusCode::kInternal, 500, "server_error", 0},
        MappingCase{absl::StatusCode::kDataLoss, 500, "server_error", 0}));

TEST(ApiErrorTest, InvalidArgumentNamesParam) {
  ApiError e =
      ApiErrorFromStatus(absl::InvalidArgumentError("top_p: 0 is out of range"));
  EXPECT_EQ(e.param, "top_p");
}

}  // namespace
}  // namespace tandem::gateway
