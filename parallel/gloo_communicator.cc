#include "parallel/gloo_communicator.h"

#include <signal.h>

#include <chrono>
#include <cstring>
#include <exception>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"

namespace tandem::parallel {
namespace {

constexpr absl::Duration kMaxTimeout = absl::Hours(24);

std::chrono::milliseconds ToChrono(absl::Duration d) {
  return std::chrono::milliseconds(std::max<int64_t>(1, absl::ToInt64Milliseconds(d)));
}

// Gloo's rendezvous store interface over ours. Every wait is bounded by the
// deadline of the whole Create(); failures are thrown (gloo's convention) and
// the first one is kept as a Status for Create() to return.
class StoreAdapter : public gloo::rendezvous::Store {
 public:
  StoreAdapter(tandem::parallel::Store* store, std::string group, absl::Time deadline)
      : store_(store), group_(std::move(group)), deadline_(deadline) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    absl::Status s = store_->Set(PrefixKey(group_, key),
                                 absl::string_view(data.data(), data.size()));
    if (!s.ok()) Fail(std::move(s));
  }

  std::vector<char> get(const std::string& key) override {
    absl::StatusOr<std::string> v = store_->Get(PrefixKey(group_, key), Remaining());
    if (!v.ok()) Fail(std::move(v).status());
    return std::vector<char>(v->begin(), v->end());
  }

  void wait(const std::vector<std::string>& keys) override {
    for (const std::string& key : keys) get(key);
  }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& /*timeout*/) override {
    wait(keys);  // bounded by the deadline of the whole rendezvous instead
  }

  const absl::Status& error() const { return error_; }

 private:
  absl::Duration Remaining() const {
    return std::max(absl::ZeroDuration(), deadline_ - absl::Now());
  }
  [[noreturn]] void Fail(absl::Status s) {
    if (error_.ok()) error_ = s;
    throw gloo::IoException(std::string(s.message()));
  }

  tandem::parallel::Store* store_;  // not owned
  const std::string group_;
  const absl::Time deadline_;
  absl::Status error_;
};

bool MentionsTimeout(absl::string_view message) {
  const std::string lower = absl::AsciiStrToLower(message);
  return absl::StrContains(lower, "timed out") || absl::StrContains(lower, "timeout");
}

// BF16 <-> fp32 (raw bits), rounding to nearest even; NaN stays NaN.
inline float Bf16ToFloat(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}
void SumBf16(void* c_, const void* a_, const void* b_, size_t n) {
  auto* c = static_cast<uint16_t*>(c_);
  const auto* a = static_cast<const uint16_t*>(a_);
  const auto* b = static_cast<const uint16_t*>(b_);
  for (size_t i = 0; i < n; ++i) {
    c[i] = FloatToBf16(Bf16ToFloat(a[i]) + Bf16ToFloat(b[i]));
  }
}
void SumFloat(void* c, const void* a, const void* b, size_t n) {
  gloo::sum<float>(c, a, b, n);
}

// Gloo writes with writev(2): a write to a peer that has left raises SIGPIPE,
// which by default kills the process. Ignore it (once, and only when nobody
// installed a handler) so the write fails with EPIPE and becomes UNAVAILABLE.
void IgnoreSigpipeOnce() {
  static const bool done = [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      signal(SIGPIPE, SIG_IGN);
    }
    return true;
  }();
  (void)done;
}

}  // namespace

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(
    const GlooOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return InvalidArgument("gloo communicator: rank ", options.rank, " of size ",
                           options.size, " is out of range");
  }
  if (options.store == nullptr) {
    return InvalidArgument("gloo communicator: no rendezvous store");
  }
  if (options.timeout <= absl::ZeroDuration() || options.timeout > kMaxTimeout) {
    return InvalidArgument("gloo communicator: timeout must be in (0, 24h], got ",
                           absl::FormatDuration(options.timeout));
  }
  IgnoreSigpipeOnce();
  const std::string where = absl::StrCat("gloo rank ", options.rank, "/", options.size,
                                         " group '", options.group, "'");
  const absl::Time start = absl::Now();
  StoreAdapter store(options.store, options.group, start + options.timeout);
  try {
    gloo::transport::tcp::attr attr;
    if (!options.interface.empty()) {
      attr.iface = options.interface;
    } else {
      attr.hostname = options.hostname;
    }
    std::shared_ptr<gloo::transport::Device> device =
        gloo::transport::tcp::CreateDevice(attr);
    auto context =
        std::make_shared<gloo::rendezvous::Context>(options.rank, options.size);
    context->setTimeout(ToChrono(options.timeout));
    context->connectFullMesh(store, device);
    return std::unique_ptr<GlooCommunicator>(new GlooCommunicator(
        options.rank, options.size, options.timeout, std::move(context)));
  } catch (const std::exception& e) {
    if (!store.error().ok()) {
      return Annotate(store.error(), absl::StrCat(where, ": rendezvous"));
    }
    const bool late = absl::Now() - start >= options.timeout;
    if (late || MentionsTimeout(e.what())) {
      return DeadlineExceeded(where, ": connecting to peers within ",
                              absl::FormatDuration(options.timeout), ": ", e.what());
    }
    return Unavailable(where, ": connecting to peers: ", e.what());
  }
}

