// SendSession: one prefill request's hand-off of its computed state into a
// decode worker's reservation, as data: an explicit state, the layers'
// rows produced, the batches ("pieces") posted and still in flight, the bytes,
// segments and checksums, a restart. No gRPC inside; the transfer agent, the
// peer cache, the clock and the metrics are injected (SendContext).
//
//  COMPUTING ──OnLayer: rows final → PlanLayerRows → PostWrite──▶ STREAMING
//      │                                                              │
//      │  OnLayer: a chunk starts anywhere but where the layer's last │
//      │  one ended (preempted, recomputed): no more streaming        │
//      ├────────────────────────────▶ RESTARTED ◀─────────────────────┤
//      │                                  │                           │
//      │   Computed (first token): checksums, PlanAll per rank        │
//      └──────────────────────────────────┼───────────────────────────┘
//                                         ▼
//                                     DRAINING   Step: the streamed batches land
//                                         │ every one ended OK
//              nothing left to send ┌─────┴─────┐ whole state due (streaming off,
//                                   │           ▼ restarted, a layer short) or
//                                   │       FINISHING  the TEST ONLY piece:
//                                   │           │      posted, they land
//                                   └─────┬─────┘
//                                         ▼ Notify(rank 0's peer, request_id)
//                                       DONE
//
//   any state before DONE:  Cancel() (any thread)             → CANCELLED
//                           a batch fails, a plan / PostWrite
//                           fails, Notify fails (peer loss), or
//                           the deadline passes (the clock)   → FAILED
//   (seen at the next OnLayer / Computed / Step; entering either cancels the
//   batches still in flight.)
//   End(), on every path before the request's blocks go: cancel and drain every
//   batch still in flight (bounded by kDrainGrace; the peer of a batch that does
//   not drain is dropped, which ends it), so no batch reads the blocks after it
//   returns. A session ended while live ends CANCELLED.
//
// Threads: every method runs on the engine thread except Cancel(), which any
// thread may call; batch completion callbacks (agent thread) only record the
// first failure. Waits: Step() never blocks except in Notify; Run() blocks
// on the agent in slices of kWaitSlice of real time (the agent's waits take
// absolute times of its own, real, clock) and ends at the session's deadline on
// the injected clock.
//
// Tensor parallelism: one source and one target per rank; rank r's layers go
// to the target's rank r (one plan and batch per rank); the checksums are
// every rank's merged rank-major; the notification goes to rank 0's peer.
#ifndef TANDEM_PREFILL_SEND_SESSION_H_
#define TANDEM_PREFILL_SEND_SESSION_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/clock.h"
#include "kvtransfer/checksum.h"
#include "kvtransfer/plan.h"
#include "kvtransfer/transfer_agent.h"
#include "prefill/peer_cache.h"
#include "proto/worker.pb.h"
#include "worker/worker_metrics.h"

