#include "kvtransfer/checksum.h"

#include <xxhash.h>

#include <cstring>
#include <random>

#include "gtest/gtest.h"
#include "kvtransfer/plan.h"

namespace tandem::kvtransfer {
namespace {

tandem::v1::KvLayout Layout(int block_size) {
  tandem::v1::KvLayout l;
  l.set_block_size(block_size);
  l.set_num_mla_layers(3);
  l.set_num_kda_layers(2);
  l.set_mla_token_bytes(1152);
  l.set_kda_state_bytes(4096);
  l.set_kda_conv_bytes(512);
  l.set_tp_size(1);
  return l;
}

RegionBytes One(RegionId id, const std::vector<uint8_t>& mem) {
  return [id, &mem](RegionId r) {
    return r == id ? absl::Span<const uint8_t>(mem) : absl::Span<const uint8_t>();
  };
}

// Copies src state into dst through the plan (as a transfer would).
void Apply(const TransferPlan& plan, const std::vector<uint8_t>& src,
           std::vector<uint8_t>* dst) {
  for (const Segment& s : plan.segments) {
    std::copy_n(src.begin() + s.local_offset, s.length, dst->begin() + s.remote_offset);
  }
}

class ChecksumTest : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(ChecksumTest, SenderAndReceiverAgreeAcrossBlockSizes) {
  const auto [sb, db] = GetParam();
  RankLayout src = ContiguousRankLayout(Layout(sb), 16, 2, 1);
  RankLayout dst = ContiguousRankLayout(Layout(db), 16, 3, 2);
  const int64_t tokens = 100;
  for (int i = 0; i < (tokens + sb - 1) / sb; ++i) src.block_ids.push_back(15 - i);
  for (int i = 0; i < (tokens + db - 1) / db; ++i)
    dst.block_ids.push_back((i * 3) % 16);
  dst.state_slot = 2;
  std::vector<uint8_t> smem(ContiguousRegionBytes(src.layout, 16, 2));
  std::vector<uint8_t> dmem(ContiguousRegionBytes(dst.layout, 16, 3), 0);
  std::mt19937 rng(sb * 100 + db);
  for (auto& b : smem) b = rng();
  auto plan = PlanAll(src, dst, tokens);
  ASSERT_TRUE(plan.ok()) << plan.status();
  Apply(*plan, smem, &dmem);
  auto want = ComputeChecksums(src, tokens, One(1, smem));
  auto got = ComputeChecksums(dst, tokens, One(2, dmem));
  ASSERT_TRUE(want.ok() && got.ok());
  EXPECT_EQ(want->mla_layer_size(), 3);
  EXPECT_EQ(want->kda_layer_size(), 2);
  EXPECT_TRUE(Verify(*want, *got).ok());
  EXPECT_EQ(want->total(), TotalChecksum(*want));
  // Layers differ from each other (random content).
  EXPECT_NE(want->mla_layer(0), want->mla_layer(1));

  // Corrupt one byte of MLA layer 1's last token on the receiver.
  auto ranges = LayerRanges(dst, {LayerKind::kMla, 1}, tokens);
  ASSERT_TRUE(ranges.ok());
  dmem[ranges->back().offset + ranges->back().length - 1] ^= 1;
  auto bad = ComputeChecksums(dst, tokens, One(2, dmem));
  ASSERT_TRUE(bad.ok());
  absl::Status st = Verify(*want, *bad);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("MLA layer 1"), std::string::npos) << st;
  dmem[ranges->back().offset + ranges->back().length - 1] ^= 1;

