#include "http/server.h"

#include <sys/socket.h>
#include <sys/stat.h>

#include <array>
#include <atomic>
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <functional>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"

namespace tandem::http {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
namespace ssl = asio::ssl;
using tcp = asio::ip::tcp;

std::chrono::steady_clock::duration ToChrono(absl::Duration d) {
  return std::chrono::nanoseconds(absl::ToInt64Nanoseconds(d));
}

// After an error response the client may still be sending (an oversized
// body): read and discard for at most this long so that the close does not
// turn into a reset that destroys the response in flight.
constexpr auto kLingerTime = std::chrono::seconds(2);
constexpr size_t kLingerMaxBytes = 1 << 20;

bool IsHttpError(const beast::error_code& ec) {
  return ec.category() ==
         bhttp::make_error_code(bhttp::error::end_of_stream).category();
}

std::string StatusLine(int status) {
  beast::string_view reason =
      bhttp::obsolete_reason(static_cast<bhttp::status>(status));
  return absl::StrCat("HTTP/1.1 ", status, " ",
                      absl::string_view(reason.data(), reason.size()), "\r\n");
}

// Status line and headers; `content_length` < 0 means chunked.
std::string Head(absl::string_view server_name, int status,
                 absl::string_view content_type, const HttpHeaderList& headers,
                 bool keep_alive, int64_t content_length) {
  std::string out = StatusLine(status);
  absl::StrAppend(&out, "Server: ", server_name, "\r\n");
  if (!content_type.empty())
    absl::StrAppend(&out, "Content-Type: ", content_type, "\r\n");
  for (const auto& [name, value] : headers) {
    // Header injection: drop any CR/LF a caller let through.
    if (name.find_first_of("\r\n") != std::string::npos ||
        value.find_first_of("\r\n") != std::string::npos) {
      continue;
    }
    absl::StrAppend(&out, name, ": ", value, "\r\n");
  }
  if (content_length >= 0) {
    absl::StrAppend(&out, "Content-Length: ", content_length, "\r\n");
  } else {
    absl::StrAppend(&out, "Transfer-Encoding: chunked\r\n");
  }
  if (!keep_alive) absl::StrAppend(&out, "Connection: close\r\n");
  out += "\r\n";
  return out;
}

class Session;

// State shared by the server, its sessions and their writers.
struct ServerCore {
  HttpServerOptions options;
  HttpHandler handler;
  HttpErrorFormatter formatter;

  absl::Mutex mu;
  absl::CondVar changed;
  absl::flat_hash_set<Session*> sessions ABSL_GUARDED_BY(mu);
  int writers ABSL_GUARDED_BY(mu) = 0;
  std::atomic<bool> stopping{false};
  std::atomic<int> open{0};
};

// One connection. Owned by its pending operations and by the writer of its
// current request (shared_ptr); every member is touched on its strand only.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, std::shared_ptr<ServerCore> core)
      : stream_(std::move(socket)),
        core_(std::move(core)),
        fd_(stream_.socket().native_handle()) {
    absl::MutexLock lock(&core_->mu);
    core_->sessions.insert(this);
    core_->open.fetch_add(1);
  }
  ~Session() {
    absl::MutexLock lock(&core_->mu);
    core_->sessions.erase(this);
    core_->open.fetch_sub(1);
    core_->changed.SignalAll();
  }

  asio::any_io_executor executor() { return stream_.get_executor(); }

  void Start() { ReadRequest(); }

  // Shutdown: close at once when no request is in flight, else after it.
  void CloseIfIdle() {
    if (!in_request_) Close();
  }
  void Abort() { Close(); }

