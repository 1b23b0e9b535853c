#include "metrics/http_exposer.h"

#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "http/server.h"
#include "metrics/text_format.h"

namespace tandem::metrics {
namespace {

constexpr absl::string_view kPlainText = "text/plain; charset=utf-8";

http::HttpResponse Plain(int status, std::string body) {
  return {.status = status,
          .content_type = std::string(kPlainText),
          .body = std::move(body)};
}

// The server's own errors (the request never reached Handle), in the words
// the exposer has always used.
http::HttpResponse FormatError(int status, std::string message) {
  switch (status) {
    case 431:
      return Plain(status, "request headers too large\n");
    case 413:
      return Plain(status, "request body too large\n");
    default:
      return Plain(status, absl::StrCat(message, "\n"));
  }
}

http::HttpServerOptions ServerOptions(const HttpExposerOptions& o) {
  http::HttpServerOptions s;
  s.server_name = "tandem-metrics";
  s.host = o.host;
  s.port = o.port;
  s.io_threads = 1;
  s.max_body_bytes = o.max_request_bytes;
  s.max_header_bytes = o.max_request_bytes;
  s.header_timeout = o.read_timeout;
  s.body_timeout = o.read_timeout;
  s.idle_timeout = o.read_timeout;
  s.write_timeout = o.write_timeout;
  s.max_connections = o.max_connections;
  return s;
}

}  // namespace

std::string RenderMetrics(const std::vector<const Registry*>& registries) {
  std::vector<FamilySnapshot> merged;
  absl::flat_hash_map<std::string, size_t> index;
  for (const Registry* registry : registries) {
    for (FamilySnapshot& family : registry->Collect()) {
      auto [it, inserted] = index.try_emplace(family.name, merged.size());
      if (inserted) {
        merged.push_back(std::move(family));
        continue;
      }
      FamilySnapshot& first = merged[it->second];
      if (first.type != family.type) continue;  // conflicting type: first one wins
      for (MetricSnapshot& m : family.metrics) first.metrics.push_back(std::move(m));
    }
  }
  return SerializeText(merged);
}

class HttpExposer::Impl {
 public:
  Impl(HttpExposerOptions options, std::vector<const Registry*> registries)
      : host_(options.host),
        registries_(std::move(registries)),
        server_(
            ServerOptions(options),
            [this](http::HttpRequest request,
                   std::shared_ptr<http::ResponseWriter> writer) {
              writer->Send(Handle(request));
            },
            &FormatError) {}

  absl::Status Start() {
    absl::Status s = server_.Start();
    if (s.ok()) {
      TLOG(INFO, "metrics exposer listening")
          .Kv("host", host_)
          .Kv("port", server_.port());
    }
    return s;
  }
  // Nothing of a scrape is worth waiting for: every connection closes now.
  void Stop() { server_.Shutdown(absl::ZeroDuration()); }
  int port() const { return server_.port(); }
  int open_connections() const { return server_.open_connections(); }

 private:
  // Runs on the server's I/O thread; answers at once.
  http::HttpResponse Handle(const http::HttpRequest& request) const {
    const bool known = request.path == "/metrics" || request.path == "/healthz";
    if (request.method != "GET") {
      http::HttpResponse r = Plain(405, "method not allowed\n");
      r.headers.emplace_back("Allow", "GET");
      return r;
    }
    if (!known) return Plain(404, "not found\n");
    if (request.path == "/healthz") return Plain(200, "ok");
    return {.status = 200,
            .content_type = std::string(kTextContentType),
            .body = RenderMetrics(registries_)};
  }

  const std::string host_;
  const std::vector<const Registry*> registries_;  // not owned
  http::HttpServer server_;
};

HttpExposer::HttpExposer(HttpExposerOptions options,
                         std::vector<const Registry*> registries)
    : impl_(std::make_unique<Impl>(std::move(options), std::move(registries))) {}

HttpExposer::~HttpExposer() { Stop(); }

absl::Status HttpExposer::Start() { return impl_->Start(); }
void HttpExposer::Stop() { impl_->Stop(); }
int HttpExposer::port() const { return impl_->port(); }
int HttpExposer::open_connections() const { return impl_->open_connections(); }

}  // namespace tandem::metrics
