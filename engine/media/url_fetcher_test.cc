#include "engine/media/url_fetcher.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::media {
namespace {

using ::testing::HasSubstr;

// A tiny HTTP/1.0-style server on 127.0.0.1, port 0, one connection at a time.
class TestServer {
 public:
  TestServer() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(listen(fd_, 16), 0);
    socklen_t len = sizeof(addr);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { Serve(); });
  }
  ~TestServer() {
    stop_ = true;
    shutdown(fd_, SHUT_RDWR);
    close(fd_);
    thread_.join();
  }
  std::string Url(const std::string& host, const std::string& path) const {
    return absl::StrCat("http://", host, ":", port_, path);
  }

 private:
  void Serve() {
    while (!stop_) {
      const int c = accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      std::string request;
      char buf[4096];
      while (request.find("\r\n\r\n") == std::string::npos) {
        const ssize_t n = read(c, buf, sizeof(buf));
        if (n <= 0) break;
        request.append(buf, n);
      }
      const size_t sp = request.find(' ');
      const std::string path =
          sp == std::string::npos
              ? ""
              : request.substr(sp + 1, request.find(' ', sp + 1) - sp - 1);
      std::string response;
      if (path == "/img") {
        response =
            "HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 7\r\n"
            "Connection: close\r\n\r\nPNGDATA";
      } else if (path == "/r1") {
        response =
            "HTTP/1.1 302 Found\r\nLocation: /img\r\nContent-Length: 0\r\n"
            "Connection: close\r\n\r\n";
      } else if (path == "/loop") {
        response =
            "HTTP/1.1 302 Found\r\nLocation: /loop\r\nContent-Length: 0\r\n"
            "Connection: close\r\n\r\n";
      } else if (path == "/big") {
        response =
            "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + std::string(5000, 'x');
      } else if (path == "/slow") {
        const std::string head =
            "HTTP/1.1 200 OK\r\nContent-Length: 100\r\nConnection: "
            "close\r\n\r\n0123456789";
        (void)!write(c, head.data(), head.size());
        for (int i = 0; i < 30 && !stop_; ++i) usleep(50 * 1000);
      } else {
        response =
            "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
      }
      if (!response.empty()) (void)!write(c, response.data(), response.size());
      close(c);
    }
  }

  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

FetchOptions Local() {
  FetchOptions o;
  o.allowed_domains = {"127.0.0.1", "localhost"};
  o.allow_private_addresses = true;
  o.timeout = absl::Seconds(5);
  return o;
}

TEST(FetchUrl, FetchesAndFollowsRedirects) {
  TestServer server;
  auto r = FetchUrl(server.Url("127.0.0.1", "/img"), Local());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->body, "PNGDATA");
  EXPECT_EQ(r->content_type, "image/png");
  auto redirected = FetchUrl(server.Url("127.0.0.1", "/r1"), Local());
  ASSERT_TRUE(redirected.ok()) << redirected.status();
  EXPECT_EQ(redirected->body, "PNGDATA");
  auto missing = FetchUrl(server.Url("127.0.0.1", "/nope"), Local());
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("HTTP 404"));
}

TEST(FetchUrl, RedirectLimit) {
  TestServer server;
  auto r = FetchUrl(server.Url("127.0.0.1", "/loop"), Local());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("more than 3 times"));
}

TEST(FetchUrl, SlowBodyTimesOut) {
  TestServer server;
  FetchOptions o = Local();
  o.timeout = absl::Milliseconds(300);
  const absl::Time start = absl::Now();
  auto r = FetchUrl(server.Url("127.0.0.1", "/slow"), o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1.2));
}

TEST(FetchUrl, OversizedBody) {
  TestServer server;
  FetchOptions o = Local();
  o.max_bytes = 1000;
  auto r = FetchUrl(server.Url("127.0.0.1", "/big"), o);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("over the limit of 1000"));
  o.max_bytes = 5000;
  EXPECT_TRUE(FetchUrl(server.Url("127.0.0.1", "/big"), o).ok());
}

TEST(FetchUrl, DisallowedDomainAndLoopbackRefused) {
  TestServer server;
  FetchOptions o = Local();
  o.allowed_domains = {"example.com"};
  auto domain = FetchUrl(server.Url("127.0.0.1", "/img"), o);
  ASSERT_FALSE(domain.ok());
  EXPECT_THAT(std::string(domain.status().message()),
              HasSubstr("not in --allowed_media_domains"));
  o = Local();
  o.allow_private_addresses = false;
  for (const char* host : {"127.0.0.1", "localhost"}) {
    auto r = FetchUrl(server.Url(host, "/img"), o);
    ASSERT_FALSE(r.ok()) << host;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("loopback")) << host;
  }
  o.allowed_domains.clear();
  auto none = FetchUrl(server.Url("127.0.0.1", "/img"), o);
  ASSERT_FALSE(none.ok());
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("disabled"));
  for (const char* url : {"file:///etc/passwd", "ftp://127.0.0.1/x", "gopher://a/"}) {
    auto r = FetchUrl(url, Local());
    ASSERT_FALSE(r.ok()) << url;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << url;
  }
}

TEST(IsPublicAddress, Table) {
  for (const char* a : {"8.8.8.8", "1.1.1.1", "2606:4700::1111", "172.32.0.1"}) {
    EXPECT_TRUE(IsPublicAddress(a)) << a;
  }
  for (const char* a :
       {"127.0.0.1", "10.1.2.3", "172.16.0.1", "172.31.255.255", "192.168.1.1",
        "169.254.169.254", "100.64.0.1", "0.0.0.0", "224.0.0.1", "::1", "::", "fe80::1",
        "fc00::1", "fd12::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "64:ff9b::a00:1",
        "not an address"}) {
    EXPECT_FALSE(IsPublicAddress(a)) << a;
  }
}

TEST(DomainAllowed, SubdomainsButNotSuffixes) {
  const std::vector<std::string> d = {"example.com", "CDN.test"};
  EXPECT_TRUE(DomainAllowed("example.com", d));
  EXPECT_TRUE(DomainAllowed("img.Example.com", d));
  EXPECT_TRUE(DomainAllowed("cdn.test", d));
  EXPECT_FALSE(DomainAllowed("badexample.com", d));
  EXPECT_FALSE(DomainAllowed("example.com.evil.net", d));
  EXPECT_FALSE(DomainAllowed("com", d));
  EXPECT_TRUE(DomainAllowed("anything.net", {"*"}));
  EXPECT_FALSE(DomainAllowed("anything.net", {}));
}

}  // namespace
}  // namespace tandem::media
