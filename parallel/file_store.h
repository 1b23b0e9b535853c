// Rendezvous store in a directory: for ranks that are processes on one host (or
// on hosts sharing a file system). Each key is one file; Set writes a temporary
// file and renames it into place, so a reader sees the whole value or nothing.
// Get polls (1 ms doubling to 20 ms) until the file exists or the timeout.
//
// The directory must be fresh per group run, or the group must use a fresh key
// prefix: a value left by an earlier run would be read as current.
#ifndef TANDEM_PARALLEL_FILE_STORE_H_
#define TANDEM_PARALLEL_FILE_STORE_H_

#include <string>

#include "parallel/store.h"

namespace tandem::parallel {

class FileStore : public Store {
 public:
  // `dir` is created (with parents) on first Set if absent.
  explicit FileStore(std::string dir);

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key,
                                  absl::Duration timeout) override;

  // The file holding `key`: bytes outside [A-Za-z0-9._-] are written %XX.
  std::string PathOf(absl::string_view key) const;

 private:
  std::string dir_;
};

}  // namespace tandem::parallel

#endif  // TANDEM_PARALLEL_FILE_STORE_H_
