// Child processes for end-to-end tests: spawn a binary with arguments, send it
// signals, wait for it with a deadline. The child's stderr goes to a file that the
// test can read (and print on failure).
#ifndef TANDEM_TESTS_TESTING_SUBPROCESS_H_
#define TANDEM_TESTS_TESTING_SUBPROCESS_H_

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tandem::testing {

class Subprocess {
 public:
  // Starts `argv[0]` with `argv`; stderr (and stdout) go to `log_path`.
  static absl::StatusOr<Subprocess> Start(const std::vector<std::string>& argv,
                                          const std::string& log_path);
  Subprocess(Subprocess&& other) noexcept;
  Subprocess& operator=(Subprocess&&) = delete;
  ~Subprocess();  // SIGKILLs and reaps a child still running

  pid_t pid() const { return pid_; }
  void Signal(int sig) const;
  // The exit status (as from waitpid: use WIFEXITED/WEXITSTATUS) once the child has
  // ended, or DeadlineExceeded at `timeout`.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  std::string ReadLog() const;

 private:
  Subprocess(pid_t pid, std::string log_path)
      : pid_(pid), log_path_(std::move(log_path)) {}
  pid_t pid_;
  std::string log_path_;
  std::optional<int> status_;
};

// Path of a binary in this test's runfiles, e.g. RunfilePath("router/router_main").
std::string RunfilePath(const std::string& workspace_relative);

}  // namespace tandem::testing

#endif  // TANDEM_TESTS_TESTING_SUBPROCESS_H_