namespace tandem::prefill {

enum class SendState {
  kComputing,  // created (connected when streaming); nothing posted yet
  kStreaming,  // layers' rows posted while the prefill computes
  kRestarted,  // recomputed below the rows posted: the whole state goes later
  kDraining,   // first token: waiting for the streamed batches
  kFinishing,  // waiting for the whole state (or the TEST ONLY piece)
  kDone,       // every batch landed and the decode worker was notified
  kCancelled,
  kFailed,
};
absl::string_view SendStateName(SendState state);

// How long a cancelled batch may take to drain before its peer is dropped, and
// the longest single wait of Run() (so that a Cancel stops it at once).
inline constexpr absl::Duration kDrainGrace = absl::Seconds(2);
inline constexpr absl::Duration kWaitSlice = absl::Milliseconds(20);

// One TP rank of this worker's state.
struct SendSource {
  kvtransfer::RankLayout pools;   // the rank's pools (no sequence: ids unused)
  kvtransfer::RegionBytes bytes;  // its registered memory (checksums)
  // Hashes the checksums' chunks where the memory lives (a device cache:
  // worker/device_checksum.h); null: the host reads `bytes`. Not owned.
  kvtransfer::ChunkHasher* hasher = nullptr;
  // Whether the host may read `bytes` (false for a CUDA cache).
  bool host_addressable = true;
};

// What a worker's sessions share. Not owned by them; must outlive them.
struct SendContext {
  kvtransfer::TransferAgent* agent = nullptr;  // not owned
  PeerCache* peers = nullptr;                  // not owned
  Clock* clock = nullptr;                      // not owned
  worker::WorkerMetrics* metrics = nullptr;    // not owned; may be null
  std::vector<SendSource> sources;             // per rank
  // Model layer -> its MLA or KDA pool (the engine reports model layers).
  std::vector<kvtransfer::LayerRef> layers;
  // TEST ONLY: flip one byte of the source after the checksums, so the decode
  // worker must detect the corruption (DATA_LOSS).
  bool test_corrupt_transfer = false;
};

// One rank of the decode worker's reservation.
struct SendTarget {
  kvtransfer::RankLayout layout;  // pools, block ids and slot of the reservation
  std::string descriptor;         // its agent's descriptor (Connect)
  std::string address;            // for messages
};

struct SendSpec {
  std::string request_id;
  int64_t num_tokens = 0;           // the prompt's
  std::vector<SendTarget> targets;  // per rank, as many as the context's sources
  // Post each layer's rows as the prefill computes them; false: the whole state
  // after the prefill (one batch per rank).
  bool stream_layers = true;
  bool checksums = false;
  absl::Time deadline = absl::InfiniteFuture();  // on the context's clock
  // KvTarget.reservation_token: the notification's payload (decimal), so the
  // decode worker can tell this reservation from an earlier one of the same id.
  // 0: none (an empty payload).
  uint64_t reservation_token = 0;
  // KvTarget.cached_prefix_tokens: the receiver holds the MLA rows of tokens
  // [0, held_tokens) already (a decode-side prefix hit); only the rows after
  // them are written (every KDA slot still goes whole). The checksums cover
  // every row: the receiver hashes its held rows with the landed ones.
  int64_t held_tokens = 0;
};

// A layer's rows [start, end) of the request are final in the source (the
// engine's layer-progress entry).
struct LayerRows {
  int64_t start = 0;
  int64_t end = 0;
  absl::Span<const int32_t> block_table;  // read during the call only
  int32_t slot = 0;
  bool completes_prefill = false;  // the prompt's last chunk (KDA slots final)
};

// The request's state after its prefill (the engine's location of it).
struct ComputedState {
  absl::Span<const int32_t> block_ids;
  int32_t slot = 0;
  int64_t num_cached_tokens = 0;
};

struct SendStats {
  int64_t batches = 0;  // posted, streamed and whole
  int64_t segments = 0;
  uint64_t bytes = 0;
  bool whole = false;  // the whole state went after the prefill
  absl::Duration prefill = absl::ZeroDuration();   // created → Computed
  absl::Duration transfer = absl::ZeroDuration();  // first post → every batch landed
  absl::Duration exposed = absl::ZeroDuration();   // Computed → every batch landed
  std::string transport;                           // towards rank 0's peer (DONE only)
};

class SendSession {
 public:
  // With spec.stream_layers, connects to every rank's agent now (through the
  // context's peer cache), so the first layer posts at once: UNAVAILABLE or
  // INVALID_ARGUMENT when a rank cannot be reached.
  static absl::StatusOr<std::unique_ptr<SendSession>> Create(const SendContext* context,
                                                             SendSpec spec);
  // Ends the session (End()).
  ~SendSession();
  SendSession(const SendSession&) = delete;
  SendSession& operator=(const SendSession&) = delete;

