// SessionPool: the gateway's Generate calls multiplexed on a few long-lived
// Router.GenerateSession streams (proto/router.proto) instead of one gRPC call
// each. The router sends what a decode step makes for many requests as one
// message, so the gateway pays one gRPC receive (thread wake-up, HTTP/2 frame,
// parse) per batch instead of per token: the per-token cost that bounded the
// gateway at one call per request.
//
// Per request (SessionCall, a GenerateCall):
//   START   queued on a session (round robin over `sessions` streams; a dead
//           one is replaced on the next start)
//   EVENTS  on_response(message) for each of its messages, in order
//   DONE    on_done(status), exactly once and last: the router's end event;
//           or CANCELLED at once after Cancel(); or DEADLINE_EXCEEDED at the
//           request's deadline (checked here too, so a router that stops
//           answering cannot hold a request past it); or UNAVAILABLE when
//           its session breaks.
// Cancel() (any thread, also from inside on_response) sends the cancel to the
// router and completes the call with CANCELLED; later events are dropped, and
// an aborted call ends with its abort status whatever the router's end says.
// One call's callbacks never overlap. Callbacks run on gRPC threads (events,
// a lost session), on the pool's reaper thread (cancel, deadline), or, while
// the pool is being destroyed, on the thread that calls Generate.
// Each session holds its gRPC call (AddHold) until its read side fails, since
// writes (starts, cancels) begin on any thread, outside gRPC's reactions.
#ifndef TANDEM_GATEWAY_ROUTER_SESSION_H_
#define TANDEM_GATEWAY_ROUTER_SESSION_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <thread>

#include "absl/time/time.h"
#include "gateway/router_client.h"
#include "metrics/registry.h"
#include "proto/router.grpc.pb.h"
#include "rpc/channel_users.h"

namespace tandem::gateway {

class SessionCall;
class RouterSession;
struct SessionPoolCore;

class SessionPool {
 public:
  struct Stats {
    int64_t sessions_opened = 0;
    int64_t messages_received = 0;  // SessionResponse messages
    int64_t events_received = 0;    // events in them
  };

  // `stub` is not owned and must outlive the pool. `sessions` >= 1.
  // `registry` (may be null, else must outlive the pool) gets the counters
  // tandem_gateway_router_sessions_opened_total and
  // tandem_gateway_router_session_{messages,events}_total. Each session
  // counts as one of `users` while it lives (its ClientContext holds the
  // channel; rpc/channel_users.h).
  SessionPool(tandem::v1::Router::Stub* stub, int sessions,
              metrics::Registry* registry = nullptr, rpc::ChannelUsers users = {});
  // Cancels the sessions (calls still running end UNAVAILABLE, their
  // on_done runs before this returns, within 5 s) and stops the reaper. The
  // sessions are destroyed here, on this thread (their ClientContexts hold a
  // channel reference), unless a caller still holds one of their calls; the
  // channel's owner (RouterClient) waits for those through `users`.
  ~SessionPool();

  std::shared_ptr<GenerateCall> Generate(tandem::v1::GenerateRequest request,
                                         absl::Time deadline,
                                         RouterClient::StreamCallbacks callbacks);
  Stats stats() const;

 private:
  void ReaperLoop();

  tandem::v1::Router::Stub* const stub_;  // not owned
  const std::shared_ptr<SessionPoolCore> core_;
  std::thread reaper_;
};

}  // namespace tandem::gateway

#endif  // TANDEM_GATEWAY_ROUTER_SESSION_H_
