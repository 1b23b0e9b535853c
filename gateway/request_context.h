// One HTTP request of the OpenAI API while it is being answered: the request,
// its ResponseWriter, the endpoint label and start time. Answers once (Send,
// Json, Error) and records the request's metrics (count by status, duration).
// Shared by the service's handlers and the Generation that streams it; not
// thread-safe (a Generation calls it under its own lock).
#ifndef TANDEM_GATEWAY_REQUEST_CONTEXT_H_
#define TANDEM_GATEWAY_REQUEST_CONTEXT_H_

#include <memory>
#include <string>

#include "absl/time/time.h"
#include "gateway/api_error.h"
#include "gateway/gateway_metrics.h"
#include "http/handler.h"
#include "nlohmann/json.hpp"

namespace tandem::gateway {

// The HTTP form of an API error: its JSON body, Retry-After when set,
// WWW-Authenticate on 401.
http::HttpResponse ErrorResponse(const ApiError& error);

struct RequestContext {
  GatewayMetrics* metrics = nullptr;  // not owned
  http::HttpRequest request;
  std::shared_ptr<http::ResponseWriter> writer;
  std::string endpoint;
  absl::Time start;
  bool answered = false;  // a response (or a stream) has started

  // Counts the request under `status` and observes its duration.
  void Record(int status);
  // The whole response, once; later calls do nothing.
  void Send(http::HttpResponse response);
  void Json(int status, const nlohmann::json& body);
  void Error(const ApiError& e) { Send(ErrorResponse(e)); }
};

}  // namespace tandem::gateway

#endif  // TANDEM_GATEWAY_REQUEST_CONTEXT_H_
