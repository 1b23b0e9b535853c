// KvCache layout and the state hand-off primitives on the tiny config.
#include "engine/runtime/kv_cache.h"

#include <cstring>

#include "engine/model/make_checkpoint.h"
#include "gtest/gtest.h"
#include "kernels/backend_factory.h"

namespace tandem::engine {
namespace {

std::unique_ptr<KvCache> Make(int64_t blocks, int64_t bs, int64_t slots) {
  KvCacheOptions o{blocks, bs, slots};
  auto c = KvCache::Create(model::TinyConfig(), o);
  EXPECT_TRUE(c.ok()) << c.status();
  return std::move(c).value();
}

TEST(KvCacheTest, SizesFollowTheConfig) {
  const model::ModelConfig cfg = model::TinyConfig();
  auto c = Make(10, 16, 3);
  EXPECT_EQ(c->num_mla_layers(), cfg.NumMlaLayers());
  EXPECT_EQ(c->num_kda_layers(), cfg.NumKdaLayers());
  EXPECT_EQ(c->mla_width(), cfg.MlaCacheValuesPerToken());
  EXPECT_EQ(c->kda_bytes_per_layer(),
            static_cast<size_t>(cfg.KdaStateBytesPerSequence()));
  EXPECT_EQ(c->total_bytes(),
            10 * 16 * cfg.MlaCacheBytesPerToken() * cfg.NumMlaLayers() +
                3 * cfg.KdaStateBytesPerSequence() * cfg.NumKdaLayers());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(c->mla_layer(0)) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(c->kda_recurrent(0, 0)) % 64, 0u);
  EXPECT_FALSE(KvCache::Create(cfg, KvCacheOptions{1, 0, 1}).ok());
}

TEST(KvCacheTest, SnapshotRestoreAndReset) {
  auto c = Make(2, 16, 2);
  float* s = c->kda_recurrent(1, 2);
  s[5] = 3.5f;
  c->kda_conv(1, 0, 2)[1] = -1.0f;
  auto snap = c->SnapshotSlot(1);
  ASSERT_TRUE(snap.ok());
  s[5] = 7.0f;
  ASSERT_TRUE(c->RestoreSlot(1, *snap).ok());
  EXPECT_EQ(s[5], 3.5f);
  EXPECT_EQ(c->kda_conv(1, 0, 2)[1], -1.0f);
  ASSERT_TRUE(c->CopySlot(1, 0).ok());
  EXPECT_EQ(c->kda_recurrent(0, 2)[5], 3.5f);
  ASSERT_TRUE(c->ResetSlot(1).ok());
  EXPECT_EQ(s[5], 0.0f);
  EXPECT_EQ(c->kda_recurrent(0, 2)[5], 3.5f);  // other slots untouched
  EXPECT_FALSE(c->ResetSlot(2).ok());
  EXPECT_FALSE(c->SnapshotSlot(-1).ok());
}

TEST(KvCacheTest, ExportCopyAcrossBlockSizes) {
  auto a = Make(8, 16, 2);
  auto b = Make(16, 4, 3);
  const int64_t n = 37;
  const std::vector<int32_t> ta = {6, 1, 3};
  std::vector<int32_t> tb;
  for (int i = 0; i < 10; ++i) tb.push_back(15 - i);
  // Token p of MLA layer m holds value (m * 1000 + p) in every lane.
  const int64_t w = a->mla_width();
  for (int m = 0; m < a->num_mla_layers(); ++m) {
    for (int64_t p = 0; p < n; ++p) {
      uint16_t* row = a->mla_layer(m) + (ta[p / 16] * 16 + p % 16) * w;
      for (int64_t i = 0; i < w; ++i) row[i] = static_cast<uint16_t>(m * 1000 + p);
    }
  }
  for (int k = 0; k < a->num_kda_layers(); ++k) a->kda_recurrent(1, k)[7] = 10.0f + k;
  auto src = a->ExportSequence(ta, n, 1);
  auto dst = b->ExportSequence(tb, n, 2);
  ASSERT_TRUE(src.ok() && dst.ok());
  size_t src_bytes = 0;
  for (const StateRange& r : *src) src_bytes += r.bytes;
  EXPECT_EQ(src_bytes, n * w * 2 * a->num_mla_layers() + a->kda_bytes_per_slot());
  ASSERT_TRUE(CopyStateRanges(*src, *dst).ok());
  for (int m = 0; m < b->num_mla_layers(); ++m) {
    for (int64_t p = 0; p < n; ++p) {
      const uint16_t* row = b->mla_layer(m) + (tb[p / 4] * 4 + p % 4) * w;
      ASSERT_EQ(row[0], m * 1000 + p);
      ASSERT_EQ(row[w - 1], m * 1000 + p);
    }
  }
  for (int k = 0; k < b->num_kda_layers(); ++k)
    EXPECT_EQ(b->kda_recurrent(2, k)[7], 10.0f + k);
  // Mismatched lengths and short tables are errors.
  auto shorter = b->ExportSequence(tb, n - 1, 2);
  ASSERT_TRUE(shorter.ok());
  EXPECT_FALSE(CopyStateRanges(*src, *shorter).ok());
  EXPECT_FALSE(a->ExportSequence(ta, 49, 1).ok());
  EXPECT_FALSE(a->ExportSequence({6, 1, 99}, n, 1).ok());
}

// A cache on a device (cuda_sim: emulated device memory the sim tracks): its
// exported ranges say so, and CopyStateRanges / CopyRangeToHost move them with
// the device's copies (host -> device, device -> device, device -> host); a
// range that claims the device but points at host memory is refused by the
// sim's ownership check, so a host memmove could not pass for a device copy.
TEST(KvCacheTest, DeviceCacheIsCopiedByItsDevice) {
  auto backend = kernels::CreateBackend("cuda_sim");
  ASSERT_TRUE(backend.ok()) << backend.status();
  kernels::Device* dev = &(*backend)->device();
  auto a = Make(8, 16, 2);
  KvCacheOptions o{16, 4, 3};
  o.device = dev;
  auto d = KvCache::Create(model::TinyConfig(), o);
  ASSERT_TRUE(d.ok()) << d.status();
  auto b = Make(8, 16, 2);
  const int64_t n = 21;
  const std::vector<int32_t> ta = {5, 2};
  const std::vector<int32_t> td = {9, 0, 4, 12, 1, 7};
  const std::vector<int32_t> td2 = {3, 8, 10, 11, 13, 14};
  const std::vector<int32_t> tb = {1, 6};
  const int64_t w = a->mla_width();
  for (int m = 0; m < a->num_mla_layers(); ++m) {
    for (int64_t p = 0; p < n; ++p) {
      uint16_t* row = a->mla_layer(m) + (ta[p / 16] * 16 + p % 16) * w;
      for (int64_t i = 0; i < w; ++i) row[i] = static_cast<uint16_t>(m * 100 + p + i);
    }
  }
  for (int k = 0; k < a->num_kda_layers(); ++k) a->kda_recurrent(0, k)[3] = 1.5f + k;

  auto from_host = a->ExportSequence(ta, n, 0);
  auto on_dev = (*d)->ExportSequence(td, n, 1);
  auto on_dev2 = (*d)->ExportSequence(td2, n, 2);
  auto to_host = b->ExportSequence(tb, n, 1);
  ASSERT_TRUE(from_host.ok() && on_dev.ok() && on_dev2.ok() && to_host.ok());
  for (const StateRange& r : *from_host) EXPECT_EQ(r.device, nullptr);
  for (const StateRange& r : *on_dev) {
    EXPECT_EQ(r.device, dev);
    EXPECT_TRUE(dev->Owns(r.data, r.bytes));
  }
  ASSERT_TRUE(CopyStateRanges(*from_host, *on_dev).ok());  // host -> device
  ASSERT_TRUE(CopyStateRanges(*on_dev, *on_dev2).ok());    // on the device
  ASSERT_TRUE(CopyStateRanges(*on_dev2, *to_host).ok());   // device -> host
  for (int m = 0; m < b->num_mla_layers(); ++m) {
    for (int64_t p = 0; p < n; ++p) {
      const uint16_t* row = b->mla_layer(m) + (tb[p / 16] * 16 + p % 16) * w;
      ASSERT_EQ(row[0], m * 100 + p) << "layer " << m << " token " << p;
      ASSERT_EQ(row[w - 1], m * 100 + p + w - 1);
    }
  }
  for (int k = 0; k < b->num_kda_layers(); ++k)
    EXPECT_EQ(b->kda_recurrent(1, k)[3], 1.5f + k);

  // The first MLA range (mla layer 0, tokens 0..3) read back through the device.
  const StateRange* first = nullptr;
  for (const StateRange& r : *on_dev2) {
    if (r.kind == StateKind::kMla && first == nullptr) first = &r;
  }
  ASSERT_NE(first, nullptr);
  std::vector<uint8_t> host(first->bytes);
  ASSERT_TRUE(CopyRangeToHost(*first, host.data()).ok());
  uint16_t v = 0;
  std::memcpy(&v, host.data() + w * 2 + 2, 2);  // token 1, lane 1
  EXPECT_EQ(v, 2);

  // A device range that points at host memory: the device refuses it.
  std::vector<StateRange> lying = *to_host;
  for (StateRange& r : lying) r.device = dev;
  const absl::Status st = CopyStateRanges(*from_host, lying);
  EXPECT_FALSE(st.ok());
  EXPECT_FALSE(CopyRangeToHost(lying.front(), host.data()).ok());
}

// A TP rank's cache: KDA state of its heads only, MLA cache whole; TP 1 keeps
// the unsharded layout; ranges carry the rank and copies match by it.
TEST(KvCacheTest, TensorParallelShard) {
  const model::ModelConfig cfg = model::TinyConfig();
  const auto& la = cfg.text.linear_attn_config;
  auto full = Make(4, 16, 2);
  for (int size : {2, 4}) {
    KvCacheOptions o{4, 16, 2};
    o.tp_size = size;
    o.tp_rank = size - 1;
    auto c = KvCache::Create(cfg, o);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ((*c)->kda_heads(), la.num_heads / size);
    EXPECT_EQ((*c)->kda_bytes_per_layer() * size, full->kda_bytes_per_layer());
    EXPECT_EQ((*c)->mla_layer_bytes(), full->mla_layer_bytes());
    EXPECT_EQ((*c)->kda_conv(0, 0, 1) - (*c)->kda_conv(0, 0, 0),
              (la.short_conv_kernel_size - 1) * la.head_dim * la.num_heads / size);
    auto ranges = (*c)->ExportSequence({0, 1}, 20, 1);
    ASSERT_TRUE(ranges.ok());
    for (const StateRange& r : *ranges) EXPECT_EQ(r.rank, size - 1);
  }
  EXPECT_EQ(full->kda_heads(), la.num_heads);
  KvCacheOptions bad{4, 16, 2};
  bad.tp_size = 8;
  auto refused = KvCache::Create(cfg, bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("num_heads = 4"), std::string::npos);
  bad.tp_size = 2;
  bad.tp_rank = 2;
  EXPECT_FALSE(KvCache::Create(cfg, bad).ok());

  // Ranges of rank 1 do not land in rank 0's streams.
  KvCacheOptions o{4, 16, 2};
  o.tp_size = 2;
  o.tp_rank = 1;
  auto r1 = KvCache::Create(cfg, o);
  o.tp_rank = 0;
  auto r0 = KvCache::Create(cfg, o);
  ASSERT_TRUE(r0.ok() && r1.ok());
  auto from = (*r1)->ExportSequence({2}, 5, 0);
  auto to0 = (*r0)->ExportSequence({3}, 5, 1);
  ASSERT_TRUE(from.ok() && to0.ok());
  EXPECT_FALSE(CopyStateRanges(*from, *to0).ok());
  (*r1)->kda_recurrent(0, 1)[3] = 4.25f;
  auto to1 = (*r1)->ExportSequence({3}, 5, 1);
  ASSERT_TRUE(to1.ok());
  ASSERT_TRUE(CopyStateRanges(*from, *to1).ok());
  EXPECT_EQ((*r1)->kda_recurrent(1, 1)[3], 4.25f);
}

}  // namespace
}  // namespace tandem::engine
