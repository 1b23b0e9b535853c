#include "parallel/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/time/clock.h"
#include "common/status.h"

namespace tandem::parallel {
namespace {

constexpr absl::Duration kMaxTimeout = absl::Hours(24);
// How long the destructor lets ncclCommFinalize flush before aborting.
constexpr absl::Duration kFinalizeTimeout = absl::Seconds(10);

// Polling pause: none for the first 200 us (a decode step's all-reduce of a
// few KB over NVLink takes 10-30 us, and a sleep costs the timer slack, ~50 us,
// on each of a step's collectives), then sleeps growing from 5 us to `most` so
// a long wait does not burn a core. A whole step's wait (WaitForStream) caps the
// pause at 50 us: a 10 ms decode step must not end up to 1 ms late.
class Backoff {
 public:
  explicit Backoff(absl::Duration most = absl::Milliseconds(1)) : most_(most) {}
  void Pause() {
    if (absl::Now() - start_ < kSpin) return;
    absl::SleepFor(pause_);
    pause_ = std::min(pause_ * 2, most_);
  }

 private:
  static constexpr absl::Duration kSpin = absl::Microseconds(200);
  const absl::Time start_ = absl::Now();
  const absl::Duration most_;
  absl::Duration pause_ = absl::Microseconds(5);
};

bool IsPeerFailure(ncclResult_t r) {
  return r == ncclRemoteError || r == ncclSystemError;
}

}  // namespace

struct NcclCommunicator::Impl {
  int rank = 0;
  int size = 1;
  int device = 0;
  absl::Duration timeout;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  bool own_stream = false;   // created here (else the caller's compute stream)
  float* scratch = nullptr;  // one device float for Barrier
  bool aborted = false;
  bool defer_abort = false;  // NcclOptions::defer_abort
  absl::Status broken;

  std::string Where(const char* what) const {
    return absl::StrCat("nccl rank ", rank, "/", size, " (device ", device,
                        "): ", what);
  }

  // Aborts the communicator (unless the abort is deferred to the owner) and
  // remembers `status` as the reason.
  absl::Status Break(absl::Status status) {
    if (!defer_abort) AbortComm();
    if (broken.ok()) broken = status;
    return status;
  }
  void AbortComm() {
    if (comm != nullptr && !aborted) {
      ncclCommAbort(comm);
      aborted = true;
    }
  }

  absl::Status FromNccl(const char* what, ncclResult_t r) {
    const std::string detail =
        absl::StrCat(ncclGetErrorString(r),
                     comm != nullptr ? absl::StrCat(" (", ncclGetLastError(comm), ")")
                                     : std::string());
    if (IsPeerFailure(r)) return Break(Unavailable(Where(what), ": ", detail));
    return Break(Internal(Where(what), ": ", detail));
  }

  // Waits until the non-blocking communicator leaves ncclInProgress.
  absl::Status WaitReady(const char* what, absl::Time deadline) {
    Backoff backoff;
    while (true) {
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = ncclCommGetAsyncError(comm, &state);
      if (r != ncclSuccess) return FromNccl(what, r);
      if (state == ncclSuccess) return absl::OkStatus();
      if (state != ncclInProgress) return FromNccl(what, state);
      if (absl::Now() >= deadline) {
        return Break(DeadlineExceeded(Where(what), ": not ready within ",
                                      absl::FormatDuration(timeout)));
      }
      backoff.Pause();
    }
  }

  // Waits until everything enqueued on the stream has finished.
  absl::Status WaitDone(const char* what, absl::Time deadline,
                        absl::Duration most_pause = absl::Milliseconds(1)) {
    Backoff backoff(most_pause);
    while (true) {
      cudaError_t q = cudaStreamQuery(stream);
      if (q == cudaSuccess) return absl::OkStatus();
      // cudaErrorNotReady is also recorded as the thread's last error: cleared,
      // or the rank's next kernel launch (checked with cudaGetLastError) would
      // fail with "device not ready".
      if (q == cudaErrorNotReady) (void)cudaGetLastError();
      if (q != cudaErrorNotReady) {
        return Break(Internal(Where(what), ": CUDA: ", cudaGetErrorString(q)));
      }
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = ncclCommGetAsyncError(comm, &state);
      if (r != ncclSuccess) return FromNccl(what, r);
      if (state != ncclSuccess && state != ncclInProgress) {
        return FromNccl(what, state);
      }
      if (absl::Now() >= deadline) {
        return Break(DeadlineExceeded(Where(what), ": not complete within ",
                                      absl::FormatDuration(timeout),
                                      " (a peer never joined the collective)"));
      }
      backoff.Pause();
    }
  }

