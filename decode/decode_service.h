// DecodeWorker service: thin RPC glue over Reservations (reservations.h, the
// lifecycle) and the engine loop. A request's state lands straight in the
// engine's own KV blocks and KDA slot, reserved for it; admission copies nothing.
//
//   Reserve(id, prompt_tokens)
//     → engine thread: Engine::Reserve (blocks + a KDA slot, held, never
//       scheduled or preempted; RESOURCE_EXHAUSTED when not free; cached
//       blocks of the prompt shared only with share_held_prefix) → the reply,
//       from the engine thread: KvTarget{agent descriptor (the engine cache's
//       geometry in its metadata), the engine's block ids, slot, layout, lease
//       expiry}                                                    RESERVED
//   (prefill worker writes over kvtransfer into those blocks, then Notify(id))
//                                                    RESERVED → LANDED
//   Decode(id, prompt, first token, checksums)
//     → RESERVED → LANDING: waits (bounded by the deadline) for the notification
//     → LANDED / LANDING + notification → ADMITTED: the hand-off is queued for
//       the lander thread, which takes every queued one together: one pause
//       between engine steps stages them in (a staged cache) and checksums them
//       (on the device for a device cache); then for each:
//       verify checksums over the engine's blocks (DATA_LOSS: freed)
//       → engine thread: Engine::AdmitReserved (nothing copied: the sequence
//         becomes runnable where it is)
//       → first message = the prefilled token (+ text, logprob, seed)
//       → engine outputs streamed until finish_reason        → FINISHED
//     client cancel: LANDING → quarantined; ADMITTED → engine Cancel
//   Release(id): RESERVED / LANDING → quarantined, LANDED → freed
//   janitor thread: Reservations::Tick(now): lease expiry (RESERVED, LANDED),
//     wait expiry (LANDING: DEADLINE_EXCEEDED), quarantine end → the memory goes
//     back to the engine (EngineLoop::Abort of the reservation's engine id)
//   Generate(request) → colocated prefill + decode on this engine (short prompts)
//
// Memory: every reservation holds engine blocks and a slot (Load() reports them
// as used); a quarantined one keeps them out of the engine's free list until
// the quarantine ends. Reservations count against the engine's running cap (its
// slots), so a reserved request's admission cannot fail for room.
//
// Tensor parallelism: every rank's engine cache is registered with the one
// agent (each rank's KDA heads, the replicated MLA latents); a reservation is
// the same block ids and slot in every rank's cache, published as N RankTargets
// (one descriptor per rank, its cache geometry in the metadata). The checksums
// verified are every rank's, merged rank-major (worker::MergeRankChecksums).
// Once the engine's TP group broke (a rank died), Reserve and Generate answer
// UNAVAILABLE (the router drops the worker).
#ifndef TANDEM_DECODE_DECODE_SERVICE_H_
#define TANDEM_DECODE_DECODE_SERVICE_H_

#include <atomic>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "decode/reservations.h"
#include "engine/runtime/kv_cache.h"
#include "kernels/backend.h"
#include "kvtransfer/checksum.h"
#include "kvtransfer/host_staging_agent.h"
#include "kvtransfer/transfer_agent.h"
#include "proto/worker.grpc.pb.h"
#include "rpc/response_stream.h"
#include "worker/cache_layout.h"
#include "worker/device_checksum.h"
#include "worker/engine_loop.h"
#include "worker/worker_metrics.h"

