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
//
// Pointers given to the collectives are device pointers on options.device.
// The header names no CUDA type, so it can be included anywhere; the library
// is empty in the default (CPU) build.
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
  absl::Duration timeout = absl::Seconds(60);
};

class NcclCommunicator : public Communicator {
 public:
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(
      const NcclOptions& options);
  ~NcclCommunicator() override;

  int rank() const override;
  int size() const override;
  absl::Duration timeout() const override;

  absl::Status AllReduceSum(float* data, size_t n) override;
  absl::Status AllReduceSumBf16(uint16_t* data, size_t n) override;
  absl::Status AllGather(const float* in, size_t n_per_rank, float* out) override;
  absl::Status Broadcast(void* data, size_t bytes, int root) override;
  absl::Status Barrier() override;

  // The cudaStream_t the collectives run on.
  void* stream() const;

  struct Impl;

 private:
  explicit NcclCommunicator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::parallel

#endif  // TANDEM_PARALLEL_NCCL_COMMUNICATOR_H_
