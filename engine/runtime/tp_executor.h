// Runs the model over the N ranks of a tensor-parallel group: what the engine
// calls instead of one ModelRunner.
//
//   TP 1 (CreateLocal): the caller's weights, backend and one KvCache; Forward is
//     ModelRunner::Forward on the caller's thread. No threads, no communicator.
//   TP N (Create from a checkpoint): per rank r
//     kernels::Backend (CPU: its own thread pool, the machine's threads / N;
//       cuda: GPU first + r, "cuda:first" naming the first; cuda_sim: an
//       emulated device of its own)
//     ModelWeights shard r (views into the one mapped checkpoint, weights.h;
//       uploaded to the rank's device on a device backend)
//     KvCache shard r (KDA state of its heads, MLA cache replicated, kv_cache.h;
//       on the rank's device)
//     communicator rank r, rendezvous in a MemoryStore: GlooCommunicator
//       (loopback TCP) where the device memory is host-addressable (host,
//       cuda_sim), NcclCommunicator on the rank's GPU otherwise (collectives on
//       the backend's compute stream)
//     ModelRunner(shard r, cache r, backend r, comm r)
//   Rank 0 runs on the caller's thread; ranks 1..N-1 are persistent threads that
//   wait for a step, run the same Forward on the same inputs, and report (one
//   thread per GPU on cuda: docs/ARCHITECTURE.md, "Tensor parallelism", says
//   why). A rank's communicator is created on its thread, which makes its GPU
//   current there; the caller's thread makes rank 0's GPU current before each
//   step.
//
//   Forward(seqs) → the ranks' CUDA-graph plans combined into one (a graph
//     only where every rank may, a capture where any must) → a capture:
//     publish "prepare k", every rank sizes its graph buffers on its thread
//     (ModelRunner::PrepareGraph, no collectives), any failure makes the step
//     eager on every rank → publish step k → ranks 1..N-1 start → rank 0 runs
//     on the caller → wait for every rank (done, failed, or thread ended) →
//     rank 0's logits (every rank holds the full logits after the all-gather)
//
// Slot operations (ResetSlot, SnapshotSlot / RestoreSlot, CopySlot) and
// ExportSequence act on every rank's cache from the caller's thread (the rank
// threads are idle between steps; ranks are threads of one process, so every
// cache is reachable here: host memory, or its device's through that device's
// copies). A snapshot covers all ranks (their slot values
// concatenated rank after rank); exported ranges are rank-major and carry their
// rank (CopyStateRanges matches (rank, layer, kind)).
//
// Failure: a rank whose Forward fails, or whose thread ends, makes Forward fail
// on the caller. Its peers are blocked in a collective at most until the
// communicator's timeout (a Gloo rank whose thread ends closes its connections,
// which fails the peers' collectives at once; an NCCL rank aborts its
// communicator, and its peers fail when their own timeout passes), so Forward
// returns within about one timeout. The executor is then broken: every later call
// returns UNAVAILABLE naming the failed rank and its error (the group must be
// recreated).
//
// Not thread-safe: one caller thread owns the executor (as the engine does).
#ifndef TANDEM_ENGINE_RUNTIME_TP_EXECUTOR_H_
#define TANDEM_ENGINE_RUNTIME_TP_EXECUTOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "engine/model/checkpoint.h"
#include "engine/runtime/kv_cache.h"
#include "engine/runtime/model_runner.h"
#include "engine/runtime/weights.h"
#include "kernels/backend.h"