namespace tandem::decode {

struct DecodeServiceOptions {
  std::string worker_id = "decode-0";
  // Lease when the router asks for none, and the most it may ask for.
  absl::Duration default_lease = absl::Seconds(10);
  absl::Duration max_lease = absl::Seconds(60);
  // Longest a Decode waits for the state's notification (also bounded by its
  // deadline).
  absl::Duration max_landing_wait = absl::Seconds(10);
  // How often the janitor runs Tick.
  absl::Duration janitor_period = absl::Milliseconds(20);
  // A reservation freed before its state landed (Release after a failed or
  // cancelled prefill, lease or wait expiry) keeps its blocks and slot out of
  // use this long: a prefill worker the router gave up on may still be writing
  // into them (a cancelled prefill drains its writes within ~2 s). Writes that
  // outlast it (a prefill worker cut off from the router until its deadline) are
  // not fenced: docs/kvtransfer.md, "Failures".
  absl::Duration unlanded_quarantine = absl::Seconds(5);
  // When the engine's caches were allocated through the agent
  // (EngineOptions::cache_allocator from AgentAllocations), their buffers are
  // already registered: not owned, may be null.
  const worker::AgentAllocations* allocations = nullptr;
  // Leases, waits and quarantines; not owned, null: the real clock.
  Clock* clock = nullptr;
  // Start the janitor thread (false: the owner calls Tick, e.g. tests).
  bool start_janitor = true;
  // Prompt tokens of hand-offs made ready in one engine pause at most (one
  // state alone may be larger): the pause holds up the running requests' next
  // step, and a staged state copies its rows host -> device there (256k tokens
  // of K3 state are ~7 GB of MLA rows).
  int64_t max_landing_tokens = 262144;
  // Per TP rank (rank order), the backend whose device holds that rank's cache:
  // the landed state's checksums are then computed on that device
  // (worker/device_checksum.h), never by the host reading device memory. Empty:
  // the host computes them (host caches; cuda_sim). Not owned; must outlive the
  // service.
  std::vector<kernels::Backend*> checksum_backends;
};

class DecodeService final : public tandem::v1::DecodeWorker::CallbackService {
 public:
  // Not owned, must outlive the service: the loop (engine thread) and its
  // engine's caches, one per TP rank in rank order (worker::RankCaches), the
  // agent they are registered with, metrics (may be null). Shut down in this
  // order: Stop(), the loop (its commands and callbacks call the service), the
  // service.
  static absl::StatusOr<std::unique_ptr<DecodeService>> Create(
      worker::EngineLoop* loop, std::vector<engine::KvCache*> caches,
      kvtransfer::TransferAgent* agent, worker::WorkerMetrics* metrics,
      DecodeServiceOptions options);
  ~DecodeService() override;  // Stop()s
  // Ends the janitor and detaches the agent's notifications, so that nothing
  // but the loop's own commands calls into the loop any more. Idempotent.
  void Stop();

  grpc::ServerUnaryReactor* Reserve(grpc::CallbackServerContext* context,
                                    const tandem::v1::ReserveRequest* request,
                                    tandem::v1::KvTarget* response) override;
  grpc::ServerWriteReactor<tandem::v1::GenerateResponse>* Decode(
      grpc::CallbackServerContext* context,
      const tandem::v1::DecodeRequest* request) override;
  grpc::ServerWriteReactor<tandem::v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context,
      const tandem::v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* context,
                                    const tandem::v1::ReleaseRequest* request,
                                    tandem::v1::ReleaseResponse* response) override;
  // Drops the engine's cached prefixes (worker/prefix_cache_reset.h).
  grpc::ServerUnaryReactor* ResetPrefixCache(
      grpc::CallbackServerContext* context,
      const tandem::v1::WorkerResetPrefixCacheRequest* request,
      tandem::v1::WorkerResetPrefixCacheResponse* response) override;

  // What the janitor runs every janitor_period: expiries and quarantine ends
  // (their memory back to the engine, expired Decodes ended), metrics.
  void Tick(absl::Time now);

  // Load for heartbeats: the engine's (reserved blocks and slots are not free).
  tandem::v1::WorkerLoad Load() const;
  tandem::v1::KvLayout layout() const { return layout_; }
  // Reservations not yet finished (RESERVED, LANDING, LANDED, ADMITTED).
  int64_t num_reservations() const { return table_.size(); }
  // Engine blocks held for hand-offs not yet admitted (quarantined included).
  int64_t reserved_blocks() const { return table_.held_blocks(); }
  int64_t quarantined() const { return table_.num_quarantined(); }
  // Hand-offs the lander thread has taken from its queue since start (tests).
  int64_t landings_taken() const { return landings_taken_.load(); }
  // Hand-offs queued for the lander thread, not yet taken (tests).
  size_t queued_landings() const {
    absl::MutexLock l(&land_mu_);
    return landings_.size();
  }
  std::optional<ReservationState> state(const std::string& request_id) const {
    return table_.State(request_id);
  }

 private:
  class DecodeWaiter;

