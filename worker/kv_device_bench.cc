// kv_device_bench: the KV hand-off from device memory to device memory, as the
// workers run it (two UCX agents, each wrapped in the host staging agent with
// --kv_buffer, the caches registered by worker::RegisterCache's rule), against
// the device's own copy in the same run.
//
//   ./tandem bench kvdevice                        # cuda_sim (harness check)
//   ./tandem bench kvdevice --backend cuda         # a GPU (--config=cuda)
//
// Two buffers of --mib each on the device of --backend: the sender's and the
// receiver's. One transfer moves the whole buffer as K3-shaped pieces
// (--piece_bytes, default one 64-token block of one MLA layer: 64 x 576 x 2
// bytes) to shuffled places in the receiver's, then notifies; staged, the
// receiver copies what landed to its device (StageIn) before the transfer
// counts as done, as the decode worker does before its checksums. Timed, best
// of --iterations after one warm-up, and checked byte for byte once:
//   transfer     post -> last byte on the receiver's device
//   d2d_copy     Device::CopyOnDevice of the same bytes in one call
//                (cudaMemcpyAsync device to device): the yardstick
//   d2h, h2d     the device's copies to and from host memory of the same bytes
//                (the staging's two legs)
// Where the agent takes the device memory (a UCX built with CUDA), --kv_buffer
// auto moves it in place; Debian's UCX cannot, so auto stages it.
//
// --two_processes: the receiver is a second process (this binary again,
// started with --receiver_child), as a decode worker is: its buffer is
// shareable device memory published in its descriptor, and the sender writes
// into it device to device (the host staging's IPC path, --kv_device_ipc);
// checked by the XXH3-64 of the receiver's buffer, which the child computes.
// A receiver the sender cannot map fails the run, saying why.
//
// Ends with one JSON line {"bench":"kv_device",...}.
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/init.h"
#include "common/status.h"
#include "kernels/backend_factory.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/host_staging_agent.h"
#include "kvtransfer/peer_process.h"
#include "kvtransfer/ucx_agent.h"
#include "nlohmann/json.hpp"
#include "worker/cache_layout.h"

ABSL_FLAG(std::string, backend, "cuda_sim", "Device backend: cuda, cuda:N or cuda_sim");
ABSL_FLAG(int64_t, mib, 0,
          "MiB moved per transfer (0: 1024 on a GPU, 32 on the emulator)");
ABSL_FLAG(int64_t, piece_bytes, 64 * 576 * 2,
          "Bytes per piece (one 64-token block of one K3 MLA layer)");
ABSL_FLAG(int, iterations, 5, "Timed transfers (best reported)");
ABSL_FLAG(std::string, kv_buffer, "auto", "auto | device | host (the workers' flag)");
ABSL_FLAG(bool, two_processes, false,
          "The receiver in a second process: device to device into its shareable "
          "memory (IPC), as between a prefill and a decode worker of one host");
ABSL_FLAG(bool, receiver_child, false, "Internal: the --two_processes receiver");
ABSL_FLAG(int64_t, receiver_bytes, 0, "Internal: the receiver's buffer size");
ABSL_FLAG(bool, release_pages, false,
          "Staged: give shadow pages back once their bytes moved (the workers do "
          "when the shadows are large against the host's memory)");

namespace tandem {
namespace {

using kvtransfer::HostStagingAgent;

struct Side {
  std::unique_ptr<HostStagingAgent> agent;
  void* mem = nullptr;
  kvtransfer::RegionId region = 0;
  bool staged = false;
};

absl::Status MakeSide(kernels::Device* device, size_t bytes, kvtransfer::KvBuffer mode,
                      Side* side) {
  kvtransfer::UcxAgentConfig config;
  config.peer_failure_detection = false;  // shared memory on one host
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<kvtransfer::UcxAgent> ucx,
                          kvtransfer::UcxAgent::Create(config));
  side->agent = std::make_unique<HostStagingAgent>(
      std::move(ucx),
      kvtransfer::HostStagingOptions{
          .buffer = mode, .release_pages = absl::GetFlag(FLAGS_release_pages)});
  TANDEM_ASSIGN_OR_RETURN(side->mem, device->Allocate(bytes));
  // The workers' rule (worker::RegisterCache).
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<worker::KvBufferRegistrar> registrar,
                          worker::KvBufferRegistrar::Create(side->agent.get(), device));
  absl::StatusOr<kvtransfer::RegionId> id = registrar->Register(side->mem, bytes);
  side->staged = registrar->staged();
  if (!id.ok()) return id.status();
  side->region = *id;
  return absl::OkStatus();
}

