#include "http/server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "metrics/http_get.h"

namespace tandem::http {
namespace {

HttpResponse PlainError(int status, std::string message) {
  return {.status = status, .content_type = "text/plain", .body = message};
}

// A connected loopback socket.
int Connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  return fd;
}

// Reads until the peer closes or `timeout_ms` passes.
std::string ReadAll(int fd, int timeout_ms) {
  std::string out;
  char buf[4096];
  while (true) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, timeout_ms) <= 0) break;
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, n);
  }
  return out;
}

constexpr int kBigChunks = 200;

// Chunk i of /big: 32 KiB, its index first, then a letter pattern.
std::string BigChunk(int i) {
  std::string out = std::to_string(i) + ":";
  out.resize(32 << 10, static_cast<char>('a' + i % 26));
  return out;
}

class HttpServerTest : public ::testing::Test {
 protected:
  void StartServer(HttpServerOptions options) {
    server_ = std::make_unique<HttpServer>(
        options,
        [this](HttpRequest req, std::shared_ptr<ResponseWriter> w) { Handle(req, w); },
        &PlainError);
    ASSERT_TRUE(server_->Start().ok());
  }
  void TearDown() override {
    std::vector<std::thread> producers;
    {
      absl::MutexLock lock(&mu_);
      held_.reset();
      producers.swap(producers_);
    }
    for (auto& t : producers) t.join();
    if (server_) server_->Shutdown(absl::Seconds(1));
  }

  void Handle(const HttpRequest& req, std::shared_ptr<ResponseWriter> w) {
    if (req.path == "/echo") {
      w->Send({.status = 200,
               .content_type = "text/plain",
               .headers = {{"X-Method", req.method}},
               .body = req.body + "|" + std::string(req.Header("x-test"))});
    } else if (req.path == "/stream") {
      w->StartStream(200, "text/event-stream", {});
      for (int i = 0; i < 3; ++i) w->Write("data: event" + std::to_string(i) + "\n\n");
      w->Write("data: [DONE]\n\n");
      w->End();
    } else if (req.path == "/big") {
      // Large chunks from another thread, faster than the client reads: the
      // socket fills, sends go partial, the rest queues on the strand.
      w->StartStream(200, "application/octet-stream", {});
      absl::MutexLock lock(&mu_);
      producers_.emplace_back([w] {
        for (int i = 0; i < kBigChunks; ++i) w->Write(BigChunk(i));
        w->End();
      });
    } else if (req.path == "/hang") {
      w->OnClientGone([this] { gone_.Notify(); });
      w->StartStream(200, "text/event-stream", {});
      w->Write("data: first\n\n");
      absl::MutexLock lock(&mu_);
      held_ = w;  // never ends
    } else if (req.path == "/hold") {
      absl::MutexLock lock(&mu_);
      held_ = w;  // answered by the test
      holding_.Notify();
    } else if (req.path == "/drop") {
      // Released without a response.
    } else {
      w->Send({.status = 404, .body = "nope"});
    }
  }

  std::unique_ptr<HttpServer> server_;
  absl::Mutex mu_;
  std::shared_ptr<ResponseWriter> held_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> producers_ ABSL_GUARDED_BY(mu_);
  absl::Notification gone_;
  absl::Notification holding_;  // /hold reached the handler
};

TEST_F(HttpServerTest, KeepAliveServesSeveralRequests) {
  StartServer({});
  auto conn =
      metrics::HttpConnection::Connect("127.0.0.1", server_->port(), absl::Seconds(5));
  ASSERT_TRUE(conn.ok());
  for (int i = 0; i < 3; ++i) {
    auto r = (*conn)->Request("POST", "/echo?q=1", {{"X-Test", "v"}},
                              "body" + std::to_string(i), absl::Seconds(5));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status_code, 200);
    EXPECT_EQ(r->body, "body" + std::to_string(i) + "|v");
    EXPECT_EQ(r->Header("X-Method"), "POST");
  }
  EXPECT_EQ(server_->open_connections(), 1);
  auto r = (*conn)->Get("/missing", absl::Seconds(5));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status_code, 404);
}

