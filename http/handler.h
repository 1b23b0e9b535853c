// What an HTTP handler sees: the request, and a ResponseWriter to answer it
// with a whole response or a stream (SSE). Kept free of Boost so that the
// handlers (the gateway's OpenAI API, the metrics exposer) compile without
// Beast: only http/server.cc includes it.
#ifndef TANDEM_HTTP_HANDLER_H_
#define TANDEM_HTTP_HANDLER_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace tandem::http {

using HttpHeaderList = std::vector<std::pair<std::string, std::string>>;

struct HttpRequest {
  std::string method;      // "GET", "POST", ...
  std::string target;      // as sent: "/v1/models?x=1"
  std::string path;        // the target without its query
  HttpHeaderList headers;  // names lower-cased
  std::string body;

  // The first header named `name` (lower-case), or "".
  absl::string_view Header(absl::string_view name) const {
    for (const auto& [k, v] : headers) {
      if (k == name) return v;
    }
    return {};
  }
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  HttpHeaderList headers;  // extra headers (Retry-After, Allow, ...)
  std::string body;
};

// Answers one request. Thread-safe: any method may be called from any thread;
// the server applies them in call order on the connection's strand. A writer
// dropped without a response makes the server answer 500.
class ResponseWriter {
 public:
  virtual ~ResponseWriter() = default;
  // A whole response (Content-Length). Once; not after StartStream().
  virtual void Send(HttpResponse response) = 0;
  // Starts a streamed (chunked) response: status line and headers go out now.
  virtual void StartStream(int status, std::string content_type,
                           HttpHeaderList headers) = 0;
  // Appends `data` to the stream as one chunk, written (flushed) as soon as
  // the socket takes it.
  virtual void Write(std::string data) = 0;
  // Ends the stream.
  virtual void End() = 0;
  // `callback` runs once, on an I/O thread, if the client disconnects (or the
  // server drops the connection) before the response has ended; at once if
  // that already happened. At most one callback.
  virtual void OnClientGone(std::function<void()> callback) = 0;
};

using HttpHandler =
    std::function<void(HttpRequest request, std::shared_ptr<ResponseWriter> writer)>;

// Formats the server's own error responses (413, 431, 400 malformed, 408, 500).
using HttpErrorFormatter = std::function<HttpResponse(int status, std::string message)>;

}  // namespace tandem::http

#endif  // TANDEM_HTTP_HANDLER_H_
