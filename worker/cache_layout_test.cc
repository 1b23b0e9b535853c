// A KvCache's state written into another KvCache (different block size and
// placement) through LoopbackAgents with the layouts built here: the bytes land
// in token order, both sides' checksums agree, and one flipped byte is DATA_LOSS.
#include "worker/cache_layout.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"
#include "kernels/backend_factory.h"
#include "kvtransfer/descriptor.h"
#include "kvtransfer/loopback_agent.h"
#include "kvtransfer/ucx_agent.h"

namespace tandem::worker {
namespace {

std::unique_ptr<engine::KvCache> Cache(int64_t block_size, int64_t blocks,
                                       int64_t slots, int tp_rank = 0,
                                       int tp_size = 1) {
  engine::KvCacheOptions o;
  o.block_size = block_size;
  o.num_blocks = blocks;
  o.num_slots = slots;
  o.tp_rank = tp_rank;
  o.tp_size = tp_size;
  return *engine::KvCache::Create(engine::testing::TinyWeights().config, o);
}

// Recognisable bytes in every MLA layer and in `slot`'s KDA state of `c`.
void FillRecognisable(engine::KvCache* c, int64_t slot, int salt) {
  for (int m = 0; m < c->num_mla_layers(); ++m) {
    auto* p = reinterpret_cast<uint8_t*>(c->mla_layer(m));
    for (size_t i = 0; i < c->mla_layer_bytes(); ++i) p[i] = (i * salt + m) & 0xFF;
  }
  for (int k = 0; k < c->num_kda_layers(); ++k) {
    float* r = c->kda_recurrent(slot, k);
    for (size_t i = 0; i < c->kda_bytes_per_layer() / 4; ++i)
      r[i] = 0.5f * i + k + salt;
  }
}

// What a decode worker publishes for `dst` (registered with `agent`): its pool
// geometry in the descriptor's metadata, the blocks and the slot.
tandem::v1::RankTarget Target(kvtransfer::TransferAgent& agent, engine::KvCache& dst,
                              const CacheRegions& regions,
                              const std::vector<int32_t>& blocks, int32_t slot) {
  tandem::v1::RankTarget target;
  target.set_transfer_descriptor(
      *agent.LocalDescriptor(PoolsMetadata(CacheRankLayout(dst, regions, {}, 0))));
  for (int32_t id : blocks) target.add_block_ids(id);
  target.set_state_slot(slot);
  *target.mutable_layout() = KvLayoutOf(dst);
  return target;
}

TEST(CacheLayoutTest, TransferThroughTargetLayoutKeepsChecksums) {
  auto src = Cache(16, 8, 2);
  auto dst = Cache(8, 20, 3);
  FillRecognisable(src.get(), 1, 31);
  kvtransfer::LoopbackAgent a, b;
  auto src_regions = RegisterCache(&a, src.get());
  auto dst_regions = RegisterCache(&b, dst.get());
  ASSERT_TRUE(src_regions.ok() && dst_regions.ok());
  const int64_t n = 37;  // 3 source blocks, 5 destination blocks
  const std::vector<int32_t> src_blocks = {5, 2, 7};
  const std::vector<int32_t> dst_blocks = {19, 0, 4, 11, 3};

  const tandem::v1::RankTarget target = Target(b, *dst, *dst_regions, dst_blocks, 2);
  auto dst_side = TargetRankLayout(target);
  ASSERT_TRUE(dst_side.ok()) << dst_side.status();
  const kvtransfer::RankLayout src_side =
      CacheRankLayout(*src, *src_regions, src_blocks, 1);

  auto plan = kvtransfer::PlanAll(src_side, *dst_side, n);
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto peer = a.Connect(target.transfer_descriptor());
  ASSERT_TRUE(peer.ok());
  auto batch = a.PostWrite(*peer, plan->segments);
  ASSERT_TRUE(batch.ok());
  ASSERT_TRUE(a.Wait(*batch, absl::Now() + absl::Seconds(10)).ok());

  // Token t of MLA layer 0 sits in the destination's block dst_blocks[t / 8].
  const size_t row = src->mla_width() * 2;
  for (int64_t t = 0; t < n; ++t) {
    const uint8_t* s = reinterpret_cast<const uint8_t*>(src->mla_layer(0)) +
                       (src_blocks[t / 16] * 16 + t % 16) * row;
    const uint8_t* d = reinterpret_cast<const uint8_t*>(dst->mla_layer(0)) +
                       (dst_blocks[t / 8] * 8 + t % 8) * row;
    ASSERT_EQ(std::memcmp(s, d, row), 0) << "token " << t;
  }
  auto want = kvtransfer::ComputeChecksums(src_side, n,
                                           CacheRegionBytes(src.get(), *src_regions));
  kvtransfer::RankLayout dst_local = CacheRankLayout(*dst, *dst_regions, dst_blocks, 2);
  auto got = kvtransfer::ComputeChecksums(dst_local, n,
                                          CacheRegionBytes(dst.get(), *dst_regions));
  ASSERT_TRUE(want.ok() && got.ok());
  EXPECT_TRUE(kvtransfer::Verify(*want, *got).ok());
  EXPECT_EQ(got->mla_layer_size(), src->num_mla_layers());
  EXPECT_EQ(got->kda_layer_size(), src->num_kda_layers());

  // One flipped byte in the landed KDA state of the last layer: DATA_LOSS.
  reinterpret_cast<uint8_t*>(dst->kda_recurrent(2, dst->num_kda_layers() - 1))[5] ^= 1;
  auto bad = kvtransfer::ComputeChecksums(dst_local, n,
                                          CacheRegionBytes(dst.get(), *dst_regions));
  ASSERT_TRUE(bad.ok());
  absl::Status v = kvtransfer::Verify(*want, *bad);
  EXPECT_EQ(v.code(), absl::StatusCode::kDataLoss) << v;
}

// A cache in cuda_sim device memory is registered where it lives: the UCX
// agent's descriptor names the device buffers themselves (the sim device owns
// every region), as host memory (the emulator's device memory is host memory);
// a UCX transfer from a host cache lands in them with matching checksums.
TEST(CacheLayoutTest, CudaSimCacheRegistersItsDeviceBuffersWithUcx) {
  auto backend = kernels::CreateBackend("cuda_sim");
  ASSERT_TRUE(backend.ok()) << backend.status();
  kernels::Device* dev = &(*backend)->device();
  engine::KvCacheOptions o;
  o.block_size = 8;
  o.num_blocks = 12;
  o.num_slots = 2;
  o.device = dev;
  auto dst = engine::KvCache::Create(engine::testing::TinyWeights().config, o);
  ASSERT_TRUE(dst.ok()) << dst.status();
  auto kind = CacheMemoryKind(**dst);
  ASSERT_TRUE(kind.ok()) << kind.status();
  EXPECT_TRUE(kind->is_host());

  auto a = kvtransfer::UcxAgent::Create({});
  auto b = kvtransfer::UcxAgent::Create({});
  ASSERT_TRUE(a.ok() && b.ok());
  auto dst_regions = RegisterCache(b->get(), dst->get());
  ASSERT_TRUE(dst_regions.ok()) << dst_regions.status();
  auto descriptor = kvtransfer::ParseDescriptor(*(*b)->LocalDescriptor());
  ASSERT_TRUE(descriptor.ok());
  ASSERT_EQ(descriptor->regions.size(), (*dst)->num_mla_layers() + 1u);
  for (int m = 0; m < (*dst)->num_mla_layers(); ++m) {
    const kvtransfer::RegionDescriptor* r = descriptor->FindRegion(dst_regions->mla[m]);
    ASSERT_NE(r, nullptr);
    EXPECT_EQ(r->base, reinterpret_cast<uintptr_t>((*dst)->mla_layer(m)));
    EXPECT_EQ(r->length, (*dst)->mla_layer_bytes());
    EXPECT_TRUE(dev->Owns(reinterpret_cast<void*>(r->base), r->length));
  }
  const kvtransfer::RegionDescriptor* kda = descriptor->FindRegion(dst_regions->kda);
  ASSERT_NE(kda, nullptr);
  EXPECT_EQ(kda->base, reinterpret_cast<uintptr_t>((*dst)->kda_recurrent(0, 0)));
  EXPECT_EQ(kda->length, (*dst)->kda_bytes_per_slot() * 2);
  EXPECT_TRUE(dev->Owns(reinterpret_cast<void*>(kda->base), kda->length));

  auto src = Cache(16, 4, 2);
  FillRecognisable(src.get(), 0, 13);
  auto src_regions = RegisterCache(a->get(), src.get());
  ASSERT_TRUE(src_regions.ok());
  const int64_t n = 21;
  const std::vector<int32_t> src_blocks = {3, 1};
  const std::vector<int32_t> dst_blocks = {10, 4, 7};
  const tandem::v1::RankTarget target = Target(**b, **dst, *dst_regions, dst_blocks, 1);
  auto dst_side = TargetRankLayout(target);
  ASSERT_TRUE(dst_side.ok());
  const kvtransfer::RankLayout src_side =
      CacheRankLayout(*src, *src_regions, src_blocks, 0);
  auto plan = kvtransfer::PlanAll(src_side, *dst_side, n);
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto peer = (*a)->Connect(target.transfer_descriptor());
  ASSERT_TRUE(peer.ok()) << peer.status();
  auto batch = (*a)->PostWrite(*peer, plan->segments);
  ASSERT_TRUE(batch.ok());
  ASSERT_TRUE((*a)->Wait(*batch, absl::Now() + absl::Seconds(20)).ok());
  auto want = kvtransfer::ComputeChecksums(src_side, n,
                                           CacheRegionBytes(src.get(), *src_regions));
  auto got =
      kvtransfer::ComputeChecksums(CacheRankLayout(**dst, *dst_regions, dst_blocks, 1),
                                   n, CacheRegionBytes(dst->get(), *dst_regions));
  ASSERT_TRUE(want.ok() && got.ok());
  EXPECT_TRUE(kvtransfer::Verify(*want, *got).ok());
  // Read through the device, as the engine would: the landed KDA value.
  float v = 0;
  ASSERT_TRUE(dev->CopyToHost(&v, (*dst)->kda_recurrent(1, 0) + 3, sizeof(v)).ok());
  EXPECT_EQ(v, src->kda_recurrent(0, 0)[3]);
}

// A device the host cannot address (what "cuda:N" is; here a stand-in that
// keeps its memory on the host but says otherwise): the cache registers as
// CUDA memory of that ordinal, the agents without CUDA transports refuse it at
// registration with a clear error, and no host bytes are handed out for
// checksums.
class NotHostAddressableDevice final : public kernels::Device {
 public:
  absl::string_view name() const override { return "cuda:3"; }
  bool host_addressable() const override { return false; }
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (p == nullptr) return absl::ResourceExhaustedError("no memory");
    live_.push_back(p);
    return p;
  }
  void Free(void* p) override {
    live_.erase(std::remove(live_.begin(), live_.end(), p), live_.end());
    std::free(p);
  }
  bool Owns(const void*, size_t) const override { return true; }
  kernels::DeviceMemoryInfo MemoryInfo() const override { return {}; }
  kernels::Stream& compute_stream() override { return stream_; }
  absl::StatusOr<std::unique_ptr<kernels::Stream>> CreateStream() override {
    return absl::UnimplementedError("stand-in");
  }
  absl::StatusOr<std::unique_ptr<kernels::Event>> CreateEvent() override {
    return absl::UnimplementedError("stand-in");
  }
  absl::Status CopyToDevice(void* d, const void* s, size_t n,
                            kernels::Stream*) override {
    std::memcpy(d, s, n);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* d, const void* s, size_t n, kernels::Stream*) override {
    std::memcpy(d, s, n);
    return absl::OkStatus();
  }
  absl::Status CopyOnDevice(void* d, const void* s, size_t n,
                            kernels::Stream*) override {
    std::memmove(d, s, n);
    return absl::OkStatus();
  }
  absl::Status Memset(void* d, uint8_t b, size_t n, kernels::Stream*) override {
    std::memset(d, b, n);
    return absl::OkStatus();
  }

