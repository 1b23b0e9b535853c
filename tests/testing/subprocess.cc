#include "tests/testing/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/time/clock.h"
#include "common/status.h"

namespace tandem::testing {

absl::StatusOr<Subprocess> Subprocess::Start(const std::vector<std::string>& argv,
                                             const std::string& log_path) {
  if (argv.empty()) return InvalidArgument("empty argv");
  int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Internal("open ", log_path, ": ", strerror(errno));
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = fork();
  if (pid < 0) {
    close(fd);
    return Internal("fork: ", strerror(errno));
  }
  if (pid == 0) {
    // Child: unblock signals the test may have blocked, route output, exec.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    dup2(fd, 1);
    dup2(fd, 2);
    execv(args[0], args.data());
    _exit(127);
  }
  close(fd);
  return Subprocess(pid, log_path);
}

Subprocess::Subprocess(Subprocess&& other) noexcept
    : pid_(other.pid_), log_path_(std::move(other.log_path_)), status_(other.status_) {
  other.pid_ = -1;
}

Subprocess::~Subprocess() {
  if (pid_ > 0 && !status_.has_value()) {
    kill(pid_, SIGKILL);
    int st;
    waitpid(pid_, &st, 0);
  }
}

void Subprocess::Signal(int sig) const {
  if (pid_ > 0 && !status_.has_value()) kill(pid_, sig);
}

absl::StatusOr<int> Subprocess::Wait(absl::Duration timeout) {
  if (status_.has_value()) return *status_;
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    int st = 0;
    pid_t r = waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      status_ = st;
      return st;
    }
    if (r < 0) return Internal("waitpid: ", strerror(errno));
    if (absl::Now() >= deadline) {
      return DeadlineExceeded("process ", pid_, " still running after ",
                              absl::FormatDuration(timeout));
    }
    absl::SleepFor(
        absl::Milliseconds(10));  // polling a child's exit; no event to wait on
  }
}

std::string Subprocess::ReadLog() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string RunfilePath(const std::string& workspace_relative) {
  const char* dir = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  if (dir == nullptr) return workspace_relative;
  return std::string(dir) + "/" + (ws ? ws : "tandem") + "/" + workspace_relative;
}

}  // namespace tandem::testing
