// Serves the registries' metrics over HTTP/1.1 for Prometheus to scrape.
//
//   HttpExposer exposer({.host = "0.0.0.0", .port = 9464}, {&registry});
//   TANDEM_RETURN_IF_ERROR(exposer.Start());   // binds; port 0 picks a free port
//   ... exposer.port() ...
//   exposer.Stop();                            // or let the destructor do it
//
// Routes:  GET /metrics -> 200, text exposition 0.0.4 of every registry
//          GET /healthz -> 200 "ok"
//          other path   -> 404;  other method -> 405 (Allow: GET)
// A request larger than max_request_bytes gets 431 (headers) or 413 (body) and
// the connection is closed; a malformed one gets 400. A response to HEAD (405)
// has no body.
//
// Flow: the exposer is a handler on the shared HTTP server (http/server.h)
// with one I/O thread: Start() binds and listens; accept → read request
// (deadline read_timeout for the headers, again for the body; the same
// deadline for an idle keep-alive connection) → collect the registries and
// serialise, on the I/O thread → write (deadline write_timeout) → the next
// request on the same connection (keep-alive) or close. Every wait has a
// deadline, so an idle or stalled client is dropped after read_timeout.
// Stop() closes the listener and every open connection at once, then joins
// the thread.
//
// Several registries: their families are written one after another in the
// order given. Families of the same name and type in different registries are
// merged (their children listed together); a name registered with different
// types in two registries is written once, from the first registry.
#ifndef TANDEM_METRICS_HTTP_EXPOSER_H_
#define TANDEM_METRICS_HTTP_EXPOSER_H_

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "metrics/registry.h"

namespace tandem::metrics {

struct HttpExposerOptions {
  std::string host = "127.0.0.1";  // "0.0.0.0" or "::" for every interface
  int port = 0;                    // 0: any free port, see HttpExposer::port()
  size_t max_request_bytes = 16 * 1024;
  // The headers, the body, or an idle keep-alive connection, each.
  absl::Duration read_timeout = absl::Seconds(30);
  absl::Duration write_timeout = absl::Seconds(30);
  int max_connections = 64;  // further connections are closed at once
};

// The exposition of several registries (what GET /metrics returns).
std::string RenderMetrics(const std::vector<const Registry*>& registries);

class HttpExposer {
 public:
  // `registries` are not owned and must outlive the exposer.
  HttpExposer(HttpExposerOptions options, std::vector<const Registry*> registries);
  ~HttpExposer();  // Stop()
  HttpExposer(const HttpExposer&) = delete;
  HttpExposer& operator=(const HttpExposer&) = delete;

  // Binds and starts serving. Errors: Unavailable when the address is in use or
  // cannot be bound, InvalidArgument for a bad host, FailedPrecondition when
  // called twice.
  absl::Status Start();
  // Closes the listener and all connections and joins the thread. Idempotent;
  // returns promptly even while clients hold keep-alive connections.
  void Stop();

  // The bound port once Start() succeeded; 0 before.
  int port() const;
  // Connections currently open (for tests and diagnostics).
  int open_connections() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::metrics

#endif  // TANDEM_METRICS_HTTP_EXPOSER_H_
