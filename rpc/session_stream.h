// SessionStream: the server side of Router.GenerateSession, many Generate
// streams multiplexed on one bidirectional call (proto/router.proto).
//
// Each SessionStart becomes a ResponseSink handed to the start function (which
// takes the producer reference: it must Close the sink once). Events of all
// the session's requests share one outbox: while a write is in flight, every
// message pushed by any request waits in the next batch, and a request's
// messages in one batch merge (CoalesceResponse). So a decode step that makes
// a token for a thousand requests reaches the client as one or two gRPC
// messages, not a thousand.
//
// Session lifecycle:
//   OPEN (reading starts and cancels; writing batches, one write in flight)
//     client half-closes → DRAINING: the running requests finish, their
//       events are written, then Finish(OK)
//     client cancels / the connection breaks / a write fails → every running
//       request's cancel hook runs; Finish(CANCELLED) once no write is in flight
//   → DONE (OnDone): the reactor is gone; sinks still held by producers drop
//     their pushes until their Close.
// Per request: START (start fn) → Push* → Close(status) → one end event with
// the status; a cancel for its id runs its cancel hook (the producer still
// Closes, and the end event says CANCELLED or whatever it closed with). A
// start whose id is running already ends at once with INVALID_ARGUMENT.
#ifndef TANDEM_RPC_SESSION_STREAM_H_
#define TANDEM_RPC_SESSION_STREAM_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <memory>

#include "proto/router.pb.h"
#include "rpc/response_sink.h"

namespace tandem::rpc {

class SessionStream final
    : public grpc::ServerBidiReactor<tandem::v1::SessionRequest,
                                     tandem::v1::SessionResponse> {
 public:
  // Runs one request; `sink` carries its stream (the producer reference
  // passes to the callee). Called on a gRPC thread; must not block.
  using StartFn =
      std::function<void(tandem::v1::GenerateRequest request, ResponseSink* sink)>;
  // What the session has done (for tests and metrics).
  struct Stats {
    int64_t started = 0;
    int64_t writes = 0;     // SessionResponse messages written
    int64_t events = 0;     // events in them
    int64_t coalesced = 0;  // messages merged into a waiting one
  };

  // Optional observers (metrics, logs); both may be empty.
  struct Hooks {
    // Runs as each message is handed to gRPC, with its number of events
    // (under the session's lock: keep it to an atomic update).
    std::function<void(int64_t events)> on_write;
    // Runs once, when the call is over.
    std::function<void(const Stats&)> on_done;
  };

  // Starts reading at once.
  explicit SessionStream(StartFn start, Hooks hooks = {});

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

  struct Core;  // state shared with the sinks (session_stream.cc)

 private:
  ~SessionStream() override = default;

  const StartFn start_;
  const Hooks hooks_;
  std::shared_ptr<Core> core_;
  tandem::v1::SessionRequest request_;  // the read in flight
};

}  // namespace tandem::rpc

#endif  // TANDEM_RPC_SESSION_STREAM_H_
