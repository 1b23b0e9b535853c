// DecodeWorker service: receives a request's state from a prefill worker into a
// reservation, then decodes it in the continuous batch and streams tokens.
//
//   Reserve(id, prompt_tokens)
//     → landing blocks + a KDA slot from the landing pool (RESOURCE_EXHAUSTED
//       when full) → KvTarget{agent descriptor (pool geometry in its metadata),
//       block ids, slot, layout, lease expiry}            state RESERVED
//   (prefill worker writes over kvtransfer, then Notify(id))    → LANDED
//   Decode(id, prompt, first token, checksums)
//     → wait (bounded by the deadline) for LANDED              → WAITING
//     → verify checksums over the landed bytes (DATA_LOSS, freed)
//     → engine thread: AddPrefilledRequestWithOutput (copies the state into the
//       engine's cache at position prompt_len) → landing freed  → DECODING
//     → first message = the prefilled token (+ text, logprob, seed)
//     → engine outputs streamed until finish_reason            → FINISHED
//     client cancel (OnCancel) → engine Abort (blocks and slot freed)
//   Release(id) / lease expiry (janitor thread) → reservation freed
//   Generate(request) → colocated prefill + decode on this engine (short prompts)
//
// The landing pool is a second KvCache registered with the transfer agent once
// at start; the state is copied into the engine's own cache on admission (one
// memcpy of the prompt's state). Writing straight into engine blocks needs a
// "reserved, not yet runnable" state in the scheduler: next step.
//
// Tensor parallelism: a TP N worker has one landing pool per rank (each shaped
// like that rank's engine cache: its KDA heads, the replicated MLA latents),
// all registered with the one agent; a reservation is the same block ids and
// slot in every rank's pool, published as N RankTargets (one descriptor per
// rank, its pool geometry in the metadata). The checksums verified are every
// rank's, merged rank-major (worker::MergeRankChecksums); admission imports the
// ranks' ranges rank-major. Once the engine's TP group broke (a rank died),
// Reserve and Generate answer UNAVAILABLE (the router drops the worker).
#ifndef TANDEM_DECODE_DECODE_SERVICE_H_
#define TANDEM_DECODE_DECODE_SERVICE_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/cache/block_allocator.h"
#include "engine/cache/slot_pool.h"
#include "engine/runtime/kv_cache.h"
#include "kvtransfer/transfer_agent.h"
#include "proto/worker.grpc.pb.h"
#include "rpc/response_stream.h"
#include "worker/cache_layout.h"
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
  // How often the janitor looks for expired leases and waits.
  absl::Duration janitor_period = absl::Milliseconds(20);
  // A reservation freed before its state landed (Release after a failed or
  // cancelled prefill, lease or wait expiry) keeps its blocks and slot out of
  // use this long: a prefill worker the router gave up on may still be writing
  // into them (a cancelled prefill drains its writes within ~2 s). Writes that
  // outlast it (a prefill worker cut off from the router until its deadline) are
  // not fenced: docs/kvtransfer.md, "Failures".
  absl::Duration unlanded_quarantine = absl::Seconds(5);
  // When the landing pools were allocated through the agent (AgentAllocations),
  // their buffers are already registered: not owned, may be null.
  const worker::AgentAllocations* allocations = nullptr;
};

class DecodeService final : public tandem::v1::DecodeWorker::CallbackService {
 public:
  // Not owned, must outlive the service: the loop (engine thread), the landing
  // cache and the agent it is registered with, metrics (may be null).
  static absl::StatusOr<std::unique_ptr<DecodeService>> Create(
      worker::EngineLoop* loop, engine::KvCache* landing,
      kvtransfer::TransferAgent* agent, worker::WorkerMetrics* metrics,
      DecodeServiceOptions options);
  // TP: one landing pool per rank, rank order (same blocks and slots each).
  static absl::StatusOr<std::unique_ptr<DecodeService>> Create(
      worker::EngineLoop* loop, std::vector<engine::KvCache*> landing,
      kvtransfer::TransferAgent* agent, worker::WorkerMetrics* metrics,
      DecodeServiceOptions options);
  ~DecodeService() override;

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

  // Load for heartbeats (engine + landing pool).
  tandem::v1::WorkerLoad Load() const;
  tandem::v1::KvLayout layout() const { return layout_; }
  int64_t num_reservations() const;
  int32_t landing_free_blocks() const;

 private:
  struct Reservation {
    std::vector<int32_t> blocks;
    int32_t slot = -1;
    int32_t prompt_tokens = 0;
    absl::Time lease_expiry;
    bool landed = false;
    // A Decode waiting for the notification.
    rpc::ResponseStream* waiting = nullptr;  // not owned (producer reference)
    tandem::v1::DecodeRequest pending;
    absl::Time wait_deadline;
    absl::Time decode_started;
  };

  DecodeService(worker::EngineLoop* loop, std::vector<engine::KvCache*> landing,
                kvtransfer::TransferAgent* agent, worker::WorkerMetrics* metrics,
                DecodeServiceOptions options);
  int tp() const { return static_cast<int>(landing_.size()); }
  // UNAVAILABLE once the engine's TP group broke; OK otherwise.
  absl::Status Usable() const;
  void OnNotification(const kvtransfer::Notification& n);
  // Verifies and admits a landed reservation (taken out of the table).
  void StartDecode(std::string id, Reservation r);
  // Frees r's blocks and slot now if its state landed (or nothing was sent),
  // else quarantines them for options_.unlanded_quarantine.
  void FreeLocked(Reservation* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseLocked(std::vector<int32_t>* blocks, int32_t* slot)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Janitor();
  void Count(const char* rpc, const char* outcome);

  worker::EngineLoop* const loop_;               // not owned
  const std::vector<engine::KvCache*> landing_;  // not owned; one per rank
  kvtransfer::TransferAgent* const agent_;       // not owned
  worker::WorkerMetrics* const metrics_;         // not owned; may be null
  const DecodeServiceOptions options_;
  std::vector<worker::CacheRegions> regions_;  // per rank
  std::vector<tandem::v1::KvLayout> layouts_;  // per rank
  std::vector<std::string> descriptors_;       // per rank
  tandem::v1::KvLayout layout_;                // rank 0's
  std::atomic<int64_t> next_engine_id_{1};

  mutable absl::Mutex mu_;
  engine::BlockAllocator blocks_ ABSL_GUARDED_BY(mu_);
  engine::SlotPool slots_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Reservation> reservations_ ABSL_GUARDED_BY(mu_);
  // Blocks and slots of reservations freed before their state landed, held
  // until `until` (FreeLocked); the janitor releases them.
  struct Quarantined {
    std::vector<int32_t> blocks;
    int32_t slot = -1;
    absl::Time until;
  };
  std::vector<Quarantined> quarantine_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread janitor_;
};

}  // namespace tandem::decode

#endif  // TANDEM_DECODE_DECODE_SERVICE_H_