  DecodeService(worker::EngineLoop* loop, std::vector<engine::KvCache*> caches,
                kvtransfer::TransferAgent* agent, worker::WorkerMetrics* metrics,
                DecodeServiceOptions options);
  int tp() const { return static_cast<int>(caches_.size()); }
  // UNAVAILABLE once the engine's TP group broke; OK otherwise.
  absl::Status Usable() const;
  // On the engine thread: the reservation, the reply, the table entry.
  absl::Status ReserveOnLoop(engine::Engine& e, const tandem::v1::ReserveRequest& req,
                             engine::RequestId eid, absl::Duration lease,
                             tandem::v1::KvTarget* resp);
  // A landed state's notification (the agent's progress thread): its handoff
  // goes to the lander thread (Enqueue).
  void OnNotification(const kvtransfer::Notification& n);
  // A hand-off whose state and Decode are both here, from the agent's progress
  // thread or a gRPC thread (`on_rpc_thread`): neither may wait for the
  // engine, so the lander thread makes it ready (after Stop: here, as nothing
  // else would). A host cache's hand-off from a gRPC thread is made ready
  // there (its checksums run in parallel with the others').
  void Enqueue(Handoff h, bool on_rpc_thread);
  bool LandingReady() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(land_mu_);
  // The lander thread: takes every hand-off queued (up to kMaxLandingBatch and
  // options_.max_landing_tokens),
  // makes their states ready together (Land), then starts each one's decode.
  void LandLoop();
  void OnDecodeCancel(const std::string& id, engine::RequestId eid,
                      rpc::ResponseStream* stream);
  // Verifies and admits an ADMITTED reservation (the hand-off). `landed`: its
  // state made ready by Land (staged in, and the checksums when the request
  // carries some); null when there was nothing to do (host cache, unchecked).
  void StartDecode(Handoff h, const absl::StatusOr<tandem::v1::StateChecksums>* landed);
  // True when a hand-off's state must be made ready (Land) before its decode.
  bool NeedsLanding(const Handoff& h) const;
  // Makes landed states ready, one result per item in order: a staged cache's
  // rows copied from host memory to the device
  // (kvtransfer::HostStagingAgent::StageIn; every item's ranges in one call),
  // then, for items with `checksums`, the state's checksums (every rank,
  // merged; empty otherwise). On this thread from host memory; on the engine
  // thread between two steps for a device (one pause for the whole batch,
  // waiting at most kDeviceChecksumWait and 0.5 s per further item).
  struct LandItem {
    ReservationInfo info;
    bool checksums = false;
  };
  std::vector<absl::StatusOr<tandem::v1::StateChecksums>> Land(
      std::vector<LandItem> items);
  // The Land item of a hand-off (checksums when its Decode carries some).
  static LandItem ItemOf(const Handoff& h);
  static constexpr int kMaxLandingBatch = 64;
  static constexpr absl::Duration kDeviceChecksumWait = absl::Seconds(30);
  // Gives a reservation's memory back to the engine (from any thread).
  void FreeInEngine(const ReservationInfo& info);
  void Count(const char* rpc, const char* outcome);

  worker::EngineLoop* const loop_;              // not owned
  const std::vector<engine::KvCache*> caches_;  // not owned; the engine's, per rank
  kvtransfer::TransferAgent* const agent_;      // not owned
  worker::WorkerMetrics* const metrics_;        // not owned; may be null
  const DecodeServiceOptions options_;
  Clock* const clock_;                               // not owned
  std::vector<worker::CacheRegions> regions_;        // per rank
  bool staged_ = false;                              // some rank's cache is staged
  kvtransfer::HostStagingAgent* staging_ = nullptr;  // agent_, when staging
  // Per rank: where its checksums are computed (the device's hasher or the host).
  std::vector<std::unique_ptr<worker::BackendChunkHasher>> hashers_;
  std::vector<kvtransfer::ChecksumMemory> checksum_memory_;
  std::vector<tandem::v1::KvLayout> layouts_;  // per rank
  std::vector<std::string> descriptors_;       // per rank
  tandem::v1::KvLayout layout_;                // rank 0's
  std::atomic<int64_t> next_engine_id_{1};
  Reservations table_;

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread janitor_;
  // Hand-offs ready to land, started in order by lander_ (with the time each
  // was queued, for tandem_worker_kv_landing_seconds).
  struct QueuedLanding {
    Handoff handoff;
    absl::Time queued;
  };
  mutable absl::Mutex land_mu_;
  std::deque<QueuedLanding> landings_ ABSL_GUARDED_BY(land_mu_);
  bool land_stop_ ABSL_GUARDED_BY(land_mu_) = false;
  std::atomic<int64_t> landings_taken_{0};
  std::thread lander_;
};

}  // namespace tandem::decode

#endif  // TANDEM_DECODE_DECODE_SERVICE_H_
