// Gateway overhead, measured in one run against the scripted test router
// (in process, loopback):
//   0. paced throughput (the headline): --paced_streams streams, each fed at
//      --paced_rate tokens/s by the fixture's step clock (one token per stream
//      per step, as a decode engine's batch step makes them; a token that is
//      ready while the previous write is in flight is coalesced into the next
//      message, as the router does), --paced_tokens tokens per request, new
//      requests for --seconds, then drained. Through the gateway (an
//      event-driven HTTP client, --client_threads threads) and directly
//      (gRPC callback client); tokens/s delivered against offered, SSE events
//      per token, inter-event gaps, request duration against the ideal.
//   1. latency: the same request (a prompt that makes the fixture stream
//      --tokens tokens) sent --requests times one after another, directly
//      over gRPC and through the gateway (POST /v1/completions, stream=true,
//      SSE read to [DONE]); p50/p99 of each and the difference (added).
//   2. full-speed throughput (the worst case: the fixture writes one token per
//      message as fast as gRPC takes them): --concurrency clients streaming
//      --stream_tokens-token completions for --seconds, directly and through
//      the gateway; tokens/s.
//      Both count the tokens the router sent (direct: token_ids received;
//      gateway: the usage chunk's completion_tokens, stream_options
//      include_usage), so the two figures count the same thing.
// The gateway runs --io_threads I/O threads (default 2: "on 2 cores").
// Ends with one JSON line {"bench":"gateway",...}.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/init.h"
#include "engine/tokenizer/tokenizer.h"
#include "gateway/openai_service.h"
#include "gateway/router_client.h"
#include "gateway/sse.h"
#include "gateway/testing/scripted_router.h"
#include "http/server.h"
#include "metrics/http_get.h"
#include "metrics/registry.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, tokenizer_dir, "", "Tokenizer directory (default: runfiles).");
ABSL_FLAG(int, requests, 300, "Sequential requests per path for the latency figures.");
ABSL_FLAG(int, tokens, 32, "Tokens per request for the latency figures.");
ABSL_FLAG(int, concurrency, 16, "Concurrent streams for the throughput figures.");
ABSL_FLAG(int, stream_tokens, 2000, "Tokens per request for the throughput figures.");
ABSL_FLAG(double, seconds, 3, "Duration of each throughput run.");
ABSL_FLAG(int, io_threads, 2, "Gateway I/O threads.");
ABSL_FLAG(int, paced_streams, 1280,
          "Concurrent streams of the paced run (0: skip); with --paced_rate, the "
          "offered load (default 128,000 tokens/s: above the 100k target, so that "
          "the run can show it).");
ABSL_FLAG(double, paced_rate, 100, "Tokens/s of each paced stream (the step clock).");
ABSL_FLAG(int, paced_tokens, 200, "Tokens per request of the paced run.");
ABSL_FLAG(bool, mutex_deadlock_detection, false,
          "Leave Abseil's Mutex deadlock detection on (as before the gateway turned "
          "it off).");
ABSL_FLAG(bool, direct_writes, true,
          "HttpServerOptions::direct_writes (false: every SSE write through the "
          "connection's strand, as before).");
ABSL_FLAG(bool, fixture_process, true,
          "Run the scripted router as its own process (scripted_router_main), so "
          "that this process's CPU is the gateway's and the clients' only.");
ABSL_FLAG(int, client_threads, 1, "Threads of the paced run's HTTP client.");
ABSL_FLAG(int, router_sessions, 2,
          "The gateway's GenerateSession streams to the router (gateway_main's "
          "--router_sessions); 0: one Generate call per request.");
ABSL_FLAG(double, direct_write_min_gap_ms, 5,
          "HttpServerOptions::direct_write_min_gap: a chunk this soon after the "
          "previous one of its stream goes through the connection's strand.");
ABSL_FLAG(int, stream_interval, 1,
          "The gateway's --stream_interval (tokens per SSE chunk, at least).");
ABSL_FLAG(bool, compare_per_request, true,
          "Also run the paced load through a gateway with one Generate call per "
          "request (the baseline of the sessions), in the same run.");

