#include "worker/prefix_cache_reset.h"

#include <memory>

namespace tandem::worker {
namespace {

// Finishes the reactor exactly once: OK after the reset ran, UNAVAILABLE when
// the command is destroyed without running (the loop stopped).
class ResetFinisher {
 public:
  explicit ResetFinisher(grpc::ServerUnaryReactor* reactor) : reactor_(reactor) {}
  ResetFinisher(const ResetFinisher&) = delete;
  ResetFinisher& operator=(const ResetFinisher&) = delete;
  ~ResetFinisher() {
    if (!done_) {
      reactor_->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                    "the worker is stopping; its prefix cache was not "
                                    "reset"));
    }
  }
  void Done() {
    done_ = true;
    reactor_->Finish(grpc::Status::OK);
  }

 private:
  grpc::ServerUnaryReactor* const reactor_;
  bool done_ = false;
};

}  // namespace

grpc::ServerUnaryReactor* ResetPrefixCacheOnLoop(grpc::CallbackServerContext* context,
                                                 EngineLoop* loop) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto finisher = std::make_shared<ResetFinisher>(reactor);
  loop->Post([finisher](engine::Engine& engine) {
    engine.ResetPrefixCache();
    finisher->Done();
  });
  return reactor;
}

}  // namespace tandem::worker
