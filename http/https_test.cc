// HTTPS on the HTTP server (HttpServerOptions::tls_*): requests, keep-alive,
// SSE streams and a large response through the TLS relay byte for byte; a
// plain-HTTP client on the HTTPS port gets nothing and the server keeps
// serving; a client that goes away is noticed; client certificates when a
// client CA is configured; a renewed certificate is picked up for new
// connections; bad files are refused at Start with the file named.
// Certificates are made with the openssl command line (Debian's openssl).
#include <unistd.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "http/server.h"

namespace tandem::http {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
namespace ssl = asio::ssl;
using tcp = asio::ip::tcp;

std::string Tmp() {
  const char* t = std::getenv("TEST_TMPDIR");
  return t != nullptr ? t : "/tmp";
}

void Shell(const std::string& cmd) {
  ASSERT_EQ(std::system((cmd + " >/dev/null 2>&1").c_str()), 0) << cmd;
}

// A self-signed CA `name` (name.crt, name.key) in TEST_TMPDIR.
std::string MakeCa(const std::string& name) {
  const std::string p = Tmp() + "/" + name;
  Shell(
      absl::StrCat("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 "
                   "-nodes -days 2 -subj /CN=",
                   name, " -keyout ", p, ".key -out ", p, ".crt"));
  return p;
}

// A certificate `name` signed by the CA at `ca` (its path prefix).
std::string MakeCert(const std::string& ca, const std::string& name) {
  const std::string p = Tmp() + "/" + name;
  Shell(absl::StrCat(
      "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
      "-subj /CN=",
      name, " -keyout ", p, ".key -out ", p, ".csr"));
  Shell(absl::StrCat("openssl x509 -req -days 2 -in ", p, ".csr -CA ", ca,
                     ".crt -CAkey ", ca, ".key -CAcreateserial -out ", p, ".crt"));
  return p;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A blocking HTTPS client: verifies the server against `ca` (path prefix),
// optionally presents the certificate at `client` (path prefix).
class Client {
 public:
  Client(const std::string& ca, const std::string& client = "")
      : ctx_(ssl::context::tls_client) {
    ctx_.load_verify_file(ca + ".crt");
    ctx_.set_verify_mode(ssl::verify_peer);
    if (!client.empty()) {
      ctx_.use_certificate_chain_file(client + ".crt");
      ctx_.use_private_key_file(client + ".key", ssl::context::pem);
    }
    stream_ = std::make_unique<ssl::stream<tcp::socket>>(ioc_, ctx_);
  }

  beast::error_code Connect(int port) {
    beast::error_code ec;
    stream_->next_layer().connect(
        tcp::endpoint(asio::ip::make_address("127.0.0.1"), static_cast<uint16_t>(port)),
        ec);
    if (ec) return ec;
    stream_->handshake(ssl::stream_base::client, ec);
    return ec;
  }

  // One request on the connection; the response (body de-chunked).
  absl::StatusOr<bhttp::response<bhttp::string_body>> Request(
      const std::string& target, const std::string& body = "") {
    bhttp::request<bhttp::string_body> req{
        body.empty() ? bhttp::verb::get : bhttp::verb::post, target, 11};
    req.set(bhttp::field::host, "127.0.0.1");
    req.set("X-Test", "v");
    req.body() = body;
    req.prepare_payload();
    beast::error_code ec;
    bhttp::write(*stream_, req, ec);
    if (ec) return absl::UnavailableError(ec.message());
    bhttp::response_parser<bhttp::string_body> parser;
    parser.body_limit(64 << 20);
    bhttp::read(*stream_, buffer_, parser, ec);
    if (ec) return absl::UnavailableError(ec.message());
    return parser.release();
  }

  // The server's leaf certificate, PEM.
  std::string PeerCertificatePem() {
    X509* cert = SSL_get1_peer_certificate(stream_->native_handle());
    if (cert == nullptr) return "";
    BIO* bio = BIO_new(BIO_s_mem());
    PEM_write_bio_X509(bio, cert);
    char* data = nullptr;
    const long n = BIO_get_mem_data(bio, &data);
    std::string out(data, n);
    BIO_free(bio);
    X509_free(cert);
    return out;
  }

  // Goes away while another thread may be blocked reading: shutdown(2) sends
  // the FIN and wakes that read (a close(2) does neither while the read holds
  // the socket: the read then waits forever, as this test once did in CI). The
  // socket itself is closed by the destructor, after that thread is joined.
  void Close() {
    beast::error_code ignored;
    stream_->next_layer().shutdown(tcp::socket::shutdown_both, ignored);
  }

 private:
  asio::io_context ioc_;
  ssl::context ctx_;
  std::unique_ptr<ssl::stream<tcp::socket>> stream_;
  beast::flat_buffer buffer_;
};

HttpResponse PlainError(int status, std::string message) {
  return {.status = status, .content_type = "text/plain", .body = message};
}

std::string BigChunk(int i) {
  std::string out = std::to_string(i) + ":";
  out.resize(32 << 10, static_cast<char>('a' + i % 26));
  return out;
}
constexpr int kBigChunks = 100;

class HttpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ca_ = MakeCa("ca");
    server_cert_ = MakeCert(ca_, "server");
  }
  void TearDown() override {
    for (auto& t : producers_) t.join();
    held_.reset();
    if (server_) server_->Shutdown(absl::Seconds(1));
  }