  // Any thread (Writer::Write): sends `bytes` of request `seq` at once when
  // the response is streaming with nothing queued or in flight (the strand
  // would only be handing the same bytes to the same socket later). Returns
  // how many bytes went out (the caller queues the rest, in order, through
  // the strand), or -1 when nothing may be sent directly now.
  ssize_t TrySendDirect(uint64_t seq, absl::string_view bytes) {
    absl::MutexLock lock(&direct_mu_);
    if (!direct_ok_ || direct_seq_ != seq) return -1;
    ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return -1;
      n = 0;
    }
    // A full socket buffer: the rest goes through the strand (with the write
    // deadline and the buffer cap), which allows direct sends again once
    // everything queued is written.
    if (static_cast<size_t>(n) < bytes.size()) direct_ok_ = false;
    return n;
  }

  // Writer entry points (posted onto the strand).
  void DoSend(uint64_t seq, HttpResponse r) {
    if (!Current(seq) || state_ != State::kNone) return;
    state_ = State::kEnded;
    std::string out = Head(core_->options.server_name, r.status, r.content_type,
                           r.headers, keep_alive_, static_cast<int64_t>(r.body.size()));
    if (method_ != "HEAD") out += r.body;
    Enqueue(std::move(out));
  }
  void DoStartStream(uint64_t seq, int status, std::string content_type,
                     HttpHeaderList headers) {
    if (!Current(seq) || state_ != State::kNone) return;
    state_ = State::kStreaming;
    headers.emplace_back("Cache-Control", "no-cache");
    headers.emplace_back("X-Accel-Buffering", "no");
    Enqueue(Head(core_->options.server_name, status, content_type, headers, keep_alive_,
                 -1));
  }
  // `chunks`: one or more writes, each already framed as an HTTP chunk.
  void DoWriteChunks(uint64_t seq, absl::string_view chunks) {
    if (!Current(seq) || state_ != State::kStreaming || chunks.empty()) return;
    Enqueue(chunks);
  }
  void DoEnd(uint64_t seq) {
    if (!Current(seq) || state_ != State::kStreaming) return;
    state_ = State::kEnded;
    Enqueue("0\r\n\r\n");
  }
  void DoOnGone(uint64_t seq, std::function<void()> callback) {
    if (seq != seq_) return;
    if (closed_ && in_request_) {
      callback();
      return;
    }
    on_gone_ = std::move(callback);
  }
  // The writer was released: a handler that never answered gets a 500, a
  // stream never ended is ended.
  void DoAbandon(uint64_t seq) {
    if (!Current(seq)) return;
    if (state_ == State::kNone) {
      DoSend(seq, core_->formatter(500, "the request was dropped without a response"));
    } else if (state_ == State::kStreaming) {
      DoEnd(seq);
    }
  }

 private:
  enum class State { kNone, kStreaming, kEnded };

  bool Current(uint64_t seq) const { return !closed_ && in_request_ && seq == seq_; }

  void ReadRequest() {
    if (core_->stopping.load()) return Close();
    parser_.emplace();
    parser_->header_limit(static_cast<uint32_t>(core_->options.max_header_bytes));
    parser_->body_limit(core_->options.max_body_bytes);
    if (buffer_.size() > 0) return ReadHeader();
    // Idle keep-alive wait: the first byte of the next request.
    stream_.expires_after(ToChrono(core_->options.idle_timeout));
    stream_.async_read_some(buffer_.prepare(4096), [self = shared_from_this()](
                                                       beast::error_code ec, size_t n) {
      if (self->closed_) return;
      self->buffer_.commit(n);
      if (ec) return self->Close();
      self->ReadHeader();
    });
  }

  void ReadHeader() {
    stream_.expires_after(ToChrono(core_->options.header_timeout));
    bhttp::async_read_header(stream_, buffer_, *parser_,
                             [self = shared_from_this()](beast::error_code ec, size_t) {
                               self->OnHeader(ec);
                             });
  }

  // True when `ec` was answered or closed the connection.
  bool HandleReadError(beast::error_code ec) {
    if (!ec) return false;
    if (closed_) return true;
    if (ec == beast::error::timeout) {
      Close();  // the stream has closed the socket already: no 408 possible
    } else if (ec == bhttp::error::end_of_stream ||
               ec == asio::error::operation_aborted) {
      Close();
    } else if (ec == bhttp::error::header_limit ||
               ec == bhttp::error::buffer_overflow) {
      WriteError(431, absl::StrCat("request headers larger than ",
                                   core_->options.max_header_bytes, " bytes"));
    } else if (ec == bhttp::error::body_limit) {
      WriteError(413, absl::StrCat("request body larger than ",
                                   core_->options.max_body_bytes, " bytes"));
    } else if (IsHttpError(ec)) {
      WriteError(400, absl::StrCat("malformed HTTP request: ", ec.message()));
    } else {
      Close();  // reset by peer and the like
    }
    return true;
  }

  void OnHeader(beast::error_code ec) {
    if (HandleReadError(ec)) return;
    const auto& req = parser_->get();
    if (auto it = req.find(bhttp::field::expect);
        it != req.end() && beast::iequals(it->value(), "100-continue")) {
      stream_.expires_after(ToChrono(core_->options.write_timeout));
      asio::async_write(stream_, asio::buffer(kContinue.data(), kContinue.size()),
                        [self = shared_from_this()](beast::error_code ec, size_t) {
                          if (self->closed_) return;
                          if (ec) return self->Close();
                          self->ReadBody();
                        });
      return;
    }
    ReadBody();
  }

  void ReadBody() {
    stream_.expires_after(ToChrono(core_->options.body_timeout));
    bhttp::async_read(stream_, buffer_, *parser_,
                      [self = shared_from_this()](beast::error_code ec, size_t) {
                        if (self->HandleReadError(ec)) return;
                        self->Dispatch();
                      });
  }

  void Dispatch() {
    bhttp::request<bhttp::string_body> req = parser_->release();
    parser_.reset();
    HttpRequest out;
    out.method = std::string(req.method_string());
    out.target = std::string(req.target());
    out.path = out.target.substr(0, out.target.find('?'));
    for (const auto& field : req) {
      out.headers.emplace_back(absl::AsciiStrToLower(std::string(field.name_string())),
                               std::string(field.value()));
    }
    out.body = std::move(req.body());
    method_ = out.method;
    keep_alive_ = req.keep_alive() && !core_->stopping.load();
    ++seq_;
    in_request_ = true;
    state_ = State::kNone;
    stream_.expires_never();
    Watch(seq_);
    core_->handler(std::move(out), MakeWriter());
  }

  std::shared_ptr<ResponseWriter> MakeWriter();

  // Notices a client that goes away while its request is being handled.
  void Watch(uint64_t seq) {
    stream_.socket().async_wait(
        tcp::socket::wait_read, [self = shared_from_this(), seq](beast::error_code ec) {
          if (self->closed_ || !self->in_request_ || seq != self->seq_) return;
          if (ec) return self->Close();
          char c;
          const ssize_t n = ::recv(self->stream_.socket().native_handle(), &c, 1,
                                   MSG_PEEK | MSG_DONTWAIT);
          if (n == 0) return self->Close();  // orderly close by the client
          if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            return self->Close();
          }
          if (n > 0) return;  // a pipelined request: read after this response
          self->Watch(seq);
        });
  }

  // Appends to what the next write takes; everything queued while a write is
  // in flight goes out together when it completes (never held back waiting).
  void Enqueue(absl::string_view bytes) {
    buffered_ += bytes.size();
    out_.append(bytes.data(), bytes.size());
    if (buffered_ > core_->options.max_buffered_bytes) {
      TLOG(WARNING, "client too slow: dropping the connection")
          .Kv("buffered_bytes", buffered_);
      return Close();
    }
    Flush();
  }

  // Strand: whether other threads may send directly (see TrySendDirect).
  void UpdateDirect() {
    const bool ok = !closed_ && in_request_ && state_ == State::kStreaming &&
                    !writing_ && out_.empty();
    absl::MutexLock lock(&direct_mu_);
    direct_ok_ = ok;
    direct_seq_ = seq_;
  }

  void Flush() {
    if (writing_ || out_.empty() || closed_) return;
    // The socket nearly always takes it all at once: send from the strand now
    // (no composed write, no completion to wait for before direct sends may
    // resume); what it does not take goes out asynchronously below.
    {
      absl::MutexLock lock(&direct_mu_);  // a direct send may be in progress
      const ssize_t n =
          ::send(fd_, out_.data(), out_.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        out_.erase(0, static_cast<size_t>(n));
        buffered_ -= std::min(buffered_, static_cast<size_t>(n));
      }
      // An error: the asynchronous write below reports it (and closes).
    }
    if (out_.empty()) {
      if (in_request_ && state_ == State::kEnded) return FinishRequest();
      return UpdateDirect();
    }
    writing_buf_.clear();
    writing_buf_.swap(out_);  // both keep their capacity: no allocation per write
    writing_ = true;
    UpdateDirect();  // off while this write is in flight
    stream_.expires_after(ToChrono(core_->options.write_timeout));
    asio::async_write(stream_, asio::buffer(writing_buf_),
                      [self = shared_from_this()](beast::error_code ec, size_t n) {
                        self->writing_ = false;
                        self->buffered_ -= std::min(self->buffered_, n);
                        if (self->closed_) return;
                        if (ec) return self->Close();
                        if (!self->out_.empty()) return self->Flush();
                        if (self->in_request_ && self->state_ == State::kEnded) {
                          return self->FinishRequest();
                        }
                        self->UpdateDirect();
                      });
  }

  void FinishRequest() {
    in_request_ = false;
    on_gone_ = nullptr;
    if (!keep_alive_ || core_->stopping.load()) return Close();
    ReadRequest();
  }

  // A response of the server's own (the request never reached the handler).
  void WriteError(int status, std::string message) {
    HttpResponse r = core_->formatter(status, std::move(message));
    std::string bytes =
        Head(core_->options.server_name, r.status, r.content_type, r.headers,
             /*keep_alive=*/false, static_cast<int64_t>(r.body.size()));
    bytes += r.body;
    writing_buf_ = std::move(bytes);
    writing_ = true;
    stream_.expires_after(ToChrono(core_->options.write_timeout));
    asio::async_write(stream_, asio::buffer(writing_buf_),
                      [self = shared_from_this()](beast::error_code ec, size_t) {
                        self->writing_ = false;
                        if (self->closed_) return;
                        if (ec) return self->Close();
                        self->Linger();
                      });
  }

  // Half-close, then discard what the client still sends until it closes, the
  // byte cap or kLingerTime.
  void Linger() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    stream_.expires_after(kLingerTime);
    Drain();
  }
  void Drain() {
    stream_.async_read_some(
        asio::buffer(scratch_),
        [self = shared_from_this()](beast::error_code ec, size_t n) {
          if (self->closed_) return;
          self->lingered_ += n;
          if (ec || self->lingered_ > kLingerMaxBytes) {
            return self->Close();
          }
          self->Drain();
        });
  }

  void Close() {
    if (closed_) return;
    closed_ = true;
    UpdateDirect();  // waits out a direct send in progress: the fd closes below
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
    out_.clear();
    if (in_request_ && state_ != State::kEnded && on_gone_) {
      std::function<void()> callback = std::move(on_gone_);
      on_gone_ = nullptr;
      callback();
    }
  }

  static constexpr absl::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";

  beast::tcp_stream stream_;
  std::shared_ptr<ServerCore> core_;
  beast::flat_buffer buffer_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;

  uint64_t seq_ = 0;  // current request
  bool in_request_ = false;
  bool keep_alive_ = true;
  std::string method_;
  State state_ = State::kNone;
  std::function<void()> on_gone_;

  const int fd_;  // the socket's, for TrySendDirect
  absl::Mutex direct_mu_;
  bool direct_ok_ ABSL_GUARDED_BY(direct_mu_) = false;
  uint64_t direct_seq_ ABSL_GUARDED_BY(direct_mu_) = 0;

  std::string out_;  // queued, not yet handed to the socket
  std::string writing_buf_;
  bool writing_ = false;
  size_t buffered_ = 0;
  bool closed_ = false;

  char scratch_[4096];
  size_t lingered_ = 0;
};

