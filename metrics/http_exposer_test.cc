#include "metrics/http_exposer.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "metrics/http_get.h"
#include "metrics/registry.h"
#include "metrics/text_format.h"
#include "metrics/text_parse.h"

namespace tandem::metrics {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(10);

class HttpExposerTest : public ::testing::Test {
 protected:
  HttpExposerTest() {
    requests_ = *registry_.AddCounter("tandem_requests_total", "Requests.");
    depth_ = *registry_.AddGauge("tandem_queue_depth", "Queue \\ depth.");
    latency_ = *registry_.AddHistogram("tandem_latency_seconds", "Latency.", {0.5, 1});
    requests_->Add({{"route", "a\"b\\c\nd"}}).Increment(7);
    depth_->Add({}).Set(3);
    latency_->Add({}).Observe(0.75);
  }

  Registry registry_;
  Family<Counter>* requests_;
  Family<Gauge>* depth_;
  Family<Histogram>* latency_;
};

TEST_F(HttpExposerTest, ServesMetricsHealthzAnd404) {
  HttpExposer exposer({}, {&registry_});
  EXPECT_EQ(exposer.port(), 0);
  ASSERT_TRUE(exposer.Start().ok());
  ASSERT_GT(exposer.port(), 0);

  absl::StatusOr<HttpResponse> r =
      HttpGet("127.0.0.1", exposer.port(), "/metrics", kTimeout);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status_code, 200);
  EXPECT_EQ(r->Header("Content-Type"), kTextContentType);
  EXPECT_EQ(r->body, SerializeText(registry_.Collect()));
  absl::StatusOr<ParsedText> parsed = ParseText(r->body);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed->Value("tandem_requests_total", {{"route", "a\"b\\c\nd"}}), 7.0);
  EXPECT_EQ(*parsed->Value("tandem_queue_depth"), 3.0);
  EXPECT_EQ(*parsed->Value("tandem_latency_seconds_bucket", {{"le", "0.5"}}), 0.0);
  EXPECT_EQ(*parsed->Value("tandem_latency_seconds_bucket", {{"le", "1"}}), 1.0);
  EXPECT_EQ(*parsed->Value("tandem_latency_seconds_sum"), 0.75);
  EXPECT_EQ(parsed->help.at("tandem_queue_depth"), "Queue \\ depth.");

  r = HttpGet("127.0.0.1", exposer.port(), "/metrics?name[]=x", kTimeout);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status_code, 200);

  r = HttpGet("127.0.0.1", exposer.port(), "/healthz", kTimeout);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status_code, 200);
  EXPECT_EQ(r->body, "ok");

  for (const char* path : {"/", "/metric", "/metrics/", "/healthz2", "/favicon.ico"}) {
    r = HttpGet("127.0.0.1", exposer.port(), path, kTimeout);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->status_code, 404) << path;
  }
}

TEST_F(HttpExposerTest, OtherMethodsGet405) {
  HttpExposer exposer({}, {&registry_});
  ASSERT_TRUE(exposer.Start().ok());
  auto conn = HttpConnection::Connect("127.0.0.1", exposer.port(), kTimeout);
  ASSERT_TRUE(conn.ok()) << conn.status();
  for (const char* method : {"POST", "PUT", "DELETE", "HEAD"}) {
    absl::StatusOr<HttpResponse> r =
        (*conn)->Request(method, "/metrics", {}, "", kTimeout);
    ASSERT_TRUE(r.ok()) << method << ": " << r.status();
    EXPECT_EQ(r->status_code, 405) << method;
    EXPECT_EQ(r->Header("Allow"), "GET");
  }
}

TEST_F(HttpExposerTest, KeepAliveConnectionSeesFreshValues) {
  HttpExposer exposer({}, {&registry_});
  ASSERT_TRUE(exposer.Start().ok());
  auto conn = HttpConnection::Connect("127.0.0.1", exposer.port(), kTimeout);
  ASSERT_TRUE(conn.ok()) << conn.status();
  Counter& c = requests_->Add({{"route", "keepalive"}});
  for (int i = 1; i <= 5; ++i) {
    c.Increment();
    absl::StatusOr<HttpResponse> r = (*conn)->Get("/metrics", kTimeout);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->status_code, 200);
    auto parsed = ParseText(r->body);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed->Value("tandem_requests_total", {{"route", "keepalive"}}), i);
    EXPECT_EQ(exposer.open_connections(), 1);  // the same connection every time
  }
}

TEST_F(HttpExposerTest, ConcurrentFetchesWhileValuesChange) {
  HttpExposer exposer({}, {&registry_});
  ASSERT_TRUE(exposer.Start().ok());
  Counter& c = requests_->Add({{"route", "concurrent"}});
  constexpr int kClients = 8;
  constexpr int kFetches = 10;
  constexpr int kIncrements = 100000;
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  threads.emplace_back([&c] {
    for (int i = 0; i < kIncrements; ++i) c.Increment();
  });
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&] {
      double last = 0;
      for (int i = 0; i < kFetches; ++i) {
        auto r = HttpGet("127.0.0.1", exposer.port(), "/metrics", kTimeout);
        if (!r.ok() || r->status_code != 200) continue;
        auto parsed = ParseText(r->body);
        if (!parsed.ok()) continue;
        auto v = parsed->Value("tandem_requests_total", {{"route", "concurrent"}});
        if (!v.ok() || *v < last || *v > kIncrements) continue;  // monotonic, bounded
        last = *v;
        ok.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), kClients * kFetches);
  auto r = HttpGet("127.0.0.1", exposer.port(), "/metrics", kTimeout);
  ASSERT_TRUE(r.ok()) << r.status();
  auto parsed = ParseText(r->body);
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(*parsed->Value("tandem_requests_total", {{"route", "concurrent"}}),
            kIncrements);
}

