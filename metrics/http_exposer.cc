#include "metrics/http_exposer.h"

#include <atomic>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <memory>
#include <optional>
#include <thread>
#include <unordered_set>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "metrics/text_format.h"

namespace tandem::metrics {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

std::chrono::steady_clock::duration ToChrono(absl::Duration d) {
  return std::chrono::nanoseconds(absl::ToInt64Nanoseconds(d));
}

// After an error response the client may still be sending (an oversized
// request): read and discard for at most this long before closing, so the close
// does not turn into a reset that destroys the response in flight.
constexpr auto kLingerTime = std::chrono::seconds(2);
constexpr size_t kLingerMaxBytes = 1 << 20;

// A parse error (as opposed to a socket error).
bool IsHttpError(const beast::error_code& ec) {
  return ec.category() == http::make_error_code(http::error::end_of_stream).category();
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
      : options_(std::move(options)), registries_(std::move(registries)) {}

  ~Impl() { Stop(); }

  absl::Status Start();
  void Stop();
  int port() const { return port_.load(); }
  int open_connections() const { return open_connections_.load(); }

 private:
  class Session;

  void DoAccept();
  http::response<http::string_body> Handle(const http::request<http::string_body>& req);

  const HttpExposerOptions options_;
  const std::vector<const Registry*> registries_;  // not owned
  std::atomic<int> port_{0};
  std::atomic<int> open_connections_{0};

  absl::Mutex lifecycle_mu_;  // serialises Start() and Stop()
  bool started_ ABSL_GUARDED_BY(lifecycle_mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(lifecycle_mu_) = false;

  // Touched only on the io thread (or before it starts / after it joins).
  // Declared before ioc_ so that it outlives handlers destroyed with ioc_.
  std::unordered_set<Session*> sessions_;
  bool stopping_ = false;

  asio::io_context ioc_{1};
  tcp::acceptor acceptor_{ioc_};
  asio::steady_timer accept_retry_{ioc_};
  std::thread thread_;
};

// One client connection: read request → handle → write response → repeat
// (keep-alive) or close. Owned by its pending asynchronous operation (through
// shared_from_this); lives on the io thread.
class HttpExposer::Impl::Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, Impl* server)
      : stream_(std::move(socket)), server_(server) {
    server_->sessions_.insert(this);
    server_->open_connections_.fetch_add(1);
  }
  ~Session() {
    server_->sessions_.erase(this);
    server_->open_connections_.fetch_sub(1);
  }

  void Start() { ReadRequest(); }

  // Stop(): abort whatever is pending; the handlers then see `stopping_`.
  void Abort() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.close();
  }

 private:
  void ReadRequest() {
    parser_.emplace();
    parser_->header_limit(static_cast<uint32_t>(server_->options_.max_request_bytes));
    parser_->body_limit(server_->options_.max_request_bytes);
    stream_.expires_after(ToChrono(server_->options_.read_timeout));
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) {
                       self->OnRead(ec);
                     });
  }

  void OnRead(beast::error_code ec) {
    if (server_->stopping_) return;
    if (ec == http::error::end_of_stream || ec == beast::error::timeout ||
        ec == asio::error::operation_aborted) {
      return Close();
    }
    if (ec == http::error::header_limit || ec == http::error::buffer_overflow) {
      return WriteError(http::status::request_header_fields_too_large,
                        "request headers too large\n");
    }
    if (ec == http::error::body_limit) {
      return WriteError(http::status::payload_too_large, "request body too large\n");
    }
    if (ec && IsHttpError(ec)) {
      return WriteError(http::status::bad_request,
                        absl::StrCat("malformed request: ", ec.message(), "\n"));
    }
    if (ec) return Close();  // reset by peer and the like

    const http::request<http::string_body>& req = parser_->get();
    response_ = server_->Handle(req);
    response_.keep_alive(req.keep_alive());
    Write(/*close_after=*/!req.keep_alive(), /*linger=*/false);
  }

  void WriteError(http::status status, std::string body) {
    response_ = {};
    response_.result(status);
    response_.version(11);
    response_.set(http::field::content_type, "text/plain; charset=utf-8");
    response_.body() = std::move(body);
    response_.keep_alive(false);
    response_.prepare_payload();
    Write(/*close_after=*/true, /*linger=*/true);
  }

  void Write(bool close_after, bool linger) {
    stream_.expires_after(ToChrono(server_->options_.write_timeout));
    http::async_write(
        stream_, response_,
        [self = shared_from_this(), close_after, linger](beast::error_code ec, size_t) {
          if (self->server_->stopping_) return;
          if (ec) return self->Close();
          if (!close_after) return self->ReadRequest();
          if (linger) return self->Linger();
          self->Close();
        });
  }

  // Half-close, then discard what the client still sends until it closes, the
  // byte cap or kLingerTime.
  void Linger() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    stream_.expires_after(kLingerTime);
    Drain();
  }
  void Drain() {
    stream_.async_read_some(
        asio::buffer(scratch_),
        [self = shared_from_this()](beast::error_code ec, size_t n) {
          if (self->server_->stopping_) return;
          self->lingered_ += n;
          if (ec || self->lingered_ > kLingerMaxBytes) return self->Close();
          self->Drain();
        });
  }

  void Close() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.close();
  }

  beast::tcp_stream stream_;
  Impl* const server_;  // not owned; outlives every session
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  http::response<http::string_body> response_;
  char scratch_[4096];
  size_t lingered_ = 0;
};