TEST_F(HttpServerTest, StreamIsChunkedSse) {
  StartServer({});
  auto conn =
      metrics::HttpConnection::Connect("127.0.0.1", server_->port(), absl::Seconds(5));
  ASSERT_TRUE(conn.ok());
  auto r = (*conn)->Get("/stream", absl::Seconds(5));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->Header("Transfer-Encoding"), "chunked");
  EXPECT_EQ(r->Header("Content-Type"), "text/event-stream");
  EXPECT_EQ(r->Header("Cache-Control"), "no-cache");
  // De-chunked by the client: the writes back to back, in order.
  EXPECT_EQ(r->body,
            "data: event0\n\ndata: event1\n\ndata: event2\n\ndata: [DONE]\n\n");
  // The connection is reusable after a stream.
  auto again = (*conn)->Request("POST", "/echo", {}, "x", absl::Seconds(5));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->body, "x|");
}

// Writes from another thread keep their order and bytes whichever way each
// goes out: sent at once from the writer's thread, partly (a full socket),
// or queued behind an in-flight write on the strand.
TEST_F(HttpServerTest, LargeStreamArrivesInOrderWithAndWithoutDirectWrites) {
  std::string expected;
  for (int i = 0; i < kBigChunks; ++i) expected += BigChunk(i);
  for (bool direct : {true, false}) {
    SCOPED_TRACE(direct ? "direct writes" : "strand only");
    StartServer({.direct_writes = direct,
                 .direct_write_min_gap = absl::ZeroDuration()});  // never a burst
    auto conn = metrics::HttpConnection::Connect("127.0.0.1", server_->port(),
                                                 absl::Seconds(5));
    ASSERT_TRUE(conn.ok()) << conn.status();
    auto r = (*conn)->Get("/big", absl::Seconds(30));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status_code, 200);
    ASSERT_EQ(r->body.size(), expected.size());
    EXPECT_TRUE(r->body == expected);
    // The connection is still usable (keep-alive after the stream ended).
    auto again = (*conn)->Get("/stream", absl::Seconds(5));
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->status_code, 200);
    conn->reset();
    TearDown();
    server_.reset();
  }
}

TEST_F(HttpServerTest, OversizedBodyIs413) {
  StartServer({.max_body_bytes = 100});
  auto conn =
      metrics::HttpConnection::Connect("127.0.0.1", server_->port(), absl::Seconds(5));
  ASSERT_TRUE(conn.ok());
  auto r =
      (*conn)->Request("POST", "/echo", {}, std::string(1000, 'a'), absl::Seconds(5));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status_code, 413);
}

TEST_F(HttpServerTest, MalformedRequestIs400) {
  StartServer({});
  int fd = Connect(server_->port());
  const std::string junk = "GARBAGE\x01 / HTTP/9\r\n\r\n";
  send(fd, junk.data(), junk.size(), 0);
  std::string resp = ReadAll(fd, 5000);
  close(fd);
  EXPECT_EQ(resp.rfind("HTTP/1.1 400", 0), 0u) << resp;
}

TEST_F(HttpServerTest, SlowHeadersAreDroppedAtTheDeadline) {
  StartServer({.header_timeout = absl::Milliseconds(200)});
  int fd = Connect(server_->port());
  const std::string partial = "GET /echo HTTP/1.1\r\nHost: x\r\n";  // never finished
  send(fd, partial.data(), partial.size(), 0);
  const absl::Time start = absl::Now();
  std::string resp = ReadAll(fd, 10000);  // returns when the server closes
  close(fd);
  EXPECT_EQ(resp, "");
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST_F(HttpServerTest, ClientDisconnectFiresOnClientGone) {
  StartServer({});
  int fd = Connect(server_->port());
  const std::string req = "GET /hang HTTP/1.1\r\nHost: x\r\n\r\n";
  send(fd, req.data(), req.size(), 0);
  // Wait for the first event, then go away.
  std::string got;
  char buf[1024];
  while (got.find("data: first") == std::string::npos) {
    pollfd p{fd, POLLIN, 0};
    ASSERT_GT(poll(&p, 1, 10000), 0);
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    ASSERT_GT(n, 0);
    got.append(buf, n);
  }
  close(fd);
  EXPECT_TRUE(gone_.WaitForNotificationWithTimeout(absl::Seconds(10)));
}

TEST_F(HttpServerTest, DroppedWriterGives500) {
  StartServer({});
  auto r = metrics::HttpGet("127.0.0.1", server_->port(), "/drop", absl::Seconds(5));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status_code, 500);
}

TEST_F(HttpServerTest, ShutdownClosesIdleKeepAliveConnectionsPromptly) {
  StartServer({.idle_timeout = absl::Minutes(10)});
  auto conn =
      metrics::HttpConnection::Connect("127.0.0.1", server_->port(), absl::Seconds(5));
  ASSERT_TRUE(conn.ok());
  ASSERT_TRUE((*conn)->Request("POST", "/echo", {}, "x", absl::Seconds(5)).ok());
  const absl::Time start = absl::Now();
  server_->Shutdown(absl::Seconds(20));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_TRUE((*conn)->WaitForClose(absl::Seconds(5)).ok());
}