TEST_F(HttpExposerTest, StopWithKeepAliveClientReturnsPromptly) {
  HttpExposerOptions options;
  options.read_timeout = absl::Seconds(120);  // Stop must not wait for it
  HttpExposer exposer(options, {&registry_});
  ASSERT_TRUE(exposer.Start().ok());
  auto conn = HttpConnection::Connect("127.0.0.1", exposer.port(), kTimeout);
  ASSERT_TRUE(conn.ok()) << conn.status();
  auto r = (*conn)->Get("/healthz", kTimeout);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(exposer.open_connections(), 1);

  const absl::Time start = absl::Now();
  exposer.Stop();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(exposer.open_connections(), 0);
  // The server closed our connection; nothing is listening any more.
  EXPECT_TRUE((*conn)->WaitForClose(kTimeout).ok());
  EXPECT_EQ(HttpGet("127.0.0.1", exposer.port(), "/healthz", kTimeout).status().code(),
            absl::StatusCode::kUnavailable);
  exposer.Stop();  // idempotent
  EXPECT_EQ(exposer.Start().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(HttpExposerTest, IdleConnectionIsDroppedAfterReadTimeout) {
  HttpExposerOptions options;
  options.read_timeout = absl::Milliseconds(200);
  HttpExposer exposer(options, {&registry_});
  ASSERT_TRUE(exposer.Start().ok());
  auto conn = HttpConnection::Connect("127.0.0.1", exposer.port(), kTimeout);
  ASSERT_TRUE(conn.ok()) << conn.status();
  // Sends nothing: the server must close the connection by itself.
  const absl::Time start = absl::Now();
  EXPECT_TRUE((*conn)->WaitForClose(kTimeout).ok());
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(150));
}

TEST_F(HttpExposerTest, OversizedRequestsAreRejected) {
  HttpExposerOptions options;
  options.max_request_bytes = 1024;
  HttpExposer exposer(options, {&registry_});
  ASSERT_TRUE(exposer.Start().ok());

  auto conn = HttpConnection::Connect("127.0.0.1", exposer.port(), kTimeout);
  ASSERT_TRUE(conn.ok()) << conn.status();
  auto r = (*conn)->Request("GET", "/metrics", {{"X-Filler", std::string(4000, 'x')}},
                            "", kTimeout);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status_code, 431);

  conn = HttpConnection::Connect("127.0.0.1", exposer.port(), kTimeout);
  ASSERT_TRUE(conn.ok()) << conn.status();
  r = (*conn)->Request("POST", "/metrics", {}, std::string(100000, 'y'), kTimeout);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status_code, 413);

  // The server is still healthy.
  r = HttpGet("127.0.0.1", exposer.port(), "/healthz", kTimeout);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status_code, 200);
}

TEST_F(HttpExposerTest, PortInUseIsAClearError) {
  HttpExposer first({}, {&registry_});
  ASSERT_TRUE(first.Start().ok());
  HttpExposerOptions options;
  options.port = first.port();
  HttpExposer second(options, {&registry_});
  absl::Status s = second.Start();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("in use"), std::string::npos) << s;
  EXPECT_NE(s.message().find(absl::StrCat(first.port())), std::string::npos) << s;
  second.Stop();  // never started: a no-op
  EXPECT_EQ(first.Start().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(HttpExposerTest, LocalhostByName) {
  HttpExposerOptions options;
  options.host = "localhost";
  HttpExposer exposer(options, {&registry_});
  ASSERT_TRUE(exposer.Start().ok());
  auto r = HttpGet("localhost", exposer.port(), "/healthz", kTimeout);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->status_code, 200);
}

TEST(HttpExposerMultiTest, SeveralRegistriesAreConcatenatedAndMerged) {
  Registry router;
  Registry engine;
  (*router.AddCounter("tandem_requests_total", "Requests."))
      ->Add({{"component", "router"}})
      .Increment(1);
  (*router.AddGauge("tandem_router_backends", "Backends."))->Add({}).Set(4);
  (*engine.AddCounter("tandem_requests_total", "Requests."))
      ->Add({{"component", "engine"}})
      .Increment(2);
  (*engine.AddCounter("tandem_engine_steps_total", "Steps."))->Add({}).Increment(9);
  (*engine.AddGauge("tandem_engine_idle", "No children: not written."));

  HttpExposer exposer({}, {&router, &engine});
  ASSERT_TRUE(exposer.Start().ok());
  auto r = HttpGet("127.0.0.1", exposer.port(), "/metrics", kTimeout);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->body,
            "# HELP tandem_requests_total Requests.\n"
            "# TYPE tandem_requests_total counter\n"
            "tandem_requests_total{component=\"router\"} 1\n"
            "tandem_requests_total{component=\"engine\"} 2\n"
            "# HELP tandem_router_backends Backends.\n"
            "# TYPE tandem_router_backends gauge\n"
            "tandem_router_backends 4\n"
            "# HELP tandem_engine_steps_total Steps.\n"
            "# TYPE tandem_engine_steps_total counter\n"
            "tandem_engine_steps_total 9\n");
  EXPECT_EQ(r->body, RenderMetrics({&router, &engine}));
}

TEST(HttpExposerMultiTest, ConflictingTypesAcrossRegistriesFirstWins) {
  Registry a;
  Registry b;
  (*a.AddGauge("tandem_x", "Gauge."))->Add({}).Set(1);
  (*b.AddCounter("tandem_x", "Counter."))->Add({}).Increment(5);
  EXPECT_EQ(RenderMetrics({&a, &b}),
            "# HELP tandem_x Gauge.\n"
            "# TYPE tandem_x gauge\n"
            "tandem_x 1\n");
}

}  // namespace
}  // namespace tandem::metrics