GlooCommunicator::GlooCommunicator(int rank, int size, absl::Duration timeout,
                                   std::shared_ptr<gloo::Context> context)
    : rank_(rank), size_(size), timeout_(timeout), context_(std::move(context)) {}

GlooCommunicator::~GlooCommunicator() = default;

template <typename Fn>
absl::Status GlooCommunicator::Run(const char* what, Fn&& fn) {
  if (!broken_.ok()) {
    return Unavailable(
        "gloo rank ", rank_, "/", size_, ": ", what,
        ": communicator unusable after an earlier error: ", broken_.message());
  }
  const absl::Time start = absl::Now();
  absl::Status status;
  try {
    fn();
    return absl::OkStatus();
  } catch (const gloo::IoException& e) {
    const bool late = absl::Now() - start >= timeout_;
    if (late || MentionsTimeout(e.what())) {
      status = DeadlineExceeded("gloo rank ", rank_, "/", size_, ": ", what,
                                ": no progress within ", absl::FormatDuration(timeout_),
                                ": ", e.what());
    } else {
      status = Unavailable("gloo rank ", rank_, "/", size_, ": ", what,
                           ": peer gone: ", e.what());
    }
  } catch (const std::exception& e) {
    status = Internal("gloo rank ", rank_, "/", size_, ": ", what, ": ", e.what());
  }
  broken_ = status;
  // Pending receives may still point at the caller's buffers: close every
  // connection so nothing arrives later, and so peers fail fast instead of
  // waiting out their own timeouts.
  try {
    context_->closeConnections();
  } catch (const std::exception&) {
  }
  return status;
}

absl::Status GlooCommunicator::AllReduceSum(float* data, size_t n) {
  if (n == 0) return absl::OkStatus();
  return Run("all-reduce", [&] {
    gloo::AllreduceOptions opts(context_);
    opts.setOutput(data, n);
    opts.setReduceFunction(&SumFloat);
    opts.setTag(NextTag());
    opts.setTimeout(ToChrono(timeout_));
    gloo::allreduce(opts);
  });
}

absl::Status GlooCommunicator::AllReduceSumBf16(uint16_t* data, size_t n) {
  if (n == 0) return absl::OkStatus();
  return Run("all-reduce bf16", [&] {
    gloo::AllreduceOptions opts(context_);
    opts.setOutput(data, n);
    opts.setReduceFunction(&SumBf16);
    opts.setTag(NextTag());
    opts.setTimeout(ToChrono(timeout_));
    gloo::allreduce(opts);
  });
}

absl::Status GlooCommunicator::AllGather(const float* in, size_t n_per_rank,
                                         float* out) {
  if (n_per_rank == 0) return absl::OkStatus();
  return Run("all-gather", [&] {
    gloo::AllgatherOptions opts(context_);
    // Gloo only reads the input (copies it into the output at this rank's slot).
    opts.setInput(const_cast<float*>(in), n_per_rank);
    opts.setOutput(out, n_per_rank * static_cast<size_t>(size_));
    opts.setTag(NextTag());
    opts.setTimeout(ToChrono(timeout_));
    gloo::allgather(opts);
  });
}

absl::Status GlooCommunicator::Broadcast(void* data, size_t bytes, int root) {
  if (root < 0 || root >= size_) {
    return InvalidArgument("broadcast root ", root, " is not a rank of a group of ",
                           size_);
  }
  if (bytes == 0) return absl::OkStatus();
  return Run("broadcast", [&] {
    gloo::BroadcastOptions opts(context_);
    opts.setOutput(static_cast<uint8_t*>(data), bytes);
    opts.setRoot(root);
    opts.setTag(NextTag());
    opts.setTimeout(ToChrono(timeout_));
    gloo::broadcast(opts);
  });
}

absl::Status GlooCommunicator::Barrier() {
  return Run("barrier", [&] {
    gloo::BarrierOptions opts(context_);
    opts.setTag(NextTag());
    opts.setTimeout(ToChrono(timeout_));
    gloo::barrier(opts);
  });
}

}  // namespace tandem::parallel