  absl::Status Usable(const char* what) const {
    if (broken.ok()) return absl::OkStatus();
    return Unavailable(Where(what), ": communicator unusable after an earlier error: ",
                       broken.message());
  }

  // Enqueues one collective with `launch` (returns ncclResult_t) without waiting
  // for it to run (a non-blocking communicator may still be issuing it: that is
  // waited for, bounded).
  template <typename Launch>
  absl::Status Enqueue(const char* what, absl::Time deadline, Launch&& launch) {
    TANDEM_RETURN_IF_ERROR(Usable(what));
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) {
      return Break(Internal(Where(what), ": cudaSetDevice: ", cudaGetErrorString(e)));
    }
    ncclResult_t r = launch();
    if (r == ncclInProgress) return WaitReady(what, deadline);
    if (r != ncclSuccess) return FromNccl(what, r);
    return absl::OkStatus();
  }

  // Enqueues one collective and waits for it.
  template <typename Launch>
  absl::Status Run(const char* what, Launch&& launch) {
    const absl::Time deadline = absl::Now() + timeout;
    TANDEM_RETURN_IF_ERROR(Enqueue(what, deadline, launch));
    return WaitDone(what, deadline);
  }
};

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    const NcclOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return InvalidArgument("nccl communicator: rank ", options.rank, " of size ",
                           options.size, " is out of range");
  }
  if (options.store == nullptr) {
    return InvalidArgument("nccl communicator: no rendezvous store");
  }
  if (options.timeout <= absl::ZeroDuration() || options.timeout > kMaxTimeout) {
    return InvalidArgument("nccl communicator: timeout must be in (0, 24h], got ",
                           absl::FormatDuration(options.timeout));
  }
  const absl::Time deadline = absl::Now() + options.timeout;
  auto impl = std::make_unique<Impl>();
  impl->rank = options.rank;
  impl->size = options.size;
  impl->device = options.device;
  impl->timeout = options.timeout;
  impl->defer_abort = options.defer_abort;
  // From here on the communicator owns what it created: ~NcclCommunicator
  // releases it on every error path.
  std::unique_ptr<NcclCommunicator> self(new NcclCommunicator(std::move(impl)));
  Impl& m = *self->impl_;

  cudaError_t e = cudaSetDevice(m.device);
  if (e != cudaSuccess) {
    return Unavailable(m.Where("cudaSetDevice"), ": ", cudaGetErrorString(e));
  }
  if (options.stream != nullptr) {
    m.stream = static_cast<cudaStream_t>(options.stream);
  } else {
    e = cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      m.stream = nullptr;
      return Internal(m.Where("cudaStreamCreate"), ": ", cudaGetErrorString(e));
    }
    m.own_stream = true;
  }
  e = cudaMalloc(reinterpret_cast<void**>(&m.scratch), sizeof(float));
  if (e != cudaSuccess) {
    m.scratch = nullptr;
    return Internal(m.Where("cudaMalloc"), ": ", cudaGetErrorString(e));
  }

  // The unique id travels through the store, like Gloo's addresses.
  const std::string key = PrefixKey(options.group, "nccl_unique_id");
  ncclUniqueId id;
  if (options.rank == 0) {
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) {
      return Internal(m.Where("ncclGetUniqueId"), ": ", ncclGetErrorString(r));
    }
    TANDEM_RETURN_IF_ERROR(options.store->Set(
        key, absl::string_view(reinterpret_cast<const char*>(&id), sizeof(id))));
  } else {
    absl::StatusOr<std::string> value =
        options.store->Get(key, std::max(absl::ZeroDuration(), deadline - absl::Now()));
    if (!value.ok()) {
      return Annotate(value.status(), m.Where("rendezvous"));
    }
    if (value->size() != sizeof(id)) {
      return Internal(m.Where("rendezvous"), ": unique id of ", value->size(),
                      " bytes, want ", sizeof(id));
    }
    std::memcpy(&id, value->data(), sizeof(id));
  }

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // so that a missing peer can be timed out and aborted
  ncclResult_t r =
      ncclCommInitRankConfig(&m.comm, options.size, id, options.rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (m.comm == nullptr) {
      return Unavailable(m.Where("ncclCommInitRankConfig"), ": ",
                         ncclGetErrorString(r));
    }
    return m.FromNccl("ncclCommInitRankConfig", r);
  }
  absl::Status ready = m.WaitReady("connecting to peers", deadline);
  if (!ready.ok()) return ready;
  return self;
}

NcclCommunicator::NcclCommunicator(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}