// --receiver_child (a kvtransfer::PeerProcess): a shareable buffer staged with
// IPC published; answers "DESC" with "DESC <hex descriptor>" and "HASH" with
// "HASH <xxh3 hex> 1" of its buffer (or "ERROR <why>"), one line each, until
// stdin closes. Anything else the process prints goes to stderr.
int RunReceiverChild() {
  const int proto_fd = dup(1);
  dup2(2, 1);
  FILE* proto = fdopen(proto_fd, "w");
  if (proto == nullptr) return 1;
  auto reply = [&](const std::string& line) {
    std::fprintf(proto, "%s\n", line.c_str());
    std::fflush(proto);
  };
  // Errors are answers too, to every command.
  auto fail = [&](const absl::Status& s) {
    char line[256];
    while (std::fgets(line, sizeof(line), stdin) != nullptr) {
      reply("ERROR " + s.ToString());
    }
    return 1;
  };
  auto backend = kernels::CreateBackend(absl::GetFlag(FLAGS_backend));
  if (!backend.ok()) return fail(backend.status());
  kernels::Device& device = (*backend)->device();
  const size_t bytes = static_cast<size_t>(absl::GetFlag(FLAGS_receiver_bytes));
  if (bytes == 0)
    return fail(absl::InvalidArgumentError("--receiver_bytes must be > 0"));
  kvtransfer::UcxAgentConfig config;
  config.peer_failure_detection = false;
  auto ucx = kvtransfer::UcxAgent::Create(config);
  if (!ucx.ok()) return fail(ucx.status());
  absl::StatusOr<void*> mem = device.AllocateShareable(bytes);
  if (!mem.ok()) return fail(mem.status());
  HostStagingAgent agent(*std::move(ucx), kvtransfer::HostStagingOptions{
                                              .buffer = kvtransfer::KvBuffer::kHost,
                                              .release_pages = false});
  auto registrar = worker::KvBufferRegistrar::Create(&agent, &device);
  if (!registrar.ok()) return fail(registrar.status());
  absl::StatusOr<kvtransfer::RegionId> region = (*registrar)->Register(*mem, bytes);
  if (!region.ok()) return fail(region.status());
  if (!agent.ipc_export_status().ok()) return fail(agent.ipc_export_status());
  absl::StatusOr<std::string> desc = agent.LocalDescriptor("");
  if (!desc.ok()) return fail(desc.status());
  std::vector<uint8_t> host(bytes);
  char line[256];
  while (std::fgets(line, sizeof(line), stdin) != nullptr) {
    if (std::strncmp(line, "DESC", 4) == 0) {
      reply("DESC " + absl::BytesToHexString(*desc));
    } else if (std::strncmp(line, "HASH", 4) == 0) {
      const bool ok = device.CopyToHost(host.data(), *mem, bytes).ok();
      reply(absl::StrFormat(
          "HASH %016llx %d",
          static_cast<unsigned long long>(XXH3_64bits(host.data(), bytes)),
          ok ? 1 : 0));
    } else {
      reply("ERROR unknown command");
    }
  }
  device.Free(*mem);
  return 0;
}

double Gbs(double bytes, double seconds) {
  return seconds > 0 ? bytes / seconds / 1e9 : 0;
}

