// OpenAI-shaped error responses: {"error":{"message","type","param","code"}}
// with the HTTP status that goes with them, and the mapping from absl/gRPC
// status codes (the router's errors) onto them.
//
//   INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION → 400 invalid_request_error
//   NOT_FOUND          → 404          UNAUTHENTICATED    → 401
//   PERMISSION_DENIED  → 403          RESOURCE_EXHAUSTED → 429 + Retry-After
//   UNAVAILABLE        → 503 + Retry-After               DEADLINE_EXCEEDED → 504
//   UNIMPLEMENTED      → 501          anything else      → 500 server_error
#ifndef TANDEM_GATEWAY_API_ERROR_H_
#define TANDEM_GATEWAY_API_ERROR_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace tandem::gateway {

struct ApiError {
  int http_status = 500;
  std::string type = "server_error";  // invalid_request_error, ...
  std::string message;
  std::string param;      // empty: JSON null
  std::string code;       // empty: JSON null
  int retry_after_s = 0;  // > 0: sent as a Retry-After header

  // {"error":{"message":...,"type":...,"param":...,"code":...}}
  std::string ToJson() const;
  // The body of an SSE error event sent after a stream has started.
  std::string ToJsonObject() const { return ToJson(); }
};

// 400 invalid_request_error.
ApiError BadRequest(std::string message, std::string param = "", std::string code = "");

// Maps a status onto the table above. For 400s, a message of the form
// "param.path: text" (what the request parser and engine/chat write) names
// `param`. `retry_after_s` is used for 429 and 503.
ApiError ApiErrorFromStatus(const absl::Status& status, int retry_after_s = 1);

// The OpenAI `param` named by a message "messages[2].content: ..." (the text
// before the first ": " when it contains no space), or "".
std::string ParamFromMessage(absl::string_view message);

}  // namespace tandem::gateway

#endif  // TANDEM_GATEWAY_API_ERROR_H_
