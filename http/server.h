// The one HTTP/1.1 server of Tandem, on Boost.Beast: the OpenAI gateway and
// every process's /metrics (metrics::HttpExposer) run on it.
// N I/O threads share one io_context, each connection lives on its own strand
// and costs no thread (thousands of concurrent SSE streams), keep-alive,
// bounded request size, header/body/idle/write deadlines, graceful shutdown.
//
//   HttpServer server(options, handler, error_formatter);
//   TANDEM_RETURN_IF_ERROR(server.Start());     // port 0 picks a free port
//   ...
//   server.Shutdown(absl::Seconds(10));         // drain, then close
//
// Flow of one connection (all on its strand):
//   accept → [idle wait for the first byte, idle_timeout]
//          → read header (header_timeout) → [100-continue] → read body
//            (body_timeout, max_body_bytes → 413)
//          → handler(request, writer)  ── meanwhile: watch the socket; a client
//            that closes fires the writer's OnClientGone callback
//          → writer.Send() | StartStream() Write()* End()   (each write flushed,
//            write_timeout each; a client too slow to take max_buffered_bytes
//            is dropped; a Write() with nothing queued before it is sent
//            from the caller's thread, see direct_writes)
//          → keep-alive: next request | close
// Errors found by the server itself (malformed 400, too large 413/431) are
// answered through the error formatter and the connection is closed; a read
// deadline that passes closes the connection without a response. A response
// to HEAD goes out without its body (its Content-Length kept).
//
// HTTPS (HttpServerOptions::tls_cert_file): each accepted connection is a TLS
// stream whose plaintext is relayed, on the connection's strand, to a session
// like any other over a local socket pair, so everything above (deadlines,
// streaming, the client-gone watch) is the same code for both.
//
// Lifetime: writers must be released before the server is destroyed (the
// destructor waits for them, bounded, after stopping).
#ifndef TANDEM_HTTP_SERVER_H_
#define TANDEM_HTTP_SERVER_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "http/handler.h"

namespace tandem::http {

struct HttpServerOptions {
  // Sent as the `Server:` header; also names the server in its logs and errors.
  std::string server_name = "tandem";
  std::string host = "127.0.0.1";  // "0.0.0.0" or "::" for every interface
  int port = 0;                    // 0: any free port, see port()
  int io_threads = 2;
  size_t max_body_bytes = 4 << 20;
  size_t max_header_bytes = 64 << 10;
  absl::Duration header_timeout = absl::Seconds(10);
  absl::Duration body_timeout = absl::Seconds(30);
  absl::Duration idle_timeout = absl::Seconds(60);   // keep-alive, between requests
  absl::Duration write_timeout = absl::Seconds(30);  // each write
  int max_connections = 10000;           // further connections are closed at once
  size_t max_buffered_bytes = 16 << 20;  // per connection, not yet written
  // A streamed chunk is sent from the writer's thread when nothing of the
  // response waits to be written (no hop to an I/O thread); false: every
  // write goes through the connection's strand.
  bool direct_writes = true;
  // A write that follows the previous one of its response by less than this
  // is part of a burst and goes through the strand, which batches (fewer
  // syscalls than one send per chunk).
  absl::Duration direct_write_min_gap = absl::Milliseconds(5);
  // HTTPS: a PEM certificate chain and its private key (both or neither; the
  // gateway's --ssl_certfile/--ssl_keyfile). Every connection is then TLS 1.2+,
  // the handshake bounded by header_timeout. The files are read again when they
  // change (checked on accept, at most once per tls_reload_period), so a renewed
  // Kubernetes Secret takes effect for new connections without a restart; a
  // renewal that does not load is logged and the previous certificate kept.
  std::string tls_cert_file;
  std::string tls_key_file;
  // Optional: clients must present a certificate this CA (PEM) signed (mTLS).
  std::string tls_client_ca_file;
  absl::Duration tls_reload_period = absl::Seconds(10);
};

class HttpServer {
 public:
  HttpServer(HttpServerOptions options, HttpHandler handler,
             HttpErrorFormatter error_formatter);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and starts the I/O threads. Unavailable when the address cannot be
  // bound, InvalidArgument for a bad host/port or TLS files that do not load
  // (named, with OpenSSL's reason), FailedPrecondition if called twice.
  absl::Status Start();
  // Stops accepting; idle connections close now, requests in flight get up
  // to `grace` to finish (their connections close after the response); then
  // every connection is closed and the threads joined. Idempotent.
  void Shutdown(absl::Duration grace);

  int port() const;
  int open_connections() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::http

#endif  // TANDEM_HTTP_SERVER_H_
