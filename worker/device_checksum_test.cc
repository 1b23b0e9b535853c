// State checksums computed on the device (BackendChunkHasher over cuda_sim, whose
// memory the test can also read on the host) equal the host's, bit for bit, for a
// KvCache allocated from the device; a cache the host cannot address and no hasher
// is FAILED_PRECONDITION.
#include "worker/device_checksum.h"

#include <cstring>
#include <memory>

#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"
#include "kernels/backend_factory.h"
#include "kvtransfer/loopback_agent.h"

namespace tandem::worker {
namespace {

struct DeviceCache {
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<engine::KvCache> cache;
};

// A tiny-model cache whose buffers come from `backend_name`'s device.
DeviceCache Make(const char* backend_name) {
  DeviceCache d;
  auto be = kernels::CreateBackend(backend_name);
  EXPECT_TRUE(be.ok()) << be.status();
  d.backend = std::move(be).value();
  kernels::Device* dev = &d.backend->device();
  engine::KvCacheOptions o;
  o.block_size = 16;
  o.num_blocks = 12;
  o.num_slots = 3;
  o.allocator.allocate = [dev](size_t bytes) -> absl::StatusOr<void*> {
    absl::StatusOr<void*> p = dev->Allocate(bytes);
    if (p.ok()) std::memset(*p, 0, bytes);  // host-addressable devices only
    return p;
  };
  o.allocator.release = [dev](void* p) { dev->Free(p); };
  d.cache = *engine::KvCache::Create(engine::testing::TinyWeights().config, o);
  return d;
}

void Fill(engine::KvCache* c, uint32_t seed) {
  for (int m = 0; m < c->num_mla_layers(); ++m) {
    auto* p = reinterpret_cast<uint8_t*>(c->mla_layer(m));
    for (size_t i = 0; i < c->mla_layer_bytes(); ++i) {
      seed = seed * 1664525u + 1013904223u;
      p[i] = static_cast<uint8_t>(seed >> 24);
    }
  }
  for (int64_t s = 0; s < c->num_slots(); ++s) {
    for (int k = 0; k < c->num_kda_layers(); ++k) {
      float* r = c->kda_recurrent(s, k);
      for (size_t i = 0; i < c->kda_bytes_per_layer() / 4; ++i)
        r[i] = 0.25f * i - k + s;
    }
  }
}

TEST(DeviceChecksumTest, CudaSimHashesEqualTheHostsForACacheOnTheDevice) {
  for (const char* name : {"cuda_sim", "cpu_reference"}) {
    DeviceCache d = Make(name);
    ASSERT_TRUE(d.cache != nullptr);
    ASSERT_TRUE(d.backend->device().Owns(d.cache->mla_layer(0), 1)) << name;
    Fill(d.cache.get(), 99);
    kvtransfer::LoopbackAgent agent;
    auto regions = RegisterCache(&agent, d.cache.get());
    ASSERT_TRUE(regions.ok()) << regions.status();
    BackendChunkHasher hasher(d.backend.get());
    // 0 tokens, one token, a partial block, several blocks out of order.
    for (int64_t n : {0, 1, 20, 150}) {
      std::vector<int32_t> blocks;
      for (int64_t b = 0; b < (n + 15) / 16; ++b) blocks.push_back((11 + 5 * b) % 12);
      const kvtransfer::RankLayout side =
          CacheRankLayout(*d.cache, *regions, blocks, /*slot=*/2);
      auto host = kvtransfer::ComputeChecksums(
          side, n, CacheRegionBytes(d.cache.get(), *regions));
      ASSERT_TRUE(host.ok()) << host.status();
      kvtransfer::ChecksumMemory m =
          CacheChecksumMemory(d.cache.get(), *regions, &hasher, d.backend->device());
      auto dev = kvtransfer::ComputeChecksums(side, n, m);
      ASSERT_TRUE(dev.ok()) << dev.status();
      EXPECT_TRUE(kvtransfer::Verify(*host, *dev).ok()) << name << " n " << n;
      EXPECT_EQ(host->total(), dev->total());
      // As for a CUDA cache: not host-addressable, the hasher still works ...
      m.host_addressable = false;
      auto again = kvtransfer::ComputeChecksums(side, n, m);
      ASSERT_TRUE(again.ok()) << again.status();
      EXPECT_EQ(again->total(), host->total());
      // ... and without it the host refuses to read.
      m.hasher = nullptr;
      EXPECT_EQ(kvtransfer::ComputeChecksums(side, n, m).status().code(),
                absl::StatusCode::kFailedPrecondition);
    }
    // A corrupt byte changes the device checksum of that layer only.
    const kvtransfer::RankLayout side = CacheRankLayout(*d.cache, *regions, {4, 9}, 0);
    kvtransfer::ChecksumMemory m =
        CacheChecksumMemory(d.cache.get(), *regions, &hasher, d.backend->device());
    auto before = kvtransfer::ComputeChecksums(side, 32, m);
    const size_t row = d.cache->mla_width() * 2;  // BF16 latents of one token
    reinterpret_cast<uint8_t*>(d.cache->mla_layer(1))[4 * 16 * row + 5] ^= 1;
    auto after = kvtransfer::ComputeChecksums(side, 32, m);
    ASSERT_TRUE(before.ok() && after.ok());
    absl::Status v = kvtransfer::Verify(*before, *after);
    EXPECT_EQ(v.code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(v.message().find("MLA layer 1"), std::string::npos) << v;
  }
}

// The hasher works on a stream of its own: while the engine captures a CUDA graph
// on the compute stream, a checksum neither joins the graph nor breaks it.
TEST(DeviceChecksumTest, HashingStaysOffACapturingComputeStream) {
  DeviceCache d = Make("cuda_sim");
  ASSERT_TRUE(d.cache != nullptr);
  Fill(d.cache.get(), 5);
  kvtransfer::LoopbackAgent agent;
  auto regions = RegisterCache(&agent, d.cache.get());
  ASSERT_TRUE(regions.ok()) << regions.status();
  BackendChunkHasher hasher(d.backend.get());
  const kvtransfer::RankLayout side = CacheRankLayout(*d.cache, *regions, {3, 7, 1}, 1);
  auto host =
      kvtransfer::ComputeChecksums(side, 40, CacheRegionBytes(d.cache.get(), *regions));
  ASSERT_TRUE(host.ok()) << host.status();
  kvtransfer::ChecksumMemory m =
      CacheChecksumMemory(d.cache.get(), *regions, &hasher, d.backend->device());
  ASSERT_TRUE(kvtransfer::ComputeChecksums(side, 40, m).ok());  // buffers, stream
  kernels::Stream& compute = d.backend->device().compute_stream();
  ASSERT_TRUE(compute.BeginCapture().ok());
  auto dev = kvtransfer::ComputeChecksums(side, 40, m);
  auto graph = compute.EndCapture();
  ASSERT_TRUE(graph.ok()) << graph.status();  // the capture stayed valid
  EXPECT_EQ((*graph)->num_nodes(), 0);
  ASSERT_TRUE(dev.ok()) << dev.status();
  EXPECT_TRUE(kvtransfer::Verify(*host, *dev).ok());
}

TEST(DeviceChecksumTest, PiecesOutsideTheDeviceAreRefused) {
  auto be = kernels::CreateBackend("cuda_sim");
  ASSERT_TRUE(be.ok()) << be.status();
  BackendChunkHasher hasher(be->get());
  std::vector<uint8_t> host(100, 7);
  std::vector<kvtransfer::ByteStream> streams = {{absl::MakeConstSpan(host)}};
  // Host memory is not the emulated device's: the backend refuses the op.
  auto got = hasher.HashChunks(streams, 64);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << got.status();
  EXPECT_EQ(hasher.HashChunks(streams, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Empty streams: no device work, empty lists.
  std::vector<kvtransfer::ByteStream> empty(3);
  auto none = hasher.HashChunks(empty, 64);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->size(), 3u);
  EXPECT_TRUE((*none)[0].empty());
}

}  // namespace
}  // namespace tandem::worker
