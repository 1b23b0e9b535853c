// PrefillWorker service: computes a prompt's state, writes it into a decode
// worker's reservation over kvtransfer, returns the first token.
//
//   Prefill(id, prompt, sampling, target)                      START
//     → target layout from the KvTarget (descriptor metadata = pool geometry)
//       (INVALID_ARGUMENT when malformed or incompatible)
//     → streaming on: Connect (cached per decode agent; UNAVAILABLE ends it),
//       the request's Stream registered on the engine thread
//     → engine thread: AddRequest (prefill-only parameters: the request's
//       sampling, no stop conditions, so the first token is exactly the one a
//       colocated run samples first)                           QUEUED → COMPUTING
//     → per prefill chunk, per model layer, as soon as the layer's state is
//       final (layer-progress callback, engine thread, inside Step):
//         PlanLayerRows(rows [start, end) of an MLA layer; a KDA layer's slot
//         on the last chunk) → PostWrite, one non-blocking batch  STREAMING
//     → first token sampled (output callback, engine thread):
//         Locate → checksums (while the last batches fly) → Wait for every
//         batch (deadline) → Notify(id) → Cancel(id) frees the blocks
//                                                              TRANSFERRED
//         (streaming off, or a recomputed request: PlanAll → PostWrite → Wait
//         of the whole state here, after the earlier batches ended)
//     → response: first token, logprob, checksums, TransferStats → FINISH
//   client cancel / Cancel(id) → engine thread: cancel and drain the stream's
//     batches, then abort the engine request                   CANCELLED
//   a failed batch → no more posts; at the first token the others are
//     cancelled and drained, the request fails (UNAVAILABLE / DEADLINE_EXCEEDED)
//
// The blocks and the slot are held by the engine request until every batch
// has ended (completed, failed, or cancelled and drained): the stream is ended
// on the engine thread before the request is aborted, on every path. The wait
// at the first token runs on the engine thread (the engine cannot hold an
// ended request's blocks without stepping it); with streaming it only covers
// the transfer not already overlapped with compute (the "exposed" seconds).
//
// Tensor parallelism: a TP N worker registers every rank's cache with its one
// agent and needs a target with N ranks (FAILED_PRECONDITION otherwise); rank r
// is written to the target's rank r (one plan and batch per rank, per layer
// when streaming), and the checksums are every rank's, merged rank-major
// (worker::MergeRankChecksums). Once the engine's TP group broke (a rank
// died) every Prefill is refused UNAVAILABLE.
#ifndef TANDEM_PREFILL_PREFILL_SERVICE_H_
#define TANDEM_PREFILL_PREFILL_SERVICE_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/kv_cache.h"
#include "kvtransfer/plan.h"
#include "kvtransfer/transfer_agent.h"
#include "proto/worker.grpc.pb.h"
#include "worker/cache_layout.h"
#include "worker/engine_loop.h"
#include "worker/worker_metrics.h"

namespace tandem::prefill {

struct PrefillServiceOptions {
  std::string worker_id = "prefill-0";
  // Deadline of a Prefill that carries none.
  absl::Duration default_deadline = absl::Seconds(60);
  // TEST ONLY: flip one byte of the source state after computing the checksums,
  // so the decode worker must detect the corruption (DATA_LOSS).
  bool test_corrupt_transfer = false;
  // Stream each layer's state while the prefill computes (overlapping transfer
  // and compute); false: the whole state after the prefill (one batch).
  bool stream_layers = true;
};

class PrefillService final : public tandem::v1::PrefillWorker::CallbackService {
 public:
  // Not owned, must outlive the service: the loop, the engine's cache (inside
  // the loop's engine), the agent, metrics (may be null).
  static absl::StatusOr<std::unique_ptr<PrefillService>> Create(
      worker::EngineLoop* loop, engine::KvCache* cache,
      kvtransfer::TransferAgent* agent, worker::WorkerMetrics* metrics,
      PrefillServiceOptions options);
  // TP: every rank's cache, rank order (the engine executor's cache(r)).
  static absl::StatusOr<std::unique_ptr<PrefillService>> Create(
      worker::EngineLoop* loop, std::vector<engine::KvCache*> caches,
      kvtransfer::TransferAgent* agent, worker::WorkerMetrics* metrics,
      PrefillServiceOptions options);

  grpc::ServerUnaryReactor* Prefill(grpc::CallbackServerContext* context,
                                    const tandem::v1::PrefillRequest* request,
                                    tandem::v1::PrefillResponse* response) override;
  grpc::ServerUnaryReactor* Cancel(grpc::CallbackServerContext* context,
                                   const tandem::v1::CancelRequest* request,
                                   tandem::v1::CancelResponse* response) override;

  // Destroy after the engine loop (no more engine callbacks); ends any batch
  // still in flight.
  ~PrefillService() override;

  tandem::v1::WorkerLoad Load() const;
  tandem::v1::KvLayout layout() const { return layout_; }

 private:
  struct Call;
  struct Stream;
  PrefillService(worker::EngineLoop* loop, std::vector<engine::KvCache*> caches,
                 kvtransfer::TransferAgent* agent, worker::WorkerMetrics* metrics,
                 PrefillServiceOptions options);
  int tp() const { return static_cast<int>(caches_.size()); }
  // On the engine thread, after the first token: finish the transfer (wait for
  // the stream's batches, or send the whole state) and answer. `stream` is
  // null when streaming is off.
  absl::Status Transfer(engine::Engine& e, Call* call, const engine::RequestOutput& out,
                        Stream* stream);
  // Engine thread: the layer-progress callback (posts this layer's segments).
  void OnLayer(int layer, absl::Span<const engine::LayerProgressEntry> entries);
  // Engine thread: waits for the stream's batches in order (deadline); after
  // the first error cancels and drains the rest. Returns the first error.
  absl::Status WaitBatches(Stream* stream, absl::Time deadline);
  // Engine thread: cancels and drains every batch left (a bounded wait; the
  // peer is dropped when one does not drain), so no batch reads the blocks
  // after this returns.
  void EndStream(Stream* stream);
  // Engine thread: removes the request's stream (null when none).
  std::unique_ptr<Stream> TakeStream(engine::RequestId eid);
  absl::StatusOr<kvtransfer::PeerId> PeerFor(const std::string& descriptor);
  void DropPeer(kvtransfer::PeerId peer);
  void Count(const char* rpc, const char* outcome);
  // Stops the call's engine work and ends it CANCELLED (unless it already ended).
  void CancelCall(std::shared_ptr<Call> call);

  worker::EngineLoop* const loop_;              // not owned
  const std::vector<engine::KvCache*> caches_;  // not owned; one per rank
  kvtransfer::TransferAgent* const agent_;      // not owned
  worker::WorkerMetrics* const metrics_;        // not owned; may be null
  const PrefillServiceOptions options_;
  std::vector<worker::CacheRegions> regions_;  // per rank
  tandem::v1::KvLayout layout_;                // rank 0's
  std::atomic<int64_t> next_engine_id_{1};
  // Model layer -> its MLA or KDA pool (the engine reports model layers).
  std::vector<kvtransfer::LayerRef> layer_refs_;
  // Engine thread only: the own caches' pools per rank (the sequence set per
  // use) and the streams of requests being prefilled with streaming on.
  std::vector<kvtransfer::RankLayout> src_pools_;
  absl::flat_hash_map<engine::RequestId, std::unique_ptr<Stream>> streams_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, kvtransfer::PeerId> peers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<Call>> active_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::prefill

#endif  // TANDEM_PREFILL_PREFILL_SERVICE_H_