// A writer's calls, in call order, waiting to be applied on the session's
// strand. Consecutive Write()s share one entry (their chunks framed back to
// back), and one posted drain applies everything queued by the time it runs:
// a fast producer costs one strand hop per batch, not per token.
struct WriterInbox {
  struct Op {
    std::string chunks;                            // framed writes, or
    std::function<void(Session*, uint64_t)> call;  // any other call
  };
  absl::Mutex mu;
  std::vector<Op> ops ABSL_GUARDED_BY(mu);
  std::vector<Op> spare ABSL_GUARDED_BY(mu);   // drained vector, reused
  bool scheduled ABSL_GUARDED_BY(mu) = false;  // a drain is posted or running
  std::string direct ABSL_GUARDED_BY(mu);      // Write's fast path, reused
  std::chrono::steady_clock::time_point last_write ABSL_GUARDED_BY(mu);
};

class Writer final : public ResponseWriter {
 public:
  Writer(std::shared_ptr<Session> session, uint64_t seq,
         std::shared_ptr<ServerCore> core)
      : session_(std::move(session)),
        seq_(seq),
        core_(std::move(core)),
        inbox_(std::make_shared<WriterInbox>()),
        min_gap_(ToChrono(core_->options.direct_write_min_gap)) {
    absl::MutexLock lock(&core_->mu);
    ++core_->writers;
  }
  ~Writer() override {
    Post([](Session* s, uint64_t seq) { s->DoAbandon(seq); });
    session_.reset();
    absl::MutexLock lock(&core_->mu);
    --core_->writers;
    core_->changed.SignalAll();
  }