namespace tandem::gateway {
namespace {

using json = nlohmann::json;

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(p * (v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

// One direct Generate read to the end; returns tokens received (-1 on error).
int DirectOnce(tandem::v1::Router::Stub* stub, const std::vector<int>& prompt) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  tandem::v1::GenerateRequest req;
  req.set_model("kimi-k3");
  req.mutable_prompt_token_ids()->mutable_ids()->Add(prompt.begin(), prompt.end());
  auto reader = stub->Generate(&ctx, req);
  tandem::v1::GenerateResponse resp;
  int tokens = 0;
  while (reader->Read(&resp)) tokens += resp.token_ids_size();
  return reader->Finish().ok() ? tokens : -1;
}

// One Generate over a GenerateSession (`client` multiplexes), read to the end;
// returns tokens received (-1 on error).
int DirectSessionOnce(RouterClient* client, const std::vector<int>& prompt) {
  tandem::v1::GenerateRequest req;
  req.set_model("kimi-k3");
  req.mutable_prompt_token_ids()->mutable_ids()->Add(prompt.begin(), prompt.end());
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  req.set_deadline_unix_ms(absl::ToUnixMillis(deadline));
  absl::Mutex mu;
  int tokens = 0;
  bool done = false, ok = false;
  auto call = client->Generate(std::move(req), deadline,
                               {.on_response =
                                    [&](const tandem::v1::GenerateResponse& r) {
                                      absl::MutexLock l(&mu);
                                      tokens += r.token_ids_size();
                                    },
                                .on_done =
                                    [&](const grpc::Status& s) {
                                      absl::MutexLock l(&mu);
                                      done = true;
                                      ok = s.ok();
                                    }});
  absl::MutexLock l(&mu);
  mu.Await(absl::Condition(&done));  // the call ends by its deadline at the latest
  return ok ? tokens : -1;
}

// One streamed completion through the gateway; returns the tokens it carried
// (the usage chunk's completion_tokens when the body asks for usage, so that
// both paths count the same tokens; else the SSE chunks), -1 on error.
int GatewayOnce(metrics::HttpConnection* conn, const std::string& body) {
  auto r =
      conn->Request("POST", "/v1/completions", {{"Content-Type", "application/json"}},
                    body, absl::Seconds(60));
  if (!r.ok() || r->status_code != 200) return -1;
  SseParser parser;
  std::vector<std::string> events;
  parser.Feed(r->body, &events);
  if (events.empty() || events.back() != "[DONE]") return -1;
  if (events.size() >= 2 &&
      absl::StrContains(events[events.size() - 2], "\"usage\":{")) {
    json usage = json::parse(events[events.size() - 2], nullptr, false);
    if (usage.is_discarded() || !usage["usage"]["completion_tokens"].is_number())
      return -1;
    return usage["usage"]["completion_tokens"].get<int>();
  }
  return static_cast<int>(events.size()) - 1;  // one chunk per token
}

// --- paced run ---------------------------------------------------------------

// What one paced run measured.
// CPU time this process has used (every thread: the fixture, the gateway,
// the clients), in seconds. On a shared machine, CPU per token is the steady
// figure; wall-clock tokens/s moves with the other load.
double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// CPU time of another process (utime + stime from /proc), 0 if unreadable.
double ChildCpuSeconds(pid_t pid) {
  if (pid <= 0) return 0;
  std::FILE* f = std::fopen(absl::StrCat("/proc/", pid, "/stat").c_str(), "r");
  if (f == nullptr) return 0;
  char buf[1024];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* p = std::strrchr(buf, ')');  // after the command name
  if (p == nullptr || p[1] == 0) return 0;
  // Fields after ")": state(3) ... utime(14) stime(15).
  std::vector<absl::string_view> fields = absl::StrSplit(p + 2, ' ');
  if (fields.size() < 13) return 0;
  double utime = 0, stime = 0;
  if (!absl::SimpleAtod(fields[11], &utime) || !absl::SimpleAtod(fields[12], &stime))
    return 0;
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// The scripted router as a child process (killed with us); its port.
struct FixtureProcess {
  pid_t pid = -1;
  int port = 0;
};

FixtureProcess SpawnFixture(const std::string& binary, const std::string& model,
                            double step_ms) {
  FixtureProcess out;
  int fds[2];
  if (pipe(fds) != 0) return out;
  const std::string model_flag = "--model=" + model;
  const std::string step_flag = absl::StrCat("--step_ms=", step_ms);
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    dup2(fds[1], 1);
    close(fds[0]);
    close(fds[1]);
    execl(binary.c_str(), binary.c_str(), model_flag.c_str(), step_flag.c_str(),
          "--quiet", static_cast<char*>(nullptr));
    _exit(127);
  }
  close(fds[1]);
  if (pid < 0) {
    close(fds[0]);
    return out;
  }
  out.pid = pid;
  std::FILE* f = fdopen(fds[0], "r");
  char line[256];
  if (f != nullptr && std::fgets(line, sizeof(line), f) != nullptr) {
    json j = json::parse(line, nullptr, false);
    if (!j.is_discarded() && j["port"].is_number()) out.port = j["port"].get<int>();
  }
  if (f != nullptr) std::fclose(f);
  return out;
}

double ProcessCpuSeconds() {
  struct rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec +
         1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

struct PacedResult {
  int64_t tokens = 0;  // usage.completion_tokens (gateway) / token ids (direct)
  int64_t events = 0;  // SSE chunks carrying tokens / gRPC messages
  int64_t requests = 0;
  int64_t failures = 0;
  double seconds = 0;
  double cpu_seconds = 0;           // this process's, during the run, less the client's
  double client_cpu_seconds = 0;    // the HTTP client's threads (gateway runs)
  double fixture_cpu_seconds = 0;   // the fixture process's, when it is one
  std::vector<double> gaps_ms;      // between consecutive events of a stream
  std::vector<double> duration_ms;  // per request, to its end

  // Adds one stream's counts and samples.
  void Add(const PacedResult& o) {
    tokens += o.tokens;
    events += o.events;
    requests += o.requests;
    failures += o.failures;
    gaps_ms.insert(gaps_ms.end(), o.gaps_ms.begin(), o.gaps_ms.end());
    duration_ms.insert(duration_ms.end(), o.duration_ms.begin(), o.duration_ms.end());
  }
};

json PacedJson(const PacedResult& r, double offered, double ideal_ms) {
  const double tps = r.seconds > 0 ? r.tokens / r.seconds : 0;
  const double cpu_us = r.tokens > 0 ? 1e6 * r.cpu_seconds / r.tokens : 0;
  return {{"tokens_per_s", tps},
          {"cpu_us_per_token", cpu_us},
          {"tokens_per_cpu_s", cpu_us > 0 ? 1e6 / cpu_us : 0},
          {"client_cpu_us_per_token",
           r.tokens > 0 ? 1e6 * r.client_cpu_seconds / r.tokens : 0},
          {"fixture_cpu_us_per_token",
           r.tokens > 0 ? 1e6 * r.fixture_cpu_seconds / r.tokens : 0},
          {"offered_tokens_per_s", offered},
          {"delivered_over_offered", offered > 0 ? tps / offered : 0},
          {"events_per_token", r.tokens > 0 ? double(r.events) / r.tokens : 0},
          {"gap_p50_ms", Percentile(r.gaps_ms, 0.5)},
          {"gap_p99_ms", Percentile(r.gaps_ms, 0.99)},
          {"request_p50_ms", Percentile(r.duration_ms, 0.5)},
          {"request_p99_ms", Percentile(r.duration_ms, 0.99)},
          {"request_ideal_ms", ideal_ms},
          {"requests", r.requests},
          {"failures", r.failures}};
}

// HTTP/1.1 chunked transfer decoding, incrementally: raw bytes in, body
// bytes out; done() after the last (zero-size) chunk and its CRLF.
class ChunkedDecoder {
 public:
  // Appends the body bytes of `in` to `out`; false on malformed framing.
  bool Feed(absl::string_view in, std::string* out) {
    while (!in.empty() && state_ != State::kDone) {
      switch (state_) {
        case State::kSize: {
          const size_t nl = in.find('\n');
          line_.append(in.data(), nl == absl::string_view::npos ? in.size() : nl);
          if (nl == absl::string_view::npos) return true;
          in.remove_prefix(nl + 1);
          if (!line_.empty() && line_.back() == '\r') line_.pop_back();
          if (!absl::SimpleHexAtoi(line_, &left_)) return false;
          line_.clear();
          state_ = left_ == 0 ? State::kTrailer : State::kData;
          break;
        }
        case State::kData: {
          const size_t n = std::min<size_t>(left_, in.size());
          out->append(in.data(), n);
          in.remove_prefix(n);
          left_ -= n;
          if (left_ == 0) state_ = State::kDataEnd;
          break;
        }
        case State::kDataEnd:
        case State::kTrailer: {
          const size_t nl = in.find('\n');
          if (nl == absl::string_view::npos) return true;
          in.remove_prefix(nl + 1);
          state_ = state_ == State::kDataEnd ? State::kSize : State::kDone;
          break;
        }
        case State::kDone:
          break;
      }
    }
    return true;
  }
  bool done() const { return state_ == State::kDone; }

 private:
  enum class State { kSize, kData, kDataEnd, kTrailer, kDone };
  State state_ = State::kSize;
  std::string line_;
  uint64_t left_ = 0;
};

// Many keep-alive connections to the gateway, each sending the same streamed
// completion again and again until `until`, reading the SSE stream as it
// comes (chunked decoding + SseParser), counting the usage chunk's
// completion_tokens and the time between token chunks. A lean load
// generator (as wrk is): `threads` threads, each a level-triggered epoll
// loop over its share of non-blocking sockets, one recv per readiness, so
// that the client takes as little as possible of the CPU it shares with the
// gateway.
class PacedHttpClient {
 public:
  PacedHttpClient(int port, std::string body, int streams, int threads,
                  absl::Time until)
      : until_(until), port_(port) {
    request_ = absl::StrCat(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Content-Type: application/json\r\nContent-Length: ",
        body.size(), "\r\n\r\n", body);
    for (int i = 0; i < streams; ++i) conns_.push_back(std::make_unique<Conn>(this));
    threads_ = std::max(1, std::min(threads, std::max(1, streams)));
  }

  PacedResult Run() {
    const absl::Time start = absl::Now();
    const double cpu0 = ProcessCpuSeconds();
    std::vector<std::thread> threads;
    absl::Mutex cpu_mu;
    double client_cpu = 0;
    for (int t = 0; t < threads_; ++t) {
      threads.emplace_back([this, t, &cpu_mu, &client_cpu] {
        const double t0 = ThreadCpuSeconds();
        Loop(t);
        absl::MutexLock lock(&cpu_mu);
        client_cpu += ThreadCpuSeconds() - t0;
      });
    }
    for (auto& t : threads) t.join();
    PacedResult r;
    r.seconds = absl::ToDoubleSeconds(absl::Now() - start);
    r.client_cpu_seconds = client_cpu;
    r.cpu_seconds = ProcessCpuSeconds() - cpu0 - client_cpu;
    for (auto& c : conns_) r.Add(c->result);
    return r;
  }

 private:
  struct Conn {
    explicit Conn(PacedHttpClient* o) : owner(o) {}
    ~Conn() {
      if (fd >= 0) close(fd);
    }

    // Connects (blocking, loopback) and sends the first request; false on
    // failure (counted).
    bool Start(int epfd) {
      fd = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(static_cast<uint16_t>(owner->port_));
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      if (fd < 0 ||
          connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
        return Fail();
      }
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.ptr = this;
      if (epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev) != 0) return Fail();
      return Send();
    }
    // Sends the request (it fits the socket buffer of a fresh exchange);
    // false when the run is over (the socket is closed) or on failure.
    bool Send() {
      if (absl::Now() >= owner->until_) return Close();
      head.clear();
      in_body = false;
      chunked = ChunkedDecoder();
      sse = SseParser();
      last_event = sent_at = absl::Now();
      events_before = result.events;
      const std::string& r = owner->request_;
      size_t off = 0;
      while (off < r.size()) {
        const ssize_t n = send(fd, r.data() + off, r.size() - off, MSG_NOSIGNAL);
        if (n > 0) {
          off += static_cast<size_t>(n);
        } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
          return Fail();
        }
      }
      return true;
    }
    // The socket is readable: one recv; false once the connection is done.
    bool OnReadable() {
      const ssize_t n = recv(fd, buf, sizeof(buf), 0);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) return true;
      if (n <= 0) return Fail();  // the gateway closed mid-response
      if (!OnBytes(absl::string_view(buf, static_cast<size_t>(n)))) return Fail();
      if (chunked.done()) {
        result.duration_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - sent_at));
        ++result.requests;
        return Send();
      }
      return true;
    }
    bool OnBytes(absl::string_view bytes) {
      if (!in_body) {
        head.append(bytes.data(), bytes.size());
        const size_t end = head.find("\r\n\r\n");
        if (end == std::string::npos) return true;
        if (!absl::StartsWith(head, "HTTP/1.1 200")) return false;
        bytes = absl::string_view(head).substr(end + 4);
        in_body = true;
        body.clear();
        if (!chunked.Feed(bytes, &body)) return false;
      } else {
        body.clear();
        if (!chunked.Feed(bytes, &body)) return false;
      }
      events.clear();
      sse.Feed(body, &events);
      if (events.empty()) return true;
      const absl::Time now = absl::Now();
      for (const std::string& e : events) {
        if (e == "[DONE]") continue;
        if (absl::StrContains(e, "\"usage\":{")) {
          json u = json::parse(e, nullptr, false);
          if (u.is_discarded() || !u["usage"]["completion_tokens"].is_number()) {
            return false;
          }
          result.tokens += u["usage"]["completion_tokens"].get<int64_t>();
          continue;
        }
        if (absl::StrContains(e, "\"text\":\"\"")) continue;  // finish chunk
        if (result.events++ > events_before) {
          result.gaps_ms.push_back(absl::ToDoubleMilliseconds(now - last_event));
        }
        last_event = now;
      }
      return true;
    }
    bool Fail() {
      ++result.failures;
      return Close();
    }
    bool Close() {
      if (fd >= 0) close(fd);  // also leaves the epoll set
      fd = -1;
      return false;
    }

