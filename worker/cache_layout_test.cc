// A KvCache's state written into another KvCache (different block size and
// placement) through LoopbackAgents with the layouts built here: the bytes land
// in token order, both sides' checksums agree, and one flipped byte is DATA_LOSS.
#include "worker/cache_layout.h"

#include <cstring>

#include "engine/runtime/test_util.h"
#include "gtest/gtest.h"
#include "kvtransfer/loopback_agent.h"

namespace tandem::worker {
namespace {

std::unique_ptr<runtime::KvCache> Cache(int64_t block_size, int64_t blocks,
                                        int64_t slots) {
  runtime::KvCacheOptions o;
  o.block_size = block_size;
  o.num_blocks = blocks;
  o.num_slots = slots;
  return *runtime::KvCache::Create(runtime::testing::TinyWeights().config, o);
}

TEST(CacheLayoutTest, TransferThroughTargetLayoutKeepsChecksums) {
  auto src = Cache(16, 8, 2);
  auto dst = Cache(8, 20, 3);
  // Recognisable source bytes.
  for (int m = 0; m < src->num_mla_layers(); ++m) {
    auto* p = reinterpret_cast<uint8_t*>(src->mla_layer(m));
    for (size_t i = 0; i < src->mla_layer_bytes(); ++i) p[i] = (i * 31 + m) & 0xFF;
  }
  for (int k = 0; k < src->num_kda_layers(); ++k) {
    float* r = src->kda_recurrent(1, k);
    for (size_t i = 0; i < src->kda_bytes_per_layer() / 4; ++i) r[i] = 0.5f * i + k;
  }
  kvtransfer::LoopbackAgent a, b;
  auto src_regions = RegisterCache(&a, src.get());
  auto dst_regions = RegisterCache(&b, dst.get());
  ASSERT_TRUE(src_regions.ok() && dst_regions.ok());
  const int64_t n = 37;  // 3 source blocks, 5 destination blocks
  const std::vector<int32_t> src_blocks = {5, 2, 7};
  const std::vector<int32_t> dst_blocks = {19, 0, 4, 11, 3};

  // The decode side publishes its geometry in the descriptor's metadata.
  tandem::v1::RankTarget target;
  target.set_transfer_descriptor(
      *b.LocalDescriptor(PoolsMetadata(CacheRankLayout(*dst, *dst_regions, {}, 0))));
  for (int32_t id : dst_blocks) target.add_block_ids(id);
  target.set_state_slot(2);
  *target.mutable_layout() = KvLayoutOf(*dst);
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
