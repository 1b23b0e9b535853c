#include "kernels/cuda/vendor.h"
// (vendor.h first)
#include "kernels/cuda/checksum.h"
#include "kernels/cuda/device_errors.h"

// XXH64 (xxHash's 64-bit hash, as specified in xxHash's doc/xxhash_spec.md), one
// chunk per group of four threads. XXH64 keeps four independent accumulators
// ("lanes"), lane j taking the 8-byte words j, j + 4, j + 8, ... of the input's
// 32-byte stripes; they only meet in the final merge. Thread j of a group runs
// lane j over the chunk's stripes, the group's first thread gathers the four
// lanes (warp shuffles), hashes the remaining < 32 bytes and finishes.
//
// Loads go through a cursor over the segment table (a chunk may start in one
// segment and end in another; segments may be of any length, zero included):
// an aligned word inside one segment is one 8-byte load, anything else is read
// byte by byte.

namespace tandem::kernels::cuda {
namespace {

constexpr uint64_t kP1 = 0x9E3779B185EBCA87ull;
constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kP3 = 0x165667B19E3779F9ull;
constexpr uint64_t kP4 = 0x85EBCA77C2B2AE63ull;
constexpr uint64_t kP5 = 0x27D4EB2F165667C5ull;

constexpr int kLanes = 4;
constexpr int kThreads = 128;
constexpr int kChunksPerBlock = kThreads / kLanes;

__device__ __forceinline__ uint64_t Rotl(uint64_t x, int r) {
  return (x << r) | (x >> (64 - r));
}

__device__ __forceinline__ uint64_t Round(uint64_t acc, uint64_t input) {
  acc += input * kP2;
  acc = Rotl(acc, 31);
  return acc * kP1;
}

__device__ __forceinline__ uint64_t MergeRound(uint64_t acc, uint64_t val) {
  acc ^= Round(0, val);
  return acc * kP1 + kP4;
}

__device__ __forceinline__ uint64_t Avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

// A position in the stream: segment `seg`, byte `pos` of it. Normalised: pos <
// segments[seg].bytes, or seg == n (the end).
struct Cursor {
  const HashSegment* segs;
  int64_t n;
  int64_t seg;
  int64_t pos;
  bool bad;  // the table broke its contract on the way
};

__device__ __forceinline__ void Normalize(Cursor* c) {
  while (c->seg < c->n && c->pos >= c->segs[c->seg].bytes) {
    const HashSegment& s = c->segs[c->seg];
    if (s.bytes < 0) {
      c->bad = true;
      c->seg = c->n;
      return;
    }
    c->pos -= s.bytes;
    if (c->seg + 1 < c->n && c->segs[c->seg + 1].offset != s.offset + s.bytes) {
      c->bad = true;
    }
    ++c->seg;
  }
}

__device__ __forceinline__ void Skip(Cursor* c, int64_t bytes) {
  c->pos += bytes;
  Normalize(c);
}

// The next `bytes` (1..8) bytes, little-endian; advances.
__device__ __forceinline__ uint64_t Load(Cursor* c, int bytes) {
  if (c->seg < c->n) {
    const HashSegment& s = c->segs[c->seg];
    if (c->pos + bytes <= s.bytes) {
      const uint8_t* p = s.data + c->pos;
      const uintptr_t a = reinterpret_cast<uintptr_t>(p);
      uint64_t v = 0;
      if (bytes == 8 && (a & 7) == 0) {
        v = *reinterpret_cast<const uint64_t*>(p);
      } else if (bytes == 4 && (a & 3) == 0) {
        v = *reinterpret_cast<const uint32_t*>(p);
      } else {
        for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
      }
      Skip(c, bytes);
      return v;
    }
  }
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) {
    if (c->seg >= c->n) {
      c->bad = true;  // the table ends before total_bytes
      return v;
    }
    v |= static_cast<uint64_t>(c->segs[c->seg].data[c->pos]) << (8 * i);
    Skip(c, 1);
  }
  return v;
}

// The cursor at stream offset `at` (the last segment starting at or before it).
__device__ Cursor Seek(const HashSegment* segs, int64_t n, int64_t at) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (segs[mid].offset <= at) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  Cursor c{segs, n, lo, at - segs[lo].offset, false};
  if (c.pos < 0) {
    c.bad = true;
    c.pos = 0;
  }
  Normalize(&c);
  return c;
}