  // Corrupt KDA layer 0's conv tails.
  auto kr = LayerRanges(dst, {LayerKind::kKda, 0}, tokens);
  ASSERT_TRUE(kr.ok());
  dmem[kr->back().offset] ^= 0x80;
  bad = ComputeChecksums(dst, tokens, One(2, dmem));
  st = Verify(*want, *bad);
  EXPECT_NE(st.message().find("KDA layer 0"), std::string::npos) << st;
}

INSTANTIATE_TEST_SUITE_P(BlockSizes, ChecksumTest,
                         ::testing::Values(std::make_pair(16, 16),
                                           std::make_pair(16, 64),
                                           std::make_pair(64, 16),
                                           std::make_pair(8, 24)));

// The definition recomputed independently: the layer's bytes gathered in token
// order, cut into 4 KiB chunks, XXH64 each, XXH64 of the hashes (libxxhash).
uint64_t IndependentLayerChecksum(const RankLayout& side, LayerRef layer, int64_t n,
                                  const std::vector<uint8_t>& mem) {
  auto ranges = LayerRanges(side, layer, n);
  EXPECT_TRUE(ranges.ok());
  std::vector<uint8_t> stream;
  for (const ByteRange& r : *ranges) {
    stream.insert(stream.end(), mem.begin() + r.offset,
                  mem.begin() + r.offset + r.length);
  }
  std::vector<uint8_t> hashes;
  for (size_t at = 0; at < stream.size(); at += 4096) {
    const uint64_t h =
        XXH64(stream.data() + at, std::min<size_t>(4096, stream.size() - at), 0);
    for (int i = 0; i < 8; ++i) hashes.push_back(static_cast<uint8_t>(h >> (8 * i)));
  }
  return XXH64(hashes.data(), hashes.size(), 0);
}

TEST(ChecksumDefinitionTest, LayersAreChunkedXxh64RecomputedIndependently) {
  // 100 tokens x 1152 bytes: 28 full chunks and a partial one per MLA layer; KDA
  // layers 4096 + 512 bytes (a chunk boundary inside the stream).
  RankLayout side = ContiguousRankLayout(Layout(16), 16, 2, 1);
  for (int i = 0; i < 7; ++i) side.block_ids.push_back((i * 5) % 16);
  side.state_slot = 1;
  std::vector<uint8_t> mem(ContiguousRegionBytes(side.layout, 16, 2));
  std::mt19937 rng(77);
  for (auto& b : mem) b = rng();
  for (int64_t tokens : {0, 1, 100, 112}) {
    auto sums = ComputeChecksums(side, tokens, One(1, mem));
    ASSERT_TRUE(sums.ok()) << sums.status();
    for (int l = 0; l < 3; ++l) {
      EXPECT_EQ(sums->mla_layer(l),
                IndependentLayerChecksum(side, {LayerKind::kMla, l}, tokens, mem))
          << "MLA layer " << l << " tokens " << tokens;
    }
    for (int l = 0; l < 2; ++l) {
      EXPECT_EQ(sums->kda_layer(l),
                IndependentLayerChecksum(side, {LayerKind::kKda, l}, tokens, mem))
          << "KDA layer " << l;
    }
    auto one = LayerChecksum(side, {LayerKind::kMla, 2}, tokens, One(1, mem));
    ASSERT_TRUE(one.ok());
    EXPECT_EQ(*one, sums->mla_layer(2));
  }
  // An empty layer is XXH64 of the empty input (a published constant).
  EXPECT_EQ(LayerFromChunkHashes({}), 0xEF46DB3751D8E999ull);
}

// A ChunkHasher over memory the host must not read: its spans are opaque handles
// (an offset into `mem` plus a base no host code may dereference), translated
// back here, as a device hasher reads device addresses.
class OpaqueHasher final : public ChunkHasher {
 public:
  explicit OpaqueHasher(const std::vector<uint8_t>* mem) : mem_(mem) {}
  static const uint8_t* Base() { return reinterpret_cast<const uint8_t*>(0x10000000); }
  absl::StatusOr<std::vector<std::vector<uint64_t>>> HashChunks(
      absl::Span<const ByteStream> streams, int64_t chunk_bytes) override {
    ++calls;
    std::vector<std::vector<uint64_t>> out;
    for (const ByteStream& s : streams) {
      std::vector<uint8_t> bytes;
      for (absl::Span<const uint8_t> p : s) {
        const size_t off = p.data() - Base();
        bytes.insert(bytes.end(), mem_->begin() + off, mem_->begin() + off + p.size());
      }
      std::vector<uint64_t> h;
      for (size_t at = 0; at < bytes.size(); at += chunk_bytes) {
        h.push_back(XXH64(bytes.data() + at,
                          std::min<size_t>(chunk_bytes, bytes.size() - at), 0));
      }
      out.push_back(std::move(h));
    }
    return out;
  }
  int calls = 0;

