// PeerProcess: a child (fork + exec) driven over two pipes, one command line in,
// one reply line out: transfer_peer (its protocol in transfer_peer.cc) for the
// multi-process tests and the kvtransfer benchmark, kv_device_bench's receiver. Every
// read has a deadline; the destructor SIGKILLs and reaps.
#ifndef TANDEM_KVTRANSFER_PEER_PROCESS_H_
#define TANDEM_KVTRANSFER_PEER_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"

namespace tandem::kvtransfer {

class PeerProcess {
 public:
  // Starts `binary` with `args`; nullptr when pipes or fork fail.
  static std::unique_ptr<PeerProcess> Spawn(const std::string& binary,
                                            const std::vector<std::string>& args = {});
  ~PeerProcess();
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;

  // Sends one command line and returns one reply line, or "ERR ..." when the
  // child does not answer within `timeout` or has exited.
  std::string Call(const std::string& cmd, absl::Duration timeout = absl::Seconds(20));
  void Signal(int sig);
  // The child's process id (-1 once reaped).
  pid_t pid() const { return pid_; }
  // Waits for the child to exit (after a fatal signal).
  void Reap();

 private:
  PeerProcess() = default;
  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  std::string buf_;
};

}  // namespace tandem::kvtransfer

#endif  // TANDEM_KVTRANSFER_PEER_PROCESS_H_