  void Send(HttpResponse response) override {
    Post([r = std::move(response)](Session* s, uint64_t seq) mutable {
      s->DoSend(seq, std::move(r));
    });
  }
  void StartStream(int status, std::string content_type,
                   HttpHeaderList headers) override {
    Post([status, ct = std::move(content_type), h = std::move(headers)](
             Session* s, uint64_t seq) mutable {
      s->DoStartStream(seq, status, std::move(ct), std::move(h));
    });
  }
  // Fast path: when nothing of this response waits in the inbox or on the
  // strand, the chunk is sent from this thread at once (no strand hop, no
  // wake-up of an I/O thread); what the socket does not take, and every
  // write while anything waits, goes through the inbox in order. A chunk
  // that follows the previous one within direct_write_min_gap is part of a
  // burst (by default a stream faster than 200 chunks/s): it goes through the
  // strand, which sends everything queued behind an in-flight write in one
  // go, so a burst costs fewer syscalls than one send per chunk.
  void Write(std::string data) override {
    if (data.empty()) return;
    char size[2 * sizeof(size_t) + 1];
    const int n = snprintf(size, sizeof(size), "%zx", data.size());
    bool post = false;
    {
      absl::MutexLock lock(&inbox_->mu);
      auto& ops = inbox_->ops;
      const auto now = std::chrono::steady_clock::now();
      const bool burst = now - inbox_->last_write < min_gap_;
      inbox_->last_write = now;
      if (!inbox_->scheduled && ops.empty() && !burst && core_->options.direct_writes) {
        std::string& framed = inbox_->direct;
        framed.clear();
        framed.append(size, static_cast<size_t>(n));
        framed += "\r\n";
        framed += data;
        framed += "\r\n";
        const ssize_t sent = session_->TrySendDirect(seq_, framed);
        if (sent == static_cast<ssize_t>(framed.size())) return;
        ops.emplace_back();
        ops.back().chunks.assign(framed, sent > 0 ? static_cast<size_t>(sent) : 0);
      } else {
        if (ops.empty() || ops.back().call) ops.emplace_back();
        std::string& out = ops.back().chunks;
        out.append(size, static_cast<size_t>(n));
        out += "\r\n";
        out += data;
        out += "\r\n";
      }
      post = !std::exchange(inbox_->scheduled, true);
    }
    if (post) ScheduleDrain();
  }
  void End() override {
    Post([](Session* s, uint64_t seq) { s->DoEnd(seq); });
  }
  void OnClientGone(std::function<void()> callback) override {
    Post([cb = std::move(callback)](Session* s, uint64_t seq) mutable {
      s->DoOnGone(seq, std::move(cb));
    });
  }

