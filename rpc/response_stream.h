// ResponseStream: a server-streaming reactor for GenerateResponse that any thread
// may feed (the engine thread, a client reactor relaying another stream).
//
// RPC lifecycle:
//   START (Create) → WRITING (Push: queued, one write in flight at a time;
//     a message pushed while a write is in flight and another message already
//     waits is coalesced into the waiting one, see CoalesceResponse)
//     → CLOSING (Close(status): remaining queue written, then Finish(status))
//     → FINISHED → DONE (OnDone)
//   OnCancel (client gone or deadline) → the producer's cancel hook runs once;
//     Finish(CANCELLED) as soon as no write is in flight; later Pushes are dropped.
// Ownership: two references, gRPC's (dropped in OnDone) and the producer's
// (dropped by Close); the object deletes itself when both are gone, so a
// producer may Push/Close after the RPC ended.
#ifndef TANDEM_RPC_RESPONSE_STREAM_H_
#define TANDEM_RPC_RESPONSE_STREAM_H_

#include <grpcpp/grpcpp.h>

#include <deque>
#include <functional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "proto/router.pb.h"
#include "rpc/response_sink.h"

namespace tandem::rpc {

// Appends `next` to `pending` when both are parts of one token stream that a
// client cannot tell apart from the two messages: `pending` is not a last
// message (no finish_reason, no usage), both carry the same request_id and
// either no logprobs or exactly one per token, and their seeds (when set)
// agree. token_ids, logprobs and text are concatenated in order; seed is kept;
// finish_reason, matched_stop and usage come from `next`. Returns false (and
// leaves both untouched) when they cannot be merged.
bool CoalesceResponse(tandem::v1::GenerateResponse* pending,
                      tandem::v1::GenerateResponse* next);

class ResponseStream final
    : public grpc::ServerWriteReactor<tandem::v1::GenerateResponse>,
      public ResponseSink {
 public:
  ResponseStream() = default;

  // Called once on cancellation (from a gRPC thread; must not block). Set it
  // before handing the reactor to gRPC, or at any time: a hook set after the
  // cancellation runs at once.
  void SetOnCancel(std::function<void()> on_cancel) override;
  // Queues a message (dropped after cancellation or Close). While a write is
  // in flight, tokens queued behind it go out as one message (coalesced), so a
  // slow client costs fewer, larger messages instead of a growing queue.
  void Push(tandem::v1::GenerateResponse message) override;
  // Messages merged into a queued one so far (for tests and metrics).
  int64_t coalesced() const;
  // Ends the stream with `status` after the queued messages; releases the
  // producer's reference: do not touch the object afterwards.
  void Close(const grpc::Status& status) override;
  bool cancelled() const override;

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  // Starts the next write or the Finish, as the state allows.
  void PumpLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unref();

  mutable absl::Mutex mu_;
  std::deque<tandem::v1::GenerateResponse> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
  std::function<void()> on_cancel_ ABSL_GUARDED_BY(mu_);
  int refs_ ABSL_GUARDED_BY(mu_) = 2;
  int64_t coalesced_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tandem::rpc

#endif  // TANDEM_RPC_RESPONSE_STREAM_H_
