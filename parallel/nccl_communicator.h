// Communicator over NCCL (one GPU per rank), built only with --config=cuda.
//
//   Create(options) → cudaSetDevice(options.device)
//                   → rank 0: ncclGetUniqueId, Set in options.store;
//                     others: Get it (bounded by the timeout)
//                   → ncclCommInitRankConfig, non-blocking, polled with
//                     ncclCommGetAsyncError until ready or the deadline
//                     (then ncclCommAbort → DEADLINE_EXCEEDED)
//   collective      → enqueue on this communicator's stream, then poll
//                     cudaStreamQuery + ncclCommGetAsyncError until done, an
//                     error (→ abort, UNAVAILABLE) or the deadline (→ abort,
//                     DEADLINE_EXCEEDED).
//   Enqueue*        → enqueue only (capturable into a CUDA graph); the poll
//                     above happens once, at WaitForStream.
//   defer_abort     → "abort" above only marks the communicator broken; the
//                     owner destroys its CUDA graphs, then AbortNow() (NCCL's
//                     abort waits for the graphs that captured the collectives).
//
// Pointers given to the collectives are device pointers on options.device.
// The collectives run on options.stream when given (the rank's compute stream:
// ordered after the kernels that produced their inputs, before those that read
// the outputs, no extra synchronisation), else on a stream of their own.
// The header names no CUDA type, so it can be included anywhere; in the default
// (CPU) build Create returns FailedPrecondition (nccl_unavailable.cc).
#ifndef TANDEM_PARALLEL_NCCL_COMMUNICATOR_H_
#define TANDEM_PARALLEL_NCCL_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"
#include "parallel/store.h"

namespace tandem::parallel {

struct NcclOptions {
  int rank = 0;
  int size = 1;
  Store* store = nullptr;  // not owned; must outlive Create()
  std::string group = "tp";
  int device = 0;  // CUDA device ordinal of this rank
  // cudaStream_t on `device` for the collectives (not owned; must outlive the
  // communicator); nullptr: the communicator creates its own.
  void* stream = nullptr;
  absl::Duration timeout = absl::Seconds(60);
  // A failed collective (timeout, peer error) marks the communicator broken
  // without ncclCommAbort; the owner calls AbortNow() after destroying the CUDA
  // graphs that captured its collectives (Communicator, "Deferred abort"). The
  // stream keeps the stuck collective until then: nothing may wait for it.
  bool defer_abort = false;
};

class NcclCommunicator : public Communicator {
 public:
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(
      const NcclOptions& options);
  ~NcclCommunicator() override;

  int rank() const override;
  int size() const override;
  absl::Duration timeout() const override;
  bool takes_device_pointers() const override { return true; }

  absl::Status AllReduceSum(float* data, size_t n) override;
  absl::Status AllReduceSumBf16(uint16_t* data, size_t n) override;
  absl::Status AllGather(const float* in, size_t n_per_rank, float* out) override;
  absl::Status Broadcast(void* data, size_t bytes, int root) override;
  absl::Status Barrier() override;
  bool stream_ordered() const override { return true; }
  absl::Status EnqueueAllReduceSum(float* data, size_t n) override;
  absl::Status EnqueueAllGather(const float* in, size_t n_per_rank,
                                float* out) override;
  absl::Status WaitForStream() override;
  bool abort_pending() const override;
  void AbortNow() override;

  // The cudaStream_t the collectives run on (options.stream or its own).
  void* stream() const;
  // ncclCommAbort now, from the thread that uses the communicator (what a rank
  // that stops does instead of a clean finalize): every later call returns
  // UNAVAILABLE. Peers blocked in a collective with this rank are not woken by
  // NCCL; they fail when their own timeout passes (and abort in turn).
  void Abort();

  struct Impl;

 private:
  explicit NcclCommunicator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::parallel

#endif  // TANDEM_PARALLEL_NCCL_COMMUNICATOR_H_
