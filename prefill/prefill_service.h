// PrefillWorker service: computes a prompt's state, writes it into a decode
// worker's reservation over kvtransfer, returns the first token.
//
//   Prefill(id, prompt, sampling, target)                      START
//     → target layout from the KvTarget (descriptor metadata = pool geometry)
//       (INVALID_ARGUMENT when malformed or incompatible)
//     → engine thread: AddRequest (prefill-only parameters: the request's
//       sampling, no stop conditions, so the first token is exactly the one a
//       colocated run samples first)                           QUEUED → COMPUTING
//     → first token sampled (output callback, engine thread):
//         Locate → PlanAll(src = own cache, dst = target) → checksums
//         → Connect (cached per decode agent) → PostWrite → Wait(deadline)
//         → Notify(id) → Cancel(id) frees the blocks at once  TRANSFERRED
//     → response: first token, logprob, checksums, TransferStats → FINISH
//   client cancel / Cancel(id) → engine abort, CANCELLED
//
// The transfer runs after the whole prefill, on the engine thread (the engine
// does not step while the state is read). Streaming layer by layer overlapped
// with compute is the next step (kvtransfer::PlanLayer is ready for it).
#ifndef TANDEM_PREFILL_PREFILL_SERVICE_H_
#define TANDEM_PREFILL_PREFILL_SERVICE_H_

#include <atomic>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/runtime/kv_cache.h"
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
};

class PrefillService final : public tandem::v1::PrefillWorker::CallbackService {
 public:
  // Not owned, must outlive the service: the loop, the engine's cache (inside
  // the loop's engine), the agent, metrics (may be null).
  static absl::StatusOr<std::unique_ptr<PrefillService>> Create(
      worker::EngineLoop* loop, runtime::KvCache* cache,
      kvtransfer::TransferAgent* agent, worker::WorkerMetrics* metrics,
      PrefillServiceOptions options);

  grpc::ServerUnaryReactor* Prefill(grpc::CallbackServerContext* context,
                                    const tandem::v1::PrefillRequest* request,
                                    tandem::v1::PrefillResponse* response) override;
  grpc::ServerUnaryReactor* Cancel(grpc::CallbackServerContext* context,
                                   const tandem::v1::CancelRequest* request,
                                   tandem::v1::CancelResponse* response) override;

  tandem::v1::WorkerLoad Load() const;
  tandem::v1::KvLayout layout() const { return layout_; }

 private:
  struct Call;
  PrefillService(worker::EngineLoop* loop, runtime::KvCache* cache,
                 kvtransfer::TransferAgent* agent, worker::WorkerMetrics* metrics,
                 PrefillServiceOptions options);
  // On the engine thread, after the first token: transfer and answer.
  absl::Status Transfer(runtime::Engine& e, Call* call,
                        const runtime::RequestOutput& out);
  absl::StatusOr<kvtransfer::PeerId> PeerFor(const std::string& descriptor);
  void DropPeer(kvtransfer::PeerId peer);
  void Count(const char* rpc, const char* outcome);
  // Stops the call's engine work and ends it CANCELLED (unless it already ended).
  void CancelCall(std::shared_ptr<Call> call);

  worker::EngineLoop* const loop_;          // not owned
  runtime::KvCache* const cache_;           // not owned
  kvtransfer::TransferAgent* const agent_;  // not owned
  worker::WorkerMetrics* const metrics_;    // not owned; may be null
  const PrefillServiceOptions options_;
  worker::CacheRegions regions_;
  tandem::v1::KvLayout layout_;
  std::atomic<int64_t> next_engine_id_{1};

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, kvtransfer::PeerId> peers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<Call>> active_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::prefill

#endif  // TANDEM_PREFILL_PREFILL_SERVICE_H_
