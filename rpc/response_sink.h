// ResponseSink: where a producer (the router's hand-off, a decode worker's
// engine loop) writes one request's GenerateResponse stream, whatever carries
// it: its own gRPC call (ResponseStream) or one stream id of a multiplexed
// Router.GenerateSession (SessionStream).
//
// Contract for producers: Push any number of messages, then Close exactly once
// (from any thread); Close releases the producer's reference, so the sink must
// not be touched afterwards. The cancel hook runs at most once, on any thread,
// when the consumer goes away; Pushes after that are dropped, and the producer
// still Closes.
#ifndef TANDEM_RPC_RESPONSE_SINK_H_
#define TANDEM_RPC_RESPONSE_SINK_H_

#include <grpcpp/grpcpp.h>

#include <functional>

#include "proto/router.pb.h"

namespace tandem::rpc {

class ResponseSink {
 public:
  // Called once on cancellation (must not block). Set at any time: a hook set
  // after the cancellation runs at once.
  virtual void SetOnCancel(std::function<void()> on_cancel) = 0;
  // Queues a message; messages queued behind a write in flight may be merged
  // (CoalesceResponse), which a client cannot tell from separate messages.
  virtual void Push(tandem::v1::GenerateResponse message) = 0;
  // Ends the stream with `status` after the queued messages.
  virtual void Close(const grpc::Status& status) = 0;
  virtual bool cancelled() const = 0;

 protected:
  ~ResponseSink() = default;  // owned by the transport, never deleted through this
};

}  // namespace tandem::rpc

#endif  // TANDEM_RPC_RESPONSE_SINK_H_