    PacedHttpClient* owner;
    int fd = -1;
    char buf[16384];
    std::string head, body;
    bool in_body = false;
    ChunkedDecoder chunked;
    SseParser sse;
    std::vector<std::string> events;
    absl::Time sent_at, last_event;
    int64_t events_before = 0;
    PacedResult result;
  };

  // Thread `t`: connections t, t + threads_, ...; until all are done.
  void Loop(int t) {
    const int epfd = epoll_create1(0);
    int open = 0;
    for (size_t i = t; i < conns_.size(); i += threads_) {
      open += conns_[i]->Start(epfd) ? 1 : 0;
    }
    std::vector<epoll_event> ready(256);
    while (open > 0) {
      // A bounded wait: a connection whose response never ends is counted by
      // the gateway's own deadlines, not waited for here forever.
      const int n =
          epoll_wait(epfd, ready.data(), static_cast<int>(ready.size()), 1000);
      if (n < 0 && errno != EINTR) break;
      if (n == 0 && absl::Now() > until_ + absl::Seconds(60)) break;
      for (int i = 0; i < n; ++i) {
        if (!static_cast<Conn*>(ready[i].data.ptr)->OnReadable()) --open;
      }
    }
    close(epfd);
  }

  const absl::Time until_;
  const int port_;
  std::string request_;
  std::vector<std::unique_ptr<Conn>> conns_;
  int threads_ = 1;
};