http::response<http::string_body> HttpExposer::Impl::Handle(
    const http::request<http::string_body>& req) {
  http::response<http::string_body> res;
  res.version(req.version());
  res.set(http::field::server, "tandem-metrics");
  beast::string_view target = req.target();
  if (const size_t q = target.find('?'); q != beast::string_view::npos) {
    target = target.substr(0, q);
  }
  const bool known = target == "/metrics" || target == "/healthz";
  if (req.method() != http::verb::get) {
    res.result(http::status::method_not_allowed);
    res.set(http::field::allow, "GET");
    res.set(http::field::content_type, "text/plain; charset=utf-8");
    res.body() = "method not allowed\n";
  } else if (!known) {
    res.result(http::status::not_found);
    res.set(http::field::content_type, "text/plain; charset=utf-8");
    res.body() = "not found\n";
  } else if (target == "/healthz") {
    res.result(http::status::ok);
    res.set(http::field::content_type, "text/plain; charset=utf-8");
    res.body() = "ok";
  } else {
    res.result(http::status::ok);
    res.set(http::field::content_type,
            beast::string_view(kTextContentType.data(), kTextContentType.size()));
    res.body() = RenderMetrics(registries_);
  }
  res.prepare_payload();
  return res;
}

void HttpExposer::Impl::DoAccept() {
  acceptor_.async_accept([this](beast::error_code ec, tcp::socket socket) {
    if (stopping_) return;
    if (ec == asio::error::operation_aborted) return;
    if (ec) {
      // Out of descriptors and the like: back off instead of spinning.
      TLOG(WARNING, "metrics exposer accept failed").Kv("error", ec.message());
      accept_retry_.expires_after(std::chrono::milliseconds(100));
      accept_retry_.async_wait([this](beast::error_code e) {
        if (!e && !stopping_) DoAccept();
      });
      return;
    }
    if (static_cast<int>(sessions_.size()) >= options_.max_connections) {
      beast::error_code ignored;
      socket.close(ignored);
    } else {
      beast::error_code ignored;
      socket.set_option(tcp::no_delay(true), ignored);
      std::make_shared<Session>(std::move(socket), this)->Start();
    }
    DoAccept();
  });
}

absl::Status HttpExposer::Impl::Start() {
  absl::MutexLock lock(&lifecycle_mu_);
  if (started_ || stopped_) {
    return absl::FailedPreconditionError("metrics exposer already started");
  }
  const std::string where = absl::StrCat(options_.host, ":", options_.port);
  if (options_.port < 0 || options_.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics exposer: bad port ", where));
  }
  beast::error_code ec;
  tcp::endpoint endpoint;
  const asio::ip::address address = asio::ip::make_address(options_.host, ec);
  if (!ec) {
    endpoint = tcp::endpoint(address, static_cast<uint16_t>(options_.port));
  } else {
    tcp::resolver resolver(ioc_);
    auto results = resolver.resolve(options_.host, std::to_string(options_.port),
                                    tcp::resolver::passive, ec);
    if (ec || results.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "metrics exposer: cannot resolve host ", where, ": ", ec.message()));
    }
    endpoint = results.begin()->endpoint();
  }
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    beast::error_code ignored;
    acceptor_.close(ignored);
    return absl::UnavailableError(
        absl::StrCat("metrics exposer: cannot listen on ", where, ": ", ec.message()));
  }
  port_.store(acceptor_.local_endpoint(ec).port());
  started_ = true;
  DoAccept();
  thread_ = std::thread([this] { ioc_.run(); });
  TLOG(INFO, "metrics exposer listening").Kv("host", options_.host).Kv("port", port());
  return absl::OkStatus();
}

void HttpExposer::Impl::Stop() {
  absl::MutexLock lock(&lifecycle_mu_);
  if (stopped_) return;
  stopped_ = true;
  if (!started_) return;
  asio::post(ioc_, [this] {
    stopping_ = true;
    beast::error_code ignored;
    acceptor_.close(ignored);
    accept_retry_.cancel();
    // Copy: an abort may end a session (and erase it) before we move on.
    std::vector<Session*> open(sessions_.begin(), sessions_.end());
    for (Session* session : open) session->Abort();
  });
  // run() returns once the aborted operations have completed and nothing is left.
  thread_.join();
}

HttpExposer::HttpExposer(HttpExposerOptions options,
                         std::vector<const Registry*> registries)
    : impl_(std::make_unique<Impl>(std::move(options), std::move(registries))) {}

HttpExposer::~HttpExposer() = default;

absl::Status HttpExposer::Start() { return impl_->Start(); }
void HttpExposer::Stop() { impl_->Stop(); }
int HttpExposer::port() const { return impl_->port(); }
int HttpExposer::open_connections() const { return impl_->open_connections(); }

}  // namespace tandem::metrics
