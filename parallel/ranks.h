// How a worker runs the N ranks of a tensor-parallel group.
//
// Decision:
// - CPU (Gloo): the N ranks are N threads of one worker process, each with its
//   own GlooCommunicator over loopback TCP. The threads share the mmapped
//   checkpoint (each rank reads only its slices, nothing is copied), one
//   process is one unit to start, watch and restart, and the collectives still
//   go through the same Communicator interface a multi-process or multi-host
//   group uses (processes on one host: FileStore; the ranks then differ only in
//   how they rendezvous).
// - GPU (NCCL): one process per GPU in production (the norm: one CUDA context
//   per process, a crash takes one rank's process down, and the NCCL group
//   spans processes through the store); threads with one device each also work
//   with NcclCommunicator and are what a single-node test uses.
//
//   RunRanks(n, fn) → MemoryStore shared by n threads
//                   → thread r: GlooCommunicator::Create(rank r) → fn(comm)
//                   → joins all threads → one status per rank
#ifndef TANDEM_PARALLEL_RANKS_H_
#define TANDEM_PARALLEL_RANKS_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "parallel/communicator.h"

namespace tandem::parallel {

struct RunRanksOptions {
  // Bound on connecting and on each collective of every rank.
  absl::Duration timeout = absl::Seconds(30);
  std::string hostname = "127.0.0.1";
  std::string group = "tp";
};

using RankFn = std::function<absl::Status(Communicator&)>;

// Starts n threads; thread r connects rank r of an n-rank Gloo group over
// loopback and runs fn on it. Returns each rank's status (the connection error
// if it could not connect, else fn's), in rank order, once all have finished.
// The communicators are destroyed as each fn returns.
std::vector<absl::Status> RunRanksEach(int n, const RankFn& fn,
                                       const RunRanksOptions& options = {});

// As RunRanksEach; OK when every rank succeeded, else the lowest failing rank's
// error prefixed with "rank r: ".
absl::Status RunRanks(int n, const RankFn& fn, const RunRanksOptions& options = {});

}  // namespace tandem::parallel

#endif  // TANDEM_PARALLEL_RANKS_H_
