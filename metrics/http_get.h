// A small blocking HTTP/1.1 client for tests and tools: fetch /metrics or
// /healthz of a running process. Every step (resolve, connect, write, read) is
// bounded by the caller's timeout. Not for production traffic.
//
//   absl::StatusOr<HttpResponse> r = HttpGet("127.0.0.1", port, "/metrics",
//                                            absl::Seconds(5));
//
// Errors: DeadlineExceeded when the timeout passes, Unavailable when the
// connection is refused or dropped, InvalidArgument for an unusable host or a
// malformed response.
#ifndef TANDEM_METRICS_HTTP_GET_H_
#define TANDEM_METRICS_HTTP_GET_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace tandem::metrics {

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

struct HttpResponse {
  int status_code = 0;
  HttpHeaders headers;  // as received
  std::string body;

  // Value of the first header named `name` (case-insensitive); empty if absent.
  std::string Header(absl::string_view name) const;
};

// One GET on a fresh connection (`Connection: close`).
absl::StatusOr<HttpResponse> HttpGet(const std::string& host, int port,
                                     const std::string& path, absl::Duration timeout);

// One client connection carrying several requests (keep-alive). Not thread-safe.
class HttpConnection {
 public:
  static absl::StatusOr<std::unique_ptr<HttpConnection>> Connect(
      const std::string& host, int port, absl::Duration timeout);
  ~HttpConnection();
  HttpConnection(const HttpConnection&) = delete;
  HttpConnection& operator=(const HttpConnection&) = delete;

  // Sends one request (with `headers` added) and reads its response. With
  // keep_alive the connection stays open for the next request unless the server
  // closes it.
  absl::StatusOr<HttpResponse> Request(absl::string_view method,
                                       absl::string_view target,
                                       const HttpHeaders& headers,
                                       absl::string_view body, absl::Duration timeout,
                                       bool keep_alive = true);
  absl::StatusOr<HttpResponse> Get(absl::string_view target, absl::Duration timeout) {
    return Request("GET", target, {}, "", timeout);
  }

  // Blocks until the server closes the connection (OK) or `timeout` passes
  // (DeadlineExceeded). Bytes that arrive meanwhile are discarded.
  absl::Status WaitForClose(absl::Duration timeout);

 private:
  struct Impl;
  explicit HttpConnection(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::metrics

#endif  // TANDEM_METRICS_HTTP_GET_H_
