// Communicator over Gloo's TCP transport (CPU ranks: threads or processes).
//
//   Create(options) → tcp device on options.hostname / options.interface
//                   → gloo rendezvous through options.store (keys under
//                     options.group): full mesh of TCP pairs, one per peer
//                   → AllReduceSum/AllGather/Broadcast/Barrier map onto gloo's
//                     allreduce (ring) / allgather (ring) / broadcast / barrier,
//                     each with the communicator's timeout and its own tag.
//
// Gloo reports errors by throwing; every call here catches them and returns a
// Status (DEADLINE_EXCEEDED for gloo's timeouts, UNAVAILABLE for closed or
// failed connections), and marks the communicator broken.
//
// Process-wide effect: the first Create() sets SIGPIPE to ignored when it is
// still at its default disposition (gloo writes with writev, and a write to a
// peer that has left would otherwise kill the process).
#ifndef TANDEM_PARALLEL_GLOO_COMMUNICATOR_H_
#define TANDEM_PARALLEL_GLOO_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "parallel/communicator.h"
#include "parallel/store.h"

namespace gloo {
class Context;
}  // namespace gloo

namespace tandem::parallel {

struct GlooOptions {
  int rank = 0;
  int size = 1;
  Store* store = nullptr;  // not owned; must outlive Create()
  // Keeps this group's rendezvous keys apart from other groups in the store.
  std::string group = "tp";
  // Where this rank listens: an address or host name to bind, or, when
  // `interface` is set, that network interface (e.g. "eth0"). Loopback by
  // default: ranks on one host.
  std::string hostname = "127.0.0.1";
  std::string interface;
  // Bound on rendezvous (all of Create) and on each collective.
  absl::Duration timeout = absl::Seconds(30);
};

class GlooCommunicator : public Communicator {
 public:
  // Connects to every peer; DEADLINE_EXCEEDED when a peer does not join within
  // the timeout, INVALID_ARGUMENT for a bad rank/size/store.
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Create(
      const GlooOptions& options);
  ~GlooCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Duration timeout() const override { return timeout_; }

  absl::Status AllReduceSum(float* data, size_t n) override;
  absl::Status AllReduceSumBf16(uint16_t* data, size_t n) override;
  absl::Status AllGather(const float* in, size_t n_per_rank, float* out) override;
  absl::Status Broadcast(void* data, size_t bytes, int root) override;
  absl::Status Barrier() override;

 private:
  GlooCommunicator(int rank, int size, absl::Duration timeout,
                   std::shared_ptr<gloo::Context> context);

  // Runs one gloo operation: refuses when broken, converts exceptions into a
  // status naming `what`, breaks the communicator on failure.
  template <typename Fn>
  absl::Status Run(const char* what, Fn&& fn);
  uint32_t NextTag() { return next_tag_++; }

  const int rank_;
  const int size_;
  const absl::Duration timeout_;
  std::shared_ptr<gloo::Context> context_;
  uint32_t next_tag_ = 0;
  absl::Status broken_;  // the first failure, OK while usable
};

}  // namespace tandem::parallel

#endif  // TANDEM_PARALLEL_GLOO_COMMUNICATOR_H_
