#include "kvtransfer/peer_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "absl/time/clock.h"

namespace tandem::kvtransfer {

std::unique_ptr<PeerProcess> PeerProcess::Spawn(const std::string& binary,
                                                const std::vector<std::string>& args) {
  // argv before the fork: the child only dup2s and execs.
  std::vector<char*> argv = {const_cast<char*>(binary.c_str())};
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0) return nullptr;
  if (pipe2(out, O_CLOEXEC) != 0) {
    close(in[0]);
    close(in[1]);
    return nullptr;
  }
  const pid_t pid = fork();
  if (pid < 0) {
    for (int fd : {in[0], in[1], out[0], out[1]}) close(fd);
    return nullptr;
  }
  if (pid == 0) {
    dup2(in[0], 0);
    dup2(out[1], 1);
    execv(binary.c_str(), argv.data());
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  std::unique_ptr<PeerProcess> p(new PeerProcess());
  p->pid_ = pid;
  p->to_child_ = in[1];
  p->from_child_ = out[0];
  return p;
}

PeerProcess::~PeerProcess() {
  close(to_child_);
  close(from_child_);
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

std::string PeerProcess::Call(const std::string& cmd, absl::Duration timeout) {
  const std::string line = cmd + "\n";
  // SIGPIPE is not wanted when the child has died: ignore it for this write.
  signal(SIGPIPE, SIG_IGN);
  if (write(to_child_, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
    return "ERR child closed its output";
  }
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    const size_t nl = buf_.find('\n');
    if (nl != std::string::npos) {
      std::string reply = buf_.substr(0, nl);
      buf_.erase(0, nl + 1);
      return reply;
    }
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) return "ERR child reply timed out";
    pollfd pfd{from_child_, POLLIN, 0};
    if (poll(&pfd, 1, static_cast<int>(ms)) <= 0) continue;
    char chunk[65536];
    const ssize_t n = read(from_child_, chunk, sizeof(chunk));
    if (n <= 0) return "ERR child closed its output";
    buf_.append(chunk, n);
  }
}

void PeerProcess::Signal(int sig) {
  if (pid_ > 0) kill(pid_, sig);
}

void PeerProcess::Reap() {
  if (pid_ > 0) waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

}  // namespace tandem::kvtransfer