  HttpServerOptions Options() {
    HttpServerOptions o;
    o.tls_cert_file = server_cert_ + ".crt";
    o.tls_key_file = server_cert_ + ".key";
    return o;
  }

  absl::Status Start(HttpServerOptions o) {
    server_ = std::make_unique<HttpServer>(
        o,
        [this](HttpRequest req, std::shared_ptr<ResponseWriter> w) { Handle(req, w); },
        &PlainError);
    return server_->Start();
  }

  void Handle(const HttpRequest& req, std::shared_ptr<ResponseWriter> w) {
    if (req.path == "/echo") {
      w->Send({.status = 200,
               .content_type = "text/plain",
               .body = req.body + "|" + std::string(req.Header("x-test"))});
    } else if (req.path == "/stream") {
      w->StartStream(200, "text/event-stream", {});
      for (int i = 0; i < 3; ++i) w->Write("data: event" + std::to_string(i) + "\n\n");
      w->End();
    } else if (req.path == "/big") {
      w->StartStream(200, "application/octet-stream", {});
      producers_.emplace_back([w] {
        for (int i = 0; i < kBigChunks; ++i) w->Write(BigChunk(i));
        w->End();
      });
    } else if (req.path == "/hang") {
      w->OnClientGone([this] { gone_.Notify(); });
      w->StartStream(200, "text/event-stream", {});
      w->Write("data: first\n\n");
      held_ = w;  // never ends
      hanging_.Notify();
    } else {
      w->Send({.status = 404, .body = "nope"});
    }
  }

  std::string ca_, server_cert_;
  std::unique_ptr<HttpServer> server_;
  std::vector<std::thread> producers_;
  std::shared_ptr<ResponseWriter> held_;
  absl::Notification gone_;
  absl::Notification hanging_;  // /hang reached the handler
};

TEST_F(HttpsTest, RequestsStreamsAndLargeResponsesOverTls) {
  ASSERT_TRUE(Start(Options()).ok());
  Client c(ca_);
  ASSERT_FALSE(c.Connect(server_->port())) << "handshake";
  for (int i = 0; i < 3; ++i) {  // keep-alive: one TLS connection
    auto r = c.Request("/echo", "body" + std::to_string(i));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->result_int(), 200);
    EXPECT_EQ(r->body(), "body" + std::to_string(i) + "|v");
  }
  EXPECT_EQ(server_->open_connections(), 1);
  auto s = c.Request("/stream");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->body(), "data: event0\n\ndata: event1\n\ndata: event2\n\n");
  auto big = c.Request("/big");
  ASSERT_TRUE(big.ok()) << big.status();
  std::string want;
  for (int i = 0; i < kBigChunks; ++i) want += BigChunk(i);
  ASSERT_EQ(big->body().size(), want.size());
  EXPECT_TRUE(big->body() == want);
  EXPECT_EQ(c.PeerCertificatePem(), ReadFile(server_cert_ + ".crt"));
}