 private:
  class NullStream final : public kernels::Stream {
   public:
    void* native() override { return nullptr; }
    absl::Status Synchronize() override { return absl::OkStatus(); }
  };
  NullStream stream_;
  std::vector<void*> live_;
};

TEST(CacheLayoutTest, CudaCacheRegistersAsCudaMemoryOrFailsClearly) {
  NotHostAddressableDevice dev;
  engine::KvCacheOptions o;
  o.block_size = 8;
  o.num_blocks = 4;
  o.num_slots = 1;
  o.device = &dev;
  auto cache = engine::KvCache::Create(engine::testing::TinyWeights().config, o);
  ASSERT_TRUE(cache.ok()) << cache.status();
  auto kind = CacheMemoryKind(**cache);
  ASSERT_TRUE(kind.ok());
  EXPECT_EQ(*kind, kvtransfer::MemoryKind::Cuda(3));

  kvtransfer::LoopbackAgent loopback;
  auto r = RegisterCache(&loopback, cache->get());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("cuda:3"), std::string::npos) << r.status();
  EXPECT_EQ(loopback.NumRegisteredRegions(), 0u);

  auto ucx = kvtransfer::UcxAgent::Create({});
  ASSERT_TRUE(ucx.ok());
  if (!(*ucx)->cuda_memory_supported()) {
    auto u = RegisterCache(ucx->get(), cache->get());
    EXPECT_EQ(u.status().code(), absl::StatusCode::kFailedPrecondition) << u.status();
    EXPECT_NE(u.status().message().find("CUDA"), std::string::npos) << u.status();
  }
  // Host code gets no bytes of it.
  CacheRegions regions;
  regions.mla.assign((*cache)->num_mla_layers(), 7);
  regions.kda = 8;
  EXPECT_TRUE(CacheRegionBytes(cache->get(), regions)(7).empty());
  EXPECT_TRUE(CacheRegionBytes(cache->get(), regions)(8).empty());
}

