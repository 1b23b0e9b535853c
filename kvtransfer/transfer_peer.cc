// transfer_peer: a UcxAgent (or LibfabricAgent) in its own process, driven line by line
// over stdin/stdout, for multi-process tests and the benchmark. Binary values travel as
// hex. Commands, then their replies (one line each):
//   INIT <tls|-> [noerr]        -> OK   (noerr: no peer-failure detection)
//   INIT libfabric <provider> <rails> [<progress_timeout_ms>]
//                               -> OK   (a LibfabricAgent instead of UCX)
//   LAYOUT <KvLayout hex> <num_blocks> <num_slots> [huge]
//                               -> OK <region_id> <bytes>
//                                  (huge: madvise(MADV_HUGEPAGE) before touching;
//                                  ucx: allocated by UcxAgent::AllocateMemory)
//   DESC                        -> DESC <descriptor hex>
//   WAITNOTE <timeout_ms>       -> NOTE <request_id hex> <payload hex> | ERR ...
//   CHECKSUM <RankTarget hex> <tokens> <num_blocks> <num_slots>
//                               -> SUM <StateChecksums hex> | ERR ...
//   QUIT                           (exits 0)
// The region is the standard contiguous placement (plan.h ContiguousRankLayout),
// zero-filled. Errors reply "ERR <message>"; the process never exits on bad input.
#include <sys/mman.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kvtransfer/checksum.h"
#include "kvtransfer/libfabric_agent.h"
#include "kvtransfer/plan.h"
#include "kvtransfer/ucx_agent.h"