 private:
  const std::vector<uint8_t>* mem_;
};

TEST(ChecksumDeviceMemoryTest, DeviceMemoryGoesToTheHasherNeverToTheHost) {
  RankLayout side = ContiguousRankLayout(Layout(16), 16, 2, 1);
  for (int i = 0; i < 7; ++i) side.block_ids.push_back(15 - i);
  std::vector<uint8_t> mem(ContiguousRegionBytes(side.layout, 16, 2));
  std::mt19937 rng(5);
  for (auto& b : mem) b = rng();
  auto host = ComputeChecksums(side, 100, One(1, mem));
  ASSERT_TRUE(host.ok());
  const size_t size = mem.size();
  RegionBytes opaque = [size](RegionId r) {
    return r == 1 ? absl::Span<const uint8_t>(OpaqueHasher::Base(), size)
                  : absl::Span<const uint8_t>();
  };
  OpaqueHasher hasher(&mem);
  ChecksumMemory device{opaque, /*host_addressable=*/false, &hasher};
  auto dev = ComputeChecksums(side, 100, device);
  ASSERT_TRUE(dev.ok()) << dev.status();
  EXPECT_EQ(hasher.calls, 1);  // every layer in one call
  EXPECT_TRUE(Verify(*host, *dev).ok());
  EXPECT_EQ(host->total(), dev->total());
  // No hasher: refused, the host does not read device memory.
  device.hasher = nullptr;
  auto refused = ComputeChecksums(side, 100, device);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("device"), std::string::npos);
  // A hasher that returns the wrong number of chunks is caught.
  class Short final : public ChunkHasher {
   public:
    absl::StatusOr<std::vector<std::vector<uint64_t>>> HashChunks(
        absl::Span<const ByteStream> streams, int64_t) override {
      return std::vector<std::vector<uint64_t>>(streams.size());
    }
  } short_hasher;
  device.hasher = &short_hasher;
  EXPECT_EQ(ComputeChecksums(side, 100, device).status().code(),
            absl::StatusCode::kInternal);
}

TEST(ChecksumVerifyTest, KnownValuesAndShapes) {
  // XXH3-64 of the empty input is a published constant.
  tandem::v1::StateChecksums empty;
  EXPECT_EQ(TotalChecksum(empty), 0x2D06800538D394C2ull);
  tandem::v1::StateChecksums a;
  a.add_mla_layer(1);
  a.add_kda_layer(2);
  a.set_total(TotalChecksum(a));
  tandem::v1::StateChecksums b = a;
  EXPECT_TRUE(Verify(a, b).ok());
  b.add_kda_layer(3);
  EXPECT_EQ(Verify(a, b).code(), absl::StatusCode::kDataLoss);
  b = a;
  b.set_total(a.total() + 1);
  EXPECT_NE(Verify(a, b).message().find("total"), std::string::npos);
}

TEST(ChecksumVerifyTest, RangeOutsideMemoryIsAnError) {
  RankLayout side = ContiguousRankLayout(Layout(16), 4, 1, 1);
  side.block_ids = {3};
  std::vector<uint8_t> small(100);
  EXPECT_EQ(ComputeChecksums(side, 16, One(1, small)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::kvtransfer