// A landing pool allocated through the receiving agent: RegisterCache reuses
// the allocations' regions (no second registration), a transfer into it lands
// with matching checksums, and destroying the cache gives the memory back.
TEST(CacheLayoutTest, AgentAllocatedCacheIsRegisteredOnceAndFreed) {
  auto src = Cache(16, 8, 2);
  FillRecognisable(src.get(), 0, 7);
  kvtransfer::LoopbackAgent a, b;
  AgentAllocations allocations(&b);
  {
    engine::KvCacheOptions o;
    o.block_size = 8;
    o.num_blocks = 12;
    o.num_slots = 2;
    o.allocator = allocations.Allocator();
    auto dst = engine::KvCache::Create(engine::testing::TinyWeights().config, o);
    ASSERT_TRUE(dst.ok()) << dst.status();
    const size_t buffers = (*dst)->num_mla_layers() + 1;
    EXPECT_EQ(allocations.num_agent_buffers(), buffers);
    EXPECT_EQ(allocations.num_heap_buffers(), 0u);
    EXPECT_EQ(b.NumRegisteredRegions(), buffers);
    // Fresh cache memory is zero, as from the heap.
    EXPECT_EQ(reinterpret_cast<const uint8_t*>((*dst)->mla_layer(0))[17], 0);

    auto src_regions = RegisterCache(&a, src.get());
    auto dst_regions = RegisterCache(&b, dst->get(), &allocations);
    ASSERT_TRUE(src_regions.ok() && dst_regions.ok());
    EXPECT_EQ(b.NumRegisteredRegions(), buffers);  // reused, not registered again
    EXPECT_EQ(dst_regions->mla[0], *allocations.RegionOf((*dst)->mla_layer(0)));

    const int64_t n = 29;
    const std::vector<int32_t> src_blocks = {3, 6};
    const std::vector<int32_t> dst_blocks = {11, 2, 5, 0};
    const tandem::v1::RankTarget target = Target(b, **dst, *dst_regions, dst_blocks, 1);
    auto dst_side = TargetRankLayout(target);
    ASSERT_TRUE(dst_side.ok()) << dst_side.status();
    const kvtransfer::RankLayout src_side =
        CacheRankLayout(*src, *src_regions, src_blocks, 0);
    auto plan = kvtransfer::PlanAll(src_side, *dst_side, n);
    ASSERT_TRUE(plan.ok()) << plan.status();
    auto peer = a.Connect(target.transfer_descriptor());
    ASSERT_TRUE(peer.ok());
    auto batch = a.PostWrite(*peer, plan->segments);
    ASSERT_TRUE(batch.ok());
    ASSERT_TRUE(a.Wait(*batch, absl::Now() + absl::Seconds(10)).ok());
    auto want = kvtransfer::ComputeChecksums(src_side, n,
                                             CacheRegionBytes(src.get(), *src_regions));
    auto got = kvtransfer::ComputeChecksums(
        CacheRankLayout(**dst, *dst_regions, dst_blocks, 1), n,
        CacheRegionBytes(dst->get(), *dst_regions));
    ASSERT_TRUE(want.ok() && got.ok());
    EXPECT_TRUE(kvtransfer::Verify(*want, *got).ok());
  }
  EXPECT_EQ(allocations.num_agent_buffers(), 0u);
  EXPECT_EQ(b.NumRegisteredRegions(), 0u);
}

