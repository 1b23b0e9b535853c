// PrefillWorker service: computes a prompt's state, writes it into a decode
// worker's reservation over kvtransfer, returns the first token. Thin glue: the
// RPCs and the engine's callbacks become calls on the request's SendSession
// (send_session.h holds the transfer's states and their transitions).
//
//   Prefill(id, prompt, sampling, target)                      START
//     → target layout from the KvTarget (descriptor metadata = pool geometry)
//       (INVALID_ARGUMENT when malformed or incompatible)
//     → SendSession::Create (streaming on: Connect, cached per decode agent in
//       the PeerCache; UNAVAILABLE ends it), registered on the engine thread
//                                                              COMPUTING
//     → images (PrefillRequest.images): each decoded and preprocessed again
//       (engine/media) and checked against the gateway's grid, token count and
//       content hash (INVALID_ARGUMENT otherwise); on an encoder thread (one
//       per tower; the engine steps meanwhile) a vision tower encodes them,
//       one MediaInput per image over its <|media_pad|> run (TP > 1: every rank
//       writes the same rows); a request cancelled meanwhile ends there
//     → engine thread: AddRequest (prefill-only parameters: the request's
//       sampling, no stop conditions, so the first token is exactly the one a
//       colocated run samples first)
//     → per prefill chunk, per model layer, as soon as the layer's state is
//       final (layer-progress callback, engine thread, inside Step):
//         SendSession::OnLayer → PlanLayerRows → PostWrite, one non-blocking
//         batch                                                STREAMING
//         (a chunk below the rows posted: preempted, recomputed) RESTARTED
//     → first token sampled (output callback, engine thread):
//         Locate → SendSession::Computed (checksums while the last batches fly)
//                                                              DRAINING
//         → SendSession::Run: every batch ends (deadline); the whole state
//           when streaming is off or the request was recomputed  FINISHING
//           → Notify(id)                                       DONE
//         → End (drain), Cancel(id) frees the blocks
//     → response: first token, logprob, checksums, TransferStats → FINISH
//   client cancel / Cancel(id) → SendSession::Cancel; engine thread: End (cancel
//     and drain the session's batches), then abort the engine request CANCELLED
//   a failed batch, PostWrite or Notify, or the deadline → FAILED: no more
//     posts; at the first token the others are cancelled and drained, the
//     request fails (UNAVAILABLE / DEADLINE_EXCEEDED)
//
// The blocks and the slot are held by the engine request until every batch
// has ended (completed, failed, or cancelled and drained): the session is ended
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
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "engine/media/decode.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/kv_cache.h"
#include "engine/vision/vision_tower.h"
#include "kernels/backend.h"
#include "kvtransfer/transfer_agent.h"
#include "prefill/peer_cache.h"
#include "prefill/send_session.h"
#include "proto/worker.grpc.pb.h"
#include "worker/cache_layout.h"
#include "worker/device_checksum.h"
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
  // Send each layer's state while the prefill computes (overlapping transfer
  // and compute); false: the whole state after the prefill (one batch).
  bool stream_layers = true;
  // The sessions' clock (deadlines, timings); null: Clock::Real(). Not owned.
  Clock* clock = nullptr;
  // Per TP rank (rank order), the backend whose device holds that rank's cache:
  // the state checksums are then computed on that device
  // (worker/device_checksum.h) and only their chunk hashes reach the host. Empty:
  // the host computes them (host caches; cuda_sim). Not owned; must outlive the
  // service.
  std::vector<kernels::Backend*> checksum_backends;
  // The vision towers (prefill_main loads them when the checkpoint has vision
  // tensors: one per TP rank's GPU on a device backend, one on the host); none:
  // a Prefill with images is refused FAILED_PRECONDITION. Each runs on an
  // encoder thread of its own, taking the next request's images from one
  // queue, while the engine keeps stepping: their backends must not be the
  // engine's (prefill_main gives each one of its own). Not owned; must outlive
  // the service.
  std::vector<vision::VisionTower*> vision;
  // Limits on the images' encoded bytes and pixels (the gateway's defaults).
  media::DecodeLimits decode_limits;
  // Write only the MLA rows after a target's held prefix
  // (KvTarget.cached_prefix_tokens), as registered with the router
  // (RegisterRequest.writes_after_held_prefix, prefill_main's
  // --kv_write_after_held_prefix). False: this worker does not take a target
  // with held rows: such a Prefill is refused FAILED_PRECONDITION before
  // anything is written (writing every row from 0 would overwrite blocks the
  // decode worker shares with other sequences).
  bool write_after_held_prefix = true;
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
  // Drops the engine's cached prefixes (worker/prefix_cache_reset.h).
  grpc::ServerUnaryReactor* ResetPrefixCache(
      grpc::CallbackServerContext* context,
      const tandem::v1::WorkerResetPrefixCacheRequest* request,
      tandem::v1::WorkerResetPrefixCacheResponse* response) override;

  // Destroy after the engine loop (no more engine callbacks); ends any session
  // still in flight.
  ~PrefillService() override;  // StopEncoding()s

  // Stops the encoder threads: the images being encoded finish (and their
  // requests go to the engine), the queued ones end UNAVAILABLE at once. Call
  // before the loop is destroyed (the encoding ones are added through it; the
  // destructor's call is a no-op then); idempotent.
  void StopEncoding();

  tandem::v1::WorkerLoad Load() const;
  tandem::v1::KvLayout layout() const { return layout_; }

 private:
  struct Call;
  PrefillService(worker::EngineLoop* loop, std::vector<engine::KvCache*> caches,
                 kvtransfer::TransferAgent* agent, worker::WorkerMetrics* metrics,
                 PrefillServiceOptions options);
  int tp() const { return static_cast<int>(caches_.size()); }
  // Engine thread, after the first token: the session's Computed and Run, then
  // the response.
  absl::Status FinishTransfer(engine::Engine& e, Call* call,
                              const engine::RequestOutput& out);
  // Engine thread: the layer-progress callback (to the entries' sessions).
  void OnLayer(int layer, absl::Span<const engine::LayerProgressEntry> entries);
  void Count(const char* rpc, const char* outcome);
  // Stops the call's engine work and ends it CANCELLED (unless it already ended).
  void CancelCall(std::shared_ptr<Call> call);
  // Engine thread: ends a call that never reached the engine (cancelled while its
  // images were encoded, or the encoder stopped) with `status`.
  void EndBeforeEngine(Call* call, const grpc::Status& status, const char* outcome);
  // Tower `t`'s encoder thread: runs queued jobs (a request's images through
  // the tower, then its AddRequest on the engine thread) in queue order.
  void EncoderLoop(int t);

  worker::EngineLoop* const loop_;              // not owned
  const std::vector<engine::KvCache*> caches_;  // not owned; one per rank
  kvtransfer::TransferAgent* const agent_;      // not owned
  worker::WorkerMetrics* const metrics_;        // not owned; may be null
  const PrefillServiceOptions options_;
  Clock* const clock_;                         // not owned
  std::vector<worker::CacheRegions> regions_;  // per rank
  // Per rank when options_.checksum_backends is set.
  std::vector<std::unique_ptr<worker::BackendChunkHasher>> hashers_;
  tandem::v1::KvLayout layout_;  // rank 0's
  std::atomic<int64_t> next_engine_id_{1};
  PeerCache peers_;
  // What every session shares: agent, peers, clock, metrics, the own caches'
  // pools per rank, the model layers' pools. Immutable after Create.
  SendContext send_;
  // Engine thread only: the sessions of requests being prefilled with
  // streaming on (the layer-progress callback's lookup).
  absl::flat_hash_map<engine::RequestId, std::shared_ptr<SendSession>> sessions_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Call>> active_ ABSL_GUARDED_BY(mu_);

  // Image requests waiting for a tower (EncoderLoop), called with the tower
  // that runs it; null: the job is dropped (the encoders stopped) and must end
  // its call.
  using EncodeJob = std::function<void(vision::VisionTower* tower, int index)>;
  absl::Mutex encode_mu_;
  std::deque<EncodeJob> encode_jobs_ ABSL_GUARDED_BY(encode_mu_);
  bool encode_stop_ ABSL_GUARDED_BY(encode_mu_) = false;
  std::vector<std::thread> encoders_;  // one per tower, started by Create
};

}  // namespace tandem::prefill

#endif  // TANDEM_PREFILL_PREFILL_SERVICE_H_