 private:
  template <typename F>
  void Post(F f) {
    bool post = false;
    {
      absl::MutexLock lock(&inbox_->mu);
      inbox_->ops.push_back({.chunks = {}, .call = std::move(f)});
      post = !std::exchange(inbox_->scheduled, true);
    }
    if (post) ScheduleDrain();
  }

  // Applies the inbox on the strand, until it is empty: calls queued while
  // it runs are applied by the same drain (`scheduled` stays set meanwhile,
  // which also keeps Write off its fast path until everything earlier has
  // reached the session).
  void ScheduleDrain() {
    asio::post(session_->executor(), [s = session_, seq = seq_, inbox = inbox_] {
      std::vector<WriterInbox::Op> ops;
      for (;;) {
        {
          absl::MutexLock lock(&inbox->mu);
          if (inbox->ops.empty()) {
            inbox->scheduled = false;
            if (inbox->spare.capacity() < ops.capacity()) inbox->spare.swap(ops);
            return;
          }
          ops.swap(inbox->ops);
          inbox->ops.swap(inbox->spare);
        }
        for (WriterInbox::Op& op : ops) {
          if (op.call) {
            op.call(s.get(), seq);
          } else {
            s->DoWriteChunks(seq, op.chunks);
          }
        }
        ops.clear();
        absl::MutexLock lock(&inbox->mu);
        if (inbox->spare.capacity() < ops.capacity()) inbox->spare.swap(ops);
      }
    });
  }

  std::shared_ptr<Session> session_;
  const uint64_t seq_;
  std::shared_ptr<ServerCore> core_;
  std::shared_ptr<WriterInbox> inbox_;
  const std::chrono::steady_clock::duration min_gap_;
};

std::shared_ptr<ResponseWriter> Session::MakeWriter() {
  return std::make_shared<Writer>(shared_from_this(), seq_, core_);
}

}  // namespace

// ---------------------------------------------------------------- HTTPS

// The server's TLS context: loaded at Start, loaded again for new connections
// when a file changed (inode, size or mtime: a Kubernetes Secret update swaps a
// symlink), checked at most once per tls_reload_period. Thread-safe.
class TlsContextSource {
 public:
  explicit TlsContextSource(const HttpServerOptions& o) : o_(o) {}

  absl::Status Load() {
    absl::StatusOr<std::shared_ptr<ssl::context>> ctx = Build();
    if (!ctx.ok()) return ctx.status();
    absl::MutexLock lock(&mu_);
    ctx_ = *std::move(ctx);
    stamp_ = Stamp();
    checked_ = absl::Now();
    return absl::OkStatus();
  }

  std::shared_ptr<ssl::context> Get() {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (now - checked_ < o_.tls_reload_period) return ctx_;
    checked_ = now;
    const std::string stamp = Stamp();
    if (stamp == stamp_) return ctx_;
    absl::StatusOr<std::shared_ptr<ssl::context>> ctx = Build();
    if (!ctx.ok()) {
      // Often a half-written renewal: keep serving the previous certificate,
      // try again at the next check.
      TLOG(WARNING,
           "https: the changed certificate files do not load; keeping the "
           "previous ones")
          .Kv("server", o_.server_name)
          .Kv("status", ctx.status());
      return ctx_;
    }
    TLOG(INFO, "https: certificate reloaded")
        .Kv("server", o_.server_name)
        .Kv("cert", o_.tls_cert_file);
    ctx_ = *std::move(ctx);
    stamp_ = stamp;
    return ctx_;
  }

 private:
  std::string Stamp() const {
    std::string out;
    for (const std::string* f :
         {&o_.tls_cert_file, &o_.tls_key_file, &o_.tls_client_ca_file}) {
      struct stat st {};
      if (f->empty() || ::stat(f->c_str(), &st) != 0) {
        out += "-;";
        continue;
      }
      absl::StrAppend(&out, st.st_ino, ":", st.st_size, ":", st.st_mtim.tv_sec, ".",
                      st.st_mtim.tv_nsec, ";");
    }
    return out;
  }

