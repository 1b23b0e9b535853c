// ChannelUsers: counts the objects that hold a grpc::Channel through a
// ClientContext (a callback reactor, a unary call's state), so that whoever
// owns the channel can wait for them to go before it drops its own reference,
// on its own thread.
//
// Why: with the gRPC this project builds on (Debian 12's 1.51), callback calls
// run on a process-wide "callback alternative" completion queue whose
// "nexting" threads run the reactions. Every grpc::Channel and grpc::Server
// holds a reference to that queue; the destructor that drops the last one
// shuts the queue down, joins its threads and frees it. A ClientContext keeps
// its channel alive, and reactors are often destroyed inside their own last
// reaction (OnDone), so when the channel's owner has already let go, the last
// reference to the channel -- and with the server gone, to the queue -- is
// dropped on a nexting thread: it joins itself, frees the queue, and its loop
// then reads the freed queue (ref_counted.h "assertion failed: prior > 0" in
// grpc_cq_internal_unref, or a crash). A gateway or router shutting down hit
// this about one run in forty of the gateway's tests.
//
// Use: make a Use (Enter) the FIRST member of each object that owns a
// ClientContext, so it is destroyed after the context (or hold the context in
// an object that keeps such an owner alive until the context is gone); the
// channel's owner calls CancelAll (for the calls that Track their context),
// then ReleaseChannel (or WaitIdle) before it drops the channel.
#ifndef TANDEM_RPC_CHANNEL_USERS_H_
#define TANDEM_RPC_CHANNEL_USERS_H_

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace tandem::rpc {

class ChannelUsers {
 public:
  struct State;

  // One user: counted from Enter until destroyed (movable; a default one
  // counts nothing).
  class Use {
   public:
    Use() = default;
    Use(Use&& other) noexcept = default;
    Use& operator=(Use&& other) noexcept;
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;
    ~Use();

    // CancelAll cancels `context` (TryCancel) until Untrack. Call Untrack
    // before the context goes (the Use outlives it): first thing in the call's
    // last reaction (OnDone, a unary call's callback).
    void Track(grpc::ClientContext* context);
    void Untrack();

   private:
    friend class ChannelUsers;
    Use(std::shared_ptr<State> state, uint64_t id)
        : state_(std::move(state)), id_(id) {}
    void Leave();
    std::shared_ptr<State> state_;
    uint64_t id_ = 0;
  };

  // Copies share the count.
  ChannelUsers();

  Use Enter() const;
  int64_t count() const;
  // TryCancel on every tracked context (Use::Track): the owner's shutdown ends
  // the calls still running instead of waiting out their deadlines.
  void CancelAll() const;
  // Waits until no Use is alive; false if `timeout` passed first.
  bool WaitIdle(absl::Duration timeout) const;
  // Drops `channel` here once no Use is alive. If `timeout` passes first, the
  // reference is kept for the rest of the process instead (logged, naming
  // `owner`), so that it can never be the last one dropped on a gRPC thread.
  void ReleaseChannel(std::shared_ptr<grpc::Channel> channel, absl::Duration timeout,
                      const std::string& owner) const;
  // The same for several channels.
  void ReleaseChannels(std::vector<std::shared_ptr<grpc::Channel>> channels,
                       absl::Duration timeout, const std::string& owner) const;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace tandem::rpc

#endif  // TANDEM_RPC_CHANNEL_USERS_H_
