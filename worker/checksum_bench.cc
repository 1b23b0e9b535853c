// checksum_bench: throughput of the KV-transfer state checksums
// (kvtransfer/checksum.h) over one layer's paged stream, on the host and on a
// device backend, against yardsticks in the same run.
//
//   ./tandem bench checksum                       # host path (+ cuda_sim check)
//   ./tandem bench checksum --backend cuda        # a GPU (--config=cuda)
//
// The stream is one K3-shaped MLA layer (1152 bytes per token, 16-token blocks
// at shuffled block ids, so every block is its own segment) of --bytes (default
// 64 MiB). Timed, median of --iterations:
//   host:    ComputeChecksums on host memory (libxxhash XXH64 per 4 KiB chunk,
//            one thread), and as yardsticks one XXH3-64 / one XXH64 pass over the
//            same ranges and a memcpy of them;
//   device:  ComputeChecksums through worker::BackendChunkHasher on --backend
//            (ChunkHashes kernel, hashes copied back), checked bit-exact against
//            the host result. On "cuda_sim" the figure is the emulator's (CUDA
//            threads as fibers on one core): a harness check, not performance.
// Ends with one JSON line {"bench":"checksum",...}.
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "common/init.h"
#include "kernels/backend_factory.h"
#include "kvtransfer/checksum.h"
#include "kvtransfer/plan.h"
#include "nlohmann/json.hpp"
#include "worker/device_checksum.h"

ABSL_FLAG(int64_t, bytes, int64_t{64} << 20, "Bytes of the layer's stream");
ABSL_FLAG(int, iterations, 5, "Timed runs per path (median reported)");
ABSL_FLAG(std::string, backend, "cuda_sim",
          "Device backend for the device path (cuda, cuda_sim, or none)");
ABSL_FLAG(int64_t, device_bytes, 0,
          "Stream bytes for the device path (0: --bytes; cuda_sim defaults to 8 MiB)");

