#include "parallel/ranks.h"

#include <memory>
#include <thread>

#include "common/status.h"
#include "parallel/gloo_communicator.h"
#include "parallel/memory_store.h"

namespace tandem::parallel {

std::vector<absl::Status> RunRanksEach(int n, const RankFn& fn,
                                       const RunRanksOptions& options) {
  if (n < 1) {
    return {InvalidArgument("RunRanks needs at least one rank, got ", n)};
  }
  MemoryStore store;
  std::vector<absl::Status> statuses(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      GlooOptions gloo;
      gloo.rank = r;
      gloo.size = n;
      gloo.store = &store;
      gloo.group = options.group;
      gloo.hostname = options.hostname;
      gloo.timeout = options.timeout;
      absl::StatusOr<std::unique_ptr<GlooCommunicator>> comm =
          GlooCommunicator::Create(gloo);
      if (!comm.ok()) {
        statuses[r] = comm.status();
        return;
      }
      statuses[r] = fn(**comm);
    });
  }
  for (std::thread& t : threads) t.join();
  return statuses;
}

absl::Status RunRanks(int n, const RankFn& fn, const RunRanksOptions& options) {
  std::vector<absl::Status> statuses = RunRanksEach(n, fn, options);
  for (size_t r = 0; r < statuses.size(); ++r) {
    if (!statuses[r].ok()) {
      return Annotate(statuses[r], absl::StrCat("rank ", r));
    }
  }
  return absl::OkStatus();
}

}  // namespace tandem::parallel