// TP 2 -> TP 2: each side's two rank caches registered with ONE agent (ranks
// are threads of a worker), one descriptor per rank; rank r is planned to rank
// r; the merged checksums agree, and a byte flipped on rank 1 only is DATA_LOSS.
TEST(CacheLayoutTest, RankToRankTransferWithOneAgentPerSide) {
  constexpr int kTp = 2;
  std::vector<std::unique_ptr<engine::KvCache>> src, dst;
  for (int r = 0; r < kTp; ++r) {
    src.push_back(Cache(16, 6, 2, r, kTp));
    dst.push_back(Cache(8, 12, 3, r, kTp));
  }
  auto tp1 = Cache(16, 6, 2);
  ASSERT_GT(src[0]->num_kda_layers(), 0);
  // A rank holds half the KDA heads' state; the MLA rows are replicated.
  EXPECT_EQ(KvLayoutOf(*src[1]).tp_rank(), 1);
  EXPECT_EQ(KvLayoutOf(*src[1]).tp_size(), kTp);
  EXPECT_EQ(KvLayoutOf(*src[0]).kda_state_bytes() * kTp,
            KvLayoutOf(*tp1).kda_state_bytes());
  EXPECT_EQ(KvLayoutOf(*src[0]).mla_token_bytes(), KvLayoutOf(*tp1).mla_token_bytes());
  for (int r = 0; r < kTp; ++r) {
    for (int m = 0; m < src[r]->num_mla_layers(); ++m) {
      auto* p = reinterpret_cast<uint8_t*>(src[r]->mla_layer(m));
      for (size_t i = 0; i < src[r]->mla_layer_bytes(); ++i) p[i] = (i * 7 + m) & 0xFF;
    }
    for (int k = 0; k < src[r]->num_kda_layers(); ++k) {
      float* f = src[r]->kda_recurrent(1, k);
      for (size_t i = 0; i < src[r]->kda_bytes_per_layer() / 4; ++i) {
        f[i] = 0.25f * i + k + 100.0f * r;  // differs per rank
      }
    }
  }
  kvtransfer::LoopbackAgent a, b;
  std::vector<CacheRegions> src_regions, dst_regions;
  for (int r = 0; r < kTp; ++r) {
    src_regions.push_back(*RegisterCache(&a, src[r].get()));
    dst_regions.push_back(*RegisterCache(&b, dst[r].get()));
  }
  const int64_t n = 21;
  const std::vector<int32_t> src_blocks = {4, 1};
  const std::vector<int32_t> dst_blocks = {9, 0, 5};
  std::vector<tandem::v1::StateChecksums> want, got;
  for (int r = 0; r < kTp; ++r) {
    tandem::v1::RankTarget target;
    target.set_transfer_descriptor(*b.LocalDescriptor(
        PoolsMetadata(CacheRankLayout(*dst[r], dst_regions[r], {}, 0))));
    for (int32_t id : dst_blocks) target.add_block_ids(id);
    target.set_state_slot(2);
    *target.mutable_layout() = KvLayoutOf(*dst[r]);
    auto dst_side = TargetRankLayout(target);
    ASSERT_TRUE(dst_side.ok()) << dst_side.status();
    const kvtransfer::RankLayout src_side =
        CacheRankLayout(*src[r], src_regions[r], src_blocks, 1);
    // Rank r never pairs with another rank's layout.
    const kvtransfer::RankLayout other =
        CacheRankLayout(*src[1 - r], src_regions[1 - r], src_blocks, 1);
    EXPECT_FALSE(kvtransfer::PlanAll(other, *dst_side, n).ok());
    auto plan = kvtransfer::PlanAll(src_side, *dst_side, n);
    ASSERT_TRUE(plan.ok()) << plan.status();
    auto peer = a.Connect(target.transfer_descriptor());
    ASSERT_TRUE(peer.ok());
    auto batch = a.PostWrite(*peer, plan->segments);
    ASSERT_TRUE(batch.ok());
    ASSERT_TRUE(a.Wait(*batch, absl::Now() + absl::Seconds(10)).ok());
    want.push_back(*kvtransfer::ComputeChecksums(
        src_side, n, CacheRegionBytes(src[r].get(), src_regions[r])));
    got.push_back(*kvtransfer::ComputeChecksums(
        CacheRankLayout(*dst[r], dst_regions[r], dst_blocks, 2), n,
        CacheRegionBytes(dst[r].get(), dst_regions[r])));
  }
  const tandem::v1::StateChecksums merged_want = MergeRankChecksums(want);
  EXPECT_EQ(merged_want.mla_layer_size(), kTp * src[0]->num_mla_layers());
  EXPECT_EQ(merged_want.kda_layer_size(), kTp * src[0]->num_kda_layers());
  EXPECT_NE(want[0].kda_layer(0), want[1].kda_layer(0));  // the ranks' heads differ
  EXPECT_EQ(merged_want.kda_layer(src[0]->num_kda_layers()), want[1].kda_layer(0));
  EXPECT_TRUE(kvtransfer::Verify(merged_want, MergeRankChecksums(got)).ok());
  // One rank: unchanged.
  EXPECT_EQ(MergeRankChecksums({want[0]}).total(), want[0].total());

  // A byte flipped in rank 1's landed KDA state only.
  reinterpret_cast<uint8_t*>(dst[1]->kda_recurrent(2, 0))[3] ^= 1;
  got[1] = *kvtransfer::ComputeChecksums(
      CacheRankLayout(*dst[1], dst_regions[1], dst_blocks, 2), n,
      CacheRegionBytes(dst[1].get(), dst_regions[1]));
  EXPECT_EQ(kvtransfer::Verify(merged_want, MergeRankChecksums(got)).code(),
            absl::StatusCode::kDataLoss);
}

TEST(CacheLayoutTest, MalformedTargetsAreInvalidArgument) {
  tandem::v1::RankTarget target;
  target.set_transfer_descriptor("not a descriptor");
  EXPECT_EQ(TargetRankLayout(target).status().code(),
            absl::StatusCode::kInvalidArgument);
  kvtransfer::LoopbackAgent b;
  target.set_transfer_descriptor(*b.LocalDescriptor("{\"mla\": 3}"));
  EXPECT_EQ(TargetRankLayout(target).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::worker