  absl::StatusOr<std::shared_ptr<ssl::context>> Build() const {
    auto ctx = std::make_shared<ssl::context>(ssl::context::tls_server);
    beast::error_code ec;
    ctx->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 |
                         ssl::context::no_sslv3 | ssl::context::no_tlsv1 |
                         ssl::context::no_tlsv1_1 | ssl::context::single_dh_use,
                     ec);
    auto fail = [this](absl::string_view what, const std::string& file,
                       const beast::error_code& e) {
      return absl::InvalidArgumentError(absl::StrCat(
          o_.server_name, ": https: cannot load ", what, " ", file, ": ", e.message()));
    };
    ctx->use_certificate_chain_file(o_.tls_cert_file, ec);
    if (ec) return fail("the certificate chain", o_.tls_cert_file, ec);
    ctx->use_private_key_file(o_.tls_key_file, ssl::context::pem, ec);
    if (ec && ec.message().find("mismatch") == std::string::npos) {
      return fail("the private key", o_.tls_key_file, ec);
    }
    if (ec || SSL_CTX_check_private_key(ctx->native_handle()) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(o_.server_name, ": https: the private key ", o_.tls_key_file,
                       " does not match the certificate ", o_.tls_cert_file));
    }
    if (!o_.tls_client_ca_file.empty()) {
      ctx->load_verify_file(o_.tls_client_ca_file, ec);
      if (ec) return fail("the client CA", o_.tls_client_ca_file, ec);
      ctx->set_verify_mode(ssl::verify_peer | ssl::verify_fail_if_no_peer_cert, ec);
    }
    return ctx;
  }

  const HttpServerOptions& o_;
  absl::Mutex mu_;
  std::shared_ptr<ssl::context> ctx_ ABSL_GUARDED_BY(mu_);
  std::string stamp_ ABSL_GUARDED_BY(mu_);
  absl::Time checked_ ABSL_GUARDED_BY(mu_);
};

// One HTTPS connection: the TLS handshake (bounded by header_timeout), then the
// plaintext relayed both ways, on the connection's strand, between the TLS
// stream and one end of a local socket pair whose other end is an ordinary
// Session. Either side closing closes both (the TLS side with a close_notify).
// Each write to the client is bounded by write_timeout.
class TlsRelay : public std::enable_shared_from_this<TlsRelay> {
 public:
  // `adopt` gets the session's end of the pair (a connected stream socket).
  TlsRelay(tcp::socket socket, std::shared_ptr<ssl::context> ctx,
           std::shared_ptr<ServerCore> core, std::function<void(int fd)> adopt)
      : ctx_(std::move(ctx)),
        tls_(std::move(socket), *ctx_),
        plain_(tls_.get_executor()),
        timer_(tls_.get_executor()),
        core_(std::move(core)),
        adopt_(std::move(adopt)) {}

  asio::any_io_executor executor() { return tls_.get_executor(); }

  void Start() {
    Arm(core_->options.header_timeout);
    tls_.async_handshake(ssl::stream_base::server,
                         [self = shared_from_this()](beast::error_code ec) {
                           self->Disarm();
                           if (self->closed_) return;
                           if (ec) {
                             TLOG(DEBUG, "https handshake failed")
                                 .Kv("server", self->core_->options.server_name)
                                 .Kv("error", ec.message());
                             return self->Close();
                           }
                           self->Connected();
                         });
  }

 private:
  void Connected() {
    int fds[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
      TLOG(WARNING, "https: socketpair failed").Kv("errno", errno);
      return Close();
    }
    beast::error_code ec;
    plain_.assign(asio::local::stream_protocol(), fds[0], ec);
    if (ec) {
      ::close(fds[0]);
      ::close(fds[1]);
      return Close();
    }
    adopt_(fds[1]);
    ReadClient();
    ReadSession();
  }

  // Client → session.
  void ReadClient() {
    tls_.async_read_some(
        asio::buffer(up_), [self = shared_from_this()](beast::error_code ec, size_t n) {
          if (self->closed_) return;
          // Finishing: this read was cancelled so that the close_notify runs alone.
          if (self->finishing_) return self->Shutdown();
          if (ec) return self->Close();  // the client closed or broke the stream
          asio::async_write(self->plain_, asio::buffer(self->up_.data(), n),
                            [self](beast::error_code e, size_t) {
                              if (self->closed_) return;
                              if (self->finishing_) return self->Shutdown();
                              if (e) return self->Close();
                              self->ReadClient();
                            });
        });
  }

  // Session → client.
  void ReadSession() {
    plain_.async_read_some(asio::buffer(down_), [self = shared_from_this()](
                                                    beast::error_code ec, size_t n) {
      if (self->closed_) return;
      if (ec) return self->Finish();  // the session closed: all of it was relayed
      self->Arm(self->core_->options.write_timeout);
      asio::async_write(self->tls_, asio::buffer(self->down_.data(), n),
                        [self](beast::error_code e, size_t) {
                          self->Disarm();
                          if (self->closed_) return;
                          if (e) return self->Close();
                          self->ReadSession();
                        });
    });
  }

  // The session closed: a close_notify to the client (bounded), then close. The
  // client side's operation in flight (a TLS read, or a write to the closed pair)
  // is cancelled first and its handler starts the shutdown, so that no TLS read
  // runs beside the shutdown's (one read and one write at a time on a stream).
  void Finish() {
    if (closed_ || finishing_) return;
    finishing_ = true;
    Arm(std::chrono::seconds(1));
    beast::error_code ignored;
    plain_.close(ignored);              // a write to it completes with an error
    tls_.next_layer().cancel(ignored);  // so does a TLS read
  }
  void Shutdown() {
    if (closed_ || shutting_down_) return;
    shutting_down_ = true;
    tls_.async_shutdown([self = shared_from_this()](beast::error_code) {
      self->Disarm();
      self->Close();
    });
  }