namespace tandem {
namespace {

constexpr int64_t kTokenBytes = 1152;  // K3: (512 + 64) BF16 latents
constexpr int64_t kBlockTokens = 16;

struct Layer {
  kvtransfer::RankLayout side;
  int64_t tokens = 0;
  uint64_t region_bytes = 0;
};

Layer MakeLayer(int64_t bytes) {
  Layer l;
  tandem::v1::KvLayout layout;
  layout.set_block_size(kBlockTokens);
  layout.set_num_mla_layers(1);
  layout.set_num_kda_layers(0);
  layout.set_mla_token_bytes(kTokenBytes);
  layout.set_tp_size(1);
  const int64_t blocks = std::max<int64_t>(1, bytes / (kTokenBytes * kBlockTokens));
  l.side = kvtransfer::ContiguousRankLayout(layout, blocks, 0, 1);
  std::vector<int32_t> ids(blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(7));
  l.side.block_ids = ids;
  l.tokens = blocks * kBlockTokens;
  l.region_bytes = kvtransfer::ContiguousRegionBytes(layout, blocks, 0);
  return l;
}

template <typename F>
double MedianSeconds(int iterations, F&& f) {
  std::vector<double> t;
  f();  // warm-up
  for (int i = 0; i < iterations; ++i) {
    const absl::Time start = absl::Now();
    f();
    t.push_back(absl::ToDoubleSeconds(absl::Now() - start));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int Run() {
  const int iterations = std::max(1, absl::GetFlag(FLAGS_iterations));
  const Layer layer = MakeLayer(absl::GetFlag(FLAGS_bytes));
  const double gb = static_cast<double>(layer.tokens * kTokenBytes) / 1e9;
  std::vector<uint8_t> mem(layer.region_bytes);
  std::mt19937_64 rng(11);
  for (size_t i = 0; i + 8 <= mem.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(mem.data() + i, &v, 8);
  }
  const kvtransfer::RegionBytes host_bytes = [&mem](kvtransfer::RegionId r) {
    return r == 1 ? absl::Span<const uint8_t>(mem) : absl::Span<const uint8_t>();
  };
  auto ranges = kvtransfer::LayerRanges(layer.side, {kvtransfer::LayerKind::kMla, 0},
                                        layer.tokens);
  if (!ranges.ok()) {
    std::fprintf(stderr, "%s\n", ranges.status().ToString().c_str());
    return 1;
  }
  std::printf(
      "checksum_bench: one MLA layer, %lld tokens x %lld bytes = %.1f MiB in %zu "
      "segments (16-token blocks, shuffled)\n",
      static_cast<long long>(layer.tokens), static_cast<long long>(kTokenBytes),
      gb * 1e9 / (1 << 20), ranges->size());

  tandem::v1::StateChecksums want;
  const double host_s = MedianSeconds(iterations, [&] {
    want = *kvtransfer::ComputeChecksums(layer.side, layer.tokens, host_bytes);
  });
  uint64_t sink = 0;
  const double xxh3_s = MedianSeconds(iterations, [&] {
    XXH3_state_t* s = XXH3_createState();
    XXH3_64bits_reset(s);
    for (const auto& r : *ranges)
      XXH3_64bits_update(s, mem.data() + r.offset, r.length);
    sink ^= XXH3_64bits_digest(s);
    XXH3_freeState(s);
  });
  const double xxh64_s = MedianSeconds(iterations, [&] {
    XXH64_state_t* s = XXH64_createState();
    XXH64_reset(s, 0);
    for (const auto& r : *ranges) XXH64_update(s, mem.data() + r.offset, r.length);
    sink ^= XXH64_digest(s);
    XXH64_freeState(s);
  });
  std::vector<uint8_t> copy(layer.tokens * kTokenBytes);
  const double memcpy_s = MedianSeconds(iterations, [&] {
    size_t at = 0;
    for (const auto& r : *ranges) {
      std::memcpy(copy.data() + at, mem.data() + r.offset, r.length);
      at += r.length;
    }
  });
  std::printf("host  ComputeChecksums (XXH64 per 4 KiB chunk)  %8.2f GB/s\n",
              gb / host_s);
  std::printf("host  yardstick XXH3-64 one pass (old layer def) %8.2f GB/s\n",
              gb / xxh3_s);
  std::printf("host  yardstick XXH64 one pass                  %8.2f GB/s\n",
              gb / xxh64_s);
  std::printf("host  yardstick memcpy of the ranges            %8.2f GB/s\n",
              gb / memcpy_s);
  nlohmann::json j;
  j["bench"] = "checksum";
  j["stream_bytes"] = layer.tokens * kTokenBytes;
  j["segments"] = ranges->size();
  j["host_gbps"] = gb / host_s;
  j["host_xxh3_one_pass_gbps"] = gb / xxh3_s;
  j["host_xxh64_one_pass_gbps"] = gb / xxh64_s;
  j["host_memcpy_gbps"] = gb / memcpy_s;
  j["sink"] = sink & 1;

  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (backend != "none" && !backend.empty()) {
    auto be = kernels::CreateBackend(backend);
    if (!be.ok()) {
      std::fprintf(stderr, "backend %s: %s\n", backend.c_str(),
                   be.status().ToString().c_str());
      return 1;
    }
    const bool emulated = absl::StartsWith(backend, "cuda_sim");
    int64_t dev_bytes = absl::GetFlag(FLAGS_device_bytes);
    if (dev_bytes <= 0)
      dev_bytes = emulated ? int64_t{8} << 20 : absl::GetFlag(FLAGS_bytes);
    const Layer dl =
        dev_bytes == absl::GetFlag(FLAGS_bytes) ? layer : MakeLayer(dev_bytes);
    const double dgb = static_cast<double>(dl.tokens * kTokenBytes) / 1e9;
    kernels::Device& dev = (*be)->device();
    auto buf = kernels::DeviceBuffer::Allocate(&dev, dl.region_bytes);
    if (!buf.ok() || !dev.CopyToDevice(buf->data(), mem.data(), dl.region_bytes).ok() ||
        !dev.Synchronize().ok()) {
      std::fprintf(stderr, "device buffer of %llu bytes failed\n",
                   static_cast<unsigned long long>(dl.region_bytes));
      return 1;
    }
    const uint8_t* base = buf->as<uint8_t>();
    const size_t n = dl.region_bytes;
    worker::BackendChunkHasher hasher(be->get());
    kvtransfer::ChecksumMemory m;
    m.regions = [base, n](kvtransfer::RegionId r) {
      return r == 1 ? absl::Span<const uint8_t>(base, n) : absl::Span<const uint8_t>();
    };
    m.host_addressable = dev.host_addressable();
    m.hasher = &hasher;
    const auto host_want =
        *kvtransfer::ComputeChecksums(dl.side, dl.tokens, host_bytes);
    tandem::v1::StateChecksums got;
    absl::Status status;
    const double dev_s = MedianSeconds(emulated ? 1 : iterations, [&] {
      auto c = kvtransfer::ComputeChecksums(dl.side, dl.tokens, m);
      status = c.status();
      if (c.ok()) got = *c;
    });
    if (!status.ok()) {
      std::fprintf(stderr, "device checksums: %s\n", status.ToString().c_str());
      return 1;
    }
    const bool equal = kvtransfer::Verify(host_want, got).ok();
    std::printf("%s ComputeChecksums via ChunkHashes (%.1f MiB)   %8.3f GB/s%s  %s\n",
                backend.c_str(), dgb * 1e9 / (1 << 20), dgb / dev_s,
                emulated ? "  [EMULATOR: CUDA threads as fibers on the CPU, not "
                           "performance]"
                         : "",
                equal ? "bit-exact vs host" : "MISMATCH vs host");
    j["device_backend"] = backend;
    j["device_emulated"] = emulated;
    j["device_stream_bytes"] = dl.tokens * kTokenBytes;
    j["device_gbps"] = dgb / dev_s;
    j["device_equals_host"] = equal;
    if (!equal) {
      std::printf("%s\n", j.dump().c_str());
      return 1;
    }
  }
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace
}  // namespace tandem

int main(int argc, char** argv) {
  tandem::InitProgram(argc, argv, "checksum_bench",
                      "checksum_bench [--bytes N] [--backend cuda|cuda_sim|none]");
  return tandem::Run();
}