  // COMPUTING / STREAMING: plans and posts the layer's new rows (an MLA layer's
  // rows; a KDA layer's slot once the prompt's last chunk is done). A chunk that
  // starts anywhere but at the rows already posted → RESTARTED. Ignored in
  // every other state.
  void OnLayer(int layer, const LayerRows& rows);
  // At the first token → DRAINING: checksums, the whole-state plans; connects
  // now when not streaming. Once only; a terminal session stays as it is.
  void Computed(const ComputedState& state);
  // Non-blocking: polls the batches in flight, applies a cancel, a failure or
  // the deadline, posts the whole state, notifies. True once the session is
  // terminal (DONE, CANCELLED, FAILED; batches may still be draining: End()).
  bool Step();
  // After Computed: steps until terminal, waiting on the batches in flight,
  // then End(). Returns status().
  absl::Status Run();
  // Any thread: the session ends CANCELLED at its next step.
  void Cancel();
  // Cancels and drains every batch still in flight (see the file comment).
  void End();

  SendState state() const { return state_; }
  // OK until FAILED or CANCELLED.
  const absl::Status& status() const { return status_; }
  const SendStats& stats() const { return stats_; }
  // Rows posted so far, per model layer.
  absl::Span<const int64_t> rows() const { return rows_; }
  // Batches posted and not yet seen to end.
  size_t in_flight() const { return pending_.size(); }
  // Every rank's checksums merged (after Computed, when spec.checksums).
  const tandem::v1::StateChecksums& checksums() const { return checksums_; }

 private:
  // The first failure of a batch, from completion callbacks (agent thread);
  // shared so that a callback after the session is gone is harmless.
  struct BatchFailures {
    absl::Mutex mu;
    absl::Status first ABSL_GUARDED_BY(mu);
  };

  SendSession(const SendContext* context, SendSpec spec);
  bool Live() const;
  absl::Status ConnectAll();
  // Live only: a Cancel() or a failed batch ends the session.
  void ObserveCancelAndFailures();
  void ObserveDeadline();
  void Fail(absl::Status status);
  // Live only: to CANCELLED or FAILED with `status`, cancelling the batches in
  // flight.
  void Terminate(SendState end, absl::Status status);
  // Cancels the batches in flight (non-blocking; End() drains them).
  void CancelInFlight();
  absl::Status Post(int rank, absl::Span<const kvtransfer::Segment> segments);
  void Ended(kvtransfer::BatchId batch, const absl::Status& status);
  void PollInFlight();
  // DRAINING / FINISHING with nothing in flight: the next move.
  void Advance();
  void Notify();
  void DropPeers();
  // The transfer's metrics, once, when a computed session ends.
  void Record();
  absl::Status TransferError(const absl::Status& s) const;
  // An agent-clock deadline for a wait of at most `cap`, ending no later than
  // the session's deadline.
  absl::Time AgentDeadline(absl::Duration cap) const;

  const SendContext* const context_;  // not owned
  const SendSpec spec_;
  SendState state_ = SendState::kComputing;
  absl::Status status_;
  std::vector<kvtransfer::PeerId> peers_;        // per rank
  std::vector<kvtransfer::RankLayout> sources_;  // per rank, the sequence set per use
  // Per model layer: rows [0, rows_) posted or held by the receiver
  // (spec.held_tokens), and where its last reported chunk ended (-1: none yet).
  std::vector<int64_t> rows_;
  std::vector<int64_t> chunk_end_;
  std::vector<kvtransfer::BatchId> pending_;     // posted, not seen to end
  std::vector<kvtransfer::TransferPlan> plans_;  // per rank, whole state
  tandem::v1::StateChecksums checksums_;
  SendStats stats_;
  bool computed_ = false;
  bool recorded_ = false;
  bool peers_dropped_ = false;
  // FAILED by the session's own deadline with no batch in flight: nothing is
  // stuck on the connection, which other requests share, so it is kept.
  bool idle_deadline_ = false;
  absl::Time started_;
  absl::Time computed_at_ = absl::InfinitePast();
  absl::Time first_post_ = absl::InfiniteFuture();
  std::atomic<bool> cancel_requested_{false};
  const std::shared_ptr<BatchFailures> failures_ = std::make_shared<BatchFailures>();
};

}  // namespace tandem::prefill

#endif  // TANDEM_PREFILL_SEND_SESSION_H_