namespace tandem::engine {

struct TpExecutorOptions {
  int tp_size = 1;
  // Kernel backend of every rank (kernels/backend_factory.h names). "cpu" and
  // "cpu_bf16" get threads_per_rank threads each; "cuda[:first]" puts rank r on
  // GPU first + r; other names as the factory makes them.
  std::string backend = "cpu";
  // 0: the machine's hardware threads / tp_size (at least 1).
  int threads_per_rank = 0;
  // The cache of every rank (tp_rank / tp_size are set per rank).
  KvCacheOptions cache;
  ModelRunnerOptions runner;
  // Bound on the rendezvous and on each collective (the communicator's timeout).
  absl::Duration timeout = absl::Seconds(30);
  std::string hostname = "127.0.0.1";
  // Fault injection (tests, failure drills): rank `fail_rank` (>= 1: a rank
  // thread) ends its thread instead of running the Forward call number
  // `fail_rank_at_step` (0-based count of Forward calls), as if it had crashed.
  // Off when either is negative.
  int fail_rank = -1;
  int64_t fail_rank_at_step = -1;
};

class TpExecutor {
 public:
  // TP 1 over the caller's weights and backend (not owned; they must outlive
  // the executor): the executor owns only the cache and the runner.
  static absl::StatusOr<std::unique_ptr<TpExecutor>> CreateLocal(
      const ModelWeights* weights, kernels::Backend* backend,
      const KvCacheOptions& cache, const ModelRunnerOptions& runner = {});
  // TP options.tp_size from `checkpoint` (not owned, must outlive the executor);
  // tp_size 1 is allowed (one rank, no threads, no communicator). Sizes the
  // config does not divide are refused (parallel::CheckTpSize's error).
  static absl::StatusOr<std::unique_ptr<TpExecutor>> Create(
      const model::Checkpoint& checkpoint, const TpExecutorOptions& options);
  // Stops and joins the rank threads.
  ~TpExecutor();
  TpExecutor(const TpExecutor&) = delete;
  TpExecutor& operator=(const TpExecutor&) = delete;

  int tp_size() const { return static_cast<int>(ranks_.size()); }

  // One step on every rank; `logits` and `placement` as ModelRunner::Forward
  // (rank 0's: with kDevice, runner(0).device_logits() holds them). Ranks 1..N-1
  // keep theirs on their device: nothing is copied back for them.
  absl::Status Forward(absl::Span<const SequenceInput> seqs, std::vector<float>* logits,
                       LogitsPlacement placement = LogitsPlacement::kHost);

  absl::Status ResetSlot(int64_t slot);
  // Every rank's KDA state of the slot, rank after rank.
  absl::StatusOr<KdaSnapshot> SnapshotSlot(int64_t slot);
  absl::Status RestoreSlot(int64_t slot, const KdaSnapshot& snapshot);
  absl::Status CopySlot(int64_t from, int64_t to);
  // KvCache::ExportSequence of every rank, rank-major.
  absl::StatusOr<std::vector<StateRange>> ExportSequence(
      absl::Span<const int32_t> block_table, int64_t num_tokens, int64_t slot);

  // Rank r's parts (r in [0, tp_size)).
  const ModelWeights& weights(int rank) const;
  KvCache& cache(int rank);
  ModelRunner& runner(int rank);
  kernels::Backend& backend(int rank);
  // Rank 0's collective time (on the caller's thread, so comparable with the
  // caller's wall time of Forward; the ranks wait for each other in every
  // collective, so their times are close).
  CommStats comm_stats() const;
  void reset_comm_stats();
  // OK while usable; else what every call returns: UNAVAILABLE naming the
  // rank that failed and its error.
  absl::Status health() const;

 private:
  struct Rank;

  TpExecutor();
  absl::Status Broken() const;
  absl::Status Connect(int rank);
  // Makes rank `r`'s device current on the calling thread (a memset or kernel
  // into a stream of a device that is not current fails on a GPU): the slot
  // operations run each rank's part so, then OnRank(0) again for the caller.
  absl::Status OnRank(size_t r) const;

  std::vector<std::unique_ptr<Rank>> ranks_;
  struct Shared;
  std::unique_ptr<Shared> shared_;  // step hand-off between caller and ranks
  TpExecutorOptions options_;
  int64_t steps_ = 0;    // Forward calls so far
  absl::Status broken_;  // OK while usable
};

}  // namespace tandem::engine

#endif  // TANDEM_ENGINE_RUNTIME_TP_EXECUTOR_H_