namespace tandem::kvtransfer {
namespace {

class Peer {
 public:
  std::string Handle(const std::string& line) {
    std::vector<std::string> w = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (w.empty()) return "ERR empty command";
    const std::string& cmd = w[0];
    if (cmd == "INIT" && w.size() >= 4 && w.size() <= 5 && w[1] == "libfabric") {
      LibfabricAgentConfig config;
      config.provider = w[2];
      int64_t timeout_ms = 0;
      if (!absl::SimpleAtoi(w[3], &config.rails) ||
          (w.size() == 5 && !absl::SimpleAtoi(w[4], &timeout_ms))) {
        return "ERR bad INIT libfabric arguments";
      }
      if (timeout_ms > 0) config.progress_timeout = absl::Milliseconds(timeout_ms);
      auto agent = LibfabricAgent::Create(config);
      if (!agent.ok()) return absl::StrCat("ERR ", agent.status().ToString());
      agent_ = std::move(*agent);
      agent_->SetNotificationCallback([this](const Notification& n) {
        absl::MutexLock l(&mu_);
        pending_.push_back(n);
      });
      return "OK";
    }
    if (cmd == "INIT" && (w.size() == 2 || (w.size() == 3 && w[2] == "noerr"))) {
      UcxAgentConfig config;
      if (w[1] != "-") config.tls = w[1];
      config.peer_failure_detection = w.size() == 2;
      auto agent = UcxAgent::Create(config);
      if (!agent.ok()) return absl::StrCat("ERR ", agent.status().ToString());
      agent_ = std::move(*agent);
      agent_->SetNotificationCallback([this](const Notification& n) {
        absl::MutexLock l(&mu_);
        pending_.push_back(n);
      });
      return "OK";
    }
    if (agent_ == nullptr) return "ERR not initialised";
    if (cmd == "LAYOUT" &&
        (w.size() == 4 || (w.size() == 5 && (w[4] == "huge" || w[4] == "ucx")))) {
      tandem::v1::KvLayout layout;
      int64_t blocks = 0, slots = 0;
      if (!layout.ParseFromString(absl::HexStringToBytes(w[1])) ||
          !absl::SimpleAtoi(w[2], &blocks) || !absl::SimpleAtoi(w[3], &slots) ||
          blocks < 0 || slots < 0) {
        return "ERR bad LAYOUT arguments";
      }
      const uint64_t bytes = ContiguousRegionBytes(layout, blocks, slots);
      if (bytes == 0 || bytes > (64ull << 30)) return "ERR region size out of range";
      if (w.size() == 5 && w[4] == "ucx") {
        auto a = agent_->AllocateMemory(bytes);
        if (!a.ok()) return absl::StrCat("ERR ", a.status().ToString());
        std::memset(a->base, 0, bytes);
        mem_ = static_cast<uint8_t*>(a->base);
        bytes_ = bytes;
        region_ = a->region;
        return absl::StrCat("OK ", region_, " ", bytes);
      }
      void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (mem == MAP_FAILED) return "ERR mmap failed";
      // Transparent huge pages where the kernel allows them (fewer pages for
      // process_vm_writev to pin and walk); advisory, so failure is ignored.
      if (w.size() == 5) (void)madvise(mem, bytes, MADV_HUGEPAGE);
      // Touch every page now so transfers do not pay the first-touch faults.
      std::memset(mem, 0, bytes);
      auto region = agent_->RegisterMemory(mem, bytes);
      if (!region.ok()) return absl::StrCat("ERR ", region.status().ToString());
      mem_ = static_cast<uint8_t*>(mem);
      bytes_ = bytes;
      region_ = *region;
      return absl::StrCat("OK ", region_, " ", bytes);
    }
    if (cmd == "DESC") {
      auto d = agent_->LocalDescriptor();
      if (!d.ok()) return absl::StrCat("ERR ", d.status().ToString());
      return absl::StrCat("DESC ", absl::BytesToHexString(*d));
    }
    if (cmd == "WAITNOTE" && w.size() == 2) {
      int64_t ms = 0;
      if (!absl::SimpleAtoi(w[1], &ms)) return "ERR bad timeout";
      absl::MutexLock l(&mu_);
      auto non_empty = [this]()
                           ABSL_NO_THREAD_SAFETY_ANALYSIS { return !pending_.empty(); };
      if (!mu_.AwaitWithTimeout(absl::Condition(&non_empty), absl::Milliseconds(ms))) {
        return "ERR no notification before the deadline";
      }
      Notification n = std::move(pending_.front());
      pending_.erase(pending_.begin());
      return absl::StrCat("NOTE ", absl::BytesToHexString(n.request_id), " ",
                          absl::BytesToHexString(n.payload), " ");
    }
    if (cmd == "CHECKSUM" && w.size() == 5) {
      tandem::v1::RankTarget target;
      int64_t tokens = 0, blocks = 0, slots = 0;
      if (!target.ParseFromString(absl::HexStringToBytes(w[1])) ||
          !absl::SimpleAtoi(w[2], &tokens) || !absl::SimpleAtoi(w[3], &blocks) ||
          !absl::SimpleAtoi(w[4], &slots)) {
        return "ERR bad CHECKSUM arguments";
      }
      if (mem_ == nullptr) return "ERR no LAYOUT yet";
      RankLayout side = ContiguousRankLayout(target.layout(), blocks, slots, region_);
      side.block_ids.assign(target.block_ids().begin(), target.block_ids().end());
      side.state_slot = target.state_slot();
      auto sums = ComputeChecksums(side, tokens, [this](RegionId r) {
        return r == region_ ? absl::Span<const uint8_t>(mem_, bytes_)
                            : absl::Span<const uint8_t>();
      });
      if (!sums.ok()) return absl::StrCat("ERR ", sums.status().ToString());
      return absl::StrCat("SUM ", absl::BytesToHexString(sums->SerializeAsString()));
    }
    return absl::StrCat("ERR unknown command: ", line.substr(0, 40));
  }

 private:
  std::unique_ptr<TransferAgent> agent_;
  uint8_t* mem_ = nullptr;
  uint64_t bytes_ = 0;
  RegionId region_ = 0;
  absl::Mutex mu_;
  std::vector<Notification> pending_ ABSL_GUARDED_BY(mu_);
};

}  // namespace
}  // namespace tandem::kvtransfer

int main() {
  tandem::kvtransfer::Peer peer;
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "QUIT") break;
    std::cout << peer.Handle(line) << std::endl;
  }
  return 0;
}