TEST_F(HttpServerTest, ServerHeaderAndHeadWithoutBody) {
  StartServer({.server_name = "tandem-test"});
  auto conn =
      metrics::HttpConnection::Connect("127.0.0.1", server_->port(), absl::Seconds(5));
  ASSERT_TRUE(conn.ok());
  auto get =
      (*conn)->Request("GET", "/echo", {{"X-Test", "abc"}}, "", absl::Seconds(5));
  ASSERT_TRUE(get.ok()) << get.status();
  EXPECT_EQ(get->Header("Server"), "tandem-test");
  EXPECT_EQ(get->body, "|abc");
  // HEAD: the same headers (Content-Length of the body it would get), no body;
  // the connection stays usable.
  auto head =
      (*conn)->Request("HEAD", "/echo", {{"X-Test", "abc"}}, "", absl::Seconds(5));
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ(head->status_code, 200);
  EXPECT_EQ(head->Header("Content-Length"), "4");
  EXPECT_EQ(head->Header("X-Method"), "HEAD");
  EXPECT_EQ(head->body, "");
  auto again = (*conn)->Request("POST", "/echo", {}, "y", absl::Seconds(5));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->body, "y|");
}

TEST_F(HttpServerTest, OversizedHeadersAre431) {
  StartServer({.max_header_bytes = 1024});
  auto conn =
      metrics::HttpConnection::Connect("127.0.0.1", server_->port(), absl::Seconds(5));
  ASSERT_TRUE(conn.ok());
  auto r = (*conn)->Request("GET", "/echo", {{"X-Filler", std::string(4000, 'x')}}, "",
                            absl::Seconds(5));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status_code, 431);
  EXPECT_EQ(r->Header("Connection"), "close");
  EXPECT_EQ(r->body, "request headers larger than 1024 bytes");  // via PlainError
}

TEST_F(HttpServerTest, ConnectionsBeyondTheLimitAreClosed) {
  StartServer({.max_connections = 1});
  auto first =
      metrics::HttpConnection::Connect("127.0.0.1", server_->port(), absl::Seconds(5));
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE((*first)->Get("/echo", absl::Seconds(5)).ok());  // accepted and counted
  ASSERT_EQ(server_->open_connections(), 1);
  auto second =
      metrics::HttpConnection::Connect("127.0.0.1", server_->port(), absl::Seconds(5));
  ASSERT_TRUE(second.ok());  // the kernel accepts; the server closes it at once
  EXPECT_TRUE((*second)->WaitForClose(absl::Seconds(5)).ok());
  auto r = (*first)->Get("/echo", absl::Seconds(5));  // the first one still works
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status_code, 200);
}

TEST_F(HttpServerTest, ShutdownLetsARequestInFlightFinishWithinGrace) {
  StartServer({});
  auto conn =
      metrics::HttpConnection::Connect("127.0.0.1", server_->port(), absl::Seconds(5));
  ASSERT_TRUE(conn.ok());
  absl::StatusOr<metrics::HttpResponse> r;
  std::thread client([&] { r = (*conn)->Get("/hold", absl::Seconds(20)); });
  ASSERT_TRUE(holding_.WaitForNotificationWithTimeout(absl::Seconds(10)));
  const absl::Time start = absl::Now();
  std::thread stopper([this] { server_->Shutdown(absl::Seconds(20)); });
  // Shutdown has begun once the listener refuses new connections.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (
      metrics::HttpConnection::Connect("127.0.0.1", server_->port(), absl::Seconds(1))
          .ok()) {
    ASSERT_LT(absl::Now(), deadline) << "the listener never closed";
    absl::SleepFor(absl::Milliseconds(5));
  }
  {
    absl::MutexLock lock(&mu_);
    held_->Send({.status = 200, .content_type = "text/plain", .body = "late"});
    held_.reset();
  }
  client.join();
  stopper.join();
  ASSERT_TRUE(r.ok()) << r.status();  // answered in full, not cut by the stop
  EXPECT_EQ(r->status_code, 200);
  EXPECT_EQ(r->body, "late");
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));  // not the whole grace
  EXPECT_EQ(server_->open_connections(), 0);
}

}  // namespace
}  // namespace tandem::http
