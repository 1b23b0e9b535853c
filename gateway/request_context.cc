#include "gateway/request_context.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "gateway/json_escape.h"

namespace tandem::gateway {

http::HttpResponse ErrorResponse(const ApiError& error) {
  http::HttpResponse r;
  r.status = error.http_status;
  r.body = error.ToJson();
  if (error.retry_after_s > 0) {
    r.headers.emplace_back("Retry-After", absl::StrCat(error.retry_after_s));
  }
  if (error.http_status == 401) r.headers.emplace_back("WWW-Authenticate", "Bearer");
  return r;
}

void RequestContext::Record(int status) {
  metrics->requests->Add({{"endpoint", endpoint}, {"status", absl::StrCat(status)}})
      .Increment();
  metrics->latency->Add({{"endpoint", endpoint}})
      .Observe(absl::ToDoubleSeconds(absl::Now() - start));
}

void RequestContext::Send(http::HttpResponse response) {
  if (answered) return;
  answered = true;
  Record(response.status);
  writer->Send(std::move(response));
}

void RequestContext::Json(int status, const nlohmann::json& body) {
  http::HttpResponse r;
  r.status = status;
  r.body = DumpJson(body);
  Send(std::move(r));
}

}  // namespace tandem::gateway
