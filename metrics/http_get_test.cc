#include "metrics/http_get.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "gtest/gtest.h"

namespace tandem::metrics {
namespace {

// A loopback listening socket that never accepts: connects succeed (the kernel
// completes the handshake into the backlog) but nothing is ever answered.
class SilentListener {
 public:
  SilentListener() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(listen(fd_, 16), 0);
    socklen_t len = sizeof(addr);
    EXPECT_EQ(getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len), 0);
    port_ = ntohs(addr.sin_port);
  }
  ~SilentListener() { Close(); }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

TEST(HttpGetTest, TimeoutWhenServerNeverAnswers) {
  SilentListener listener;
  const absl::Time start = absl::Now();
  absl::StatusOr<HttpResponse> r =
      HttpGet("127.0.0.1", listener.port(), "/metrics", absl::Milliseconds(300));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(HttpGetTest, ConnectionRefusedIsUnavailable) {
  int port;
  {
    SilentListener listener;
    port = listener.port();
  }  // closed: nothing listens on `port` now
  absl::StatusOr<HttpResponse> r = HttpGet("127.0.0.1", port, "/", absl::Seconds(5));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
}

TEST(HttpGetTest, BadPortIsInvalidArgument) {
  EXPECT_EQ(HttpGet("127.0.0.1", 0, "/", absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HttpGet("127.0.0.1", 70000, "/", absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(HttpGetTest, HeaderLookupIsCaseInsensitive) {
  HttpResponse r;
  r.headers = {{"Content-Type", "text/plain"}, {"X-A", "1"}, {"x-a", "2"}};
  EXPECT_EQ(r.Header("content-type"), "text/plain");
  EXPECT_EQ(r.Header("X-a"), "1");
  EXPECT_EQ(r.Header("missing"), "");
}

}  // namespace
}  // namespace tandem::metrics