__global__ void ChunkHashesKernel(const HashSegment* __restrict__ segs, int64_t n,
                                  int64_t total, int64_t chunk_bytes,
                                  uint64_t* __restrict__ hashes, int32_t* error_word) {
  const int lane = threadIdx.x % kLanes;
  const int64_t chunk =
      static_cast<int64_t>(blockIdx.x) * kChunksPerBlock + threadIdx.x / kLanes;
  const int64_t num_chunks = (total + chunk_bytes - 1) / chunk_bytes;
  const bool live = chunk < num_chunks;
  const int64_t start = live ? chunk * chunk_bytes : 0;
  const int64_t len =
      live ? (total - start < chunk_bytes ? total - start : chunk_bytes) : 0;
  const int64_t stripes = len / 32;
  bool bad = false;

  // Lane `lane` over every stripe: words lane, lane + 4, ... of 8 bytes.
  uint64_t v = lane == 0 ? kP1 + kP2 : lane == 1 ? kP2 : lane == 2 ? 0 : 0 - kP1;
  if (stripes > 0) {
    Cursor c = Seek(segs, n, start + 8 * lane);
    for (int64_t s = 0; s < stripes; ++s) {
      v = Round(v, Load(&c, 8));
      if (s + 1 < stripes) Skip(&c, 24);
    }
    bad = bad || c.bad;
  }
  // Every thread of the warp takes part (groups are 4-aligned within a warp).
  const int base = (threadIdx.x % tandem::gpu::kWarpSize) & ~(kLanes - 1);
  uint64_t lanes[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    lanes[j] = static_cast<uint64_t>(__shfl_sync(
        tandem::gpu::kFullMask, static_cast<unsigned long long>(v), base + j));
  }
  if (live && lane == 0) {
    uint64_t h;
    if (stripes > 0) {
      h = Rotl(lanes[0], 1) + Rotl(lanes[1], 7) + Rotl(lanes[2], 12) +
          Rotl(lanes[3], 18);
      for (int j = 0; j < kLanes; ++j) h = MergeRound(h, lanes[j]);
    } else {
      h = kP5;
    }
    h += static_cast<uint64_t>(len);
    int64_t rest = len - stripes * 32;
    Cursor c = Seek(segs, n, start + stripes * 32);
    while (rest >= 8) {
      h ^= Round(0, Load(&c, 8));
      h = Rotl(h, 27) * kP1 + kP4;
      rest -= 8;
    }
    if (rest >= 4) {
      h ^= Load(&c, 4) * kP1;
      h = Rotl(h, 23) * kP2 + kP3;
      rest -= 4;
    }
    while (rest > 0) {
      h ^= Load(&c, 1) * kP5;
      h = Rotl(h, 11) * kP1;
      --rest;
    }
    hashes[chunk] = Avalanche(h);
    bad = bad || c.bad;
    // The table must end exactly at total_bytes (the chunk that reaches the end).
    if (start + len == total &&
        (segs[0].offset != 0 || segs[n - 1].offset + segs[n - 1].bytes != total)) {
      bad = true;
    }
  }
  if (bad && error_word != nullptr) atomicCAS(error_word, 0, kBadSegmentTable);
}

}  // namespace

const char* LaunchChunkHashes(const HashSegment* segments, int64_t num_segments,
                              int64_t total_bytes, int64_t chunk_bytes,
                              uint64_t* hashes, int32_t* error_word, void* stream) {
  if (total_bytes <= 0) return nullptr;
  if (chunk_bytes <= 0) return "LaunchChunkHashes: chunk_bytes <= 0";
  if (num_segments <= 0) return "LaunchChunkHashes: no segments";
  const int64_t chunks = (total_bytes + chunk_bytes - 1) / chunk_bytes;
  const int64_t blocks = (chunks + kChunksPerBlock - 1) / kChunksPerBlock;
  if (blocks > 2147483647) return "LaunchChunkHashes: too many chunks";
  TANDEM_LAUNCH(ChunkHashesKernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads),
                0, stream, segments, num_segments, total_bytes, chunk_bytes, hashes,
                error_word);
  return tandem::gpu::LaunchError();
}

}  // namespace tandem::kernels::cuda
