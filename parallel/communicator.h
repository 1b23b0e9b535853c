// The tensor-parallel communicator: the collectives one TP group needs, behind a
// narrow interface (Gloo over TCP on CPU, NCCL on GPU).
//
//   rank r of N ──AllReduceSum(partial sums)──> every rank holds the sum
//              ──AllGather(my slice)──────────> every rank holds all slices, rank order
//              ──Broadcast(root's bytes)───────> every rank holds root's bytes
//              ──Barrier()─────────────────────> no rank leaves before all arrived
//
// Contract (every implementation):
// - Collective: all N ranks call the same operations in the same order with the
//   same sizes (n, bytes, root). A call with n == 0 / bytes == 0 returns OK at
//   once on every rank without communicating.
// - Pointers live in the communicator's memory space (takes_device_pointers()):
//   host memory for Gloo, device memory of the communicator's GPU for NCCL. Calls are
//   synchronous: when one returns OK its output is complete.
// - Bounded waits: every call finishes within the communicator's timeout
//   (configured at creation) plus a small slack. DEADLINE_EXCEEDED when the
//   timeout passed (a peer never arrived); UNAVAILABLE when a peer is gone
//   (connection closed, communicator aborted); INVALID_ARGUMENT for a bad root.
//   After any DEADLINE_EXCEEDED or UNAVAILABLE the communicator is broken: every
//   later call returns UNAVAILABLE naming the first error. Recreate the group.
// - One thread at a time per communicator (not thread-safe); different
//   communicators are independent.
#ifndef TANDEM_PARALLEL_COMMUNICATOR_H_
#define TANDEM_PARALLEL_COMMUNICATOR_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace tandem::parallel {

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The bound on each call's wait.
  virtual absl::Duration timeout() const = 0;
  // True when the collectives take device pointers of the communicator's GPU
  // (NCCL); false when they take host memory (Gloo).
  virtual bool takes_device_pointers() const { return false; }

  // In place: data[i] = sum over ranks of data[i].
  virtual absl::Status AllReduceSum(float* data, size_t n) = 0;
  // Same for BF16 values (raw bits). Partial sums are formed in fp32 and rounded
  // to BF16 (nearest-even) after each pairwise addition, so for N > 2 the result
  // may differ from "sum in fp32, round once" by a rounding per step; every rank
  // gets bit-identical values.
  virtual absl::Status AllReduceSumBf16(uint16_t* data, size_t n) = 0;
  // out[r * n_per_rank + i] = in[i] of rank r; `out` holds size() * n_per_rank
  // values and must not overlap `in`.
  virtual absl::Status AllGather(const float* in, size_t n_per_rank, float* out) = 0;
  // Root's `bytes` bytes at `data` are copied to `data` on every rank.
  virtual absl::Status Broadcast(void* data, size_t bytes, int root) = 0;
  virtual absl::Status Barrier() = 0;

  // ---- Stream-ordered collectives (stream_ordered(): NCCL) ------------------
  // The collective is enqueued on the communicator's stream (the rank's compute
  // stream) after the work before it, and the call returns without waiting: a
  // step's collectives can then be captured into a CUDA graph with its kernels
  // and the step waited for once, not once per collective. Its result is there
  // once the stream has run it. Errors of the enqueue are returned; a peer that
  // never joins, or an asynchronous error, surfaces at WaitForStream. Same
  // collective contract as above (every rank, same order, same sizes: an
  // enqueued and a synchronous call of one kind pair up).
  virtual bool stream_ordered() const { return false; }
  virtual absl::Status EnqueueAllReduceSum(float* data, size_t n) {
    (void)data;
    (void)n;
    return absl::UnimplementedError("this communicator's collectives are synchronous");
  }
  virtual absl::Status EnqueueAllGather(const float* in, size_t n_per_rank,
                                        float* out) {
    (void)in;
    (void)n_per_rank;
    (void)out;
    return absl::UnimplementedError("this communicator's collectives are synchronous");
  }
  // Waits until the stream has run everything enqueued on it so far, bounded by
  // timeout(): DEADLINE_EXCEEDED when it has not (a peer never joined; the
  // communicator is aborted, so the queued work cannot hang the device for
  // ever), UNAVAILABLE on an asynchronous error (a peer gone). Not while the
  // stream captures (a capture records the collectives; the graph's launch
  // runs them, and is waited for so).
  virtual absl::Status WaitForStream() { return absl::OkStatus(); }

  // ---- Deferred abort (NCCL whose collectives CUDA graphs captured) -----------
  // NCCL's abort waits, without a bound, for every graph that captured the
  // communicator's collectives to be destroyed. A communicator created with its
  // abort deferred (NcclOptions::defer_abort) only marks itself broken when a
  // collective fails; its owner destroys those graphs, then calls AbortNow().
  // True from such a failure until AbortNow().
  virtual bool abort_pending() const { return false; }
  virtual void AbortNow() {}
};

}  // namespace tandem::parallel

#endif  // TANDEM_PARALLEL_COMMUNICATOR_H_
