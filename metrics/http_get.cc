#include "metrics/http_get.h"

#include <algorithm>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace tandem::metrics {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

constexpr size_t kMaxResponseBytes = 256 << 20;

std::chrono::steady_clock::duration ToChrono(absl::Duration d) {
  return std::chrono::nanoseconds(absl::ToInt64Nanoseconds(d));
}

// A parse error (as opposed to a socket error).
bool IsHttpError(const beast::error_code& ec) {
  return ec.category() == http::make_error_code(http::error::end_of_stream).category();
}

absl::Status FromError(const beast::error_code& ec, absl::string_view what) {
  if (ec == beast::error::timeout || ec == asio::error::timed_out) {
    return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
  }
  if (IsHttpError(ec) && ec != http::error::end_of_stream &&
      ec != http::error::partial_message) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", ec.message()));
  }
  return absl::UnavailableError(absl::StrCat(what, ": ", ec.message()));
}

}  // namespace

std::string HttpResponse::Header(absl::string_view name) const {
  for (const auto& [key, value] : headers) {
    if (absl::EqualsIgnoreCase(key, name)) return value;
  }
  return "";
}

struct HttpConnection::Impl {
  asio::io_context ioc;
  beast::tcp_stream stream{ioc};
  beast::flat_buffer buffer;
  std::string host_header;

  // Runs the queued operation to completion; tcp_stream's expiry bounds it.
  void Run() {
    ioc.restart();
    ioc.run();
  }
};

HttpConnection::HttpConnection(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpConnection::~HttpConnection() {
  beast::error_code ec;
  impl_->stream.socket().shutdown(tcp::socket::shutdown_both, ec);
  impl_->stream.close();
}

absl::StatusOr<std::unique_ptr<HttpConnection>> HttpConnection::Connect(
    const std::string& host, int port, absl::Duration timeout) {
  if (port <= 0 || port > 65535)
    return absl::InvalidArgumentError(absl::StrCat("bad port ", port));
  auto impl = std::make_unique<Impl>();
  impl->host_header = absl::StrCat(host, ":", port);
  const std::string where = absl::StrCat("connect to ", host, ":", port);

  // Resolution (numeric hosts resolve without a lookup).
  tcp::resolver resolver(impl->ioc);
  beast::error_code ec;
  tcp::resolver::results_type endpoints;
  bool resolved = false;
  resolver.async_resolve(host, std::to_string(port),
                         [&](beast::error_code e, tcp::resolver::results_type r) {
                           ec = e;
                           endpoints = std::move(r);
                           resolved = true;
                         });
  impl->ioc.run_for(ToChrono(timeout));
  if (!resolved) {
    resolver.cancel();
    impl->Run();
    return absl::DeadlineExceededError(absl::StrCat(where, ": resolve timed out"));
  }
  if (ec) return absl::InvalidArgumentError(absl::StrCat(where, ": ", ec.message()));

  impl->stream.expires_after(ToChrono(timeout));
  impl->stream.async_connect(
      endpoints, [&](beast::error_code e, const tcp::endpoint&) { ec = e; });
  impl->Run();
  if (ec) return FromError(ec, where);
  impl->stream.socket().set_option(tcp::no_delay(true), ec);
  return std::unique_ptr<HttpConnection>(new HttpConnection(std::move(impl)));
}

absl::StatusOr<HttpResponse> HttpConnection::Request(
    absl::string_view method, absl::string_view target, const HttpHeaders& headers,
    absl::string_view body, absl::Duration timeout, bool keep_alive) {
  http::request<http::string_body> req;
  req.method_string(beast::string_view(method.data(), method.size()));
  req.target(beast::string_view(target.data(), target.size()));
  req.version(11);
  req.set(http::field::host, impl_->host_header);
  for (const auto& [key, value] : headers) req.insert(key, value);
  req.keep_alive(keep_alive);
  req.body() = std::string(body);
  if (!body.empty() || method == "POST" || method == "PUT") req.prepare_payload();

  const auto deadline = std::chrono::steady_clock::now() + ToChrono(timeout);
  beast::error_code ec;
  impl_->stream.expires_at(deadline);
  http::async_write(impl_->stream, req, [&](beast::error_code e, size_t) { ec = e; });
  impl_->Run();
  if (ec) return FromError(ec, "send request");

  http::response_parser<http::string_body> parser;
  parser.header_limit(64 * 1024);
  parser.body_limit(kMaxResponseBytes);
  if (method == "HEAD") parser.skip(true);  // a response to HEAD has no body
  impl_->stream.expires_at(deadline);
  http::async_read(impl_->stream, impl_->buffer, parser,
                   [&](beast::error_code e, size_t) { ec = e; });
  impl_->Run();
  if (ec) return FromError(ec, "read response");

  http::response<http::string_body> res = parser.release();
  HttpResponse out;
  out.status_code = static_cast<int>(res.result_int());
  for (const auto& field : res) {
    out.headers.emplace_back(std::string(field.name_string()),
                             std::string(field.value()));
  }
  out.body = std::move(res.body());
  return out;
}

absl::Status HttpConnection::WaitForClose(absl::Duration timeout) {
  impl_->stream.expires_after(ToChrono(timeout));
  char scratch[4096];
  beast::error_code ec;
  while (!ec) {
    impl_->stream.async_read_some(asio::buffer(scratch),
                                  [&](beast::error_code e, size_t) { ec = e; });
    impl_->Run();
  }
  if (ec == asio::error::eof || ec == asio::error::connection_reset)
    return absl::OkStatus();
  return FromError(ec, "wait for close");
}

absl::StatusOr<HttpResponse> HttpGet(const std::string& host, int port,
                                     const std::string& path, absl::Duration timeout) {
  const auto deadline = absl::Now() + timeout;
  absl::StatusOr<std::unique_ptr<HttpConnection>> conn =
      HttpConnection::Connect(host, port, timeout);
  if (!conn.ok()) return conn.status();
  return (*conn)->Request("GET", path, {}, "",
                          std::max(deadline - absl::Now(), absl::ZeroDuration()),
                          /*keep_alive=*/false);
}

}  // namespace tandem::metrics
