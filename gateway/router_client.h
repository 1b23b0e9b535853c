// The gateway's client of the router (proto/router.proto) on gRPC's callback
// API: a streaming Generate costs no thread while it waits, every call has a
// deadline, and a Generate can be cancelled from any thread (the client went
// away, a stop string matched) so that the router and its workers free the
// request.
//
// With Options::sessions > 0 the calls are multiplexed on GenerateSession
// streams instead (router_session.h), with the same callbacks and guarantees.
//
// Lifecycle of one Generate (GenerateCall, a ClientReadReactor):
//   START  StartRead + StartCall
//   READ   OnReadDone(ok) → on_response(message) → StartRead   (repeats)
//   DONE   OnDone(status) → on_done(status)      (always, exactly once, last)
// Cancel() at any point → TryCancel → OnDone(CANCELLED) unless already done.
// Callbacks run on gRPC threads; one call's callbacks never overlap.
#ifndef TANDEM_GATEWAY_ROUTER_CLIENT_H_
#define TANDEM_GATEWAY_ROUTER_CLIENT_H_

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "metrics/registry.h"
#include "proto/health.grpc.pb.h"
#include "proto/router.grpc.pb.h"
#include "rpc/channel_users.h"

namespace tandem::gateway {

class GenerateCall {
 public:
  virtual ~GenerateCall() = default;
  // Cancels the call (idempotent; a no-op once it is done).
  virtual void Cancel() = 0;
};

class SessionPool;

class RouterClient {
 public:
  struct StreamCallbacks {
    std::function<void(const tandem::v1::GenerateResponse&)> on_response;
    std::function<void(const grpc::Status&)> on_done;
  };

  struct Options {
    // Generate calls go over this many multiplexed Router.GenerateSession
    // streams (router_session.h); 0: one Router.Generate call each.
    int sessions = 0;
    // Where the sessions' counters go (tandem_gateway_router_session_*); may
    // be null.
    metrics::Registry* registry = nullptr;
  };

  explicit RouterClient(std::shared_ptr<grpc::Channel> channel);
  RouterClient(std::shared_ptr<grpc::Channel> channel, Options options);
  // Closes the sessions, cancels the calls still running (their callbacks
  // run, CANCELLED), then waits (up to kCallsEndWithin) until no call object
  // holds the channel any more, so that its last reference is dropped here
  // and not on a gRPC thread (rpc/channel_users.h). A GenerateCall handle kept
  // past this wait keeps the channel for the process's life (logged).
  ~RouterClient();

  static constexpr absl::Duration kCallsEndWithin = absl::Seconds(10);

  // Starts a Generate stream with `deadline`.
  std::shared_ptr<GenerateCall> Generate(tandem::v1::GenerateRequest request,
                                         absl::Time deadline,
                                         StreamCallbacks callbacks);
  // Asynchronous ListModels; `done` runs on a gRPC thread.
  void ListModels(
      absl::Time deadline,
      std::function<void(absl::StatusOr<tandem::v1::ListModelsResponse>)> done);
  // Asynchronous ResetPrefixCache (every worker's cache); `done` runs on a
  // gRPC thread.
  void ResetPrefixCache(
      absl::Time deadline,
      std::function<void(absl::StatusOr<tandem::v1::ResetPrefixCacheResponse>)> done);
  // grpc.health.v1 Check of the router as a whole; `done` gets the serving
  // status or the RPC error.
  void CheckHealth(
      absl::Time deadline,
      std::function<
          void(absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus>)>
          done);

 private:
  // The objects that hold the channel through a ClientContext: every call's.
  const rpc::ChannelUsers users_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<tandem::v1::Router::Stub> router_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
  std::unique_ptr<SessionPool> sessions_;  // when Options::sessions > 0
};

}  // namespace tandem::gateway

#endif  // TANDEM_GATEWAY_ROUTER_CLIENT_H_
