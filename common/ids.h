// Request and worker ids: 128 random bits as 32 lowercase hex characters, the
// shape of an OpenAI completion id's suffix. An IdGenerator takes a seed so tests
// get the same ids every run; production seeds from the OS.
#ifndef TANDEM_COMMON_IDS_H_
#define TANDEM_COMMON_IDS_H_

#include <cstdint>
#include <optional>
#include <random>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace tandem {

class IdGenerator {
 public:
  // With no seed, seeds from std::random_device (the OS entropy source).
  explicit IdGenerator(std::optional<uint64_t> seed = std::nullopt);

  // `prefix` + 32 hex characters, e.g. Next("req-") == "req-3f9a...". Thread-safe.
  std::string Next(absl::string_view prefix = "");

 private:
  absl::Mutex mu_;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
};

// True when `id` is non-empty, at most 128 bytes, and only [A-Za-z0-9._:-]:
// ids from clients go into logs and metric labels, so they are checked.
bool IsValidId(absl::string_view id);

}  // namespace tandem

#endif  // TANDEM_COMMON_IDS_H_
