// In-process rendezvous store for ranks that are threads of one process.
#ifndef TANDEM_PARALLEL_MEMORY_STORE_H_
#define TANDEM_PARALLEL_MEMORY_STORE_H_

#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "parallel/store.h"

namespace tandem::parallel {

class MemoryStore : public Store {
 public:
  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key,
                                  absl::Duration timeout) override;

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tandem::parallel

#endif  // TANDEM_PARALLEL_MEMORY_STORE_H_
