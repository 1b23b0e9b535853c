#include "gateway/api_error.h"

#include <utility>

#include "nlohmann/json.hpp"

namespace tandem::gateway {

std::string ApiError::ToJson() const {
  nlohmann::json error = {
      {"message", message},
      {"type", type},
      {"param", param.empty() ? nlohmann::json(nullptr) : nlohmann::json(param)},
      {"code", code.empty() ? nlohmann::json(nullptr) : nlohmann::json(code)},
  };
  return nlohmann::json({{"error", std::move(error)}})
      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

ApiError BadRequest(std::string message, std::string param, std::string code) {
  ApiError e;
  e.http_status = 400;
  e.type = "invalid_request_error";
  e.message = std::move(message);
  e.param = std::move(param);
  e.code = std::move(code);
  return e;
}

std::string ParamFromMessage(absl::string_view message) {
  const size_t colon = message.find(": ");
  if (colon == absl::string_view::npos || colon == 0) return "";
  absl::string_view head = message.substr(0, colon);
  if (head.find(' ') != absl::string_view::npos) return "";
  return std::string(head);
}

ApiError ApiErrorFromStatus(const absl::Status& status, int retry_after_s) {
  ApiError e;
  e.message = std::string(status.message());
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
      e = BadRequest(e.message, ParamFromMessage(e.message));
      break;
    case absl::StatusCode::kNotFound:
      e.http_status = 404;
      e.type = "invalid_request_error";
      e.code = "not_found";
      break;
    case absl::StatusCode::kUnauthenticated:
      e.http_status = 401;
      e.type = "invalid_request_error";
      e.code = "invalid_api_key";
      break;
    case absl::StatusCode::kPermissionDenied:
      e.http_status = 403;
      e.type = "invalid_request_error";
      e.code = "permission_denied";
      break;
    case absl::StatusCode::kResourceExhausted:
      e.http_status = 429;
      e.type = "rate_limit_error";
      e.code = "rate_limit_exceeded";
      e.retry_after_s = retry_after_s;
      break;
    case absl::StatusCode::kUnavailable:
      e.http_status = 503;
      e.type = "server_error";
      e.code = "service_unavailable";
      e.retry_after_s = retry_after_s;
      break;
    case absl::StatusCode::kDeadlineExceeded:
      e.http_status = 504;
      e.type = "server_error";
      e.code = "timeout";
      break;
    case absl::StatusCode::kUnimplemented:
      e.http_status = 501;
      e.type = "invalid_request_error";
      e.code = "not_implemented";
      break;
    default:
      e.http_status = 500;
      e.type = "server_error";
      break;
  }
  if (e.message.empty())
    e.message = std::string(absl::StatusCodeToString(status.code()));
  return e;
}

}  // namespace tandem::gateway