  template <typename D>
  void Arm(D timeout) {
    const uint64_t gen = ++timer_gen_;
    timer_.expires_after(timeout);
    timer_.async_wait([self = shared_from_this(), gen](beast::error_code ec) {
      if (ec || gen != self->timer_gen_) return;  // cancelled or re-armed
      self->Close();
    });
  }
  void Arm(absl::Duration timeout) { Arm(ToChrono(timeout)); }
  void Disarm() {
    ++timer_gen_;
    timer_.cancel();
  }

  void Close() {
    if (closed_) return;
    closed_ = true;
    Disarm();
    beast::error_code ignored;
    tls_.lowest_layer().shutdown(tcp::socket::shutdown_both, ignored);
    tls_.lowest_layer().close(ignored);
    plain_.close(ignored);
  }

  std::shared_ptr<ssl::context> ctx_;  // outlives the stream
  ssl::stream<tcp::socket> tls_;
  asio::local::stream_protocol::socket plain_;
  asio::steady_timer timer_;
  uint64_t timer_gen_ = 0;
  std::shared_ptr<ServerCore> core_;
  std::function<void(int fd)> adopt_;
  std::array<char, 16 << 10> up_;
  std::array<char, 16 << 10> down_;
  bool closed_ = false;
  bool finishing_ = false;
  bool shutting_down_ = false;
};

class HttpServer::Impl {
 public:
  Impl(HttpServerOptions options, HttpHandler handler, HttpErrorFormatter formatter)
      : core_(std::make_shared<ServerCore>()),
        ioc_(options.io_threads > 0 ? options.io_threads : 1) {
    core_->options = std::move(options);
    core_->handler = std::move(handler);
    core_->formatter = std::move(formatter);
  }
  ~Impl() {
    Shutdown(absl::ZeroDuration());
    // Writers still held by handlers post into the stopped io_context; wait
    // (bounded) until they are released so that none outlives it.
    absl::MutexLock lock(&core_->mu);
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (core_->writers > 0) {
      if (core_->changed.WaitWithDeadline(&core_->mu, deadline)) break;
    }
    if (core_->writers > 0) {
      TLOG(ERROR, "http server destroyed while handlers still hold writers")
          .Kv("writers", core_->writers);
    }
  }

  absl::Status Start();
  void Shutdown(absl::Duration grace);
  int port() const { return port_.load(); }
  int open_connections() const { return core_->open.load(); }

 private:
  void DoAccept();
  // A session on `socket` (an accepted TCP connection, or the session end of
  // an HTTPS relay's socket pair), unless the connection cap is reached.
  void Adopt(tcp::socket socket);
  // Posts `f(session)` onto every open session's strand.
  template <typename F>
  void ForEachSession(F f) {
    std::vector<std::shared_ptr<Session>> open;
    {
      absl::MutexLock lock(&core_->mu);
      for (Session* s : core_->sessions) {
        if (auto sp = s->weak_from_this().lock()) open.push_back(std::move(sp));
      }
    }
    for (auto& s : open) {
      asio::post(s->executor(), [s, f] { f(s.get()); });
    }
  }

