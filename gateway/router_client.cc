#include "gateway/router_client.h"

#include <utility>

#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "gateway/router_session.h"
#include "rpc/channel_users.h"
#include "rpc/deadline.h"

namespace tandem::gateway {
namespace {

// Owns itself from StartCall until OnDone (self_), and is shared with the
// caller's handle so that Cancel() is safe at any time: the ClientContext
// outlives the call.
class GenerateReactor final
    : public grpc::ClientReadReactor<tandem::v1::GenerateResponse>,
      public GenerateCall,
      public std::enable_shared_from_this<GenerateReactor> {
 public:
  GenerateReactor(rpc::ChannelUsers::Use use, tandem::v1::GenerateRequest request,
                  absl::Time deadline, RouterClient::StreamCallbacks callbacks)
      : use_(std::move(use)),
        request_(std::move(request)),
        callbacks_(std::move(callbacks)) {
    context_.set_deadline(rpc::ToGrpcDeadline(deadline));
  }

  void Start(tandem::v1::Router::Stub* stub) {
    self_ = shared_from_this();
    use_.Track(&context_);  // the client's destructor cancels it
    stub->async()->Generate(&context_, &request_, this);
    StartRead(&response_);
    StartCall();
  }

  // TryCancel is only valid before OnDone (gRPC has released the call by
  // then); a caller may cancel from inside on_done (a choice that ends others).
  void Cancel() override {
    absl::MutexLock l(&done_mu_);
    if (!done_) context_.TryCancel();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended; OnDone follows
    callbacks_.on_response(response_);
    response_.Clear();
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override {
    use_.Untrack();
    {
      absl::MutexLock l(&done_mu_);
      done_ = true;
    }
    callbacks_.on_done(status);
    callbacks_ = {};
    std::shared_ptr<GenerateReactor> keep = std::move(self_);
  }

 private:
  // First: destroyed after context_ (its channel reference); see
  // rpc/channel_users.h.
  rpc::ChannelUsers::Use use_;
  grpc::ClientContext context_;
  tandem::v1::GenerateRequest request_;
  tandem::v1::GenerateResponse response_;
  RouterClient::StreamCallbacks callbacks_;
  std::shared_ptr<GenerateReactor> self_;
  absl::Mutex done_mu_;
  bool done_ ABSL_GUARDED_BY(done_mu_) = false;
};

}  // namespace

RouterClient::RouterClient(std::shared_ptr<grpc::Channel> channel, Options options)
    : channel_(std::move(channel)),
      router_(tandem::v1::Router::NewStub(channel_)),
      health_(grpc::health::v1::Health::NewStub(channel_)) {
  if (options.sessions > 0) {
    sessions_ = std::make_unique<SessionPool>(router_.get(), options.sessions,
                                              options.registry, users_);
  }
}

RouterClient::RouterClient(std::shared_ptr<grpc::Channel> channel)
    : RouterClient(std::move(channel), Options{}) {}

RouterClient::~RouterClient() {
  sessions_.reset();
  // Calls still running (an admin RPC, a Generate whose handle is kept) end
  // now, CANCELLED, instead of at their deadlines.
  users_.CancelAll();
  // The stubs hold the channel too but are destroyed here, on this thread.
  users_.ReleaseChannel(std::move(channel_), kCallsEndWithin, "gateway router client");
}

std::shared_ptr<GenerateCall> RouterClient::Generate(
    tandem::v1::GenerateRequest request, absl::Time deadline,
    StreamCallbacks callbacks) {
  if (sessions_ != nullptr) {
    return sessions_->Generate(std::move(request), deadline, std::move(callbacks));
  }
  auto call = std::make_shared<GenerateReactor>(users_.Enter(), std::move(request),
                                                deadline, std::move(callbacks));
  call->Start(router_.get());
  return call;
}

void RouterClient::ResetPrefixCache(
    absl::Time deadline,
    std::function<void(absl::StatusOr<tandem::v1::ResetPrefixCacheResponse>)> done) {
  struct State {
    rpc::ChannelUsers::Use use;  // first: outlives the context
    grpc::ClientContext context;
    tandem::v1::ResetPrefixCacheRequest request;
    tandem::v1::ResetPrefixCacheResponse response;
  };
  auto* state = new State{.use = users_.Enter()};
  state->use.Track(&state->context);
  state->context.set_deadline(rpc::ToGrpcDeadline(deadline));
  router_->async()->ResetPrefixCache(
      &state->context, &state->request, &state->response,
      [state, done = std::move(done)](grpc::Status status) {
        std::unique_ptr<State> owned(state);
        owned->use.Untrack();
        if (status.ok()) {
          done(std::move(owned->response));
        } else {
          done(FromGrpcStatus(status));
        }
      });
}

void RouterClient::ListModels(
    absl::Time deadline,
    std::function<void(absl::StatusOr<tandem::v1::ListModelsResponse>)> done) {
  struct State {
    rpc::ChannelUsers::Use use;  // first: outlives the context
    grpc::ClientContext context;
    tandem::v1::ListModelsRequest request;
    tandem::v1::ListModelsResponse response;
  };
  auto* state = new State{.use = users_.Enter()};
  state->use.Track(&state->context);
  state->context.set_deadline(rpc::ToGrpcDeadline(deadline));
  router_->async()->ListModels(&state->context, &state->request, &state->response,
                               [state, done = std::move(done)](grpc::Status status) {
                                 std::unique_ptr<State> owned(state);
                                 owned->use.Untrack();
                                 if (status.ok()) {
                                   done(std::move(owned->response));
                                 } else {
                                   done(FromGrpcStatus(status));
                                 }
                               });
}

void RouterClient::CheckHealth(
    absl::Time deadline,
    std::function<
        void(absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus>)>
        done) {
  struct State {
    rpc::ChannelUsers::Use use;  // first: outlives the context
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
  };
  auto* state = new State{.use = users_.Enter()};
  state->use.Track(&state->context);
  state->context.set_deadline(rpc::ToGrpcDeadline(deadline));
  health_->async()->Check(&state->context, &state->request, &state->response,
                          [state, done = std::move(done)](grpc::Status status) {
                            std::unique_ptr<State> owned(state);
                            owned->use.Untrack();
                            if (status.ok()) {
                              done(owned->response.status());
                            } else {
                              done(FromGrpcStatus(status));
                            }
                          });
}

}  // namespace tandem::gateway
