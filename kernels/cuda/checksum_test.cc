// The chunk-hash kernel (checksum.cu) on the emulator against libxxhash's XXH64:
// lengths around every boundary of the algorithm (0..8 bytes, the 32-byte stripe,
// a chunk), streams split into segments of awkward sizes and alignments, several
// scheduling seeds; a broken segment table recorded in the error word; and the
// GpuBackend op on cuda_sim device memory.
#include "kernels/cuda/checksum.h"

#include <xxhash.h>

#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_errors.h"
#include "kernels/cuda/vendor.h"

namespace tandem::kernels::cuda {
namespace {

constexpr int64_t kChunk = 4096;

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// libxxhash per chunk of the logical stream `stream`.
std::vector<uint64_t> Want(const std::vector<uint8_t>& stream, int64_t chunk) {
  std::vector<uint64_t> out;
  for (size_t at = 0; at < stream.size(); at += chunk) {
    const size_t n = std::min<size_t>(chunk, stream.size() - at);
    out.push_back(XXH64(stream.data() + at, n, 0));
  }
  return out;
}

// The stream laid out as segments of `sizes` (cycled) at `misalign` bytes past
// 8-byte alignment in a scattered buffer.
struct Scattered {
  std::vector<uint8_t> memory;
  std::vector<HashSegment> segments;
};
Scattered Scatter(const std::vector<uint8_t>& stream, const std::vector<int64_t>& sizes,
                  int misalign) {
  Scattered s;
  s.memory.resize(stream.size() * 2 + 64 * (stream.size() + 2), 0xEE);
  std::vector<std::pair<size_t, int64_t>> where;  // memory offset, length
  int64_t at = 0;
  size_t mem = 0;
  for (size_t i = 0; at < static_cast<int64_t>(stream.size()) || i == 0; ++i) {
    const int64_t n = std::min<int64_t>(sizes[i % sizes.size()],
                                        static_cast<int64_t>(stream.size()) - at);
    mem = (mem + 7) / 8 * 8 + misalign;
    where.push_back({mem, n});
    std::copy_n(stream.begin() + at, n, s.memory.begin() + mem);
    mem += n + 8;
    at += n;
    if (n == 0 && at == static_cast<int64_t>(stream.size())) break;
  }
  at = 0;
  for (auto [m, n] : where) {
    s.segments.push_back({s.memory.data() + m, at, n});
    at += n;
  }
  return s;
}

std::vector<uint64_t> RunKernel(const Scattered& s, int64_t total, int64_t chunk,
                                int32_t* error) {
  const int64_t chunks = (total + chunk - 1) / chunk;
  std::vector<uint64_t> got(chunks + 1, 0xABCD);
  const char* e =
      LaunchChunkHashes(s.segments.data(), static_cast<int64_t>(s.segments.size()),
                        total, chunk, got.data(), error, &got);
  EXPECT_EQ(e, nullptr) << e;
  EXPECT_EQ(got.back(), 0xABCDu) << "wrote past the last chunk";
  got.pop_back();
  return got;
}

TEST(ChunkHashes, EqualsLibxxhashOnEveryLengthBoundary) {
  const std::vector<int64_t> lengths = {
      0,  1,  2,    3,    4,    5,    7,    8,    9,
      15, 16, 31,   32,   33,   63,   64,   65,   95,
      96, 97, 4095, 4096, 4097, 8191, 8192, 8193, 3 * kChunk + 77};
  for (uint64_t seed : {1, 5}) {
    ::cuda_sim::SetSeed(seed);
    for (int64_t len : lengths) {
      const std::vector<uint8_t> stream = RandomBytes(len, static_cast<uint32_t>(len));
      const Scattered one = Scatter(stream, {1 << 30}, 0);
      int32_t error = 0;
      const std::vector<uint64_t> got = RunKernel(one, len, kChunk, &error);
      EXPECT_EQ(error, kDeviceOk);
      EXPECT_EQ(got, Want(stream, kChunk)) << "length " << len << " seed " << seed;
      if (len > 0 && len <= kChunk) {
        EXPECT_EQ(got[0], XXH64(stream.data(), len, 0)) << "length " << len;
      }
    }
  }
}

TEST(ChunkHashes, SegmentBoundariesAnywhereInAChunk) {
  const std::vector<uint8_t> stream = RandomBytes(3 * kChunk + 1000, 7);
  const std::vector<std::vector<int64_t>> splits = {
      {1}, {3}, {7, 0, 9}, {31, 33}, {1152}, {4095, 1, 0, 2}, {5000}};
  for (const auto& sizes : splits) {
    for (int misalign : {0, 1, 4}) {
      const Scattered s = Scatter(stream, sizes, misalign);
      for (int64_t chunk : {int64_t{32}, int64_t{100}, kChunk}) {
        int32_t error = 0;
        EXPECT_EQ(RunKernel(s, static_cast<int64_t>(stream.size()), chunk, &error),
                  Want(stream, chunk))
            << "split " << sizes[0] << " misalign " << misalign << " chunk " << chunk;
        EXPECT_EQ(error, kDeviceOk);
      }
    }
  }
}

TEST(ChunkHashes, ABrokenTableIsRecordedInTheErrorWord) {
  const std::vector<uint8_t> stream = RandomBytes(300, 9);
  Scattered s = Scatter(stream, {100}, 0);
  ASSERT_EQ(s.segments.size(), 3u);
  int32_t error = 0;
  s.segments[2].offset += 1;  // a gap
  RunKernel(s, 300, 64, &error);
  EXPECT_EQ(error, kBadSegmentTable);
  s = Scatter(stream, {100}, 0);
  error = 0;
  RunKernel(s, 250, 64, &error);  // the table holds 300 bytes
  EXPECT_EQ(error, kBadSegmentTable);
  error = 0;
  RunKernel(s, 350, 64, &error);  // ... or claims more than it holds
  EXPECT_EQ(error, kBadSegmentTable);
}

TEST(ChunkHashes, BackendOpOnEmulatedDeviceMemory) {
  auto be = CreateCudaSimBackend();
  ASSERT_TRUE(be.ok()) << be.status();
  Backend& b = **be;
  Device& dev = b.device();
  const std::vector<uint8_t> stream = RandomBytes(2 * kChunk + 5, 11);
  auto data = DeviceBuffer::Allocate(&dev, stream.size());
  ASSERT_TRUE(data.ok());
  ASSERT_TRUE(dev.CopyToDevice(data->data(), stream.data(), stream.size()).ok());
  // Two segments, the second first in memory.
  const int64_t first = kChunk + 3;
  const uint8_t* base = data->as<uint8_t>();
  std::vector<uint8_t> swapped(stream.begin() + first, stream.end());
  swapped.insert(swapped.end(), stream.begin(), stream.begin() + first);
  ASSERT_TRUE(dev.CopyToDevice(data->data(), swapped.data(), swapped.size()).ok());
  const int64_t second = static_cast<int64_t>(stream.size()) - first;
  std::vector<ByteSegment> table = {{base + second, 0, first}, {base, first, second}};
  auto dtable = DeviceBuffer::Allocate(&dev, table.size() * sizeof(ByteSegment));
  auto dhashes = DeviceBuffer::Allocate(&dev, 3 * sizeof(uint64_t));
  ASSERT_TRUE(dtable.ok() && dhashes.ok());
  ASSERT_TRUE(
      dev.CopyToDevice(dtable->data(), table.data(), table.size() * sizeof(ByteSegment))
          .ok());
  ChunkHashArgs a;
  a.segments = dtable->as<ByteSegment>();
  a.num_segments = 2;
  a.total_bytes = static_cast<int64_t>(stream.size());
  a.chunk_bytes = kChunk;
  a.hashes = dhashes->as<uint64_t>();
  ASSERT_TRUE(b.ChunkHashes(a).ok());
  ASSERT_TRUE(b.Synchronize().ok());
  std::vector<uint64_t> got(3);
  ASSERT_TRUE(dev.CopyToHost(got.data(), a.hashes, 3 * sizeof(uint64_t)).ok());
  EXPECT_EQ(got, Want(stream, kChunk));

  // Host memory is refused (every op pointer is device memory).
  std::vector<uint64_t> host(3);
  ChunkHashArgs h = a;
  h.hashes = host.data();
  EXPECT_EQ(b.ChunkHashes(h).code(), absl::StatusCode::kFailedPrecondition);
  // A broken table comes back from Synchronize.
  table[1].offset += 1;
  ASSERT_TRUE(
      dev.CopyToDevice(dtable->data(), table.data(), table.size() * sizeof(ByteSegment))
          .ok());
  ASSERT_TRUE(b.ChunkHashes(a).ok());
  absl::Status st = b.Synchronize();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("segment table"), std::string::npos) << st;
  EXPECT_TRUE(b.Synchronize().ok());  // cleared
  // Empty stream: nothing launched, nothing written.
  a.total_bytes = 0;
  a.num_segments = 0;
  EXPECT_TRUE(b.ChunkHashes(a).ok());
  a.chunk_bytes = 0;
  EXPECT_EQ(b.ChunkHashes(a).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::kernels::cuda