TEST_F(HttpsTest, PlainHttpOnTheHttpsPortGetsNoResponseAndServingGoesOn) {
  HttpServerOptions o = Options();
  o.header_timeout = absl::Seconds(2);
  ASSERT_TRUE(Start(o).ok());
  {
    asio::io_context ioc;
    tcp::socket s(ioc);
    s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"),
                            static_cast<uint16_t>(server_->port())));
    const std::string req = "GET /echo HTTP/1.1\r\nHost: x\r\n\r\n";
    asio::write(s, asio::buffer(req));
    std::string got;
    beast::error_code ec;
    char buf[512];
    while (!ec) {
      const size_t n = s.read_some(asio::buffer(buf), ec);
      got.append(buf, n);
    }
    EXPECT_EQ(got.find("HTTP/1.1"), std::string::npos) << got;  // no HTTP response
  }
  Client c(ca_);
  ASSERT_FALSE(c.Connect(server_->port()));
  auto r = c.Request("/echo", "x");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->body(), "x|v");
}

TEST_F(HttpsTest, ClientGoingAwayIsNoticed) {
  ASSERT_TRUE(Start(Options()).ok());
  Client c(ca_);
  ASSERT_FALSE(c.Connect(server_->port()));
  std::thread reader([&c] { (void)c.Request("/hang"); });
  ASSERT_TRUE(hanging_.WaitForNotificationWithTimeout(absl::Seconds(10)));
  c.Close();
  reader.join();
  EXPECT_TRUE(gone_.WaitForNotificationWithTimeout(absl::Seconds(10)));
}

TEST_F(HttpsTest, ClientCertificatesRequiredWhenAClientCaIsGiven) {
  HttpServerOptions o = Options();
  o.tls_client_ca_file = ca_ + ".crt";
  ASSERT_TRUE(Start(o).ok());
  const std::string good = MakeCert(ca_, "client");
  const std::string other_ca = MakeCa("other-ca");
  const std::string stranger = MakeCert(other_ca, "stranger");
  {
    Client c(ca_, good);
    ASSERT_FALSE(c.Connect(server_->port()));
    auto r = c.Request("/echo", "ok");
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->body(), "ok|v");
  }
  for (const std::string& who : {std::string(), stranger}) {
    Client c(ca_, who);
    // TLS 1.3 reports the refusal on the first read rather than the handshake.
    const bool refused = c.Connect(server_->port()) || !c.Request("/echo", "no").ok();
    EXPECT_TRUE(refused) << (who.empty() ? "no certificate" : who);
  }
}

TEST_F(HttpsTest, RenewedCertificateServesNewConnections) {
  HttpServerOptions o = Options();
  o.tls_reload_period = absl::ZeroDuration();
  ASSERT_TRUE(Start(o).ok());
  const std::string first = ReadFile(server_cert_ + ".crt");
  {
    Client c(ca_);
    ASSERT_FALSE(c.Connect(server_->port()));
    EXPECT_EQ(c.PeerCertificatePem(), first);
  }
  // Renewal: a new key and certificate written over the files.
  const std::string renewed = MakeCert(ca_, "renewed");
  Shell(absl::StrCat("cp ", renewed, ".key ", server_cert_, ".key"));
  Shell(absl::StrCat("cp ", renewed, ".crt ", server_cert_, ".crt"));
  Client c(ca_);
  ASSERT_FALSE(c.Connect(server_->port()));
  EXPECT_EQ(c.PeerCertificatePem(), ReadFile(renewed + ".crt"));
  EXPECT_NE(c.PeerCertificatePem(), first);
  auto r = c.Request("/echo", "after");
  ASSERT_TRUE(r.ok()) << r.status();
  // A renewal that does not load (a key that does not match) keeps the last one.
  const std::string third = MakeCert(ca_, "third");
  Shell(absl::StrCat("cp ", third, ".crt ", server_cert_,
                     ".crt"));  // key still "renewed"
  Client d(ca_);
  ASSERT_FALSE(d.Connect(server_->port()));
  EXPECT_EQ(d.PeerCertificatePem(), ReadFile(renewed + ".crt"));
}

TEST_F(HttpsTest, BadFilesAreRefusedAtStartNamingThem) {
  HttpServerOptions o = Options();
  o.tls_key_file = Tmp() + "/missing.key";
  absl::Status s = Start(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("missing.key"), std::string::npos) << s;
  const std::string other = MakeCert(ca_, "other");
  o.tls_key_file = other + ".key";  // does not match the certificate
  s = Start(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("does not match"), std::string::npos) << s;
  o = Options();
  o.tls_key_file.clear();
  s = Start(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("both a certificate and a private key"), std::string::npos)
      << s;
}

}  // namespace
}  // namespace tandem::http