// The same load directly on the router's gRPC API (callback client, no
// thread per stream).
class PacedDirectClient {
 public:
  PacedDirectClient(tandem::v1::Router::Stub* stub, std::vector<int> prompt,
                    int streams, absl::Time until)
      : stub_(stub), prompt_(std::move(prompt)), until_(until), left_(streams) {
    for (int i = 0; i < streams; ++i)
      streams_.push_back(std::make_unique<Stream>(this));
  }

  PacedResult Run() {
    const absl::Time start = absl::Now();
    const double cpu0 = ProcessCpuSeconds();
    for (auto& s : streams_) s->Next();
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](int* left) { return *left == 0; }, &left_));
    }
    PacedResult r;
    r.seconds = absl::ToDoubleSeconds(absl::Now() - start);
    r.cpu_seconds = ProcessCpuSeconds() - cpu0;
    for (auto& s : streams_) r.Add(s->result);
    return r;
  }

 private:
  // One stream: a request at a time; a call object per request.
  struct Stream {
    explicit Stream(PacedDirectClient* o) : owner(o) {}
    struct Call : grpc::ClientReadReactor<tandem::v1::GenerateResponse> {
      Stream* stream;
      grpc::ClientContext context;
      tandem::v1::GenerateRequest request;
      tandem::v1::GenerateResponse response;
      void OnReadDone(bool ok) override {
        if (!ok) return;
        const absl::Time now = absl::Now();
        stream->result.tokens += response.token_ids_size();
        if (stream->result.events++ > stream->events_before) {
          stream->result.gaps_ms.push_back(
              absl::ToDoubleMilliseconds(now - stream->last_event));
        }
        stream->last_event = now;
        StartRead(&response);
      }
      void OnDone(const grpc::Status& s) override {
        Stream* st = stream;
        if (!s.ok()) ++st->result.failures;
        st->result.duration_ms.push_back(
            absl::ToDoubleMilliseconds(absl::Now() - st->sent_at));
        ++st->result.requests;
        delete this;
        st->Next();
      }
    };
    void Next() {
      if (absl::Now() >= owner->until_) {
        absl::MutexLock lock(&owner->mu_);
        --owner->left_;
        return;
      }
      auto* call = new Call;
      call->stream = this;
      call->context.set_deadline(std::chrono::system_clock::now() +
                                 std::chrono::seconds(120));
      call->request.set_model("kimi-k3");
      call->request.mutable_prompt_token_ids()->mutable_ids()->Add(
          owner->prompt_.begin(), owner->prompt_.end());
      sent_at = last_event = absl::Now();
      events_before = result.events;
      owner->stub_->async()->Generate(&call->context, &call->request, call);
      call->StartRead(&call->response);
      call->StartCall();
    }
    PacedDirectClient* owner;
    absl::Time sent_at, last_event;
    int64_t events_before = 0;
    PacedResult result;
  };

  tandem::v1::Router::Stub* const stub_;
  const std::vector<int> prompt_;
  const absl::Time until_;
  absl::Mutex mu_;
  int left_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Stream>> streams_;
};