int Run() {
  const std::string backend_name = absl::GetFlag(FLAGS_backend);
  auto backend = kernels::CreateBackend(backend_name);
  if (!backend.ok()) {
    std::fprintf(stderr, "kv_device_bench: %s\n", backend.status().ToString().c_str());
    return 1;
  }
  kernels::Device& device = (*backend)->device();
  const bool emulated = device.host_addressable();
  int64_t mib = absl::GetFlag(FLAGS_mib);
  if (mib <= 0) mib = emulated ? 32 : 1024;
  const int64_t piece = std::max<int64_t>(1, absl::GetFlag(FLAGS_piece_bytes));
  const int64_t pieces = (mib << 20) / piece;
  const size_t bytes = static_cast<size_t>(pieces * piece);
  auto mode = kvtransfer::ParseKvBuffer(absl::GetFlag(FLAGS_kv_buffer));
  if (!mode.ok() || pieces <= 0) {
    std::fprintf(
        stderr, "kv_device_bench: %s\n",
        mode.ok() ? "--mib too small for one piece" : mode.status().ToString().c_str());
    return 1;
  }
  const bool two = absl::GetFlag(FLAGS_two_processes);
  Side src, dst;
  for (Side* s : {&src, &dst}) {
    if (two && s == &dst) {             // the receiver is the child's; a local buffer
      auto m = device.Allocate(bytes);  // for the device-copy yardstick
      if (!m.ok()) {
        std::fprintf(stderr, "kv_device_bench: %s\n", m.status().ToString().c_str());
        return 1;
      }
      dst.mem = *m;
      continue;
    }
    if (absl::Status st = MakeSide(&device, bytes, *mode, s); !st.ok()) {
      std::fprintf(stderr, "kv_device_bench: %s\n", st.ToString().c_str());
      return 1;
    }
  }
  std::unique_ptr<kvtransfer::PeerProcess> child;
  std::string child_desc;
  if (two) {
    child = kvtransfer::PeerProcess::Spawn(
        "/proc/self/exe",
        {"--receiver_child", "--backend=" + backend_name,
         absl::StrCat("--receiver_bytes=", bytes), "--log_format=json"});
    const std::string first =
        child != nullptr ? child->Call("DESC", absl::Minutes(2)) : "ERR cannot start";
    if (!absl::StartsWith(first, "DESC ")) {
      std::fprintf(stderr, "kv_device_bench: the receiver process: %s\n",
                   first.c_str());
      return 1;
    }
    child_desc = absl::HexStringToBytes(first.substr(5));
    auto d = kvtransfer::ParseDescriptor(child_desc);
    if (!d.ok() || d->regions.size() != 1) {
      std::fprintf(stderr, "kv_device_bench: the receiver's descriptor: %s\n",
                   d.ok() ? "not one region" : d.status().ToString().c_str());
      return 1;
    }
    dst.region = d->regions[0].id;
  }
  auto peer = src.agent->Connect(two ? child_desc : *dst.agent->LocalDescriptor(""));
  if (!peer.ok()) {
    std::fprintf(stderr, "kv_device_bench: connect: %s\n",
                 peer.status().ToString().c_str());
    return 1;
  }
  if (two && !src.agent->IsDirect(*peer)) {
    std::fprintf(stderr,
                 "kv_device_bench: the receiver process's device memory cannot be "
                 "written directly: %s\n",
                 src.agent->last_direct_refusal().ToString().c_str());
    return 1;
  }
  // Random bytes on the sender's device; the pieces land shuffled.
  std::vector<uint8_t> host(bytes);
  std::mt19937_64 rng(1);
  for (size_t i = 0; i + 8 <= bytes; i += 8) {
    const uint64_t v = rng();
    std::memcpy(host.data() + i, &v, 8);
  }
  if (!device.CopyToDevice(src.mem, host.data(), bytes).ok() ||
      !device.Synchronize().ok()) {
    std::fprintf(stderr, "kv_device_bench: cannot fill the sender's buffer\n");
    return 1;
  }
  std::vector<int64_t> order(pieces);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<kvtransfer::Segment> segs;
  std::vector<kvtransfer::ByteRange> landed;
  for (int64_t i = 0; i < pieces; ++i) {
    segs.push_back({src.region, static_cast<uint64_t>(i * piece), dst.region,
                    static_cast<uint64_t>(order[i] * piece),
                    static_cast<uint64_t>(piece)});
    landed.push_back({dst.region, static_cast<uint64_t>(order[i] * piece),
                      static_cast<uint64_t>(piece)});
  }
  auto transfer = [&]() -> absl::StatusOr<double> {
    const absl::Time t0 = absl::Now();
    TANDEM_ASSIGN_OR_RETURN(kvtransfer::BatchId b,
                            src.agent->PostWrite(*peer, segs, nullptr));
    TANDEM_RETURN_IF_ERROR(src.agent->Wait(b, absl::Now() + absl::Minutes(2)));
    TANDEM_RETURN_IF_ERROR(
        src.agent->Notify(*peer, "bench", "", absl::Now() + absl::Seconds(30)));
    if (!two && dst.staged) TANDEM_RETURN_IF_ERROR(dst.agent->StageIn(landed));
    return absl::ToDoubleSeconds(absl::Now() - t0);
  };
  const int iterations = std::max(1, absl::GetFlag(FLAGS_iterations));
  double best = 1e30;
  for (int i = 0; i <= iterations; ++i) {  // the first is the warm-up
    absl::StatusOr<double> s = transfer();
    if (!s.ok()) {
      std::fprintf(stderr, "kv_device_bench: transfer: %s\n",
                   s.status().ToString().c_str());
      return 1;
    }
    if (i > 0) best = std::min(best, *s);
  }
  // Byte for byte, once: the receiver's device against the sender's pieces
  // (two processes: the XXH3-64 of the child's buffer against the expected).
  std::vector<uint8_t> got(bytes);
  bool exact = true;
  if (two) {
    for (int64_t i = 0; i < pieces; ++i) {
      std::memcpy(got.data() + order[i] * piece, host.data() + i * piece, piece);
    }
    const std::string want = absl::StrFormat(
        "HASH %016llx 1",
        static_cast<unsigned long long>(XXH3_64bits(got.data(), bytes)));
    const std::string answer = child->Call("HASH", absl::Minutes(2));
    exact = answer == want;
    if (!exact) {
      std::fprintf(stderr, "kv_device_bench: receiver says '%s', want '%s'\n",
                   answer.c_str(), want.c_str());
    }
  } else {
    if (!device.CopyToHost(got.data(), dst.mem, bytes).ok()) {
      std::fprintf(stderr, "kv_device_bench: cannot read the receiver's buffer\n");
      return 1;
    }
    for (int64_t i = 0; i < pieces && exact; ++i) {
      exact = std::memcmp(got.data() + order[i] * piece, host.data() + i * piece,
                          piece) == 0;
    }
  }
  // The yardsticks, best of the same count.
  auto timed = [&](auto op) {
    double t = 1e30;
    for (int i = 0; i <= iterations; ++i) {
      const absl::Time t0 = absl::Now();
      if (!op().ok() || !device.Synchronize().ok()) return -1.0;
      if (i > 0) t = std::min(t, absl::ToDoubleSeconds(absl::Now() - t0));
    }
    return t;
  };
  const double d2d =
      timed([&] { return device.CopyOnDevice(dst.mem, src.mem, bytes); });
  const double d2h =
      timed([&] { return device.CopyToHost(got.data(), src.mem, bytes); });
  const double h2d =
      timed([&] { return device.CopyToDevice(dst.mem, host.data(), bytes); });
  const double b = static_cast<double>(bytes);
  const double gbs = Gbs(b, best);
  nlohmann::json j;
  j["bench"] = "kv_device";
  j["backend"] = backend_name;
  j["device"] = std::string(device.name());
  j["emulated"] = emulated;
  j["kv_buffer"] = absl::GetFlag(FLAGS_kv_buffer);
  j["path"] = two ? "device_ipc" : src.staged || dst.staged ? "staged" : "in_place";
  j["two_processes"] = two;
  j["transport"] = src.agent->Transport(*peer);
  j["bytes"] = bytes;
  j["pieces"] = pieces;
  j["exact"] = exact;
  j["transfer_s"] = best;
  j["transfer_gbs"] = gbs;
  j["d2d_copy_gbs"] = Gbs(b, d2d);
  j["d2h_gbs"] = Gbs(b, d2h);
  j["h2d_gbs"] = Gbs(b, h2d);
  j["vs_d2d_copy"] = d2d > 0 ? gbs / Gbs(b, d2d) : 0;
  const kvtransfer::HostStagingStats st = src.agent->stats();
  j["staged_to_host_bytes"] = st.bytes_to_host;
  j["staged_to_device_bytes"] = two ? 0 : dst.agent->stats().bytes_to_device;
  j["direct_bytes"] = st.bytes_direct;
  std::printf(
      "kv_device: %s (%s), %lld pieces of %lld bytes, %s: transfer %.2f GB/s, device "
      "copy %.2f GB/s (x%.3f), d2h %.2f, h2d %.2f GB/s, %s\n",
      backend_name.c_str(), emulated ? "emulated: harness check" : "GPU",
      static_cast<long long>(pieces), static_cast<long long>(piece),
      j["path"].get<std::string>().c_str(), gbs, Gbs(b, d2d),
      j["vs_d2d_copy"].get<double>(), Gbs(b, d2h), Gbs(b, h2d),
      exact ? "bytes exact" : "BYTES DIFFER");
  std::printf("%s\n", j.dump().c_str());
  src.agent.reset();
  dst.agent.reset();
  child.reset();
  device.Free(src.mem);
  device.Free(dst.mem);
  return exact ? 0 : 1;
}

}  // namespace
}  // namespace tandem

int main(int argc, char** argv) {
  tandem::InitProgram(argc, argv, "kv_device_bench",
                      "kv_device_bench [--backend cuda|cuda_sim] [--mib N] "
                      "[--kv_buffer auto|device|host] [--two_processes]: the KV "
                      "hand-off between two "
                      "device buffers against the device's own copy");
  if (absl::GetFlag(FLAGS_receiver_child)) return tandem::RunReceiverChild();
  return tandem::Run();
}
