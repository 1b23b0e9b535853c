// Rendezvous store: how the ranks of a group find each other before they can
// talk. A key is written once (Set) and read by every rank (Get waits for it).
//
// Implementations: MemoryStore (ranks that are threads of one process) and
// FileStore (ranks that are processes sharing a directory: one host, or a
// shared file system). Gloo exchanges its TCP addresses through it; NCCL its
// unique id. Keys of different groups are kept apart by a prefix (PrefixKey).
#ifndef TANDEM_PARALLEL_STORE_H_
#define TANDEM_PARALLEL_STORE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace tandem::parallel {

class Store {
 public:
  virtual ~Store() = default;

  // Publishes `value` under `key` (overwrites). Thread-safe.
  virtual absl::Status Set(absl::string_view key, absl::string_view value) = 0;
  // The value of `key`, waiting until it is set; DEADLINE_EXCEEDED (naming the
  // key) when it is still absent after `timeout`. Thread-safe.
  virtual absl::StatusOr<std::string> Get(absl::string_view key,
                                          absl::Duration timeout) = 0;
};

// "<prefix>/<key>": the name under which a group stores `key`.
inline std::string PrefixKey(absl::string_view prefix, absl::string_view key) {
  return absl::StrCat(prefix, "/", key);
}

}  // namespace tandem::parallel

#endif  // TANDEM_PARALLEL_STORE_H_