int Main(int argc, char** argv) {
  std::string dir = absl::GetFlag(FLAGS_tokenizer_dir);
  if (dir.empty())
    dir = std::string(argv[0]) + ".runfiles/tandem/third_party/kimi_k3_tokenizer";
  auto tokenizer = tokenizer::Tokenizer::Load(dir);
  if (!tokenizer.ok()) {
    fprintf(stderr, "gateway_bench: %s\n", tokenizer.status().ToString().c_str());
    return 1;
  }
  const double paced_rate = absl::GetFlag(FLAGS_paced_rate);
  const absl::Duration step =
      paced_rate > 0 ? absl::Seconds(1 / paced_rate) : absl::ZeroDuration();
  // The fixture: a child process (forked before any thread starts here), or
  // in process.
  FixtureProcess child;
  std::unique_ptr<testing::ScriptedRouter> fixture;
  std::unique_ptr<grpc::Server> grpc_server;
  int grpc_port = 0;
  if (absl::GetFlag(FLAGS_fixture_process)) {
    child = SpawnFixture(
        std::string(argv[0]) + ".runfiles/tandem/gateway/scripted_router_main", dir,
        absl::ToDoubleMilliseconds(step));
    grpc_port = child.port;
    if (grpc_port == 0) {
      fprintf(stderr, "gateway_bench: the scripted router process did not start\n");
      return 1;
    }
  } else {
    fixture = std::make_unique<testing::ScriptedRouter>(
        tokenizer->get(), testing::ScriptedRouter::Options{.step = step}, nullptr);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &grpc_port);
    builder.RegisterService(fixture.get());
    grpc_server = builder.BuildAndStart();
  }
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(grpc_port),
                                     grpc::InsecureChannelCredentials());
  auto stub = tandem::v1::Router::NewStub(channel);

  // A gateway (router client, OpenAI service, HTTP server) per transport to
  // the router: `sessions` multiplexed streams, or 0: a call per request.
  struct Gateway {
    Gateway(int sessions, int grpc_port, const tokenizer::Tokenizer* tokenizer)
        : client(
              [&] {
                grpc::ChannelArguments args;
                args.SetMaxReceiveMessageSize(64 << 20);
                // Its own connection (not shared with the other gateway's).
                args.SetInt("bench.gateway_sessions", sessions);
                return grpc::CreateCustomChannel(
                    "127.0.0.1:" + std::to_string(grpc_port),
                    grpc::InsecureChannelCredentials(), args);
              }(),
              RouterClient::Options{.sessions = sessions}),
          service(
              {.stream_interval = std::max(1, absl::GetFlag(FLAGS_stream_interval))},
              tokenizer, &client, &registry),
          http(
              {.io_threads = absl::GetFlag(FLAGS_io_threads),
               .direct_writes = absl::GetFlag(FLAGS_direct_writes)},
              [this](http::HttpRequest r, std::shared_ptr<http::ResponseWriter> w) {
                service.Handle(std::move(r), std::move(w));
              },
              &OpenAIService::FormatServerError) {}
    ~Gateway() {
      http.Shutdown(absl::Seconds(2));
      service.CancelAll(absl::Seconds(5));
    }
    metrics::Registry registry;
    RouterClient client;
    OpenAIService service;
    http::HttpServer http;
  };
  const int sessions = absl::GetFlag(FLAGS_router_sessions);
  auto gateway = std::make_unique<Gateway>(sessions, grpc_port, tokenizer->get());
  if (!gateway->http.Start().ok()) return 1;
  std::unique_ptr<Gateway> per_request;
  if (sessions > 0 && absl::GetFlag(FLAGS_compare_per_request)) {
    per_request = std::make_unique<Gateway>(0, grpc_port, tokenizer->get());
    if (!per_request->http.Start().ok()) return 1;
  }
  http::HttpServer& http = gateway->http;

  // `usage`: ask for the usage chunk, whose completion_tokens the throughput
  // run counts (the same tokens the direct run counts).
  auto prompt_for = [&](int n, bool usage, bool paced = false) {
    const std::string text =
        absl::StrCat(paced ? "Bench #paced" : "Bench", " #tokens:", n);
    json body = {{"model", "kimi-k3"}, {"prompt", text}, {"stream", true}};
    if (usage) body["stream_options"] = {{"include_usage", true}};
    return std::make_pair(*(*tokenizer)->Encode(text), body.dump());
  };

  int errors = 0;
  // 0. Paced: many streams at a modest rate each (the headline).
  const int paced_streams = absl::GetFlag(FLAGS_paced_streams);
  const int paced_tokens = absl::GetFlag(FLAGS_paced_tokens);
  json paced = nullptr;
  if (paced_streams > 0 && paced_rate > 0) {
    // "#tokens:N" streams N filler tokens and [EOS].
    auto [pids, pbody] = prompt_for(paced_tokens - 1, /*usage=*/true, /*paced=*/true);
    const double offered = paced_streams * paced_rate;
    const double ideal_ms = 1e3 * (paced_tokens - 1) / paced_rate;
    const absl::Duration window = absl::Seconds(absl::GetFlag(FLAGS_seconds));
    double f0 = ChildCpuSeconds(child.pid);
    PacedResult direct =
        PacedDirectClient(stub.get(), pids, paced_streams, absl::Now() + window).Run();
    direct.fixture_cpu_seconds = ChildCpuSeconds(child.pid) - f0;
    auto through_gateway = [&](const Gateway& g) {
      const double c0 = ChildCpuSeconds(child.pid);
      PacedResult r =
          PacedHttpClient(g.http.port(), pbody, paced_streams,
                          absl::GetFlag(FLAGS_client_threads), absl::Now() + window)
              .Run();
      r.fixture_cpu_seconds = ChildCpuSeconds(child.pid) - c0;
      return r;
    };
    PacedResult through = through_gateway(*gateway);
    paced = {{"streams", paced_streams},
             {"rate_per_stream", paced_rate},
             {"tokens_per_request", paced_tokens},
             {"router_sessions", sessions},
             {"direct", PacedJson(direct, offered, ideal_ms)},
             {"gateway", PacedJson(through, offered, ideal_ms)}};
    errors += static_cast<int>(direct.failures + through.failures);
    if (per_request != nullptr) {
      PacedResult base = through_gateway(*per_request);
      errors += static_cast<int>(base.failures);
      paced["gateway_per_request_calls"] = PacedJson(base, offered, ideal_ms);
      const double base_tps = paced["gateway_per_request_calls"]["tokens_per_s"];
      const double base_cpu = paced["gateway_per_request_calls"]["cpu_us_per_token"];
      paced["sessions_over_per_request_tokens_per_s"] =
          base_tps > 0 ? paced["gateway"]["tokens_per_s"].get<double>() / base_tps : 0;
      fprintf(
          stderr,
          "paced, baseline gateway with one Generate call per request: %.0f SSE "
          "tokens/s (gateway %.1f us CPU/token; client %.1f, router fixture %.1f "
          "us CPU/token); sessions / per-request calls: %.2fx tokens/s, %.2fx "
          "gateway CPU per token\n",
          base_tps, base_cpu,
          paced["gateway_per_request_calls"]["client_cpu_us_per_token"].get<double>(),
          paced["gateway_per_request_calls"]["fixture_cpu_us_per_token"].get<double>(),
          paced["sessions_over_per_request_tokens_per_s"].get<double>(),
          base_cpu > 0 ? paced["gateway"]["cpu_us_per_token"].get<double>() / base_cpu
                       : 0.0);
    }
    fprintf(stderr,
            "paced (%d streams x %.0f tokens/s, %d tokens/request; offered %.0f "
            "tokens/s): direct %.0f tokens/s (%.1f us CPU/token); gateway (%d router "
            "sessions) SSE %.0f "
            "tokens/s (gateway %.1f us CPU/token = %.0f tokens per CPU second; "
            "client %.1f, router fixture %.1f us CPU/token; %.2f of "
            "offered, %.3f SSE chunks/token, gap p50 %.1f ms p99 %.1f ms, request p50 "
            "%.0f ms p99 %.0f ms, ideal %.0f ms)\n",
            paced_streams, paced_rate, paced_tokens, offered,
            paced["direct"]["tokens_per_s"].get<double>(),
            paced["direct"]["cpu_us_per_token"].get<double>(), sessions,
            paced["gateway"]["tokens_per_s"].get<double>(),
            paced["gateway"]["cpu_us_per_token"].get<double>(),
            paced["gateway"]["tokens_per_cpu_s"].get<double>(),
            paced["gateway"]["client_cpu_us_per_token"].get<double>(),
            paced["gateway"]["fixture_cpu_us_per_token"].get<double>(),
            paced["gateway"]["delivered_over_offered"].get<double>(),
            paced["gateway"]["events_per_token"].get<double>(),
            paced["gateway"]["gap_p50_ms"].get<double>(),
            paced["gateway"]["gap_p99_ms"].get<double>(),
            paced["gateway"]["request_p50_ms"].get<double>(),
            paced["gateway"]["request_p99_ms"].get<double>(), ideal_ms);
  }

  // 1. Latency, sequential, interleaved so both paths see the same machine.
  // Like for like: the gateway on sessions against a direct client on
  // sessions (the same fixture behaviour: a session's messages merge), and
  // the per-request gateway against direct Generate calls.
  const int n_tokens = absl::GetFlag(FLAGS_tokens);
  auto [ids, body] = prompt_for(n_tokens, /*usage=*/false);
  auto latency = [&](http::HttpServer& server, const std::function<int()>& direct,
                     std::vector<double>* direct_ms, std::vector<double>* gateway_ms) {
    auto conn =
        metrics::HttpConnection::Connect("127.0.0.1", server.port(), absl::Seconds(10));
    if (!conn.ok()) {
      ++errors;
      return;
    }
    for (int i = 0; i < 20; ++i) {  // warm-up
      direct();
      GatewayOnce(conn->get(), body);
    }
    for (int i = 0; i < absl::GetFlag(FLAGS_requests); ++i) {
      absl::Time t0 = absl::Now();
      if (direct() < 0) ++errors;
      absl::Time t1 = absl::Now();
      if (GatewayOnce(conn->get(), body) < 0) ++errors;
      absl::Time t2 = absl::Now();
      direct_ms->push_back(absl::ToDoubleMilliseconds(t1 - t0));
      gateway_ms->push_back(absl::ToDoubleMilliseconds(t2 - t1));
    }
  };
  std::unique_ptr<RouterClient> direct_sessions;
  if (sessions > 0) {
    direct_sessions = std::make_unique<RouterClient>(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(grpc_port),
                            grpc::InsecureChannelCredentials()),
        RouterClient::Options{.sessions = sessions});
  }
  std::vector<double> direct_ms, gateway_ms;
  latency(
      http,
      [&, &ids = ids] {
        return direct_sessions ? DirectSessionOnce(direct_sessions.get(), ids)
                               : DirectOnce(stub.get(), ids);
      },
      &direct_ms, &gateway_ms);
  std::vector<double> direct_call_ms, gateway_call_ms;  // per-request baseline
  if (per_request != nullptr) {
    latency(
        per_request->http, [&, &ids = ids] { return DirectOnce(stub.get(), ids); },
        &direct_call_ms, &gateway_call_ms);
  }

  // 2. Throughput with concurrent streams, one token per gRPC message: the
  // per-request gateway (on a session the fixture's messages merge, so "one
  // token per message" has no meaning there).
  http::HttpServer& full_speed_http = per_request ? per_request->http : http;
  auto [big_ids, big_body] =
      prompt_for(absl::GetFlag(FLAGS_stream_tokens), /*usage=*/true);
  const int concurrency = absl::GetFlag(FLAGS_concurrency);
  const absl::Duration duration = absl::Seconds(absl::GetFlag(FLAGS_seconds));
  auto run = [&](bool through_gateway) {
    std::atomic<int64_t> tokens{0};
    std::atomic<int> failures{0};
    const absl::Time start = absl::Now();
    const double cpu0 = ProcessCpuSeconds();
    absl::Mutex cpu_mu;
    double client_cpu = 0;  // the HTTP client threads' (gateway runs)
    std::vector<std::thread> threads;
    for (int c = 0; c < concurrency; ++c) {
      threads.emplace_back([&] {
        const double t0 = ThreadCpuSeconds();
        auto count_cpu = absl::MakeCleanup([&] {
          if (!through_gateway) return;
          absl::MutexLock lock(&cpu_mu);
          client_cpu += ThreadCpuSeconds() - t0;
        });
        std::unique_ptr<metrics::HttpConnection> http_conn;
        if (through_gateway) {
          auto cc = metrics::HttpConnection::Connect(
              "127.0.0.1", full_speed_http.port(), absl::Seconds(10));
          if (!cc.ok()) {
            failures.fetch_add(1);
            return;
          }
          http_conn = *std::move(cc);
        }
        while (absl::Now() - start < duration) {
          int n = through_gateway ? GatewayOnce(http_conn.get(), big_body)
                                  : DirectOnce(stub.get(), big_ids);
          if (n < 0) {
            failures.fetch_add(1);
          } else {
            tokens.fetch_add(n);
          }
        }
      });
    }
    for (auto& t : threads) t.join();
    const double secs = absl::ToDoubleSeconds(absl::Now() - start);
    errors += failures.load();
    return std::make_pair(
        tokens.load() / secs,
        tokens.load() > 0
            ? 1e6 * (ProcessCpuSeconds() - cpu0 - client_cpu) / tokens.load()
            : 0.0);
  };
  const auto [direct_tps, direct_cpu_us] = run(false);
  const auto [gateway_tps, gateway_cpu_us] = run(true);

  json out = {
      {"bench", "gateway"},
      {"headline_paced_gateway_sse_tokens_per_s",
       paced.is_null() ? json(nullptr) : paced["gateway"]["tokens_per_s"]},
      {"paced", paced},
      {"io_threads", absl::GetFlag(FLAGS_io_threads)},
      {"router_sessions", sessions},
      {"stream_interval", absl::GetFlag(FLAGS_stream_interval)},
      {"latency_tokens_per_request", n_tokens},
      {"requests", absl::GetFlag(FLAGS_requests)},
      {"direct_p50_ms", Percentile(direct_ms, 0.5)},
      {"direct_p99_ms", Percentile(direct_ms, 0.99)},
      {"gateway_p50_ms", Percentile(gateway_ms, 0.5)},
      {"gateway_p99_ms", Percentile(gateway_ms, 0.99)},
      {"added_p50_ms", Percentile(gateway_ms, 0.5) - Percentile(direct_ms, 0.5)},
      {"added_p99_ms", Percentile(gateway_ms, 0.99) - Percentile(direct_ms, 0.99)},
      {"latency_transport", sessions > 0 ? "sessions" : "per_request_calls"},
      {"per_request_calls_added_p50_ms",
       direct_call_ms.empty()
           ? json(nullptr)
           : json(Percentile(gateway_call_ms, 0.5) - Percentile(direct_call_ms, 0.5))},
      {"per_request_calls_direct_p50_ms",
       direct_call_ms.empty() ? json(nullptr) : json(Percentile(direct_call_ms, 0.5))},
      {"per_request_calls_gateway_p50_ms",
       gateway_call_ms.empty() ? json(nullptr)
                               : json(Percentile(gateway_call_ms, 0.5))},
      {"concurrency", concurrency},
      {"stream_tokens_per_request", absl::GetFlag(FLAGS_stream_tokens)},
      {"direct_tokens_per_s", direct_tps},
      {"gateway_sse_tokens_per_s", gateway_tps},
      {"direct_cpu_us_per_token", direct_cpu_us},
      {"gateway_cpu_us_per_token", gateway_cpu_us},
      {"errors", errors},
  };
  fprintf(
      stderr,
      "latency (%d tokens/request, %d requests, %s): direct p50 %.3f ms p99 %.3f "
      "ms; gateway p50 %.3f ms p99 %.3f ms; added p50 %.3f ms%s\n"
      "full speed (%d streams x %d tokens, %s): direct %.0f "
      "tokens/s (%.1f us CPU/token); gateway SSE %.0f tokens/s (%.1f us "
      "CPU/token)\n",
      n_tokens, absl::GetFlag(FLAGS_requests),
      sessions > 0 ? "sessions, direct client on sessions too" : "per-request calls",
      out["direct_p50_ms"].get<double>(), out["direct_p99_ms"].get<double>(),
      out["gateway_p50_ms"].get<double>(), out["gateway_p99_ms"].get<double>(),
      out["added_p50_ms"].get<double>(),
      direct_call_ms.empty()
          ? ""
          : absl::StrCat(
                "; per-request calls: direct p50 ",
                absl::SixDigits(Percentile(direct_call_ms, 0.5)), " ms, gateway p50 ",
                absl::SixDigits(Percentile(gateway_call_ms, 0.5)), " ms, added ",
                absl::SixDigits(Percentile(gateway_call_ms, 0.5) -
                                Percentile(direct_call_ms, 0.5)),
                " ms")
                .c_str(),
      concurrency, absl::GetFlag(FLAGS_stream_tokens),
      per_request != nullptr || sessions == 0
          ? "one token per message, per-request gateway"
          : "gateway on sessions: the fixture's messages merge",
      direct_tps, direct_cpu_us, gateway_tps, gateway_cpu_us);
  direct_sessions.reset();
  gateway.reset();
  per_request.reset();
  if (grpc_server) {
    grpc_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
  if (child.pid > 0) {
    kill(child.pid, SIGTERM);
    waitpid(child.pid, nullptr, 0);
  }
  printf("%s\n", out.dump().c_str());
  return errors == 0 ? 0 : 1;
}

}  // namespace
}  // namespace tandem::gateway

int main(int argc, char** argv) {
  tandem::InitProgram(argc, argv, "gateway_bench",
                      "Gateway overhead vs calling the router directly.");
  // Debian's Abseil is built without NDEBUG, which leaves Mutex deadlock
  // detection on: a global graph update on every lock (5% of the gateway's
  // CPU in the streaming benchmark). It is a debugging aid; turn it off.
  // --mutex_deadlock_detection keeps it on (to compare with earlier builds).
  if (!absl::GetFlag(FLAGS_mutex_deadlock_detection)) {
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  }
  return tandem::gateway::Main(argc, argv);
}