  std::shared_ptr<ServerCore> core_;
  std::unique_ptr<TlsContextSource> tls_;  // null: plain HTTP
  std::atomic<int> port_{0};
  absl::Mutex lifecycle_mu_;
  bool started_ ABSL_GUARDED_BY(lifecycle_mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(lifecycle_mu_) = false;

  asio::io_context ioc_;
  // Keeps the I/O threads running from Start() until Shutdown() has waited
  // out the sessions: once the listener is closed the io_context may run out
  // of work between two handlers of a request still in flight, and threads
  // that returned from run() would never run what a writer posts after.
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work_;
  tcp::acceptor acceptor_{asio::make_strand(ioc_)};
  asio::steady_timer accept_retry_{acceptor_.get_executor()};
  std::vector<std::thread> threads_;
};

void HttpServer::Impl::DoAccept() {
  acceptor_.async_accept(
      asio::make_strand(ioc_), [this](beast::error_code ec, tcp::socket socket) {
        if (core_->stopping.load() || ec == asio::error::operation_aborted) return;
        if (ec) {
          TLOG(WARNING, "http accept failed")
              .Kv("server", core_->options.server_name)
              .Kv("error", ec.message());
          accept_retry_.expires_after(std::chrono::milliseconds(100));
          accept_retry_.async_wait([this](beast::error_code e) {
            if (!e && !core_->stopping.load()) DoAccept();
          });
          return;
        }
        if (tls_ == nullptr) {
          beast::error_code ignored;
          socket.set_option(tcp::no_delay(true), ignored);
          Adopt(std::move(socket));
        } else if (core_->open.load() >= core_->options.max_connections) {
          beast::error_code ignored;
          socket.close(ignored);
        } else {
          beast::error_code ignored;
          socket.set_option(tcp::no_delay(true), ignored);
          auto relay = std::make_shared<TlsRelay>(
              std::move(socket), tls_->Get(), core_, [this](int fd) {
                tcp::socket inner(asio::make_strand(ioc_));
                beast::error_code ec;
                inner.assign(tcp::v4(), fd, ec);  // a stream socket; only I/O is used
                if (ec) {
                  ::close(fd);
                  return;
                }
                Adopt(std::move(inner));
              });
          asio::post(relay->executor(), [relay] { relay->Start(); });
        }
        DoAccept();
      });
}

void HttpServer::Impl::Adopt(tcp::socket socket) {
  if (core_->open.load() >= core_->options.max_connections) {
    beast::error_code ignored;
    socket.close(ignored);
    return;
  }
  auto session = std::make_shared<Session>(std::move(socket), core_);
  asio::post(session->executor(), [session] { session->Start(); });
}

absl::Status HttpServer::Impl::Start() {
  absl::MutexLock lock(&lifecycle_mu_);
  if (started_ || stopped_)
    return absl::FailedPreconditionError(
        absl::StrCat(core_->options.server_name, ": already started"));
  const HttpServerOptions& o = core_->options;
  const std::string where = absl::StrCat(o.host, ":", o.port);
  if (o.port < 0 || o.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(o.server_name, ": bad port ", where));
  }
  if (o.tls_cert_file.empty() != o.tls_key_file.empty() ||
      (o.tls_cert_file.empty() && !o.tls_client_ca_file.empty())) {
    return absl::InvalidArgumentError(
        absl::StrCat(o.server_name,
                     ": https needs both a certificate and a private key (a client CA "
                     "only with them)"));
  }
  if (!o.tls_cert_file.empty()) {
    tls_ = std::make_unique<TlsContextSource>(core_->options);
    if (absl::Status s = tls_->Load(); !s.ok()) {
      tls_.reset();
      return s;
    }
  }
  beast::error_code ec;
  tcp::endpoint endpoint;
  const asio::ip::address address = asio::ip::make_address(o.host, ec);
  if (!ec) {
    endpoint = tcp::endpoint(address, static_cast<uint16_t>(o.port));
  } else {
    tcp::resolver resolver(ioc_);
    auto results =
        resolver.resolve(o.host, std::to_string(o.port), tcp::resolver::passive, ec);
    if (ec || results.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          o.server_name, ": cannot resolve host ", where, ": ", ec.message()));
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
        absl::StrCat(o.server_name, ": cannot listen on ", where, ": ", ec.message()));
  }
  port_.store(acceptor_.local_endpoint(ec).port());
  started_ = true;
  work_.emplace(ioc_.get_executor());
  DoAccept();
  const int n = o.io_threads > 0 ? o.io_threads : 1;
  for (int i = 0; i < n; ++i) threads_.emplace_back([this] { ioc_.run(); });
  return absl::OkStatus();
}

void HttpServer::Impl::Shutdown(absl::Duration grace) {
  absl::MutexLock lock(&lifecycle_mu_);
  if (stopped_) return;
  stopped_ = true;
  if (!started_) return;
  core_->stopping.store(true);
  asio::post(acceptor_.get_executor(), [this] {
    beast::error_code ignored;
    acceptor_.close(ignored);
    accept_retry_.cancel();
  });
  ForEachSession([](Session* s) { s->CloseIfIdle(); });
  {
    // Requests in flight finish (their connections then close) within grace.
    absl::MutexLock core_lock(&core_->mu);
    const absl::Time deadline = absl::Now() + grace;
    while (!core_->sessions.empty()) {
      if (core_->changed.WaitWithDeadline(&core_->mu, deadline)) break;
    }
  }
  ForEachSession([](Session* s) { s->Abort(); });
  {
    // Aborted sessions end once their handlers release them; bounded.
    absl::MutexLock core_lock(&core_->mu);
    const absl::Time deadline = absl::Now() + absl::Seconds(2);
    while (!core_->sessions.empty()) {
      if (core_->changed.WaitWithDeadline(&core_->mu, deadline)) break;
    }
  }
  work_.reset();
  ioc_.stop();
  for (std::thread& t : threads_) t.join();
  threads_.clear();
}

HttpServer::HttpServer(HttpServerOptions options, HttpHandler handler,
                       HttpErrorFormatter error_formatter)
    : impl_(std::make_unique<Impl>(std::move(options), std::move(handler),
                                   std::move(error_formatter))) {}
HttpServer::~HttpServer() = default;
absl::Status HttpServer::Start() { return impl_->Start(); }
void HttpServer::Shutdown(absl::Duration grace) { impl_->Shutdown(grace); }
int HttpServer::port() const { return impl_->port(); }
int HttpServer::open_connections() const { return impl_->open_connections(); }

}  // namespace tandem::http