NcclCommunicator::~NcclCommunicator() {
  Impl& m = *impl_;
  cudaSetDevice(m.device);
  if (m.comm != nullptr) {
    // Broken, its abort deferred and not done (an owner that never got to it, or
    // a failed Create): aborted now, not finalized.
    if (!m.aborted && !m.broken.ok()) m.AbortComm();
    if (!m.aborted) {
      // Flush what was issued, bounded; abort if it does not finish.
      ncclResult_t r = ncclCommFinalize(m.comm);
      bool clean = r == ncclSuccess || r == ncclInProgress;
      if (clean) {
        m.timeout = std::min(m.timeout, kFinalizeTimeout);
        clean = m.WaitReady("finalize", absl::Now() + m.timeout).ok();
      }
      if (!m.aborted) {
        if (clean) {
          ncclCommDestroy(m.comm);
        } else {
          ncclCommAbort(m.comm);
        }
      }
    }
    m.comm = nullptr;
  }
  if (m.scratch != nullptr) cudaFree(m.scratch);
  if (m.stream != nullptr && m.own_stream) cudaStreamDestroy(m.stream);
}

int NcclCommunicator::rank() const { return impl_->rank; }
int NcclCommunicator::size() const { return impl_->size; }
absl::Duration NcclCommunicator::timeout() const { return impl_->timeout; }
void* NcclCommunicator::stream() const { return impl_->stream; }

void NcclCommunicator::Abort() {
  cudaSetDevice(impl_->device);
  (void)impl_->Break(Unavailable(impl_->Where("abort"), ": aborted by its owner"));
  impl_->AbortComm();
}

bool NcclCommunicator::abort_pending() const {
  return !impl_->broken.ok() && !impl_->aborted && impl_->comm != nullptr;
}

void NcclCommunicator::AbortNow() {
  cudaSetDevice(impl_->device);
  impl_->AbortComm();
}

absl::Status NcclCommunicator::AllReduceSum(float* data, size_t n) {
  if (n == 0) return absl::OkStatus();
  return impl_->Run("all-reduce", [&] {
    return ncclAllReduce(data, data, n, ncclFloat32, ncclSum, impl_->comm,
                         impl_->stream);
  });
}

absl::Status NcclCommunicator::AllReduceSumBf16(uint16_t* data, size_t n) {
  if (n == 0) return absl::OkStatus();
  return impl_->Run("all-reduce bf16", [&] {
    return ncclAllReduce(data, data, n, ncclBfloat16, ncclSum, impl_->comm,
                         impl_->stream);
  });
}

absl::Status NcclCommunicator::AllGather(const float* in, size_t n_per_rank,
                                         float* out) {
  if (n_per_rank == 0) return absl::OkStatus();
  return impl_->Run("all-gather", [&] {
    return ncclAllGather(in, out, n_per_rank, ncclFloat32, impl_->comm, impl_->stream);
  });
}

absl::Status NcclCommunicator::Broadcast(void* data, size_t bytes, int root) {
  if (root < 0 || root >= impl_->size) {
    return InvalidArgument("broadcast root ", root, " is not a rank of a group of ",
                           impl_->size);
  }
  if (bytes == 0) return absl::OkStatus();
  return impl_->Run("broadcast", [&] {
    return ncclBroadcast(data, data, bytes, ncclUint8, root, impl_->comm,
                         impl_->stream);
  });
}

absl::Status NcclCommunicator::EnqueueAllReduceSum(float* data, size_t n) {
  if (n == 0) return absl::OkStatus();
  return impl_->Enqueue("all-reduce", absl::Now() + impl_->timeout, [&] {
    return ncclAllReduce(data, data, n, ncclFloat32, ncclSum, impl_->comm,
                         impl_->stream);
  });
}

absl::Status NcclCommunicator::EnqueueAllGather(const float* in, size_t n_per_rank,
                                                float* out) {
  if (n_per_rank == 0) return absl::OkStatus();
  return impl_->Enqueue("all-gather", absl::Now() + impl_->timeout, [&] {
    return ncclAllGather(in, out, n_per_rank, ncclFloat32, impl_->comm, impl_->stream);
  });
}

absl::Status NcclCommunicator::WaitForStream() {
  TANDEM_RETURN_IF_ERROR(impl_->Usable("wait for the stream"));
  cudaError_t e = cudaSetDevice(impl_->device);
  if (e != cudaSuccess) {
    return impl_->Break(Internal(impl_->Where("wait for the stream"),
                                 ": cudaSetDevice: ", cudaGetErrorString(e)));
  }
  return impl_->WaitDone("the step's collectives", absl::Now() + impl_->timeout,
                         absl::Microseconds(50));
}

absl::Status NcclCommunicator::Barrier() {
  // NCCL has no barrier: a one-value all-reduce that every rank must join.
  return impl_->Run("barrier", [&] {
    return ncclAllReduce(impl_->scratch, impl_->scratch, 1, ncclFloat32, ncclSum,
                         impl_->comm, impl_->stream);
  });
}

}  // namespace tandem::parallel
